// AVX-512 (F, BW, VL, DQ) moment kernels, "avx512bw": for CPUs without AVX512_VBMI or AVX512_BF16 (Skylake-X, Ice
// Lake), and a second AVX-512 variant the tests compare with adam_moments_avx512.cpp. 16 lanes, masked tails. int8
// maps and midpoints live in registers as 16-bit planes looked up with vpermt2w, 32 lanes at a time; encode takes the
// decade of y from its exponent and one compare, the one bucket edge near y arithmetically, and compares y with that
// midpoint: exact, no gathers.
// Headers with templates are included before the target pragma, so their instantiations stay baseline x86-64.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "adam/adam_moments.h"

#pragma GCC push_options
// gcc 12 warns inside its own avx512 intrinsics (their _mm512_undefined_* placeholders): a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps of adam_kernels.h.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#include "adam/avx512_common.h"
#include "adam/moment_codes.h"

namespace offload {
namespace {

inline __mmask16 lanes(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}

// adam_kernels.h's maths on decoded m, v; stores p (and out); returns the new m, v and sqrt(v) in place.
template <DType G, DType O, bool kHasOut>
inline void adam16(const MomentBuffers& b, const Constants512& c, int64_t i, __mmask16 k, __m512& m, __m512& v,
                   __m512& s) {
  const __m512 p = adam_math16(c, load16<G>(b.g, i, k), _mm512_maskz_loadu_ps(k, b.p + i), m, v, s);
  _mm512_mask_storeu_ps(b.p + i, k, p);
  if constexpr (kHasOut) store16<O, false>(b.out, i, p, k);
}

// --- int8 codes ----------------------------------------------------------------------------------------------

// A table of N floats (N = 128 or 256) held in registers as two planes of 16-bit halves, looked up 32 lanes at a
// time: vpermt2w picks from 64 words by the index's low 6 bits, blends by bits 6 (and 7) choose the register
// pair. 32 lanes per lookup halve the permutes of a 16-lane float table; AVX-512BW only (no VBMI).
// The indices come in "pack order", the order _mm512_packus_epi32(a, b) puts the lanes of two 16-lane vectors
// in (per 128-bit lane L: a[4L..4L+3], b[4L..4L+3]); unpacking the two planes with unpack{lo,hi}_epi16 then gives
// the floats of a and of b back in their natural order.
template <int N>
struct HalfTable {
  static_assert(N == 128 || N == 256, "two or four register pairs per plane");
  __m512i lo[N / 32], hi[N / 32];
  explicit HalfTable(const float* values) {
    for (int r = 0; r < N / 32; ++r) {
      alignas(64) uint16_t l[32], h[32];
      for (int i = 0; i < 32; ++i) {
        uint32_t bits;
        std::memcpy(&bits, values + 32 * r + i, 4);
        l[i] = static_cast<uint16_t>(bits);
        h[i] = static_cast<uint16_t>(bits >> 16);
      }
      lo[r] = _mm512_load_si512(l);
      hi[r] = _mm512_load_si512(h);
    }
  }
  static inline __m512i pick(const __m512i* plane, __m512i idx, __mmask32 bit6, __mmask32 bit7) {
    __m512i r0 = _mm512_mask_blend_epi16(bit6, _mm512_permutex2var_epi16(plane[0], idx, plane[1]),
                                         _mm512_permutex2var_epi16(plane[2], idx, plane[3]));
    if constexpr (N == 256) {
      const __m512i r1 = _mm512_mask_blend_epi16(bit6, _mm512_permutex2var_epi16(plane[4], idx, plane[5]),
                                                 _mm512_permutex2var_epi16(plane[6], idx, plane[7]));
      r0 = _mm512_mask_blend_epi16(bit7, r0, r1);
    }
    return r0;
  }
  // table[idx] for 32 word indices in pack order: a gets the first 16 lanes, b the second, in natural order.
  inline void operator()(__m512i idx, __m512& a, __m512& b) const {
    const __mmask32 bit6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(64));
    const __mmask32 bit7 = N == 256 ? _mm512_test_epi16_mask(idx, _mm512_set1_epi16(128)) : 0;
    const __m512i l = pick(lo, idx, bit6, bit7), h = pick(hi, idx, bit6, bit7);
    a = _mm512_castsi512_ps(_mm512_unpacklo_epi16(l, h));
    b = _mm512_castsi512_ps(_mm512_unpackhi_epi16(l, h));
  }
};

// 32 code bytes as words in pack order (see HalfTable), and the same words in natural order.
inline __m512i codes_in_pack_order(const uint8_t* codes, __mmask32 k, __m512i& natural) {
  const __m512i order = _mm512_set_epi16(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8,  //
                                         23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  natural = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(k, codes));
  return _mm512_permutexvar_epi16(order, natural);
}

// Four vectors of codes in [0, 255] as 64 bytes in natural order.
inline __m512i pack_codes(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
  // packus leaves dword 4L + q (128-bit lane L) holding elements 4L..4L+3 of c_q; put it at 4q + L.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
  return _mm512_permutexvar_epi32(order, bytes);
}

inline __mmask64 lanes64(int64_t count) { return count >= 64 ? ~__mmask64{0} : (__mmask64{1} << count) - 1; }
inline __mmask32 lanes32(int64_t count) { return count >= 32 ? ~__mmask32{0} : (__mmask32{1} << count) - 1; }

// One map's encoder: code = #{midpoints < y}, exactly, with no gathers and no branch per vector.
//   1. The decade d of y: the binade of y (its exponent field) gives the decade of the binade's bottom, dlo, and
//      the power of ten inside the binade, if any (a binade spans a factor 2, so at most one): d = dlo + (y >= it).
//   2. Decade d has K = 2^(d+1) evenly spaced values, codes K-1 .. 2K-2; t = (y - 10^(d-D+1)/10) / width is the
//      position of y in units of the bucket width, so its inner bucket edges are at t = 1 .. K-1. The border
//      edges (midpoints to the neighbouring decade's values, or to 0 or 1) are at t = 0.2 and K+1 (0.139 below
//      decade 0, K-0.25 at the top). e = floor(t - 0.5) + K - 1 = floor(y * a[d] - b[d]) then names the one edge
//      within half a bucket of y: every other edge is more than 0.25 (in t) away from y, far beyond the ~1e-4 of
//      fp32 rounding in t and in the decade choice.
//   3. code = e + (y > mid[e]), the midpoints looked up in registers (HalfTable).
// A y of 0 gives e = 0 and code 0. For v the first midpoint is replaced by 0: a positive y never takes code 0.
template <int N>
struct Encoder {
  static constexpr int kFirstExp = 96;  // binades of y below 2^(kFirstExp - 126) share slot 0: all in decade 0
  HalfTable<N> mids;
  __m512i dlo[2];
  __m512 split[2], a, b;
  explicit Encoder(const float* midpoints, int decades, bool floor_at_one) : mids(padded(midpoints, floor_at_one)) {
    alignas(64) int32_t lo[32];
    alignas(64) float at[32], av[16] = {}, bv[16] = {};
    for (int s = 0; s < 32; ++s) {
      const double bottom = s == 0 ? 0.0 : std::ldexp(1.0, kFirstExp + s - 127), top = std::ldexp(1.0, kFirstExp + s - 126);
      lo[s] = 0;
      at[s] = INFINITY;
      for (int i = 0; i + 1 < decades; ++i) {
        const float bound = static_cast<float>(std::pow(10.0, i + 1 - decades));  // y >= bound: decade > i
        if (bound <= bottom) ++lo[s];
        else if (bound < top) at[s] = bound;
      }
    }
    for (int d = 0; d < decades; ++d) {
      const double k = std::ldexp(1.0, d + 1);
      av[d] = static_cast<float>(k / (0.9 * std::pow(10.0, d - decades + 1)));
      bv[d] = static_cast<float>(k / 9.0 - k + 1.5);
    }
    for (int h = 0; h < 2; ++h) {
      dlo[h] = _mm512_load_si512(lo + 16 * h);
      split[h] = _mm512_load_ps(at + 16 * h);
    }
    a = _mm512_load_ps(av);
    b = _mm512_load_ps(bv);
  }
  static const float* padded(const float* midpoints, bool floor_at_one) {
    thread_local float table[N];
    std::memcpy(table, midpoints, sizeof(float) * (N - 1));
    table[N - 1] = INFINITY;  // never looked up: e <= N - 2
    if (floor_at_one) table[0] = 0.0f;
    return table;
  }

  // e of step 2 for y in [0, 1 + 2^-20]: lanes of a finite, normal (or zero) scale.
  inline __m512i edge(__m512 y) const {
    const __m512i slot = _mm512_subs_epu16(_mm512_srli_epi32(_mm512_castps_si512(y), 23), _mm512_set1_epi32(kFirstExp));
    __m512i d = _mm512_permutex2var_epi32(dlo[0], slot, dlo[1]);
    const __mmask16 above = _mm512_cmp_ps_mask(y, _mm512_permutex2var_ps(split[0], slot, split[1]), _CMP_GE_OQ);
    d = _mm512_mask_sub_epi32(d, above, d, _mm512_set1_epi32(-1));
    return _mm512_cvttps_epi32(_mm512_fmsub_ps(y, _mm512_permutexvar_ps(d, a), _mm512_permutexvar_ps(d, b)));
  }

  // Codes of 64 values y (4 vectors): e + (y > mid[e]).
  inline void codes(const __m512 (&y)[4], __m512i (&c)[4]) const {
    __m512i e[4];
    for (int q = 0; q < 4; ++q) e[q] = edge(y[q]);
    __m512 mid[4];
    mids(_mm512_packus_epi32(e[0], e[1]), mid[0], mid[1]);
    mids(_mm512_packus_epi32(e[2], e[3]), mid[2], mid[3]);
    for (int q = 0; q < 4; ++q) {
      c[q] = _mm512_mask_sub_epi32(e[q], _mm512_cmp_ps_mask(y[q], mid[q], _CMP_GT_OQ), e[q], _mm512_set1_epi32(-1));
    }
  }
};

struct Int8Codec {
  const MomentMaps& maps;
  HalfTable<128> m_map;
  HalfTable<256> v_map;
  Encoder<128> m_enc;
  Encoder<256> v_enc;
  Int8Codec()
      : maps(moment_maps()), m_map(maps.m), v_map(maps.v), m_enc(maps.m_mid, 6, false), v_enc(maps.v_mid, 7, true) {}

  // 32 decoded values at codes[0..31] (lanes beyond k decode code 0): m signed, a and b the two halves.
  inline void decode_m(const uint8_t* codes, __mmask32 k, __m512 scale, __m512& a, __m512& b) const {
    __m512i natural;
    m_map(codes_in_pack_order(codes, k, natural), a, b);  // bit 7 is not looked at: 128 entries
    const __mmask32 neg = _mm512_test_epi16_mask(natural, _mm512_set1_epi16(0x80));
    const __m512i sign = _mm512_set1_epi32(INT32_MIN);
    a = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(_mm512_mul_ps(a, scale)), static_cast<__mmask16>(neg),
                                                  _mm512_castps_si512(_mm512_mul_ps(a, scale)), sign));
    b = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(_mm512_mul_ps(b, scale)),
                                                  static_cast<__mmask16>(neg >> 16),
                                                  _mm512_castps_si512(_mm512_mul_ps(b, scale)), sign));
  }
  inline void decode_sqrt_v(const uint8_t* codes, __mmask32 k, __m512 scale, __m512& a, __m512& b) const {
    __m512i natural;
    v_map(codes_in_pack_order(codes, k, natural), a, b);
    a = _mm512_mul_ps(a, scale);
    b = _mm512_mul_ps(b, scale);
  }

  // Codes of one block of `count` values (m, sign-bearing, for kExpAvg; sqrt(v) for kExpAvgSq) with the given
  // scale, the block's largest magnitude (NaN if it holds a NaN; negated largest finite one if it holds an inf).
  void encode_block(const float* vals, uint8_t* codes, int64_t count, float scale, int which) const {
    if (moment_code::holds_inf(scale) || !(scale == 0.0f || (scale >= FLT_MIN && scale <= FLT_MAX))) {
      return encode_special(vals, codes, count, scale, which);
    }
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)), inv16 = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < count; i += 64) {
      __m512 x[4], y[4];
      __m512i c[4];
      for (int q = 0; q < 4; ++q) {
        x[q] = _mm512_load_ps(vals + i + 16 * q);  // a whole 64-value group: the buffer has 256 (lanes past count unused)
        y[q] = _mm512_mul_ps(_mm512_and_ps(x[q], abs_mask), inv16);
      }
      if (which == kExpAvg) {
        m_enc.codes(y, c);
        for (int q = 0; q < 4; ++q) {  // sign bit for x < 0 unless the code is 0
          const __mmask16 neg = _mm512_mask_cmp_ps_mask(_mm512_test_epi32_mask(c[q], c[q]), x[q], _mm512_setzero_ps(), _CMP_LT_OQ);
          c[q] = _mm512_mask_or_epi32(c[q], neg, c[q], _mm512_set1_epi32(0x80));
        }
      } else {
        v_enc.codes(y, c);
      }
      _mm512_mask_storeu_epi8(codes + i, lanes64(count - i), pack_codes(c[0], c[1], c[2], c[3]));
    }
  }

  // A block holding an infinity, or whose scale is NaN or subnormal (y = |x| * inv may be NaN or inf there): the
  // scalar kernel's rule, element by element (moment_codes.h), so every variant gives the same codes.
  void encode_special(const float* vals, uint8_t* codes, int64_t count, float scale, int which) const {
    const bool inf_block = moment_code::holds_inf(scale);
    const float inv = moment_code::inverse(moment_code::magnitude_scale(scale));
    for (int64_t i = 0; i < count; ++i) codes[i] = moment_code::encode(vals[i], inv, which, inf_block, maps);
  }
};

// After a block was decoded against |scale|: the codes that stand for infinity in a block holding one (rare).
inline void decode_infinities(const uint8_t* codes, float scale, int which, float* out, int64_t count) {
  if (!moment_code::holds_inf(scale)) return;
  for (int64_t i = 0; i < count; ++i) {
    if (which == kExpAvg && (codes[i] & 0x7f) == moment_code::inf_code(which)) {
      out[i] = (codes[i] & 0x80) ? -INFINITY : INFINITY;
    } else if (which == kExpAvgSq && codes[i] == moment_code::inf_code(which)) {
      out[i] = INFINITY;
    }
  }
}

// Built once (its tables take a few hundred pow() calls); each kernel call copies it to its stack.
const Int8Codec& int8_codec() {
  static const Int8Codec codec;
  return codec;
}

// The block scale from the integer max of |x|'s bits: NaN bits exceed +inf's, so a NaN anywhere shows; an
// infinity (+inf's bits) makes it the largest finite magnitude of `vals` (count values), negated (rare: a scan).
inline float scale_from_bits(__m512i max_bits, const float* vals, int64_t count) {
  const uint32_t bits = _mm512_reduce_max_epu32(max_bits);
  if (bits > 0x7f800000u) return NAN;
  if (bits == 0x7f800000u) {
    float finite_max = 0.0f;
    for (int64_t i = 0; i < count; ++i) {
      const float a = std::fabs(vals[i]);
      finite_max = a > finite_max && a != INFINITY ? a : finite_max;
    }
    return moment_code::block_scale(finite_max, false, true);
  }
  float scale;
  std::memcpy(&scale, &bits, 4);
  return scale;
}

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

// Each block in three sweeps over a stack buffer: decode m and sqrt(v); the Adam maths, with the running max of
// |m| and sqrt(v); the codes, 64 at a time. Decoding apart from the maths keeps the map tables and the Adam
// constants from competing for registers (bf16 grads in, bf16 copy out: 35 -> 31 ms per 20M on one core).
template <DType G, DType O, bool kHasOut>
void step_int8(const MomentBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end) {
  const Constants512 c(constants);
  const Int8Codec codec = int8_codec();
  uint8_t* mc = static_cast<uint8_t*>(b.m);
  uint8_t* vc = static_cast<uint8_t*>(b.v);
  alignas(64) float new_m[kInt8Block], new_s[kInt8Block];
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block), blk = start / kInt8Block;
    const float m_stored = b.m_scales[blk], v_stored = b.v_scales[blk];
    const __m512 m_scale = _mm512_set1_ps(moment_code::magnitude_scale(m_stored));
    const __m512 v_scale = _mm512_set1_ps(moment_code::magnitude_scale(v_stored));
    // Decode first (the map tables fill most registers), then the Adam maths on the decoded block.
    for (int64_t i = start; i < stop; i += 2 * kLanes) {
      const __mmask32 k = lanes32(stop - i);
      __m512 m[2], s[2];
      codec.decode_m(mc + i, k, m_scale, m[0], m[1]);
      codec.decode_sqrt_v(vc + i, k, v_scale, s[0], s[1]);
      for (int h = 0; h < 2; ++h) {
        _mm512_store_ps(new_m + (i - start) + 16 * h, m[h]);
        _mm512_store_ps(new_s + (i - start) + 16 * h, s[h]);
      }
    }
    decode_infinities(mc + start, m_stored, kExpAvg, new_m, stop - start);
    decode_infinities(vc + start, v_stored, kExpAvgSq, new_s, stop - start);
    __m512i m_max = _mm512_setzero_si512(), s_max = _mm512_setzero_si512();
    for (int64_t i = start; i < stop; i += kLanes) {
      const __mmask16 k = lanes(stop - i);
      float* m_at = new_m + (i - start);
      float* s_at = new_s + (i - start);
      __m512 m = _mm512_load_ps(m_at), s = _mm512_load_ps(s_at), v = _mm512_mul_ps(s, s);
      adam16<G, O, kHasOut>(b, c, i, k, m, v, s);
      _mm512_store_ps(m_at, m);
      _mm512_store_ps(s_at, s);
      // Masked: past the block's end the decoded zeros times a NaN scale would be NaN.
      m_max = _mm512_mask_max_epu32(m_max, k, m_max, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
      s_max = _mm512_mask_max_epu32(s_max, k, s_max, _mm512_and_si512(_mm512_castps_si512(s), abs_mask));
    }
    const float m_block_scale = scale_from_bits(m_max, new_m, stop - start);
    const float s_block_scale = scale_from_bits(s_max, new_s, stop - start);
    codec.encode_block(new_m, mc + start, stop - start, m_block_scale, kExpAvg);
    codec.encode_block(new_s, vc + start, stop - start, s_block_scale, kExpAvgSq);
    b.m_scales[blk] = m_block_scale;
    b.v_scales[blk] = s_block_scale;
  }
}

template <DType G, DType O, bool kHasOut>
void step_format(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  if (b.format == MomentFormat::kBFloat16) step_bf16<G, O, kHasOut>(b, c, begin, end);
  else step_int8<G, O, kHasOut>(b, c, begin, end);
}

// p of [begin, end) into out in out's dtype, rounded as the fused store rounds it.
template <DType O>
void cast_out(const MomentBuffers& b, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kLanes) {
    const __mmask16 k = lanes(end - i);
    store16<O, false>(b.out, i, _mm512_maskz_loadu_ps(k, b.p + i), k);
  }
}

// Only out = none and out dtype = grad dtype are fused into the step (the engine's case); any other out dtype is the
// step without out, then a cast of p (the same bytes: one rounding of the same p), as in adam_moments_avx512.cpp.
template <DType G>
void step_out(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  if (!b.out) return step_format<G, DType::kFloat32, false>(b, c, begin, end);
  if (b.out_dtype == G) return step_format<G, G, true>(b, c, begin, end);
  MomentBuffers without_out = b;
  without_out.out = nullptr;
  step_format<G, DType::kFloat32, false>(without_out, c, begin, end);
  switch (b.out_dtype) {
    case DType::kBFloat16: return cast_out<DType::kBFloat16>(b, begin, end);
    case DType::kFloat16: return cast_out<DType::kFloat16>(b, begin, end);
    default: return cast_out<DType::kFloat32>(b, begin, end);
  }
}

}  // namespace

void moment_step_avx512bw(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  switch (b.g_dtype) {
    case DType::kBFloat16: return step_out<DType::kBFloat16>(b, c, begin, end);
    case DType::kFloat16: return step_out<DType::kFloat16>(b, c, begin, end);
    default: return step_out<DType::kFloat32>(b, c, begin, end);
  }
}

void moment_encode_avx512bw(const float* src, void* codes, float* scales, MomentFormat format, int which,
                          int64_t begin, int64_t end) {
  if (format == MomentFormat::kBFloat16) {
    for (int64_t i = begin; i < end; i += kLanes) {
      const __mmask16 k = lanes(end - i);
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(codes) + i, k, to_bf16(_mm512_maskz_loadu_ps(k, src + i)));
    }
    return;
  }
  const Int8Codec codec = int8_codec();
  alignas(64) float mags[kInt8Block];
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block);
    __m512i max_bits = _mm512_setzero_si512();
    for (int64_t i = start; i < stop; i += kLanes) {
      const __mmask16 k = lanes(stop - i);
      __m512 x = _mm512_maskz_loadu_ps(k, src + i);
      if (which == kExpAvgSq) x = _mm512_sqrt_ps(x);
      _mm512_store_ps(mags + (i - start), x);
      max_bits = _mm512_max_epu32(max_bits, _mm512_and_si512(_mm512_castps_si512(x), abs_mask));
    }
    const float scale = scale_from_bits(max_bits, mags, stop - start);
    codec.encode_block(mags, static_cast<uint8_t*>(codes) + start, stop - start, scale, which);
    scales[start / kInt8Block] = scale;
  }
}

void moment_decode_avx512bw(const void* codes, const float* scales, MomentFormat format, int which, float* out,
                          int64_t begin, int64_t end) {
  if (format == MomentFormat::kBFloat16) {
    for (int64_t i = begin; i < end; i += kLanes) {
      const __mmask16 k = lanes(end - i);
      _mm512_mask_storeu_ps(out + i, k, load16<DType::kBFloat16>(codes, i, k));
    }
    return;
  }
  const Int8Codec codec = int8_codec();
  const uint8_t* c8 = static_cast<const uint8_t*>(codes);
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block);
    const float stored = scales[start / kInt8Block];
    const __m512 scale = _mm512_set1_ps(moment_code::magnitude_scale(stored));
    for (int64_t i = start; i < stop; i += 2 * kLanes) {
      const __mmask32 k = lanes32(stop - i);
      __m512 x[2];
      if (which == kExpAvg) {
        codec.decode_m(c8 + i, k, scale, x[0], x[1]);
      } else {
        codec.decode_sqrt_v(c8 + i, k, scale, x[0], x[1]);
        for (__m512& s : x) s = _mm512_mul_ps(s, s);
      }
      _mm512_mask_storeu_ps(out + i, static_cast<__mmask16>(k), x[0]);
      _mm512_mask_storeu_ps(out + i + kLanes, static_cast<__mmask16>(k >> 16), x[1]);
    }
    decode_infinities(c8 + start, stored, which, out + start, stop - start);
  }
}

}  // namespace offload
#pragma GCC diagnostic pop
#pragma GCC pop_options
