// AVX2 pieces both AVX2 kernels use (adam_avx2.cpp: fp32 state; adam_moments_avx2.cpp: compressed moments):
// constants in registers, loads and stores of fp32/bf16/fp16, and the Adam maths on one vector of 8.
// Included only after a file's `#pragma GCC target("avx2,fma,f16c")`; everything sits in an unnamed namespace, so
// no instantiation compiled for AVX2 leaks to other files.
#include <immintrin.h>

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

inline __m256 bf16x8_to_float(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

template <DType T>
inline __m256 load8(const void* base, int64_t i) {
  if constexpr (T == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == DType::kBFloat16) {
      return bf16x8_to_float(h);
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Round to nearest even, NaN kept quiet: scalar::float_to_bf16 on 8 lanes.
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

// adam_kernels.h's maths on 8 lanes: from the upcast gradient `g` and the old `p`, `m`, `v`, the new `m`, `v` and
// `s` = sqrt(v) in place, and the new p returned. One definition for both AVX2 kernels.
inline __m256 adam_math8(const Constants256& c, __m256 g, __m256 p, __m256& m, __m256& v, __m256& s) {
  g = _mm256_mul_ps(g, c.grad_scale);
  p = _mm256_mul_ps(p, c.decay_factor);
  if (c.use_l2) g = _mm256_fmadd_ps(c.l2_weight, p, g);
  m = _mm256_fmadd_ps(c.lerp_weight, _mm256_sub_ps(g, m), m);
  v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g, _mm256_mul_ps(v, c.beta2));
  s = _mm256_sqrt_ps(v);
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(s, c.bc2_sqrt), c.eps);
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c.neg_step, m), denom));  // torch's addcdiv order
}

}  // namespace
}  // namespace offload
