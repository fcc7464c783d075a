// The per-element moment kernels, included by adam_moments_scalar.cpp (baseline x86-64) and
// adam_moments_avx2.cpp (under its target pragma). Internal linkage only (unnamed namespace, static inline), so
// no copy compiled for a wider ISA leaks into another file through the linker.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "adam/adam_moments.h"
#include "adam/moment_codes.h"
#include "adam/scalar_math.h"

namespace offload {
namespace {

// Codes of one block: `vals` are m (sign-bearing) for kExpAvg, sqrt(v) for kExpAvgSq. Returns the scale: the
// largest magnitude; NaN if the block holds a NaN; the largest finite magnitude negated if it holds an infinity.
inline float encode_block(const float* vals, uint8_t* codes, int64_t count, int which) {
  const MomentMaps& maps = moment_maps();
  float finite_max = 0.0f;
  bool nan = false, inf = false;
  for (int64_t i = 0; i < count; ++i) {
    const float a = std::fabs(vals[i]);
    nan |= a != a;
    inf |= a == INFINITY;
    finite_max = a > finite_max && a != INFINITY ? a : finite_max;
  }
  const float scale = moment_code::block_scale(finite_max, nan, inf);
  const bool inf_block = moment_code::holds_inf(scale);
  const float inv = moment_code::inverse(moment_code::magnitude_scale(scale));
  if (!moment_code::plain_encode_scale(scale)) {  // rare: the search, and the marks of an infinity
    for (int64_t i = 0; i < count; ++i) codes[i] = moment_code::encode(vals[i], inv, which, inf_block, maps);
  } else if (which == kExpAvg) {
    for (int64_t i = 0; i < count; ++i) codes[i] = moment_code::plain_encode_m(vals[i], inv, maps);
  } else {
    for (int64_t i = 0; i < count; ++i) codes[i] = moment_code::plain_encode_sqrt_v(vals[i], inv, maps);
  }
  return scale;
}

// The maths of scalar::adam_element on decoded m, v: updates p (and out), returns the new m and v.
inline void adam_math(const MomentBuffers& b, const AdamConstants& c, int64_t i, float& m, float& v) {
  float g = scalar::load(b.g, b.g_dtype, i) * c.grad_scale;
  float p = b.p[i] * c.decay_factor;
  if (c.use_l2) g = __builtin_fmaf(c.l2_weight, p, g);
  m = __builtin_fmaf(c.lerp_weight, g - m, m);
  v = __builtin_fmaf(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = __builtin_sqrtf(v) / c.bias_correction2_sqrt + c.eps;
  p = p + (c.neg_step_size * m) / denom;
  b.p[i] = p;
  if (b.out) scalar::store(b.out, b.out_dtype, i, p);
}

inline void step_bf16(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  uint16_t* m16 = static_cast<uint16_t*>(b.m);
  uint16_t* v16 = static_cast<uint16_t*>(b.v);
  for (int64_t i = begin; i < end; ++i) {
    float m = scalar::bf16_to_float(m16[i]), v = scalar::bf16_to_float(v16[i]);
    adam_math(b, c, i, m, v);
    m16[i] = scalar::float_to_bf16(m);
    v16[i] = scalar::float_to_bf16(v);
  }
}

inline void step_int8(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  const MomentMaps& maps = moment_maps();
  uint8_t* mc = static_cast<uint8_t*>(b.m);
  uint8_t* vc = static_cast<uint8_t*>(b.v);
  float new_m[kInt8Block], new_s[kInt8Block];
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block), blk = start / kInt8Block;
    const float m_scale = b.m_scales[blk], v_scale = b.v_scales[blk];
    const bool plain = moment_code::plain_decode_scale(m_scale) && moment_code::plain_decode_scale(v_scale);
    for (int64_t i = start; i < stop; ++i) {
      float m, s;
      if (plain) {
        m = moment_code::plain_decode_m(mc[i], m_scale, maps);
        s = moment_code::plain_decode_sqrt_v(vc[i], v_scale, maps);
      } else {
        m = moment_code::decode(mc[i], m_scale, kExpAvg, maps);
        s = moment_code::decode(vc[i], v_scale, kExpAvgSq, maps);
      }
      float v = s * s;
      adam_math(b, c, i, m, v);
      new_m[i - start] = m;
      new_s[i - start] = __builtin_sqrtf(v);
    }
    b.m_scales[blk] = encode_block(new_m, mc + start, stop - start, kExpAvg);
    b.v_scales[blk] = encode_block(new_s, vc + start, stop - start, kExpAvgSq);
  }
}

inline void step_range(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  if (b.format == MomentFormat::kBFloat16) step_bf16(b, c, begin, end);
  else step_int8(b, c, begin, end);
}

inline void encode_range(const float* src, void* codes, float* scales, MomentFormat format, int which,
                         int64_t begin, int64_t end) {
  if (format == MomentFormat::kBFloat16) {
    for (int64_t i = begin; i < end; ++i) static_cast<uint16_t*>(codes)[i] = scalar::float_to_bf16(src[i]);
    return;
  }
  float mags[kInt8Block];
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block);
    const float* vals = src + start;
    if (which == kExpAvgSq) {
      for (int64_t i = start; i < stop; ++i) mags[i - start] = __builtin_sqrtf(src[i]);
      vals = mags;
    }
    scales[start / kInt8Block] = encode_block(vals, static_cast<uint8_t*>(codes) + start, stop - start, which);
  }
}

inline void decode_range(const void* codes, const float* scales, MomentFormat format, int which, float* out,
                         int64_t begin, int64_t end) {
  if (format == MomentFormat::kBFloat16) {
    for (int64_t i = begin; i < end; ++i) out[i] = scalar::bf16_to_float(static_cast<const uint16_t*>(codes)[i]);
    return;
  }
  const MomentMaps& maps = moment_maps();
  const uint8_t* c8 = static_cast<const uint8_t*>(codes);
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block);
    const float scale = scales[start / kInt8Block];
    const bool plain = moment_code::plain_decode_scale(scale);
    for (int64_t i = start; i < stop; ++i) {
      if (which == kExpAvg) {
        out[i] = plain ? moment_code::plain_decode_m(c8[i], scale, maps) : moment_code::decode(c8[i], scale, kExpAvg, maps);
      } else {
        const float s = plain ? moment_code::plain_decode_sqrt_v(c8[i], scale, maps)
                              : moment_code::decode(c8[i], scale, kExpAvgSq, maps);
        out[i] = s * s;
      }
    }
  }
}

}  // namespace
}  // namespace offload
