// A 16-bit gradient rebuilt from Adam's old and new fp32 first moment, for speculative clipping (issue 35).
//
// The fused step computes m' = fma(1-b1, g - m, m) in fp32. A bf16 or fp16 gradient has 8 or 11 significant bits,
// so fma(m' - m, 1/(1-b1), m), rounded to the gradient's dtype, is g itself unless |g| is tiny against |m|
// (measured: 1.4e-5 to 3e-5 of the elements of a GPT in bf16; `python benchmarks/grad_from_moments.py`). A
// zero gradient is rebuilt as zero when m' is what the step makes of g = 0 (fma(1-b1, -m, m)): unused embedding
// rows keep their exact zeros. The speculative step (adam_step_resting) checks each element against the
// gradient it stepped on and keeps those it would miss, so a later rebuild with the same function, patched with
// them, is the gradient bit for bit. Every operation is one IEEE-rounded fp32 operation (sub, fma),
// so each ISA's compilation of this loop gives the same bits.
//
// Included by each ISA's kernel file after its target pragma (static inline: no copy leaks across files).
#pragma once

#include <cstdint>
#include <cstring>

#include "adam/adam_kernels.h"
#include "adam/scalar_math.h"

namespace offload {
namespace rebuild {

template <DType G>
static inline void rebuild_loop(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out,
                                int64_t n) {
  const float inverse = 1.0f / lerp_weight;  // a multiply, not a divide, per element: the check runs in every step
  for (int64_t i = 0; i < n; ++i) {
    const float old = m_old[i], now = m_new[i];
    const float of_zero = __builtin_fmaf(lerp_weight, -old, old);
    const float rebuilt = __builtin_fmaf(now - old, inverse, old);
    uint32_t bits;
    std::memcpy(&bits, &rebuilt, sizeof bits);
    bits &= -static_cast<uint32_t>(now != of_zero);  // +0.0 for a zero gradient; no branch, so every ISA vectorizes
    float g;
    std::memcpy(&g, &bits, sizeof g);
    if constexpr (G == DType::kBFloat16) {
      out[i] = scalar::float_to_bf16(g);
    } else {
      out[i] = scalar::float_to_fp16(g);
    }
  }
}

// The rebuilt gradient's bits of n elements (dtype bf16 or fp16: the binding checks).
static inline void rebuild_range(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out,
                                 DType dtype, int64_t n) {
  if (dtype == DType::kBFloat16) {
    rebuild_loop<DType::kBFloat16>(m_old, m_new, lerp_weight, out, n);
  } else {
    rebuild_loop<DType::kFloat16>(m_old, m_new, lerp_weight, out, n);
  }
}

}  // namespace rebuild
}  // namespace offload
