// Per-element Adam maths and 16-bit float conversions, shared by the scalar kernel and the SIMD tails.
// Every function has internal linkage (static inline), so each ISA's file compiles its own copy with its
// own target flags and no copy compiled for a wider ISA can leak into another file through the linker.
#pragma once

#include <cstdint>
#include <cstring>

#include "adam/adam_kernels.h"

namespace offload {
namespace scalar {

static inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest, ties to even (what torch's .to(torch.bfloat16) does); NaN stays a quiet NaN.
static inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

static inline float fp16_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, sizeof x);
  return static_cast<float>(x);
}

static inline uint16_t float_to_fp16(float f) {
  _Float16 x = static_cast<_Float16>(f);  // IEEE round to nearest even
  uint16_t h;
  std::memcpy(&h, &x, sizeof h);
  return h;
}

static inline float load(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

static inline void store(void* base, DType dtype, int64_t i, float x) {
  switch (dtype) {
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(x); break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_fp16(x); break;
    default: static_cast<float*>(base)[i] = x;
  }
}

// The update of one element, in the order of torch's single-tensor Adam/AdamW (see adam_kernels.h).
// Without FMA hardware __builtin_fmaf is a (slow, exact) library call: the scalar kernel favours equality.
static inline void adam_element(const AdamBuffers& b, const AdamConstants& c, int64_t i) {
  float g = load(b.g, b.g_dtype, i) * c.grad_scale;
  float p = b.p[i] * c.decay_factor;
  if (c.use_l2) g = __builtin_fmaf(c.l2_weight, p, g);
  float m = b.m[i];
  m = __builtin_fmaf(c.lerp_weight, g - m, m);
  float v = __builtin_fmaf(c.one_minus_beta2 * g, g, b.v[i] * c.beta2);
  float denom = __builtin_sqrtf(v) / c.bias_correction2_sqrt + c.eps;
  p = p + (c.neg_step_size * m) / denom;
  b.p[i] = p;
  b.m[i] = m;
  b.v[i] = v;
  if (b.out) store(b.out, b.out_dtype, i, p);
}

static inline void adam_elements(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) adam_element(b, c, i);
}

static inline double sum_squares(const void* x, DType dtype, int64_t begin, int64_t end) {
  double acc = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    double e = load(x, dtype, i);
    acc += e * e;
  }
  return acc;
}

}  // namespace scalar
}  // namespace offload
