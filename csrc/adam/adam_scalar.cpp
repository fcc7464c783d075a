// The portable kernel: any x86-64 (or other) CPU; also the reference the SIMD kernels are tested against.
#include "adam/adam_kernels.h"

#pragma GCC push_options
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps torch's kernels take.
#pragma GCC optimize("fp-contract=off")
#include "adam/scalar_math.h"
#include "adam/grad_rebuild.h"
#include "adam/torch_order_norm.h"

namespace offload {

void adam_range_scalar(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  scalar::adam_elements(b, c, begin, end);
}

float torch_order_norm_scalar(const uint16_t* x, DType dtype, int64_t n, int lanes, bool fused) {
  return torch_order::norm_range(x, dtype, n, lanes, fused);
}
void rebuild_scalar(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out, DType dtype, int64_t n) {
  rebuild::rebuild_range(m_old, m_new, lerp_weight, out, dtype, n);
}

double sum_squares_scalar(const void* x, DType dtype, int64_t begin, int64_t end) {
  return scalar::sum_squares(x, dtype, begin, end);
}

}  // namespace offload
#pragma GCC pop_options
