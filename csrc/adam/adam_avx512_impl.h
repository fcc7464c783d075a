// The AVX-512 kernel body, included only by adam_avx512.cpp after its `#pragma GCC target(...)`.
// Everything here sits in an unnamed namespace, so no instantiation compiled for AVX-512 leaks to other files.
#include <immintrin.h>

#include <type_traits>

#include "adam/avx512_common.h"
#include "adam/scalar_math.h"

namespace offload {
namespace {

inline __mmask16 tail_mask(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

// One vector's step; returns the first moment it wrote, and puts the one it read in `old` (the resting check's).
template <DType G, DType O, bool kHasOut, bool kStream>
inline __m512 step16(const AdamBuffers& b, const Constants512& c, int64_t i, __mmask16 k, __m512& old) {
  __m512 m = _mm512_maskz_loadu_ps(k, b.m + i);
  old = m;
  __m512 v = _mm512_maskz_loadu_ps(k, b.v + i);
  __m512 s;
  const __m512 p = adam_math16(c, load16<G>(b.g, i, k), _mm512_maskz_loadu_ps(k, b.p + i), m, v, s);
  _mm512_mask_storeu_ps(b.p + i, k, p);
  _mm512_mask_storeu_ps(b.m + i, k, m);
  _mm512_mask_storeu_ps(b.v + i, k, v);
  if constexpr (kHasOut) store16<O, kStream>(b.out, i, p, k);
  return m;
}

// Calls vector(i, mask, stream) over [begin, end) one vector of kLanes at a time, `stream` a
// std::integral_constant<bool, ...>: whether the vector's `out` store may stream. Streaming stores for `out`,
// which is only written, spare reading its lines into the cache first (2 bytes per element for bf16). They need
// 32/64-byte alignment, so elements are peeled until then, and one fence ends the call. Measured on an AMD EPYC
// (Zen 4) at 200M elements: no difference for the plain step within noise (kept as they never add traffic);
// the resting step, which does more per vector, 1.11-1.14x -> 1.01-1.04x the plain step on 2 cores.
template <DType O, bool kHasOut, typename Vector>
inline void over_vectors(const AdamBuffers& b, int64_t begin, int64_t end, const Vector& vector) {
  constexpr int64_t elem = (O == DType::kFloat32) ? 4 : 2;
  constexpr uintptr_t align = kLanes * elem;
  const std::integral_constant<bool, false> plain;
  const std::integral_constant<bool, true> streamed;
  int64_t i = begin;
  const bool stream = kHasOut && b.stream_out && (reinterpret_cast<uintptr_t>(b.out) % elem == 0) &&
                      (end - begin) >= 4 * kLanes;
  if (stream) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(b.out) + static_cast<uintptr_t>(i) * elem;
    const int64_t head = static_cast<int64_t>(((align - addr % align) % align) / elem);
    if (head > 0) vector(i, tail_mask(head), plain);
    i += head;
    for (; i + kLanes <= end; i += kLanes) vector(i, static_cast<__mmask16>(0xffff), streamed);
    _mm_sfence();
  } else {
    for (; i + kLanes <= end; i += kLanes) vector(i, static_cast<__mmask16>(0xffff), plain);
  }
  if (i < end) vector(i, tail_mask(end - i), plain);
}

template <DType G, DType O, bool kHasOut>
void adam_loop(const AdamBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end) {
  const Constants512 c(constants);
  over_vectors<O, kHasOut>(b, begin, end, [&](int64_t i, __mmask16 k, auto stream) {
    __m512 old;
    step16<G, O, kHasOut, decltype(stream)::value>(b, c, i, k, old);
  });
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

void adam_range(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  switch (b.g_dtype) {
    case DType::kBFloat16: return adam_dispatch_out<DType::kBFloat16>(b, c, begin, end);
    case DType::kFloat16: return adam_dispatch_out<DType::kFloat16>(b, c, begin, end);
    default: return adam_dispatch_out<DType::kFloat32>(b, c, begin, end);
  }
}

// The resting step (adam_step_resting) in one pass: each vector is stepped, then the gradient rebuilt from the old
// and new first moment as grad_rebuild.h does it, in registers, and compared with the gradient's bits. Lanes that
// differ, and any lane whose rebuild is NaN (its payload may differ from the rebuild loop's), are misses.
template <DType G, DType O, bool kHasOut, bool kStream>
inline void resting16(const AdamBuffers& b, const Constants512& c, __m512 inverse, int64_t i, __mmask16 k,
                      const MissSink& misses) {
  const uint16_t* grad = static_cast<const uint16_t*>(b.g);
  const __m256i bits = _mm256_maskz_loadu_epi16(k, grad + i);
  __m512 old;
  const __m512 m = step16<G, O, kHasOut, kStream>(b, c, i, k, old);
  const __m512 of_zero = _mm512_fnmadd_ps(c.lerp_weight, old, old);  // fma(lw, -old, old)
  __m512 rebuilt = _mm512_fmadd_ps(_mm512_sub_ps(m, old), inverse, old);
  rebuilt = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, of_zero, _CMP_NEQ_UQ), rebuilt);  // +0.0: a zero gradient
  const __m256i rounded = (G == DType::kBFloat16)
                              ? to_bf16(rebuilt)
                              : _mm512_cvtps_ph(rebuilt, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 missed = _mm256_mask_cmpneq_epi16_mask(k, rounded, bits) |
                           _mm512_mask_cmp_ps_mask(k, rebuilt, rebuilt, _CMP_UNORD_Q);
  for (unsigned lanes = missed; lanes != 0; lanes &= lanes - 1) {
    const int64_t at = i + __builtin_ctz(lanes);
    misses.add(at, grad[at]);
  }
}

template <DType G, DType O, bool kHasOut>
void resting_loop(const AdamBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end,
                  const MissSink& misses) {
  const Constants512 c(constants);
  const __m512 inverse = _mm512_set1_ps(1.0f / constants.lerp_weight);  // as grad_rebuild.h computes it
  over_vectors<O, kHasOut>(b, begin, end, [&](int64_t i, __mmask16 k, auto stream) {
    resting16<G, O, kHasOut, decltype(stream)::value>(b, c, inverse, i, k, misses);
  });
}

template <DType G>
void resting_dispatch_out(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end,
                          const MissSink& misses) {
  if (!b.out) return resting_loop<G, DType::kFloat32, false>(b, c, begin, end, misses);
  switch (b.out_dtype) {
    case DType::kBFloat16: return resting_loop<G, DType::kBFloat16, true>(b, c, begin, end, misses);
    case DType::kFloat16: return resting_loop<G, DType::kFloat16, true>(b, c, begin, end, misses);
    default: return resting_loop<G, DType::kFloat32, true>(b, c, begin, end, misses);
  }
}

// g_dtype bf16 or fp16 (the binding checks).
void resting_range(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end, const MissSink& misses) {
  if (b.g_dtype == DType::kBFloat16) return resting_dispatch_out<DType::kBFloat16>(b, c, begin, end, misses);
  return resting_dispatch_out<DType::kFloat16>(b, c, begin, end, misses);
}

template <DType T>
double sum_squares_loop(const void* x, int64_t begin, int64_t end) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (int64_t i = begin; i < end; i += kLanes) {
    const __mmask16 k = (end - i >= kLanes) ? static_cast<__mmask16>(0xffff) : tail_mask(end - i);
    const __m512 f = load16<T>(x, i, k);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
}

double sum_squares(const void* x, DType dtype, int64_t begin, int64_t end) {
  switch (dtype) {
    case DType::kBFloat16: return sum_squares_loop<DType::kBFloat16>(x, begin, end);
    case DType::kFloat16: return sum_squares_loop<DType::kFloat16>(x, begin, end);
    default: return sum_squares_loop<DType::kFloat32>(x, begin, end);
  }
}

}  // namespace
}  // namespace offload
