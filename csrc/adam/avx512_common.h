// AVX-512 pieces both AVX-512 kernels use (adam_avx512_impl.h: fp32 state; adam_moments_avx512.cpp: compressed
// moments): constants in registers, loads and stores of fp32/bf16/fp16, and the Adam maths on one vector.
// Included only after a file's `#pragma GCC target(...)`; everything sits in an unnamed namespace, so no
// instantiation compiled for AVX-512 leaks to other files.
#include <immintrin.h>

namespace offload {
namespace {

constexpr int kLanes = 16;

struct Constants512 {
  __m512 grad_scale, decay_factor, l2_weight, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  bool use_l2;
  explicit Constants512(const AdamConstants& c)
      : grad_scale(_mm512_set1_ps(c.grad_scale)),
        decay_factor(_mm512_set1_ps(c.decay_factor)),
        l2_weight(_mm512_set1_ps(c.l2_weight)),
        lerp_weight(_mm512_set1_ps(c.lerp_weight)),
        beta2(_mm512_set1_ps(c.beta2)),
        one_minus_beta2(_mm512_set1_ps(c.one_minus_beta2)),
        bc2_sqrt(_mm512_set1_ps(c.bias_correction2_sqrt)),
        eps(_mm512_set1_ps(c.eps)),
        neg_step(_mm512_set1_ps(c.neg_step_size)),
        use_l2(c.use_l2) {}
};

template <DType T>
inline __m512 load16(const void* base, int64_t i, __mmask16 k) {
  if constexpr (T == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(base) + i);
  } else {
    __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(base) + i);
    if constexpr (T == DType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Round to nearest even with integer arithmetic. Not vcvtneps2bf16 (AVX512_BF16): that instruction flushes
// denormal inputs to zero, where torch's .to(torch.bfloat16) keeps them; and in a loop bound by memory
// bandwidth these few integer operations cost nothing measurable.
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i upper = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(upper, _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(upper, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(rounded);
}

// Stores 16 results to `out` at element i: masked when k is partial, non-temporal when kStream (the caller
// guarantees the alignment the streaming store needs).
template <DType O, bool kStream>
inline void store16(void* out, int64_t i, __m512 x, __mmask16 k) {
  if constexpr (O == DType::kFloat32) {
    float* dst = static_cast<float*>(out) + i;
    if (k != 0xffff) _mm512_mask_storeu_ps(dst, k, x);
    else if (kStream) _mm512_stream_ps(dst, x);
    else _mm512_storeu_ps(dst, x);
  } else {
    __m256i h = (O == DType::kBFloat16) ? to_bf16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    uint16_t* dst = static_cast<uint16_t*>(out) + i;
    if (k != 0xffff) _mm256_mask_storeu_epi16(dst, k, h);
    else if (kStream) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  }
}

// adam_kernels.h's maths on 16 lanes: from the upcast gradient `g` and the old `p`, `m`, `v`, the new `m`, `v`
// and `s` = sqrt(v) in place, and the new p returned. One definition for both kernels, so their fp32 maths
// cannot drift apart.
inline __m512 adam_math16(const Constants512& c, __m512 g, __m512 p, __m512& m, __m512& v, __m512& s) {
  g = _mm512_mul_ps(g, c.grad_scale);
  p = _mm512_mul_ps(p, c.decay_factor);
  if (c.use_l2) g = _mm512_fmadd_ps(c.l2_weight, p, g);
  m = _mm512_fmadd_ps(c.lerp_weight, _mm512_sub_ps(g, m), m);
  v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g, _mm512_mul_ps(v, c.beta2));
  s = _mm512_sqrt_ps(v);
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(s, c.bc2_sqrt), c.eps);
  return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.neg_step, m), denom));  // torch's addcdiv order
}

}  // namespace
}  // namespace offload
