// The int8 maps, the kernel variant for this CPU, and the whole-buffer operations spread over threads in chunks
// of whole int8 blocks.
#include <cmath>
#include <memory>
#include <stdexcept>

#include "adam/adam_moments.h"
#include "adam/for_chunks.h"
#include "common/cpu_features.h"

namespace offload {

namespace {

static_assert(kChunk % kInt8Block == 0, "chunks must hold whole blocks");

constexpr MomentKernels kAvx512{moment_step_avx512, moment_encode_avx512, moment_decode_avx512, "avx512"};
constexpr MomentKernels kAvx2{moment_step_avx2, moment_encode_avx2, moment_decode_avx2, "avx2"};
constexpr MomentKernels kScalar{moment_step_scalar, moment_encode_scalar, moment_decode_scalar, "scalar"};

// bitsandbytes' create_dynamic_map(signed=False) over `decades` decades: 0, then decade d holds 2^(d+1) bucket
// centres of [0.1, 1] * 10^(d - decades + 1), then 1. The same expression, in the same order, as moments.py.
template <int N>
void build_map(int decades, float (&values)[N], float (&mids)[N - 1], float& skip_mid) {
  int at = 0;
  values[at++] = 0.0f;
  for (int d = 0; d < decades; ++d) {
    const double k = std::ldexp(1.0, d + 1);
    const double scale = std::pow(10.0, d - decades + 1);
    for (int j = 0; j < static_cast<int>(k); ++j) values[at++] = static_cast<float>(scale * (0.1 + 0.9 * (j + 0.5) / k));
  }
  values[at++] = 1.0f;
  if (at != N) throw std::logic_error("moment map size");
  for (int i = 0; i + 1 < N; ++i) {
    mids[i] = static_cast<float>((static_cast<double>(values[i]) + static_cast<double>(values[i + 1])) / 2);
  }
  skip_mid = static_cast<float>((static_cast<double>(values[N - 3]) + static_cast<double>(values[N - 1])) / 2);
}

MomentMaps make_maps() {
  MomentMaps maps;
  build_map(6, maps.m, maps.m_mid, maps.m_skip_mid);
  build_map(7, maps.v, maps.v_mid, maps.v_skip_mid);
  return maps;
}

}  // namespace

const MomentMaps& moment_maps() {
  static const MomentMaps maps = make_maps();  // immutable after first use
  return maps;
}

const MomentKernels& moment_kernels_for(const std::string& isa) {
  // Same names, same choice as adam_kernels_for: the variant adam_step would use on this CPU.
  const std::string name = adam_kernels_for(isa).name;
  moment_maps();  // built before any thread needs them
  if (name == "avx512") return kAvx512;
  if (name == "avx2") return kAvx2;
  return kScalar;
}

void moments_step(const MomentBuffers& buffers, const AdamConstants& constants, int64_t n, ThreadPool* pool,
                  int num_threads, const MomentKernels& kernels) {
  const MomentStepFn fn = kernels.step;
  for_chunks(n, pool, num_threads, [&](int64_t begin, int64_t end) { fn(buffers, constants, begin, end); });
}

void moments_encode(const float* src, void* codes, float* scales, MomentFormat format, int which, int64_t n,
                    ThreadPool* pool, int num_threads, const MomentKernels& kernels) {
  const MomentEncodeFn fn = kernels.encode;
  for_chunks(n, pool, num_threads,
             [&](int64_t begin, int64_t end) { fn(src, codes, scales, format, which, begin, end); });
}

void moments_decode(const void* codes, const float* scales, MomentFormat format, int which, float* out, int64_t n,
                    ThreadPool* pool, int num_threads, const MomentKernels& kernels) {
  const MomentDecodeFn fn = kernels.decode;
  for_chunks(n, pool, num_threads,
             [&](int64_t begin, int64_t end) { fn(codes, scales, format, which, out, begin, end); });
}

}  // namespace offload
