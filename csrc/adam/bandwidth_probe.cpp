// The DRAM bound the Adam benchmark reports against: a "traffic twin" of the fp32-mode kernel. It reads p, m,
// v and an fp32 g and writes p, m, v back in one pass over the same arrays (28 bytes per element, the
// kernel's traffic) with next to no arithmetic, so its time is what the memory system allows for that
// access pattern. Compiled for each ISA with target_clones, so it vectorises like the kernel does.
#include <cstdint>

#include "adam/adam_kernels.h"

namespace offload {

__attribute__((target_clones("avx512f", "avx2", "default"))) void traffic_range(float* __restrict p,
                                                                                float* __restrict m,
                                                                                float* __restrict v,
                                                                                const float* __restrict g,
                                                                                float scale, float zero,
                                                                                int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    p[i] = p[i] * scale + g[i] * zero;  // `zero` is a run-time 0: g must really be read
    m[i] = m[i] * scale;
    v[i] = v[i] * scale;
  }
}

}  // namespace offload
