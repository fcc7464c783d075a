// Picks the kernel for this CPU once, and spreads a flat buffer over threads in cache-friendly chunks.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "adam/adam_kernels.h"
#include "adam/step_crcs.h"
#include "common/cpu_features.h"

namespace offload {

namespace {

// The resting step of the ISAs without a fused one: the step and the rebuild 1024 elements at a time, so the old
// moments (4 KiB) and the rebuilt bits (2 KiB) stay in L1 while the step's lines are in L1/L2 (the check reads
// nothing more from DRAM than the step does); `out` is written plainly (the streaming stores' fence would come
// after every block).
template <AdamRangeFn kStep, RebuildFn kRebuild>
void resting_in_blocks(const AdamBuffers& buffers, const AdamConstants& constants, int64_t begin, int64_t end,
                       const MissSink& misses) {
  constexpr int64_t kBlock = 1024;
  AdamBuffers unstreamed = buffers;
  unstreamed.stream_out = false;
  float old[kBlock];
  uint16_t rebuilt[kBlock];
  const uint16_t* grad = static_cast<const uint16_t*>(buffers.g);
  for (int64_t i = begin; i < end; i += kBlock) {
    const int64_t len = std::min(kBlock, end - i);
    std::memcpy(old, buffers.m + i, static_cast<size_t>(len) * sizeof(float));
    kStep(unstreamed, constants, i, i + len);
    kRebuild(old, buffers.m + i, constants.lerp_weight, rebuilt, buffers.g_dtype, len);
    if (std::memcmp(rebuilt, grad + i, static_cast<size_t>(len) * sizeof(uint16_t)) == 0) continue;
    for (int64_t j = 0; j < len; ++j) {
      if (rebuilt[j] != grad[i + j]) misses.add(i + j, grad[i + j]);
    }
  }
}

constexpr AdamKernels kAvx512{adam_range_avx512, sum_squares_avx512, rebuild_avx512, torch_order_norm_avx512,
                              resting_range_avx512, "avx512"};
constexpr AdamKernels kAvx2{adam_range_avx2, sum_squares_avx2, rebuild_avx2, torch_order_norm_avx2,
                            resting_in_blocks<adam_range_avx2, rebuild_avx2>, "avx2"};
constexpr AdamKernels kScalar{adam_range_scalar, sum_squares_scalar, rebuild_scalar, torch_order_norm_scalar,
                              resting_in_blocks<adam_range_scalar, rebuild_scalar>, "scalar"};

const AdamKernels& select_kernels() {
  switch (best_isa()) {
    case Isa::kAvx512: return kAvx512;
    case Isa::kAvx2: return kAvx2;
    default: return kScalar;
  }
}

const AdamKernels& best_kernels() {
  static const AdamKernels& selected = select_kernels();  // immutable after first use
  return selected;
}

}  // namespace

AdamConstants make_adam_constants(int64_t step, double lr, double beta1, double beta2, double eps,
                                  double weight_decay, bool adamw, double grad_scale) {
  AdamConstants c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.decay_factor = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2_weight = adamw ? 0.0f : static_cast<float>(weight_decay);
  c.use_l2 = !adamw && weight_decay != 0.0;
  c.lerp_weight = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, static_cast<double>(step)))));
  return c;
}

const char* adam_isa_name() { return best_kernels().name; }

const AdamKernels& adam_kernels_for(const std::string& isa) {
  if (isa.empty()) return best_kernels();
  const Isa best = best_isa();
  const AdamKernels* found = nullptr;
  bool supported = false;
  if (isa == "avx512") found = &kAvx512, supported = best == Isa::kAvx512;
  else if (isa == "avx2") found = &kAvx2, supported = best != Isa::kScalar;
  else if (isa == "scalar") found = &kScalar, supported = true;
  if (!found) throw std::invalid_argument("unknown kernel variant '" + isa + "': use avx512, avx2 or scalar");
  if (!supported) throw std::invalid_argument("this CPU cannot run the '" + isa + "' kernels");
  return *found;
}

namespace {

// Byte lengths of the pieces the fp32 step writes over elements [begin, end) (StepCrc).
void flat_piece_lengths(const AdamBuffers& b, int64_t begin, int64_t end, size_t* len) {
  const size_t count = static_cast<size_t>(end - begin);
  len[kCrcParam] = len[kCrcExpAvg] = len[kCrcExpAvgSq] = 4 * count;
  len[kCrcExpAvgScales] = len[kCrcExpAvgSqScales] = 0;
  len[kCrcOut] = b.out ? dtype_size(b.out_dtype) * count : 0;
}

// Continues the CRCs with the pieces of [begin, end), read back right after the step wrote them (in L1/L2).
void flat_crcs_after(const AdamBuffers& b, int64_t begin, int64_t end, uint32_t* crcs) {
  const size_t count = static_cast<size_t>(end - begin);
  crcs[kCrcParam] = crc32c(b.p + begin, 4 * count, crcs[kCrcParam]);
  crcs[kCrcExpAvg] = crc32c(b.m + begin, 4 * count, crcs[kCrcExpAvg]);
  crcs[kCrcExpAvgSq] = crc32c(b.v + begin, 4 * count, crcs[kCrcExpAvgSq]);
  if (b.out) {
    const size_t ob = dtype_size(b.out_dtype);
    crcs[kCrcOut] = crc32c(static_cast<const uint8_t*>(b.out) + ob * static_cast<size_t>(begin), ob * count,
                           crcs[kCrcOut]);
  }
}

// The step over [0, n) as `range(buffers, begin, end)` does it, and, with `crcs`, the CRCs of what it writes:
// kCrcSpan elements are stepped, then their pieces checksummed while in cache. `out` is then written plainly:
// streamed, it would leave the cache only to be read back from DRAM.
template <typename Range>
void step_flat(const AdamBuffers& buffers, int64_t n, ThreadPool* pool, int num_threads, uint32_t* crcs,
               const Range& range) {
  if (!crcs) {
    for_chunks(n, pool, num_threads, [&](int64_t begin, int64_t end) { range(buffers, begin, end); });
    return;
  }
  AdamBuffers cached = buffers;
  cached.stream_out = false;
  for_chunks_with_crcs(
      n, pool, num_threads,
      [&](int64_t begin, int64_t end, uint32_t* part) {
        for (int64_t start = begin; start < end; start += kCrcSpan) {
          const int64_t stop = std::min(end, start + kCrcSpan);
          range(cached, start, stop);
          flat_crcs_after(cached, start, stop, part);
        }
      },
      [&](int64_t begin, int64_t end, size_t* len) { flat_piece_lengths(buffers, begin, end, len); }, crcs);
}

}  // namespace

void adam_step(const AdamBuffers& buffers, const AdamConstants& constants, int64_t n, ThreadPool* pool,
               int num_threads, const AdamKernels& kernels, uint32_t* crcs) {
  const AdamRangeFn fn = kernels.adam;
  step_flat(buffers, n, pool, num_threads, crcs,
            [&](const AdamBuffers& b, int64_t begin, int64_t end) { fn(b, constants, begin, end); });
}

int64_t adam_step_resting(const AdamBuffers& buffers, const AdamConstants& constants, int64_t n, ThreadPool* pool,
                          int num_threads, const AdamKernels& kernels, int64_t* miss_index, uint16_t* miss_bits,
                          int64_t capacity, int64_t index_base, uint32_t* crcs) {
  std::atomic<int64_t> count{0};
  const MissSink misses{miss_index, miss_bits, capacity, &count};
  const RestingRangeFn resting = kernels.resting;
  step_flat(buffers, n, pool, num_threads, crcs,
            [&](const AdamBuffers& b, int64_t begin, int64_t end) { resting(b, constants, begin, end, misses); });
  const int64_t found = count.load();
  if (found <= capacity) {  // ascending, as their reader wants them: here, not in a Python op a chunk
    std::vector<std::pair<int64_t, uint16_t>> sorted(static_cast<size_t>(found));
    for (int64_t i = 0; i < found; ++i) sorted[static_cast<size_t>(i)] = {miss_index[i], miss_bits[i]};
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < found; ++i) {
      miss_index[i] = sorted[static_cast<size_t>(i)].first + index_base;
      miss_bits[i] = sorted[static_cast<size_t>(i)].second;
    }
  }
  return found;
}

void rebuild_gradient(const float* m_old, const float* m_new, float lerp_weight, void* out, DType dtype, int64_t n,
                      ThreadPool* pool, int num_threads, const AdamKernels& kernels) {
  const RebuildFn fn = kernels.rebuild;
  uint16_t* bits = static_cast<uint16_t*>(out);
  for_chunks(n, pool, num_threads, [&](int64_t begin, int64_t end) {
    fn(m_old + begin, m_new + begin, lerp_weight, bits + begin, dtype, end - begin);
  });
}

void torch_order_norms(const uint16_t* const* xs, const int64_t* ns, int64_t count, DType dtype, int lanes,
                       bool fused, float* out, ThreadPool* pool, int num_threads, const AdamKernels& kernels) {
  std::vector<int64_t> order(static_cast<size_t>(count));
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    order[static_cast<size_t>(i)] = i;
    total += ns[i];
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ns[a] > ns[b]; });
  const auto norm = [&](int64_t t) {
    const int64_t i = order[static_cast<size_t>(t)];
    out[i] = kernels.torch_order_norm(xs[i], dtype, ns[i], lanes, fused);
  };
  const int threads = pool ? pool->size() : num_threads;
  if (count < 2 || threads <= 1 || total < kParallelThreshold) {
    for (int64_t t = 0; t < count; ++t) norm(t);
    return;
  }
  std::unique_ptr<ThreadPool> own;
  if (!pool) {
    own = std::make_unique<ThreadPool>(static_cast<int>(std::min<int64_t>(threads, count)));
    pool = own.get();
  }
  pool->parallel_for(count, norm);
}

double sum_of_squares(const void* x, DType dtype, int64_t n, ThreadPool* pool, int num_threads,
                      const AdamKernels& kernels) {
  const SumSquaresFn fn = kernels.sum_squares;
  if (n < kParallelThreshold) return fn(x, dtype, 0, n);
  // One partial per chunk, added in chunk order: the result does not depend on the thread count.
  std::vector<double> partials(static_cast<size_t>((n + kChunk - 1) / kChunk), 0.0);
  for_chunks(n, pool, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kChunk) partials[b / kChunk] = fn(x, dtype, b, std::min(end, b + kChunk));
  });
  double total = 0.0;
  for (double part : partials) total += part;
  return total;
}

void memory_traffic_probe(float* p, float* m, float* v, const float* g, int64_t n, ThreadPool* pool,
                          int num_threads) {
  for_chunks(n, pool, num_threads,
             [&](int64_t begin, int64_t end) { traffic_range(p, m, v, g, 1.0f, 0.0f, begin, end); });
}

}  // namespace offload
