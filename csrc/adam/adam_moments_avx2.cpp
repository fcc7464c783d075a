// The moment kernels for AVX2 CPUs: the scalar loops compiled with AVX2 + FMA + F16C (the compiler vectorizes the
// bf16 loops and the fma; the int8 map lookups stay scalar). Headers with templates come before the pragma.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "adam/adam_moments.h"

#pragma GCC push_options
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps of adam_kernels.h.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx2,fma,f16c")
#include "adam/adam_moments_scalar.h"

namespace offload {

void moment_step_avx2(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  step_range(b, c, begin, end);
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
