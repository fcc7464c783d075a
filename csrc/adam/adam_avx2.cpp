// AVX2 + FMA + F16C kernels (8 lanes); tails run the scalar maths compiled in this file.
// Headers with templates are included before the target pragma, so their instantiations stay baseline x86-64.
#include <cstring>
#include <immintrin.h>

#include "adam/adam_kernels.h"

#pragma GCC push_options
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps torch's kernels take.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx2,fma,f16c")
#include "adam/scalar_math.h"

namespace offload {
namespace {

constexpr int kLanes = 8;

struct Constants256 {
  __m256 grad_scale, decay_factor, l2_weight, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  bool use_l2;
  explicit Constants256(const AdamConstants& c)
      : grad_scale(_mm256_set1_ps(c.grad_scale)),
        decay_factor(_mm256_set1_ps(c.decay_factor)),
        l2_weight(_mm256_set1_ps(c.l2_weight)),
        lerp_weight(_mm256_set1_ps(c.lerp_weight)),
        beta2(_mm256_set1_ps(c.beta2)),
        one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)),
        bc2_sqrt(_mm256_set1_ps(c.bias_correction2_sqrt)),
        eps(_mm256_set1_ps(c.eps)),
        neg_step(_mm256_set1_ps(c.neg_step_size)),
        use_l2(c.use_l2) {}
};

template <DType T>
inline __m256 load8(const void* base, int64_t i) {
  if constexpr (T == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == DType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

inline __m128i to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i upper = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(upper, _mm256_set1_epi32(0x40)), nan);
  // Values are < 65536, so the unsigned-saturating pack is exact; it packs per 128-bit lane, hence the permute.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  return _mm256_castsi256_si128(packed);
}

template <DType O, bool kStream>
inline void store8(void* out, int64_t i, __m256 x) {
  if constexpr (O == DType::kFloat32) {
    float* dst = static_cast<float*>(out) + i;
    if (kStream) _mm256_stream_ps(dst, x);
    else _mm256_storeu_ps(dst, x);
  } else {
    __m128i h = (O == DType::kBFloat16) ? to_bf16(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if (kStream) _mm_stream_si128(dst, h);
    else _mm_storeu_si128(dst, h);
  }
}

template <DType G, DType O, bool kHasOut, bool kStream>
inline void step8(const AdamBuffers& b, const Constants256& c, int64_t i) {
  __m256 g = _mm256_mul_ps(load8<G>(b.g, i), c.grad_scale);
  __m256 p = _mm256_mul_ps(_mm256_loadu_ps(b.p + i), c.decay_factor);
  if (c.use_l2) g = _mm256_fmadd_ps(c.l2_weight, p, g);
  __m256 m = _mm256_loadu_ps(b.m + i);
  m = _mm256_fmadd_ps(c.lerp_weight, _mm256_sub_ps(g, m), m);
  __m256 v = _mm256_loadu_ps(b.v + i);
  v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g, _mm256_mul_ps(v, c.beta2));
  __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bc2_sqrt), c.eps);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c.neg_step, m), denom));  // torch's addcdiv order
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
  const bool stream = kHasOut && (reinterpret_cast<uintptr_t>(b.out) % elem == 0) && (end - begin) >= 4 * kLanes;
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

double sum_squares_avx2(const void* x, DType dtype, int64_t begin, int64_t end) {
  switch (dtype) {
    case DType::kBFloat16: return sum_squares_loop<DType::kBFloat16>(x, begin, end);
    case DType::kFloat16: return sum_squares_loop<DType::kFloat16>(x, begin, end);
    default: return sum_squares_loop<DType::kFloat32>(x, begin, end);
  }
}

}  // namespace offload
#pragma GCC pop_options
