// The int8 code of one value and the marks of a block that holds an infinity: the rule every kernel variant
// applies element by element (the scalar and AVX2 kernels everywhere, the AVX-512 kernel for blocks whose scale is
// not a normal number, and for blocks holding an infinity). Included after each file's target pragma; everything
// is static inline, so no copy compiled for a wider ISA leaks into another file.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

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
