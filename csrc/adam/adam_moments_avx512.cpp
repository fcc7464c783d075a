// AVX-512 (F, BW, VL, DQ) moment kernels: 16 lanes, masked tails. int8 decode looks the map up in registers;
// encode finds the decade of y with compares, a candidate code arithmetically, then moves it one step
// toward the nearest map value with two gathers of the midpoints: the same code as the scalar kernels' search.
// Headers with templates are included before the target pragma, so their instantiations stay baseline x86-64.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <immintrin.h>

#include "adam/adam_moments.h"

#pragma GCC push_options
// gcc 12 warns inside its own avx512 intrinsics (their _mm512_undefined_* placeholders): a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps of adam_kernels.h.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

namespace offload {
namespace {

constexpr int kLanes = 16;

inline __mmask16 lanes(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}

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

// Round to nearest even with integer arithmetic, NaN kept quiet: as adam_avx512_impl.h's to_bf16.
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i upper = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(upper, _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(upper, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(rounded);
}

template <DType O>
inline void store16(void* out, int64_t i, __m512 x, __mmask16 k) {
  if constexpr (O == DType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + i, k, x);
  } else {
    __m256i h = (O == DType::kBFloat16) ? to_bf16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k, h);
  }
}

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

// adam_kernels.h's maths on decoded m, v; stores p (and out); returns the new m, v and sqrt(v) in place.
template <DType G, DType O, bool kHasOut>
inline void adam16(const MomentBuffers& b, const Constants512& c, int64_t i, __mmask16 k, __m512& m, __m512& v,
                   __m512& s) {
  __m512 g = _mm512_mul_ps(load16<G>(b.g, i, k), c.grad_scale);
  __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, b.p + i), c.decay_factor);
  if (c.use_l2) g = _mm512_fmadd_ps(c.l2_weight, p, g);
  m = _mm512_fmadd_ps(c.lerp_weight, _mm512_sub_ps(g, m), m);
  v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g, _mm512_mul_ps(v, c.beta2));
  s = _mm512_sqrt_ps(v);
  __m512 denom = _mm512_add_ps(_mm512_div_ps(s, c.bc2_sqrt), c.eps);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.neg_step, m), denom));  // torch's addcdiv order
  _mm512_mask_storeu_ps(b.p + i, k, p);
  if constexpr (kHasOut) store16<O>(b.out, i, p, k);
}

// --- int8 codes ----------------------------------------------------------------------------------------------

// One map's encoder. The exact code is #{midpoints < y}; computing it with two gathered midpoints per lane costs
// more than the rest of the step (gathers are slow on CPUs with the Downfall/GDS mitigation), so:
//   1. the decade d of y by compares, then t = y * a[d] - b[d], whose integer part j is the bucket of y in its
//      decade (the buckets' edges are the midpoints between the decade's values) and c = 2^(d+1) - 1 + j;
//   2. the first bucket of a decade borders the previous decade's last value, and the last bucket the next
//      decade's first value (or 1): there the midpoint is not an edge, so compare y with it (per-decade constants,
//      picked with permutexvar);
//   3. t carries ~2e-5 of rounding (a, b, y * a and the midpoints' own fp32 rounding), so when its fraction is
//      within kEdge of an inner edge, the lane could be on either side: then (rarely: ~0.2% of lanes) the whole
//      vector takes the exact path, the candidate corrected by one step with the two gathered midpoints.
struct Encoder {
  static constexpr float kEdge = 1.0f / 1024;
  const float* mids;
  int decades;
  __m512 bound[7];  // bound[i] = 10^(i + 1 - decades): y >= bound[i] means decade > i
  __m512 a, b;      // indexed by decade (permutexvar)
  __m512 below, above;  // midpoint below the decade's first value, above its last value
  explicit Encoder(const float* midpoints, int num_decades) : mids(midpoints), decades(num_decades) {
    alignas(64) float av[16] = {}, bv[16] = {}, lo[16] = {}, hi[16] = {};
    for (int d = 0; d < decades; ++d) {
      const int k = 2 << d;
      av[d] = static_cast<float>(k / (0.9 * std::pow(10.0, d - decades + 1)));
      bv[d] = static_cast<float>(k / 9.0);
      lo[d] = midpoints[k - 2];      // between code k - 2 (previous decade's last, or 0) and k - 1
      hi[d] = midpoints[2 * k - 2];  // between code 2k - 2 (this decade's last) and 2k - 1 (next first, or 1)
      if (d + 1 < decades) bound[d] = _mm512_set1_ps(static_cast<float>(std::pow(10.0, d + 1 - decades)));
    }
    a = _mm512_load_ps(av);
    b = _mm512_load_ps(bv);
    below = _mm512_load_ps(lo);
    above = _mm512_load_ps(hi);
  }

  inline __m512i encode(__m512 y) const {
    const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
    __m512i d = zero;
    for (int i = 0; i + 1 < decades; ++i) d = _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(y, bound[i], _CMP_GE_OQ), d, one);
    const __m512 t = _mm512_fmsub_ps(y, _mm512_permutexvar_ps(d, a), _mm512_permutexvar_ps(d, b));
    const __m512i last = _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(2), d), one);  // K - 1
    __m512i j = _mm512_max_epi32(_mm512_cvttps_epi32(t), zero);  // NaN: INT_MIN -> 0
    j = _mm512_min_epi32(j, last);
    const __m512i c = _mm512_add_epi32(last, j);  // in [1, size - 2]
    const __m512 frac = _mm512_sub_ps(t, _mm512_cvtepi32_ps(j));
    const __mmask16 first = _mm512_cmpeq_epi32_mask(j, zero), top = _mm512_cmpeq_epi32_mask(j, last);
    const __mmask16 unsure = (_mm512_cmp_ps_mask(frac, _mm512_set1_ps(kEdge), _CMP_LT_OQ) & ~first) |
                             (_mm512_cmp_ps_mask(frac, _mm512_set1_ps(1.0f - kEdge), _CMP_GT_OQ) & ~top);
    if (__builtin_expect(unsure != 0, 0)) return exact(y, c);
    const __mmask16 down = first & _mm512_cmp_ps_mask(y, _mm512_permutexvar_ps(d, below), _CMP_LE_OQ);
    const __mmask16 up = top & _mm512_cmp_ps_mask(y, _mm512_permutexvar_ps(d, above), _CMP_GT_OQ);
    return _mm512_mask_add_epi32(_mm512_mask_sub_epi32(c, down, c, one), up, c, one);
  }

  // c within one step of #{midpoints < y}: one comparison on each side settles it.
  __m512i exact(__m512 y, __m512i c) const {
    const __m512i one = _mm512_set1_epi32(1);
    const __m512 hi = _mm512_i32gather_ps(c, mids, 4);
    const __m512 lo = _mm512_i32gather_ps(_mm512_sub_epi32(c, one), mids, 4);
    const __mmask16 up = _mm512_cmp_ps_mask(y, hi, _CMP_GT_OQ), down = _mm512_cmp_ps_mask(y, lo, _CMP_LE_OQ);
    return _mm512_mask_sub_epi32(_mm512_mask_add_epi32(c, up, c, one), down, c, one);
  }
};

// A lookup in a table of 128 or 256 floats held in registers: vpermt2ps picks from 32 entries by the index's
// low 5 bits, then blends by bits 5-7. Cheaper than a gather where the GDS (Downfall) mitigation slows gathers.
template <int N>
struct Table {
  __m512 part[N / 16];
  explicit Table(const float* values) {
    for (int i = 0; i < N / 16; ++i) part[i] = _mm512_loadu_ps(values + 16 * i);
  }
  inline __m512 operator()(__m512i idx) const {
    __m512 r[N / 32];
    for (int q = 0; q < N / 32; ++q) r[q] = _mm512_permutex2var_ps(part[2 * q], idx, part[2 * q + 1]);
    for (int bit = 32, count = N / 32; count > 1; bit *= 2, count /= 2) {
      const __mmask16 high = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(bit));
      for (int q = 0; q < count / 2; ++q) r[q] = _mm512_mask_blend_ps(high, r[2 * q], r[2 * q + 1]);
    }
    return r[0];
  }
};

struct Int8Codec {
  const MomentMaps& maps;
  Table<128> m_map;
  Table<256> v_map;
  Encoder m_enc, v_enc;
  Int8Codec()
      : maps(moment_maps()), m_map(maps.m), v_map(maps.v), m_enc(maps.m_mid, 6), v_enc(maps.v_mid, 7) {}

  inline __m512 decode_m(const uint8_t* codes, int64_t i, __mmask16 k, __m512 scale) const {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes + i));
    const __m512 mag = m_map(c);  // bit 7 is not looked at: 128 entries
    const __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(c, 7), 31);
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(mag, scale)), sign));
  }
  inline __m512 decode_sqrt_v(const uint8_t* codes, int64_t i, __mmask16 k, __m512 scale) const {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes + i));
    return _mm512_mul_ps(v_map(c), scale);
  }

  // Codes of one block of `count` values (m, sign-bearing, for kExpAvg; sqrt(v) for kExpAvgSq); returns its scale.
  float encode_block(const float* vals, uint8_t* codes, int64_t count, int which) const {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < count; i += kLanes) {
      const __mmask16 k = lanes(count - i);
      const __m512 a = _mm512_and_ps(_mm512_maskz_loadu_ps(k, vals + i), abs_mask);
      nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, a);
    }
    const float scale = nan ? NAN : _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t i = 0; i < count; i += kLanes) {
      const __mmask16 k = lanes(count - i);
      const __m512 x = _mm512_maskz_loadu_ps(k, vals + i);
      const __m512 y = _mm512_mul_ps(_mm512_and_ps(x, abs_mask), inv);
      __m512i c;
      if (which == kExpAvg) {
        c = m_enc.encode(y);
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ) & _mm512_cmpgt_epi32_mask(c, zero);
        c = _mm512_mask_or_epi32(c, neg, c, _mm512_set1_epi32(0x80));
      } else {
        c = v_enc.encode(y);
        const __mmask16 floor = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ) & _mm512_cmpeq_epi32_mask(c, zero);
        c = _mm512_mask_mov_epi32(c, floor, _mm512_set1_epi32(1));
      }
      _mm_mask_storeu_epi8(codes + i, k, _mm512_cvtepi32_epi8(c));
    }
    return scale;
  }
};

template <DType G, DType O, bool kHasOut>
void step_bf16(const MomentBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end) {
  const Constants512 c(constants);
  uint16_t* m16 = static_cast<uint16_t*>(b.m);
  uint16_t* v16 = static_cast<uint16_t*>(b.v);
  for (int64_t i = begin; i < end; i += kLanes) {
    const __mmask16 k = lanes(end - i);
    __m512 m = load16<DType::kBFloat16>(m16, i, k), v = load16<DType::kBFloat16>(v16, i, k), s;
    adam16<G, O, kHasOut>(b, c, i, k, m, v, s);
    _mm256_mask_storeu_epi16(m16 + i, k, to_bf16(m));
    _mm256_mask_storeu_epi16(v16 + i, k, to_bf16(v));
  }
}

template <DType G, DType O, bool kHasOut>
void step_int8(const MomentBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end) {
  const Constants512 c(constants);
  const Int8Codec codec;
  uint8_t* mc = static_cast<uint8_t*>(b.m);
  uint8_t* vc = static_cast<uint8_t*>(b.v);
  alignas(64) float new_m[kInt8Block], new_s[kInt8Block];
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block), blk = start / kInt8Block;
    const __m512 m_scale = _mm512_set1_ps(b.m_scales[blk]), v_scale = _mm512_set1_ps(b.v_scales[blk]);
    for (int64_t i = start; i < stop; i += kLanes) {
      const __mmask16 k = lanes(stop - i);
      __m512 m = codec.decode_m(mc, i, k, m_scale);
      const __m512 s_old = codec.decode_sqrt_v(vc, i, k, v_scale);
      __m512 v = _mm512_mul_ps(s_old, s_old), s;
      adam16<G, O, kHasOut>(b, c, i, k, m, v, s);
      _mm512_mask_storeu_ps(new_m + (i - start), k, m);
      _mm512_mask_storeu_ps(new_s + (i - start), k, s);
    }
    b.m_scales[blk] = codec.encode_block(new_m, mc + start, stop - start, kExpAvg);
    b.v_scales[blk] = codec.encode_block(new_s, vc + start, stop - start, kExpAvgSq);
  }
}

template <DType G, DType O, bool kHasOut>
void step_format(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  if (b.format == MomentFormat::kBFloat16) step_bf16<G, O, kHasOut>(b, c, begin, end);
  else step_int8<G, O, kHasOut>(b, c, begin, end);
}

template <DType G>
void step_out(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  if (!b.out) return step_format<G, DType::kFloat32, false>(b, c, begin, end);
  switch (b.out_dtype) {
    case DType::kBFloat16: return step_format<G, DType::kBFloat16, true>(b, c, begin, end);
    case DType::kFloat16: return step_format<G, DType::kFloat16, true>(b, c, begin, end);
    default: return step_format<G, DType::kFloat32, true>(b, c, begin, end);
  }
}

}  // namespace

void moment_step_avx512(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  switch (b.g_dtype) {
    case DType::kBFloat16: return step_out<DType::kBFloat16>(b, c, begin, end);
    case DType::kFloat16: return step_out<DType::kFloat16>(b, c, begin, end);
    default: return step_out<DType::kFloat32>(b, c, begin, end);
  }
}

void moment_encode_avx512(const float* src, void* codes, float* scales, MomentFormat format, int which,
                          int64_t begin, int64_t end) {
  if (format == MomentFormat::kBFloat16) {
    for (int64_t i = begin; i < end; i += kLanes) {
      const __mmask16 k = lanes(end - i);
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(codes) + i, k, to_bf16(_mm512_maskz_loadu_ps(k, src + i)));
    }
    return;
  }
  const Int8Codec codec;
  alignas(64) float mags[kInt8Block];
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block);
    const float* vals = src + start;
    if (which == kExpAvgSq) {
      for (int64_t i = start; i < stop; i += kLanes) {
        const __mmask16 k = lanes(stop - i);
        _mm512_mask_storeu_ps(mags + (i - start), k, _mm512_sqrt_ps(_mm512_maskz_loadu_ps(k, src + i)));
      }
      vals = mags;
    }
    scales[start / kInt8Block] = codec.encode_block(vals, static_cast<uint8_t*>(codes) + start, stop - start, which);
  }
}

void moment_decode_avx512(const void* codes, const float* scales, MomentFormat format, int which, float* out,
                          int64_t begin, int64_t end) {
  if (format == MomentFormat::kBFloat16) {
    for (int64_t i = begin; i < end; i += kLanes) {
      const __mmask16 k = lanes(end - i);
      _mm512_mask_storeu_ps(out + i, k, load16<DType::kBFloat16>(codes, i, k));
    }
    return;
  }
  const Int8Codec codec;
  const uint8_t* c8 = static_cast<const uint8_t*>(codes);
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block);
    const __m512 scale = _mm512_set1_ps(scales[start / kInt8Block]);
    for (int64_t i = start; i < stop; i += kLanes) {
      const __mmask16 k = lanes(stop - i);
      __m512 x;
      if (which == kExpAvg) {
        x = codec.decode_m(c8, i, k, scale);
      } else {
        const __m512 s = codec.decode_sqrt_v(c8, i, k, scale);
        x = _mm512_mul_ps(s, s);
      }
      _mm512_mask_storeu_ps(out + i, k, x);
    }
  }
}

}  // namespace offload
#pragma GCC diagnostic pop
#pragma GCC pop_options
