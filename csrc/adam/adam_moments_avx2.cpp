// The moment kernels for AVX2 CPUs (AVX2 + FMA + F16C, 8 lanes): the same bytes as the scalar kernel, whose loops,
// compiled here, take the rare cases (a range's partial int8 block and its tail, blocks whose scale is NaN or marks
// an infinity). The int8 maps and lines are looked up with gathers: the scalar loops compiled for AVX2 took 80-90 ns
// a parameter (a binary search per code), then 18.6 with moment_code::plain_code, against ~2 here.
// Headers with templates come before the target pragma.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "adam/adam_moments.h"

#pragma GCC push_options
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps of adam_kernels.h.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx2,fma,f16c")
#include "adam/adam_moments_scalar.h"
#include "adam/avx2_common.h"

namespace offload {
namespace {

// The operands of one call, in locals (the compiler reloads a struct's pointers after every store through them).
struct Operands {
  float* p;
  const void* g;
  void* out;
  explicit Operands(const MomentBuffers& b) : p(b.p), g(b.g), out(b.out) {}
};

// 8 elements from i of a bf16-moment step.
template <DType G, bool kHasOut>
inline void bf16_vector(const Operands& o, uint16_t* m16, uint16_t* v16, const Constants256& c, int64_t i) {
  __m256 m = load8<DType::kBFloat16>(m16, i), v = load8<DType::kBFloat16>(v16, i), s;
  const __m256 p = adam_math8(c, load8<G>(o.g, i), _mm256_loadu_ps(o.p + i), m, v, s);
  _mm256_storeu_ps(o.p + i, p);
  if constexpr (kHasOut) store8<G, false>(o.out, i, p);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(m16 + i), to_bf16(m));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(v16 + i), to_bf16(v));
}

template <DType G, bool kHasOut>
void vector_step_bf16(const MomentBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end) {
  const Constants256 c(constants);
  const Operands o(b);
  uint16_t* m16 = static_cast<uint16_t*>(b.m);
  uint16_t* v16 = static_cast<uint16_t*>(b.v);
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) bf16_vector<G, kHasOut>(o, m16, v16, c, i);
  step_bf16(b, constants, i, end);
}

// --- int8 ------------------------------------------------------------------------------------------------------

// 8 codes at `codes` as 32-bit lanes.
inline __m256i load_codes(const uint8_t* codes) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
}

// moment_code::plain_decode_m and plain_decode_sqrt_v on 8 codes.
inline __m256 decode_m8(const MomentMaps& maps, const uint8_t* codes, __m256 scale) {
  const __m256i c = load_codes(codes);
  const __m256 x = _mm256_mul_ps(_mm256_i32gather_ps(maps.m, _mm256_and_si256(c, _mm256_set1_epi32(0x7f)), 4), scale);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(x), sign));
}
inline __m256 decode_sqrt_v8(const MomentMaps& maps, const uint8_t* codes, __m256 scale) {
  return _mm256_mul_ps(_mm256_i32gather_ps(maps.v, load_codes(codes), 4), scale);
}

// moment_code::plain_code on 8 lanes of y in [0, 1 + 2^-20]: the same operations, lane by lane.
inline __m256i plain_code8(__m256 y, const float* line_a, const float* line_b, const float* mids) {
  const __m256i exponent = _mm256_srli_epi32(_mm256_castps_si256(y), 23);
  const __m256i slot = _mm256_max_epi32(_mm256_sub_epi32(exponent, _mm256_set1_epi32(kLineFirstExp)), _mm256_setzero_si256());
  const __m256 a = _mm256_i32gather_ps(line_a, slot, 4), b = _mm256_i32gather_ps(line_b, slot, 4);
  const __m256 u_lo = _mm256_sub_ps(_mm256_mul_ps(y, a), b);
  const __m256 u_hi = _mm256_sub_ps(_mm256_mul_ps(y, _mm256_mul_ps(a, _mm256_set1_ps(0.2f))),
                                    _mm256_sub_ps(_mm256_mul_ps(b, _mm256_set1_ps(2.0f)), _mm256_set1_ps(1.5f)));
  const __m256i e = _mm256_cvttps_epi32(_mm256_min_ps(u_lo, u_hi));
  const __m256 above = _mm256_cmp_ps(y, _mm256_i32gather_ps(mids, e, 4), _CMP_GT_OQ);  // all ones: -1
  return _mm256_sub_epi32(e, _mm256_castps_si256(above));
}

// plain_encode_m and plain_encode_sqrt_v on 8 values.
inline __m256i encode_m8(const MomentMaps& maps, __m256 x, __m256 inv) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i c = plain_code8(_mm256_mul_ps(_mm256_and_ps(x, abs_mask), inv), maps.m_line_a, maps.m_line_b, maps.m_mid);
  // the sign bit for x < 0 unless the code is 0
  const __m256i nonzero = _mm256_andnot_si256(_mm256_cmpeq_epi32(c, _mm256_setzero_si256()), _mm256_set1_epi32(0x80));
  const __m256i sign = _mm256_and_si256(_mm256_srai_epi32(_mm256_castps_si256(x), 31), nonzero);
  return _mm256_or_si256(c, sign);
}
inline __m256i encode_sqrt_v8(const MomentMaps& maps, __m256 s, __m256 inv) {
  const __m256 y = _mm256_mul_ps(s, inv);
  const __m256i c = plain_code8(y, maps.v_line_a, maps.v_line_b, maps.v_mid);
  // a positive y never takes code 0: c + (c == 0 and y > 0)
  const __m256i zero_code = _mm256_cmpeq_epi32(c, _mm256_setzero_si256());
  const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ));
  return _mm256_sub_epi32(c, _mm256_and_si256(zero_code, positive));
}

// 4 vectors of 8 codes (each < 256) as 32 bytes in element order: the packs interleave 128-bit lanes, the permute
// puts each vector's two halves back together.
inline __m256i pack_codes(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The block scale from the max of |x|'s bits over the block (scalar encode_block's rule): NaN bits exceed +inf's,
// so a NaN anywhere shows; an infinity makes it the largest finite magnitude, negated (rare: a scan).
inline float scale_from_bits(__m256i max_bits, const float* vals) {
  __m128i x = _mm_max_epu32(_mm256_castsi256_si128(max_bits), _mm256_extracti128_si256(max_bits, 1));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4e));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xb1));
  const uint32_t bits = static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  if (bits > 0x7f800000u) return NAN;
  if (bits == 0x7f800000u) {
    float finite_max = 0.0f;
    for (int64_t i = 0; i < kInt8Block; ++i) {
      const float a = std::fabs(vals[i]);
      finite_max = a > finite_max && a != INFINITY ? a : finite_max;
    }
    return moment_code::block_scale(finite_max, false, true);
  }
  float scale;
  std::memcpy(&scale, &bits, 4);
  return scale;
}

// One whole block's codes from its new values and scale (sign-bearing m for kExpAvg, sqrt(v) for kExpAvgSq).
template <int kWhich>
inline void encode_block8(const MomentMaps& maps, const float* vals, uint8_t* codes, float scale) {
  if (!moment_code::plain_encode_scale(scale)) {  // rare: the scalar rule
    const bool inf_block = moment_code::holds_inf(scale);
    const float inv = moment_code::inverse(moment_code::magnitude_scale(scale));
    for (int64_t i = 0; i < kInt8Block; ++i) codes[i] = moment_code::encode(vals[i], inv, kWhich, inf_block, maps);
    return;
  }
  const __m256 inv = _mm256_set1_ps(moment_code::inverse(scale));
  for (int64_t at = 0; at < kInt8Block; at += 4 * kLanes) {
    __m256i c[4];
    for (int q = 0; q < 4; ++q) {
      const __m256 x = _mm256_load_ps(vals + at + kLanes * q);
      c[q] = kWhich == kExpAvg ? encode_m8(maps, x, inv) : encode_sqrt_v8(maps, x, inv);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + at), pack_codes(c[0], c[1], c[2], c[3]));
  }
}

// Whole blocks in two sweeps (the scale needs the whole block before any code is written): decode and the Adam
// maths into a stack buffer with the running max of |m| and sqrt(v), then the codes. The partial block at the end
// runs the scalar loops.
template <DType G, bool kHasOut>
void vector_step_int8(const MomentBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end) {
  const MomentMaps& maps = moment_maps();
  const Constants256 c(constants);
  const Operands o(b);
  uint8_t* mc = static_cast<uint8_t*>(b.m);
  uint8_t* vc = static_cast<uint8_t*>(b.v);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  alignas(32) float new_m[kInt8Block], new_s[kInt8Block];
  int64_t start = begin;
  for (; start + kInt8Block <= end; start += kInt8Block) {
    const int64_t blk = start / kInt8Block;
    const float m_stored = b.m_scales[blk], v_stored = b.v_scales[blk];
    const bool plain = moment_code::plain_decode_scale(m_stored) && moment_code::plain_decode_scale(v_stored);
    if (!plain) {  // rare: the scalar rule
      for (int64_t i = 0; i < kInt8Block; ++i) {
        new_m[i] = moment_code::decode(mc[start + i], m_stored, kExpAvg, maps);
        new_s[i] = moment_code::decode(vc[start + i], v_stored, kExpAvgSq, maps);
      }
    }
    const __m256 m_scale = _mm256_set1_ps(m_stored), v_scale = _mm256_set1_ps(v_stored);
    __m256i m_max = _mm256_setzero_si256(), s_max = _mm256_setzero_si256();
    for (int64_t at = 0; at < kInt8Block; at += kLanes) {
      const int64_t i = start + at;
      __m256 m, s;
      if (plain) {
        m = decode_m8(maps, mc + i, m_scale);
        s = decode_sqrt_v8(maps, vc + i, v_scale);
      } else {
        m = _mm256_load_ps(new_m + at);
        s = _mm256_load_ps(new_s + at);
      }
      __m256 v = _mm256_mul_ps(s, s);
      const __m256 p = adam_math8(c, load8<G>(o.g, i), _mm256_loadu_ps(o.p + i), m, v, s);
      _mm256_storeu_ps(o.p + i, p);
      if constexpr (kHasOut) store8<G, false>(o.out, i, p);
      _mm256_store_ps(new_m + at, m);
      _mm256_store_ps(new_s + at, s);
      m_max = _mm256_max_epu32(m_max, _mm256_and_si256(_mm256_castps_si256(m), abs_mask));
      s_max = _mm256_max_epu32(s_max, _mm256_and_si256(_mm256_castps_si256(s), abs_mask));
    }
    const float m_scale_new = scale_from_bits(m_max, new_m), s_scale_new = scale_from_bits(s_max, new_s);
    encode_block8<kExpAvg>(maps, new_m, mc + start, m_scale_new);
    encode_block8<kExpAvgSq>(maps, new_s, vc + start, s_scale_new);
    b.m_scales[blk] = m_scale_new;
    b.v_scales[blk] = s_scale_new;
  }
  step_int8(b, constants, start, end);
}

template <DType G, bool kHasOut>
void vector_step(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  if (b.format == MomentFormat::kBFloat16) vector_step_bf16<G, kHasOut>(b, c, begin, end);
  else vector_step_int8<G, kHasOut>(b, c, begin, end);
}

// Only out = none and out dtype = grad dtype are compiled into the step (the engine's case); any other out dtype is
// the step without out, then a cast of p (the same bytes: one rounding of the same p).
template <DType G>
void step_out(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  if (!b.out) return vector_step<G, false>(b, c, begin, end);
  if (b.out_dtype == G) return vector_step<G, true>(b, c, begin, end);
  MomentBuffers without_out = b;
  without_out.out = nullptr;
  vector_step<G, false>(without_out, c, begin, end);
  for (int64_t i = begin; i < end; ++i) scalar::store(b.out, b.out_dtype, i, b.p[i]);
}

}  // namespace

void moment_step_avx2(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  switch (b.g_dtype) {
    case DType::kBFloat16: return step_out<DType::kBFloat16>(b, c, begin, end);
    case DType::kFloat16: return step_out<DType::kFloat16>(b, c, begin, end);
    default: return step_out<DType::kFloat32>(b, c, begin, end);
  }
}
void moment_encode_avx2(const float* src, void* codes, float* scales, MomentFormat format, int which,
                        int64_t begin, int64_t end) {
  encode_range(src, codes, scales, format, which, begin, end);
}
void moment_decode_avx2(const void* codes, const float* scales, MomentFormat format, int which, float* out,
                        int64_t begin, int64_t end) {
  decode_range(codes, scales, format, which, out, begin, end);
}

}  // namespace offload
#pragma GCC pop_options
