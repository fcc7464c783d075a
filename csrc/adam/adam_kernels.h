// The fused CPU Adam/AdamW step over flat buffers, and the fp64 sum of squares used for gradient clipping.
//
// Contract (offload/optim/functional.py validates all of this before calling):
//   * p, m, v: fp32, n elements each, no alignment required, not overlapping each other or g/out.
//   * g: n elements of fp32, bf16 or fp16; multiplied by grad_scale after the upcast.
//   * out: null, or n elements of fp32/bf16/fp16 that receive the new p (bf16 and fp16 rounded to nearest even).
// One pass over memory: each element of p, m, v, g is read once and p, m, v (and out) written once.
// The maths follows torch's single-tensor Adam/AdamW in order of operations, in fp32:
//   g = g * grad_scale;  adamw: p = p * (1 - lr*wd)  |  L2: g = fma(wd, p, g)
//   m = fma(1-b1, g - m, m);  v = fma((1-b2)*g, g, v*b2)
//   p = p + (-step_size * m) / (sqrt(v) / bc2_sqrt + eps)   with step_size = lr / (1 - b1^step)
// which is what torch's CPU kernels compute (its lerp and add-with-alpha use fma; addcdiv multiplies by the
// scalar before dividing). fp32 results match torch.optim.Adam/AdamW (foreach=False) to the last ulp in
// general, not bit for bit: our sqrt is correctly rounded and torch's vectorized CPU sqrt is not always, and
// Adam amplifies that ulp where the true gradient is ~0 (a qkv bias, an unused router row). docs/design.md
// [Note: clipping parity] says how the tests compare.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "adam/for_chunks.h"  // kParallelThreshold, for_chunks
#include "common/thread_pool.h"

namespace offload {

enum class DType { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
inline size_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Hyper-parameters as the kernel uses them: every scalar torch computes in double is computed here in double,
// then rounded once to fp32, as torch does when it hands a Python float to an fp32 kernel.
struct AdamConstants {
  float grad_scale;
  float decay_factor;   // 1 - lr*wd (adamw), else 1
  float l2_weight;      // wd (Adam with L2), else 0
  bool use_l2;          // Adam with L2 and wd != 0 (skipping the fma keeps an inf param from making a NaN)
  float lerp_weight;    // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

AdamConstants make_adam_constants(int64_t step, double lr, double beta1, double beta2, double eps,
                                  double weight_decay, bool adamw, double grad_scale);

struct AdamBuffers {
  float* p;
  float* m;
  float* v;
  const void* g;
  DType g_dtype;
  void* out;  // may be null
  DType out_dtype;
  // `out` with streaming stores (it is only written), fenced at the end of each kernel call: for calls over whole
  // tasks (AVX-512's fused resting step too); the resting step of the other ISAs calls the kernel 1024 elements at a
  // time and writes `out` plainly (no fence each)
  bool stream_out = true;
};

// One ISA's kernel over elements [begin, end).
using AdamRangeFn = void (*)(const AdamBuffers&, const AdamConstants&, int64_t begin, int64_t end);
void adam_range_scalar(const AdamBuffers&, const AdamConstants&, int64_t begin, int64_t end);
void adam_range_avx2(const AdamBuffers&, const AdamConstants&, int64_t begin, int64_t end);
void adam_range_avx512(const AdamBuffers&, const AdamConstants&, int64_t begin, int64_t end);

// Sum of x[i]^2 over [begin, end) with fp64 accumulation; inf and nan propagate.
using SumSquaresFn = double (*)(const void* x, DType dtype, int64_t begin, int64_t end);
double sum_squares_scalar(const void* x, DType dtype, int64_t begin, int64_t end);
double sum_squares_avx2(const void* x, DType dtype, int64_t begin, int64_t end);
double sum_squares_avx512(const void* x, DType dtype, int64_t begin, int64_t end);

// The 16-bit gradient rebuilt from the old and new first moment (grad_rebuild.h), one ISA's compilation.
using RebuildFn = void (*)(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out, DType dtype,
                           int64_t n);
void rebuild_scalar(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out, DType dtype, int64_t n);
void rebuild_avx2(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out, DType dtype, int64_t n);
void rebuild_avx512(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out, DType dtype, int64_t n);

// Where a resting step (adam_step_resting) puts the elements the rebuild would miss: their index and the gradient's
// bits, at most `capacity`; `count` says how many there were (beyond `capacity`: the lists are incomplete).
struct MissSink {
  int64_t* index;
  uint16_t* bits;
  int64_t capacity;
  std::atomic<int64_t>* count;

  void add(int64_t at, uint16_t grad_bits) const {
    const int64_t slot = count->fetch_add(1, std::memory_order_relaxed);
    if (slot < capacity) {
      index[slot] = at;
      bits[slot] = grad_bits;
    }
  }
};

// One ISA's resting step over elements [begin, end): the step, and the check of each element's rebuild.
using RestingRangeFn = void (*)(const AdamBuffers&, const AdamConstants&, int64_t begin, int64_t end,
                                const MissSink& misses);
void resting_range_avx512(const AdamBuffers&, const AdamConstants&, int64_t begin, int64_t end, const MissSink&);

// The L2 norm of n bf16/fp16 elements in torch's order of fp32 operations (torch_order_norm.h), one ISA's compilation.
using TorchOrderNormFn = float (*)(const uint16_t* x, DType dtype, int64_t n, int lanes, bool fused);
float torch_order_norm_scalar(const uint16_t* x, DType dtype, int64_t n, int lanes, bool fused);
float torch_order_norm_avx2(const uint16_t* x, DType dtype, int64_t n, int lanes, bool fused);
float torch_order_norm_avx512(const uint16_t* x, DType dtype, int64_t n, int lanes, bool fused);

// The variant used on this CPU: "avx512", "avx2" or "scalar". Chosen once (cpu_features()).
const char* adam_isa_name();

// The kernels of one named variant ("avx512", "avx2", "scalar"; "" = the best for this CPU), so
// tests can run every variant the CPU supports. Throws std::invalid_argument for an unknown or unsupported name.
struct AdamKernels {
  AdamRangeFn adam;
  SumSquaresFn sum_squares;
  RebuildFn rebuild;
  TorchOrderNormFn torch_order_norm;
  RestingRangeFn resting;
  const char* name;
};
const AdamKernels& adam_kernels_for(const std::string& isa);


// Updates all n elements. pool may be null (then the call creates threads only when n is large and
// num_threads > 1); otherwise the pool's threads are used and num_threads is ignored. crcs: null, or kCrcCount
// entries (step_crcs.h) that receive the CRC-32C of p, m, v and out as written (0 for the absent scales and out),
// computed in the same pass.
void adam_step(const AdamBuffers& buffers, const AdamConstants& constants, int64_t n, ThreadPool* pool,
               int num_threads, const AdamKernels& kernels, uint32_t* crcs = nullptr);

// A speculative step (issue 35): adam_step, which also checks that the 16-bit gradient (g_dtype bf16 or fp16,
// grad_scale 1, no L2 term) can be rebuilt from the old and new first moment (grad_rebuild.h), in the step's own
// loop (AVX-512) or a block of elements at a time while they are in cache (the others: kernels.resting). The
// elements it would miss are written to miss_index (their index plus `index_base`, ascending) and miss_bits (the
// gradient's bits), at most `capacity` of them. Returns how many there are: more than `capacity` means the lists
// are incomplete and unsorted (the gradient cannot rest in the moments). crcs: as for adam_step.
int64_t adam_step_resting(const AdamBuffers& buffers, const AdamConstants& constants, int64_t n, ThreadPool* pool,
                          int num_threads, const AdamKernels& kernels, int64_t* miss_index, uint16_t* miss_bits,
                          int64_t capacity, int64_t index_base = 0, uint32_t* crcs = nullptr);

// The gradient rebuilt from the moments into `out` (n elements of `dtype`, bf16 or fp16); the caller patches the
// misses the speculative step kept.
void rebuild_gradient(const float* m_old, const float* m_new, float lerp_weight, void* out, DType dtype, int64_t n,
                      ThreadPool* pool, int num_threads, const AdamKernels& kernels);

double sum_of_squares(const void* x, DType dtype, int64_t n, ThreadPool* pool, int num_threads,
                      const AdamKernels& kernels);

// The torch-order L2 norm (kernels.torch_order_norm) of each of `count` bf16/fp16 vectors into out[i]: each one
// whole on one thread (its order is torch's, one chain of additions), the vectors spread over the threads, the
// largest first, so a block's parameters take the time of its largest ones, not of their sum.
void torch_order_norms(const uint16_t* const* xs, const int64_t* ns, int64_t count, DType dtype, int lanes,
                       bool fused, float* out, ThreadPool* pool, int num_threads, const AdamKernels& kernels);

// The DRAM bound benchmarks compare the step against: the fp32-mode kernel's memory traffic (read p, m, v, g;
// write p, m, v: 28 bytes per element) in one pass with next to no arithmetic (csrc/adam/bandwidth_probe.cpp),
// threaded like adam_step. Values are unchanged.
void traffic_range(float* p, float* m, float* v, const float* g, float scale, float zero, int64_t begin,
                   int64_t end);
void memory_traffic_probe(float* p, float* m, float* v, const float* g, int64_t n, ThreadPool* pool,
                          int num_threads);

}  // namespace offload
