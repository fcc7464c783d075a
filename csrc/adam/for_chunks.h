// Spreads a flat buffer over threads in cache-friendly chunks: the one loop of the fp32 and the moment kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "common/thread_pool.h"

namespace offload {

// 64K elements: 256 KiB of each fp32 array per task, so the streams of one task stay in L2 and the shared task
// counter is touched rarely. A multiple of 64 keeps every chunk start equally aligned, and of 256 (the int8
// moments' block) keeps every quantization block inside one task.
constexpr int64_t kChunk = int64_t{1} << 16;

// Below this many elements the kernels run on the calling thread: waking workers costs more than it saves.
constexpr int64_t kParallelThreshold = int64_t{1} << 18;

// Runs body(begin, end) over [0, n) in chunks: inline when small or single-threaded, otherwise on `pool`, or
// on a pool made for this call when the caller owns none.
template <typename Body>
void for_chunks(int64_t n, ThreadPool* pool, int num_threads, const Body& body) {
  const int threads = pool ? pool->size() : num_threads;
  if (n < kParallelThreshold || threads <= 1) {
    body(0, n);
    return;
  }
  const int64_t tasks = (n + kChunk - 1) / kChunk;
  std::unique_ptr<ThreadPool> own;
  if (!pool) {
    own = std::make_unique<ThreadPool>(static_cast<int>(std::min<int64_t>(threads, tasks)));
    pool = own.get();
  }
  pool->parallel_for(tasks, [&](int64_t t) { body(t * kChunk, std::min(n, (t + 1) * kChunk)); });
}

}  // namespace offload
