#include "common/crc32c.h"

#include <immintrin.h>

#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cpu_features.h"

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

// x^(2^k) modulo the polynomial, reflected, k = 0..63: the squares xpow_mod multiplies together.
struct SquarePowers {
  uint32_t x2k[64];
  SquarePowers() {
    x2k[0] = 1u << 30;  // x^1
    for (int k = 1; k < 64; ++k) x2k[k] = mul_mod_poly(x2k[k - 1], x2k[k - 1]);
  }
};

// x^n modulo the polynomial, reflected: one product per set bit of n.
uint32_t xpow_mod(size_t n) {
  static const SquarePowers powers;
  uint32_t result = 1u << 31;  // x^0
  for (int k = 0; n; ++k, n >>= 1) {
    if (n & 1) result = mul_mod_poly(result, powers.x2k[k]);
  }
  return result;
}

// x^(8 * nbytes) modulo the polynomial: what appending nbytes of zeros does to a CRC state.
uint32_t shift_operator(size_t nbytes) { return xpow_mod(8 * nbytes); }

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

// The three-chain rounds: consumes whole rounds of 3 * kLaneBytes from p and n, returns the state.
__attribute__((target("sse4.2"))) uint32_t hw_rounds(uint32_t crc, const uint8_t*& p, size_t& n) {
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
  return crc;
}

__attribute__((target("sse4.2"))) uint32_t hw_update(uint32_t crc, const uint8_t* p, size_t n) {
  crc = hw_rounds(crc, p, n);
  return hw_serial(crc, p, n);
}

// Carry-less folding. A 16-byte block, as loaded, holds the message polynomial's coefficients from the
// highest degree (bit 0) down; moving it D bytes later multiplies it by x^(8D). Each 64-bit half is
// multiplied (PCLMULQDQ) by x^(8D) reduced together with its own offset: the low half (degrees 64 higher)
// by x^(8D+31), the high half by x^(8D-33), where the -33 undoes the 32-bit constant's place in its
// qword and the one-bit shift of a reflected carry-less product. Products have degree < 128, so the
// sum of both stays congruent to the block and fits the 16 bytes it is XORed into. No Barrett step: the
// last 16 folded bytes are fed to the crc32 instruction from state 0 (the seed was XORed into the
// first block), which reduces exactly.
struct FoldKey {
  uint64_t lo, hi;  // for the low qword: x^(8D+31) mod P; for the high qword: x^(8D-33) mod P
};

FoldKey fold_key(size_t distance) { return {xpow_mod(8 * distance + 31), xpow_mod(8 * distance - 33)}; }

struct FoldKeys {
  FoldKey d16 = fold_key(16), d32 = fold_key(32), d48 = fold_key(48), d64 = fold_key(64);
  FoldKey d128 = fold_key(128), d192 = fold_key(192), d256 = fold_key(256);
};

const FoldKeys& fold_keys() {
  static const FoldKeys keys;  // 14 powers by square-and-multiply, ~10 us: once
  return keys;
}

constexpr size_t kFoldMinBytes = 256;  // shorter inputs: the crc32 chain is as fast and needs no setup

__attribute__((target("sse4.2,pclmul"))) inline __m128i key128(const FoldKey& k) {
  return _mm_set_epi64x(static_cast<int64_t>(k.hi), static_cast<int64_t>(k.lo));
}

// x moved `k`'s distance later, XORed with the block found there.
__attribute__((target("sse4.2,pclmul"))) inline __m128i fold128(__m128i x, __m128i k, __m128i block) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), block);
}

__attribute__((target("sse4.2,pclmul"))) inline __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Folds 16-byte blocks into x while they last, then reduces x and the tail with crc32.
__attribute__((target("sse4.2,pclmul"))) uint32_t finish128(__m128i x, const uint8_t* p, size_t n) {
  const __m128i k16 = key128(fold_keys().d16);
  for (; n >= 16; p += 16, n -= 16) x = fold128(x, k16, load128(p));
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  return hw_serial(static_cast<uint32_t>(c), p, n);
}

// Four 128-bit lanes 64 bytes apart: four independent multiply chains hide PCLMULQDQ's latency. n >= 64.
__attribute__((target("sse4.2,pclmul"))) uint32_t fold128_update(uint32_t crc, const uint8_t* p, size_t n) {
  const FoldKeys& keys = fold_keys();
  const __m128i k64 = key128(keys.d64);
  __m128i x0 = _mm_xor_si128(load128(p), _mm_cvtsi32_si128(static_cast<int>(crc)));
  __m128i x1 = load128(p + 16), x2 = load128(p + 32), x3 = load128(p + 48);
  for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
    x0 = fold128(x0, k64, load128(p));
    x1 = fold128(x1, k64, load128(p + 16));
    x2 = fold128(x2, k64, load128(p + 32));
    x3 = fold128(x3, k64, load128(p + 48));
  }
  __m128i x = fold128(x2, key128(keys.d16), x3);
  x = fold128(x1, key128(keys.d32), x);
  x = fold128(x0, key128(keys.d48), x);
  return finish128(x, p, n);
}

// a macro: the target attribute takes only a string literal
#define OFFLOAD_AVX512_CLMUL __attribute__((target("sse4.2,pclmul,avx512f,avx512bw,avx512vl,vpclmulqdq")))

OFFLOAD_AVX512_CLMUL inline __m512i fold512(__m512i z, __m512i k, __m512i block) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z, k, 0x00), _mm512_clmulepi64_epi128(z, k, 0x11), block,
                                   0x96);  // a ^ b ^ c
}

OFFLOAD_AVX512_CLMUL inline __m512i load512(const uint8_t* p) { return _mm512_loadu_si512(p); }

OFFLOAD_AVX512_CLMUL inline __m512i key512(const FoldKey& k) {
  const auto lo = static_cast<int64_t>(k.lo), hi = static_cast<int64_t>(k.hi);
  return _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);  // not broadcast_i32x4: GCC 12 warns on its undefined source
}

// Four 512-bit registers (16 lanes of 128 bits) 256 bytes apart, then folded down to one 128-bit lane. n >= 256.
OFFLOAD_AVX512_CLMUL uint32_t fold512_update(uint32_t crc, const uint8_t* p, size_t n) {
  const FoldKeys& keys = fold_keys();
  const __m512i k256 = key512(keys.d256);
  __m512i z0 = _mm512_xor_si512(load512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  __m512i z1 = load512(p + 64), z2 = load512(p + 128), z3 = load512(p + 192);
  for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
    z0 = fold512(z0, k256, load512(p));
    z1 = fold512(z1, k256, load512(p + 64));
    z2 = fold512(z2, k256, load512(p + 128));
    z3 = fold512(z3, k256, load512(p + 192));
  }
  __m512i z = fold512(z2, key512(keys.d64), z3);
  z = fold512(z1, key512(keys.d128), z);
  z = fold512(z0, key512(keys.d192), z);
  for (const __m512i k64 = key512(keys.d64); n >= 64; p += 64, n -= 64) z = fold512(z, k64, load512(p));
  // lanes 0, 1, 2 move 48, 32, 16 bytes to lane 3 in one multiply (lane 3's key is zero)
  const __m512i lanes = _mm512_set_epi64(0, 0, static_cast<int64_t>(keys.d16.hi), static_cast<int64_t>(keys.d16.lo),
                                         static_cast<int64_t>(keys.d32.hi), static_cast<int64_t>(keys.d32.lo),
                                         static_cast<int64_t>(keys.d48.hi), static_cast<int64_t>(keys.d48.lo));
  const __m512i moved = fold512(z, lanes, _mm512_setzero_si512());
  // maskz extracts: the plain ones trip GCC 12's -Wuninitialized (their undefined source)
  __m128i x = _mm_xor_si128(_mm512_maskz_extracti32x4_epi32(0xF, moved, 0), _mm512_maskz_extracti32x4_epi32(0xF, moved, 1));
  x = _mm_xor_si128(x, _mm_xor_si128(_mm512_maskz_extracti32x4_epi32(0xF, moved, 2),
                                     _mm512_maskz_extracti32x4_epi32(0xF, z, 3)));
  return finish128(x, p, n);
}

#undef OFFLOAD_AVX512_CLMUL

enum class Path { kTable, kSse42, kPclmul, kVpclmul };

// Preferred first. On a Zen 4 core 4 x 128-bit folding runs at 14.5 GB/s (its multiplies issue about one
// per 2 cycles) against 25.5 for the three crc32 chains, which only start at 24 KiB: so "pclmulqdq" folds
// what the single crc32 chain would take (256 B up to 24 KiB, and the rest after the rounds).
constexpr Path kPreferredFirst[] = {Path::kVpclmul, Path::kPclmul, Path::kSse42, Path::kTable};

const char* path_name(Path path) {
  switch (path) {
    case Path::kVpclmul: return "vpclmulqdq-avx512";
    case Path::kPclmul: return "pclmulqdq";
    case Path::kSse42: return "sse4.2";
    default: return "table";
  }
}

bool supported(Path path) {
  const CpuFeatures& f = cpu_features();
  switch (path) {
    case Path::kVpclmul: return f.sse42 && f.pclmul && f.vpclmulqdq && f.avx512f && f.avx512bw && f.avx512vl;
    case Path::kPclmul: return f.sse42 && f.pclmul;  // the final reduction uses crc32 (SSE4.2)
    case Path::kSse42: return f.sse42;
    default: return true;
  }
}

Path best_path() {
  for (Path path : kPreferredFirst)
    if (supported(path)) return path;
  return Path::kTable;
}

// Raw state update along `path`, which the CPU must support.
uint32_t update(Path path, uint32_t crc, const uint8_t* p, size_t n) {
  switch (path) {
    case Path::kVpclmul: return n >= kFoldMinBytes ? fold512_update(crc, p, n) : hw_update(crc, p, n);
    case Path::kPclmul:  // the crc32 rounds are faster where they apply; folding replaces the single chain
      crc = hw_rounds(crc, p, n);
      return n >= kFoldMinBytes ? fold128_update(crc, p, n) : hw_serial(crc, p, n);
    case Path::kSse42: return hw_update(crc, p, n);
    default: return table_update(crc, p, n);
  }
}

Path chosen_path() {
  static const Path path = best_path();
  return path;
}

}  // namespace

uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t seed) {
  return ~table_update(~seed, static_cast<const uint8_t*>(data), nbytes);
}

uint32_t crc32c(const void* data, size_t nbytes, uint32_t seed) {
  return ~update(chosen_path(), ~seed, static_cast<const uint8_t*>(data), nbytes);
}

const char* crc32c_path() { return path_name(chosen_path()); }

std::vector<std::string> crc32c_paths() {
  std::vector<std::string> names;
  for (Path path : kPreferredFirst)
    if (supported(path)) names.emplace_back(path_name(path));
  return names;
}

uint32_t crc32c_with(const std::string& path, const void* data, size_t nbytes, uint32_t seed) {
  for (Path p : kPreferredFirst) {
    if (path != path_name(p)) continue;
    if (!supported(p)) throw std::invalid_argument("this CPU cannot run the crc32c path '" + path + "'");
    return ~update(p, ~seed, static_cast<const uint8_t*>(data), nbytes);
  }
  throw std::invalid_argument("unknown crc32c path '" + path +
                              "': use vpclmulqdq-avx512, pclmulqdq, sse4.2 or table");
}

uint32_t crc32c_shift(size_t len2) { return shift_operator(len2); }

uint32_t crc32c_xpow(uint64_t n) { return xpow_mod(n); }

uint32_t crc32c_combine_shifted(uint32_t crc1, uint32_t crc2, uint32_t shift) {
  return mul_mod_poly(crc1, shift) ^ crc2;  // the conditioning of crc1 and crc2 cancels (zlib's crc32_combine)
}

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2) {
  return len2 == 0 ? crc1 : crc32c_combine_shifted(crc1, crc2, shift_operator(len2));
}

}  // namespace offload
