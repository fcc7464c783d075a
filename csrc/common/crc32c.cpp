#include "common/crc32c.h"

#include <nmmintrin.h>
#include <pybind11/pybind11.h>

#include <array>
#include <string>
#include <cstring>

#include "bindings.h"

namespace offload {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

// Raw (unconditioned) CRC state update, slicing by 8.
uint32_t table_update(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& t = tables();
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^ t[4][(word >> 24) & 0xFF] ^
          t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^ t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

// a * b modulo the polynomial, both in reflected bit order (bit 31 is x^0).
uint32_t mul_mod_poly(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 * nbytes) modulo the polynomial: what appending nbytes of zeros does to a CRC state.
uint32_t shift_operator(size_t nbytes) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 23;   // x^8: one byte
  while (nbytes) {
    if (nbytes & 1) result = mul_mod_poly(result, power);
    power = mul_mod_poly(power, power);
    nbytes >>= 1;
  }
  return result;
}

__attribute__((target("sse4.2"))) uint32_t hw_serial(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

constexpr size_t kLaneBytes = 8192;  // each of the three chains covers this many bytes per round

__attribute__((target("sse4.2"))) uint32_t hw_update(uint32_t crc, const uint8_t* p, size_t n) {
  if (n >= 3 * kLaneBytes) {
    static const uint32_t shift = shift_operator(kLaneBytes);  // ~2K cycles: once, not per call
    while (n >= 3 * kLaneBytes) {
      uint64_t a = crc, b = 0, c = 0;
      const uint8_t* pa = p;
      const uint8_t* pb = p + kLaneBytes;
      const uint8_t* pc = p + 2 * kLaneBytes;
      for (size_t i = 0; i < kLaneBytes; i += 8) {
        uint64_t wa, wb, wc;
        std::memcpy(&wa, pa + i, 8);
        std::memcpy(&wb, pb + i, 8);
        std::memcpy(&wc, pc + i, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        c = _mm_crc32_u64(c, wc);
      }
      // raw CRCs are linear: state(A|B|C) = shift(shift(a) ^ b) ^ c
      uint32_t joined = mul_mod_poly(static_cast<uint32_t>(a), shift) ^ static_cast<uint32_t>(b);
      crc = mul_mod_poly(joined, shift) ^ static_cast<uint32_t>(c);
      p += 3 * kLaneBytes;
      n -= 3 * kLaneBytes;
    }
  }
  return hw_serial(crc, p, n);
}

bool has_sse42() { return __builtin_cpu_supports("sse4.2"); }

}  // namespace

uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t seed) {
  return ~table_update(~seed, static_cast<const uint8_t*>(data), nbytes);
}

uint32_t crc32c(const void* data, size_t nbytes, uint32_t seed) {
  static const bool hw = has_sse42();
  if (!hw) return crc32c_portable(data, nbytes, seed);
  return ~hw_update(~seed, static_cast<const uint8_t*>(data), nbytes);
}

const char* crc32c_path() { return has_sse42() ? "sse4.2" : "table"; }

void bind_crc32c(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "crc32c",
      [](uintptr_t ptr, size_t nbytes, uint32_t seed) {
        return crc32c(reinterpret_cast<const void*>(ptr), nbytes, seed);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0, py::call_guard<py::gil_scoped_release>(),
      "CRC-32C of nbytes at address ptr, continuing from seed (0 starts a new checksum).");
  m.def(
      "crc32c_portable",
      [](uintptr_t ptr, size_t nbytes, uint32_t seed) {
        return crc32c_portable(reinterpret_cast<const void*>(ptr), nbytes, seed);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0, py::call_guard<py::gil_scoped_release>(),
      "The table path of crc32c (same values; for tests and measurements).");
  m.def("crc32c_path", [] { return std::string(crc32c_path()); }, "'sse4.2' or 'table': the path crc32c takes.");
}

}  // namespace offload
