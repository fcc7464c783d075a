// AVX2 + FMA + F16C kernels (8 lanes); tails run the scalar maths compiled in this file.
// Headers with templates are included before the target pragma, so their instantiations stay baseline x86-64.
#include <cstring>
#include <immintrin.h>

#include "adam/adam_kernels.h"

#pragma GCC push_options
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps torch's kernels take.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx2,fma,f16c")
#include "adam/avx2_common.h"
#include "adam/scalar_math.h"
#include "adam/grad_rebuild.h"
#include "adam/torch_order_norm.h"

namespace offload {
namespace {

template <DType G, DType O, bool kHasOut, bool kStream>
inline void step8(const AdamBuffers& b, const Constants256& c, int64_t i) {
  __m256 m = _mm256_loadu_ps(b.m + i), v = _mm256_loadu_ps(b.v + i), s;
  const __m256 p = adam_math8(c, load8<G>(b.g, i), _mm256_loadu_ps(b.p + i), m, v, s);
  _mm256_storeu_ps(b.p + i, p);
  _mm256_storeu_ps(b.m + i, m);
  _mm256_storeu_ps(b.v + i, v);
  if constexpr (kHasOut) store8<O, kStream>(b.out, i, p);
}

template <DType G, DType O, bool kHasOut>
void adam_loop(const AdamBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end) {
  const Constants256 c(constants);
  int64_t i = begin;
  constexpr int64_t elem = (O == DType::kFloat32) ? 4 : 2;
  constexpr uintptr_t align = kLanes * elem;
  const bool stream = kHasOut && b.stream_out && (reinterpret_cast<uintptr_t>(b.out) % elem == 0) &&
                      (end - begin) >= 4 * kLanes;
  if (stream) {  // streaming stores for the write-only `out`; see the AVX-512 kernel
    const uintptr_t addr = reinterpret_cast<uintptr_t>(b.out) + static_cast<uintptr_t>(i) * elem;
    const int64_t head = static_cast<int64_t>(((align - addr % align) % align) / elem);
    scalar::adam_elements(b, constants, i, i + head);
    i += head;
    for (; i + kLanes <= end; i += kLanes) step8<G, O, kHasOut, true>(b, c, i);
    _mm_sfence();
  } else {
    for (; i + kLanes <= end; i += kLanes) step8<G, O, kHasOut, false>(b, c, i);
  }
  scalar::adam_elements(b, constants, i, end);
}

template <DType G>
void adam_dispatch_out(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  if (!b.out) return adam_loop<G, DType::kFloat32, false>(b, c, begin, end);
  switch (b.out_dtype) {
    case DType::kBFloat16: return adam_loop<G, DType::kBFloat16, true>(b, c, begin, end);
    case DType::kFloat16: return adam_loop<G, DType::kFloat16, true>(b, c, begin, end);
    default: return adam_loop<G, DType::kFloat32, true>(b, c, begin, end);
  }
}

template <DType T>
double sum_squares_loop(const void* x, int64_t begin, int64_t end) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const __m256 f = load8<T>(x, i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    acc0 = _mm256_fmadd_pd(lo, lo, acc0);
    acc1 = _mm256_fmadd_pd(hi, hi, acc1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]) + scalar::sum_squares(x, T, i, end);
}

}  // namespace

void adam_range_avx2(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  switch (b.g_dtype) {
    case DType::kBFloat16: return adam_dispatch_out<DType::kBFloat16>(b, c, begin, end);
    case DType::kFloat16: return adam_dispatch_out<DType::kFloat16>(b, c, begin, end);
    default: return adam_dispatch_out<DType::kFloat32>(b, c, begin, end);
  }
}

float torch_order_norm_avx2(const uint16_t* x, DType dtype, int64_t n, int lanes, bool fused) {
  return torch_order::norm_range(x, dtype, n, lanes, fused);
}
void rebuild_avx2(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out, DType dtype, int64_t n) {
  rebuild::rebuild_range(m_old, m_new, lerp_weight, out, dtype, n);
}

double sum_squares_avx2(const void* x, DType dtype, int64_t begin, int64_t end) {
  switch (dtype) {
    case DType::kBFloat16: return sum_squares_loop<DType::kBFloat16>(x, begin, end);
    case DType::kFloat16: return sum_squares_loop<DType::kFloat16>(x, begin, end);
    default: return sum_squares_loop<DType::kFloat32>(x, begin, end);
  }
}

}  // namespace offload
#pragma GCC pop_options
