// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of swap records and checkpoint
// files. Same values as the iSCSI/ext4/RFC 3720 CRC-32C: crc32c("123456789") == 0xE3069283.
//
// Contract: `crc32c(data, nbytes, seed)` continues a checksum: crc32c(B, n2, crc32c(A, n1, 0)) equals the
// checksum of A followed by B. `data` may be any address (no alignment needed); nbytes == 0 returns seed.
// Paths, fastest first, chosen at run time: "vpclmulqdq-avx512" and "pclmulqdq" fold 16-byte blocks with
// carry-less multiplies (4 x 512-bit or 4 x 128-bit lanes) and reduce the last 16 bytes with the crc32
// instruction; "sse4.2" runs three crc32 chains over adjacent chunks, joined with a GF(2) shift (and takes
// inputs under 256 bytes on the folding paths too); "table" is slicing-by-8. All give the same values;
// none throws.
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

// The paths this CPU can run, fastest first; the last is "table".
std::vector<std::string> crc32c_paths();

// crc32c() along one named path (tests, benchmarks). Throws std::invalid_argument for a name that is not
// a path or that this CPU cannot run.
uint32_t crc32c_with(const std::string& path, const void* data, size_t nbytes, uint32_t seed = 0);

}  // namespace offload
