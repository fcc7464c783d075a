// The int8 code of one value and the marks of a block that holds an infinity: the rule every kernel variant
// applies element by element (encode: a search of the midpoints; the kernels' reference, and their path for blocks
// whose scale is not zero or a normal number, or that hold an infinity), and its search-free equal for the other
// blocks (plain_code: the scalar kernel, the AVX2 kernel's lanes). Included after each file's target pragma;
// everything is static inline, so no copy compiled for a wider ISA leaks into another file.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <xmmintrin.h>

#include "adam/adam_moments.h"

namespace offload {
namespace moment_code {

// The magnitude code that stands for infinity in a block holding one: the map's second-highest value.
static inline int inf_code(int which) { return which == kExpAvg ? 126 : 254; }

// A block's scale says it holds an infinity: sign bit set (-0.0 too), not NaN.
static inline bool holds_inf(float scale) { return std::signbit(scale) && !std::isnan(scale); }

// The scale stored for a block: `finite_max` is the largest finite magnitude (NaN if the block holds a NaN).
static inline float block_scale(float finite_max, bool nan, bool inf) {
  if (nan) return NAN;
  return inf ? -finite_max : finite_max;
}

// The magnitude scale a block's codes are read against (|scale| for a block holding an infinity).
static inline float magnitude_scale(float scale) { return holds_inf(scale) ? -scale : scale; }

// 1 / scale, or 0 for a zero (or NaN) scale: never 0/0.
static inline float inverse(float magnitude_scale) { return magnitude_scale > 0.0f ? 1.0f / magnitude_scale : 0.0f; }

// The code of x (m, sign-bearing, for kExpAvg; sqrt(v) for kExpAvgSq) in a block read against 1 / `inv`:
// #{midpoints < y} for y = |x| * inv (ties to the lower code; a NaN y gives 0), no sign bit on a magnitude code 0,
// no code 0 for a positive sqrt(v). In a block holding an infinity (`inf_block`) an infinite x takes inf_code, and
// a finite y that would round to it takes the nearer of its two neighbours.
static inline uint8_t encode(float x, float inv, int which, bool inf_block, const MomentMaps& maps) {
  const bool is_m = which == kExpAvg;
  const float a = std::fabs(x);
  int c;
  if (inf_block && a == INFINITY) {
    c = inf_code(which);
  } else {
    const float y = a * inv;
    const float* mids = is_m ? maps.m_mid : maps.v_mid;
    const int count = is_m ? 127 : 255;
    c = static_cast<int>(std::lower_bound(mids, mids + count, y) - mids);
    if (inf_block && c == inf_code(which)) c = y > (is_m ? maps.m_skip_mid : maps.v_skip_mid) ? c + 1 : c - 1;
    if (!is_m && y > 0.0f && c == 0) c = 1;
  }
  if (is_m && x < 0.0f && c > 0) c |= 0x80;
  return static_cast<uint8_t>(c);
}

// A block scale that plain_code and plain_decode take: zero or a normal number, no infinity in the block (so
// y = |x| / scale lies in [0, 1 + 2^-20]).
static inline bool plain_encode_scale(float scale) {
  return !holds_inf(scale) && (scale == 0.0f || (scale >= FLT_MIN && scale <= FLT_MAX));
}
// A stored scale plain_decode takes: not NaN, no infinity in the block.
static inline bool plain_decode_scale(float scale) { return !std::signbit(scale) && !std::isnan(scale); }

// #{midpoints < y} (encode's code of a magnitude) for y in [0, 1 + 2^-20], without a search (one lane of
// adam_moments_avx512.cpp's Encoder, which explains it): the binade of y spans at most two decades, d and d + 1;
// in units of a bucket, u_d = y * a[d] - b[d] puts decade d's midpoints at half-integers, and u_(d+1) meets u_d at
// the power of ten between them, five times less steep, so e = floor(min(u_d, u_(d+1))) names the one midpoint
// within half a bucket of y (every other is more than a quarter bucket away: rounding in u, ~1e-5, cannot cross
// it). Checked against encode for every fp32 y in [0, 1 + 2^-19], m's map and v's.
static inline int plain_code(float y, const float* line_a, const float* line_b, const float* mids) {
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  const int exponent = static_cast<int>(bits >> 23);
  const int slot = std::max(exponent - kLineFirstExp, 0);
  const float a = line_a[slot], b = line_b[slot];
  const float u_lo = y * a - b;
  const float u_hi = y * (a * 0.2f) - (b * 2.0f - 1.5f);
  // minss, not a branch: which line is lower is a coin toss from element to element
  const int e = _mm_cvttss_si32(_mm_min_ss(_mm_set_ss(u_lo), _mm_set_ss(u_hi)));
  return e + (y > mids[e]);
}

// encode's code of m (sign-bearing) and of sqrt(v) in a block whose scale passes plain_encode_scale (inv: 1 / scale,
// or 0 for a zero scale).
static inline uint8_t plain_encode_m(float x, float inv, const MomentMaps& maps) {
  const int c = plain_code(std::fabs(x) * inv, maps.m_line_a, maps.m_line_b, maps.m_mid);
  // arithmetic, not branches: the sign bit for x < 0 unless the code is 0 (-0.0 too: its code is 0)
  return static_cast<uint8_t>(c | (std::signbit(x) & (c != 0)) << 7);
}
static inline uint8_t plain_encode_sqrt_v(float s, float inv, const MomentMaps& maps) {
  const float y = s * inv;
  const int c = plain_code(y, maps.v_line_a, maps.v_line_b, maps.v_mid);
  return static_cast<uint8_t>(c + ((c == 0) & (y > 0.0f)));
}

// decode's value of m's and sqrt(v)'s codes for a stored scale that passes plain_decode_scale.
static inline float plain_decode_m(uint8_t c, float scale, const MomentMaps& maps) {
  float x = maps.m[c & 0x7f] * scale;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits ^= static_cast<uint32_t>(c & 0x80) << 24;  // the code's sign, without a branch
  std::memcpy(&x, &bits, 4);
  return x;
}
static inline float plain_decode_sqrt_v(uint8_t c, float scale, const MomentMaps& maps) { return maps.v[c] * scale; }

// The value of a code in a block of the given stored scale: m signed, sqrt(v) for kExpAvgSq.
static inline float decode(uint8_t c, float scale, int which, const MomentMaps& maps) {
  if (which == kExpAvg) {
    const int k = c & 0x7f;
    const float x = holds_inf(scale) ? (k == 126 ? INFINITY : maps.m[k] * -scale) : maps.m[k] * scale;
    return (c & 0x80) ? -x : x;
  }
  return holds_inf(scale) ? (c == 254 ? INFINITY : maps.v[c] * -scale) : maps.v[c] * scale;
}

}  // namespace moment_code
}  // namespace offload
