// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of swap records and checkpoint
// files. Same values as the iSCSI/ext4/RFC 3720 CRC-32C: crc32c("123456789") == 0xE3069283.
//
// Contract: `crc32c(data, nbytes, seed)` continues a checksum: crc32c(B, n2, crc32c(A, n1, 0)) equals the
// checksum of A followed by B. `data` may be any address (no alignment needed); nbytes == 0 returns seed.
// Paths, chosen at run time in this order: "vpclmulqdq-avx512" folds 16-byte blocks with carry-less
// multiplies in 4 x 512-bit registers and reduces the last 16 bytes with the crc32 instruction; "pclmulqdq"
// folds in 4 x 128-bit lanes, but leaves inputs of 24 KiB and more to the crc32 rounds of "sse4.2" (faster
// on Zen 4) and folds only what is left; "sse4.2" runs three crc32 chains over adjacent 8 KiB chunks, joined
// with a GF(2) shift, and one chain for the rest. Inputs under 256 bytes take one crc32 chain on all three;
// "table" is slicing-by-8. All give the same values; none throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace offload {

uint32_t crc32c(const void* data, size_t nbytes, uint32_t seed = 0);

// The table path, always available (tests compare the other paths with it).
uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t seed = 0);

// "vpclmulqdq-avx512", "pclmulqdq", "sse4.2" or "table": the path crc32c() takes on this CPU.
const char* crc32c_path();

// The paths this CPU can run, preferred first: the first is crc32c_path(), the last "table".
std::vector<std::string> crc32c_paths();

// crc32c() along one named path (tests, benchmarks). Throws std::invalid_argument for a name that is not
// a path or that this CPU cannot run.
uint32_t crc32c_with(const std::string& path, const void* data, size_t nbytes, uint32_t seed = 0);

// The checksum of A followed by B from crc1 = crc32c(A) and crc2 = crc32c(B), len2 = B's length in bytes
// (zlib's crc32_combine: crc1 times x^(8 * len2) modulo the polynomial, XOR crc2). Threads that checksum adjacent
// pieces of one buffer join their results with it. Costs about 2 us (64 products); crc32c_shift(len2) once and
// crc32c_combine_shifted for each pair makes it one product when many pieces have the same length.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2);
uint32_t crc32c_shift(size_t len2);
uint32_t crc32c_combine_shifted(uint32_t crc1, uint32_t crc2, uint32_t shift);

// x^n modulo the polynomial, bit-reflected as the CRCs are (for carry-less-multiply keys: a raw 32-bit CRC state c
// times x^(8 d) is crc32_u64(0, clmul(c, crc32c_xpow(8 d - 33))), the state after d more zero bytes).
uint32_t crc32c_xpow(uint64_t n);

}  // namespace offload
