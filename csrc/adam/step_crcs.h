// The CRC-32C of each piece an Adam step writes, computed in the pass that writes them, for the swap file's seals
// (offload/tiers/disk.py): the fp32 step (adam_dispatch.cpp) and the compressed-moment step
// (adam_moments_dispatch.cpp) alike, so the worker reads nothing back to seal a chunk it wrote.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "adam/for_chunks.h"
#include "common/crc32c.h"

namespace offload {

// `crcs[k]` for k below (offload.optim.functional.CRC_PIECES): an absent piece (fp32 or bf16 moments' scales, no
// out) has the CRC of no bytes, 0.
enum StepCrc : int {
  kCrcParam = 0,           // p: 4 n bytes
  kCrcExpAvg = 1,          // m's values (fp32: 4 n bytes, bf16: 2 n) or int8 codes (n)
  kCrcExpAvgScales = 2,    // m's int8 scales (4 ceil(n / kInt8Block) bytes)
  kCrcExpAvgSq = 3,        // v's values or codes
  kCrcExpAvgSqScales = 4,  // v's int8 scales
  kCrcOut = 5,             // out: n elements of out_dtype
  kCrcCount = 6,
};

// Elements a portable kernel steps before it checksums their pieces: 16 KiB of fp32 p, in L1/L2 when read back.
// A multiple of the int8 moments' block (256).
constexpr int64_t kCrcSpan = 4096;

// Runs step(begin, end, crcs) over [0, n) in for_chunks' tasks, each task continuing CRCs that start at 0, and
// joins them in order into `crcs` (kCrcCount entries): crc(A B) = crc32c_combine(crc(A), crc(B), len(B)).
// lengths(begin, end, len) gives each piece's byte length over elements [begin, end).
template <typename Step, typename Lengths>
void for_chunks_with_crcs(int64_t n, ThreadPool* pool, int num_threads, const Step& step, const Lengths& lengths,
                          uint32_t* crcs) {
  struct Slot {
    uint32_t crc[kCrcCount];
    int64_t end;
  };
  // Each task's CRCs in the slot of its first chunk index (run inline, slot 0 covers everything).
  std::vector<Slot> slots(static_cast<size_t>(std::max<int64_t>(1, (n + kChunk - 1) / kChunk)));
  for_chunks(n, pool, num_threads, [&](int64_t begin, int64_t end) {
    Slot& slot = slots[static_cast<size_t>(begin / kChunk)];
    std::fill(slot.crc, slot.crc + kCrcCount, 0u);
    slot.end = end;
    step(begin, end, slot.crc);
  });
  std::copy(slots[0].crc, slots[0].crc + kCrcCount, crcs);
  size_t full[kCrcCount];
  lengths(0, kChunk, full);
  uint32_t full_shift[kCrcCount];
  for (int k = 0; k < kCrcCount; ++k) full_shift[k] = crc32c_shift(full[k]);
  for (int64_t at = n > 0 ? slots[0].end : 0; at < n;) {
    const Slot& slot = slots[static_cast<size_t>(at / kChunk)];
    size_t len[kCrcCount];
    lengths(at, slot.end, len);
    for (int k = 0; k < kCrcCount; ++k) {
      crcs[k] = len[k] == full[k] ? crc32c_combine_shifted(crcs[k], slot.crc[k], full_shift[k])
                                  : crc32c_combine(crcs[k], slot.crc[k], len[k]);
    }
    at = slot.end;
  }
}

}  // namespace offload
