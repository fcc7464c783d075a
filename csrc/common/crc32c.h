// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of swap records and checkpoint
// files. Same values as the iSCSI/ext4/RFC 3720 CRC-32C: crc32c("123456789") == 0xE3069283.
//
// Contract: `crc32c(data, nbytes, seed)` continues a checksum: crc32c(B, n2, crc32c(A, n1, 0)) equals the
// checksum of A followed by B. `data` may be any address (no alignment needed); nbytes == 0 returns seed.
// The SSE4.2 path runs three independent chains over three adjacent chunks, interleaved so the CRC32
// instruction's 3-cycle latency is hidden, then joins them with a GF(2) shift; without SSE4.2 a
// slicing-by-8 table path gives the same values. Chosen at run time; never throws.
#pragma once

#include <cstddef>
#include <cstdint>

namespace offload {

uint32_t crc32c(const void* data, size_t nbytes, uint32_t seed = 0);

// The table path, always available (tests compare it with the SSE4.2 path).
uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t seed = 0);

// "sse4.2" or "table": the path crc32c() takes on this CPU.
const char* crc32c_path();

}  // namespace offload
