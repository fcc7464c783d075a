// AVX-512 (F, BW, VL, DQ) kernels: 16 lanes, masked tails, streaming stores for the write-only copy-out.
// Headers with templates are included before the target pragma, so their instantiations stay baseline x86-64.
#include <cstring>
#include <immintrin.h>

#include "adam/adam_kernels.h"

#pragma GCC push_options
// gcc 12 warns inside its own avx512 intrinsics (their _mm512_undefined_* placeholders): a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps torch's kernels take.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#include "adam/adam_avx512_impl.h"
#include "adam/grad_rebuild.h"
#include "adam/torch_order_norm.h"

namespace offload {
void adam_range_avx512(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  adam_range(b, c, begin, end);
}
void resting_range_avx512(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end,
                          const MissSink& misses) {
  resting_range(b, c, begin, end, misses);
}
float torch_order_norm_avx512(const uint16_t* x, DType dtype, int64_t n, int lanes, bool fused) {
  return torch_order::norm_range(x, dtype, n, lanes, fused);
}
void rebuild_avx512(const float* m_old, const float* m_new, float lerp_weight, uint16_t* out, DType dtype, int64_t n) {
  rebuild::rebuild_range(m_old, m_new, lerp_weight, out, dtype, n);
}
double sum_squares_avx512(const void* x, DType dtype, int64_t begin, int64_t end) {
  return sum_squares(x, dtype, begin, end);
}
}  // namespace offload
#pragma GCC diagnostic pop
#pragma GCC pop_options
