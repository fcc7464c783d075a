// The int8 maps, the kernel variant for this CPU, and the whole-buffer operations spread over threads in chunks
// of whole int8 blocks.
#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <vector>

#include "adam/adam_moments.h"
#include "adam/for_chunks.h"
#include "common/cpu_features.h"
#include "common/crc32c.h"

namespace offload {

namespace {

static_assert(kChunk % kInt8Block == 0, "chunks must hold whole blocks");

constexpr MomentKernels kAvx512{moment_step_avx512, moment_encode_avx512, moment_decode_avx512,
                                moment_step_crc_avx512, "avx512"};
constexpr MomentKernels kAvx512Bw{moment_step_avx512bw, moment_encode_avx512bw, moment_decode_avx512bw,
                                  moment_step_crc_avx512bw, "avx512bw"};
constexpr MomentKernels kAvx2{moment_step_avx2, moment_encode_avx2, moment_decode_avx2, moment_step_crc_avx2, "avx2"};
constexpr MomentKernels kScalar{moment_step_scalar, moment_encode_scalar, moment_decode_scalar,
                                moment_step_crc_scalar, "scalar"};

// The AVX-512 kernel with byte-plane tables needs VBMI (vpermt2b) and AVX512_BF16 (vcvtneps2bf16).
bool has_vbmi_kernel() {
  static const bool has = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
  return has;
}

// Bytes per element of one step's pieces.
int code_bytes(MomentFormat format) { return format == MomentFormat::kBFloat16 ? 2 : 1; }

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

// The lines of moment_code::plain_code: for binade slot s of y, those of its lowest decade d, u = y * a[d] - b[d],
// which puts decade d's inner midpoints at the half-integers between its codes (as adam_moments_avx512.cpp's
// Encoder builds them).
void build_lines(int decades, float (&a)[32], float (&b)[32]) {
  for (int s = 0; s < 32; ++s) {
    const double bottom = s == 0 ? 0.0 : std::ldexp(1.0, kLineFirstExp + s - 127);
    int d = 0;
    for (int i = 0; i + 1 < decades; ++i) {
      if (static_cast<float>(std::pow(10.0, i + 1 - decades)) <= bottom) ++d;  // y >= 10^(i+1-decades): decade > i
    }
    const double k = std::ldexp(1.0, d + 1);
    a[s] = static_cast<float>(k / (0.9 * std::pow(10.0, d - decades + 1)));
    b[s] = static_cast<float>(k / 9.0 - k + 1.5);
  }
}

MomentMaps make_maps() {
  MomentMaps maps;
  build_map(6, maps.m, maps.m_mid, maps.m_skip_mid);
  build_map(7, maps.v, maps.v_mid, maps.v_skip_mid);
  build_lines(6, maps.m_line_a, maps.m_line_b);
  build_lines(7, maps.v_line_a, maps.v_line_b);
  return maps;
}

}  // namespace

const MomentMaps& moment_maps() {
  static const MomentMaps maps = make_maps();  // immutable after first use
  return maps;
}

const MomentKernels& moment_kernels_for(const std::string& isa) {
  moment_maps();  // built before any thread needs them
  // "avx512bw": the F/BW kernel, also where the VBMI one runs (tests compare them).
  const bool bw_only = isa == "avx512bw";
  // Same names, same choice as adam_kernels_for: the variant adam_step would use on this CPU.
  const std::string name = adam_kernels_for(bw_only ? "avx512" : isa).name;
  if (name == "avx512") return bw_only || !has_vbmi_kernel() ? kAvx512Bw : kAvx512;
  if (name == "avx2") return kAvx2;
  return kScalar;
}

std::vector<std::string> moment_isas() {
  std::vector<std::string> names;
  const std::string best = adam_kernels_for("").name;
  if (best == "avx512") {
    names.emplace_back("avx512");
    if (has_vbmi_kernel()) names.emplace_back("avx512bw");
  }
  if (best == "avx512" || best == "avx2") names.emplace_back("avx2");
  names.emplace_back("scalar");
  return names;
}

void moment_crcs_after(const MomentBuffers& b, int64_t begin, int64_t end, uint32_t* crcs) {
  const int64_t count = end - begin;
  const int cb = code_bytes(b.format);
  crcs[kCrcParam] = crc32c(b.p + begin, 4 * count, crcs[kCrcParam]);
  crcs[kCrcExpAvg] = crc32c(static_cast<const uint8_t*>(b.m) + cb * begin, cb * count, crcs[kCrcExpAvg]);
  crcs[kCrcExpAvgSq] = crc32c(static_cast<const uint8_t*>(b.v) + cb * begin, cb * count, crcs[kCrcExpAvgSq]);
  if (b.format == MomentFormat::kInt8) {
    const int64_t first = begin / kInt8Block, blocks = (end + kInt8Block - 1) / kInt8Block - first;
    crcs[kCrcExpAvgScales] = crc32c(b.m_scales + first, 4 * blocks, crcs[kCrcExpAvgScales]);
    crcs[kCrcExpAvgSqScales] = crc32c(b.v_scales + first, 4 * blocks, crcs[kCrcExpAvgSqScales]);
  }
  if (b.out) {
    const int64_t ob = static_cast<int64_t>(dtype_size(b.out_dtype));
    crcs[kCrcOut] = crc32c(static_cast<const uint8_t*>(b.out) + ob * begin, ob * count, crcs[kCrcOut]);
  }
}

namespace {

// The portable kernels' CRCs: step a span small enough to stay in L1/L2 (kCrcSpan), then read its pieces back.
static_assert(kCrcSpan % kInt8Block == 0, "spans hold whole blocks");

template <MomentStepFn kStep>
void step_crc_by_spans(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end, uint32_t* crcs) {
  for (int64_t start = begin; start < end; start += kCrcSpan) {
    const int64_t stop = std::min(end, start + kCrcSpan);
    kStep(b, c, start, stop);
    moment_crcs_after(b, start, stop, crcs);
  }
}

// Byte lengths of the pieces of elements [begin, end).
void piece_lengths(const MomentBuffers& b, int64_t begin, int64_t end, size_t* len) {
  const int64_t count = end - begin;
  len[kCrcParam] = 4 * count;
  len[kCrcExpAvg] = len[kCrcExpAvgSq] = code_bytes(b.format) * count;
  const int64_t blocks = (end + kInt8Block - 1) / kInt8Block - begin / kInt8Block;
  len[kCrcExpAvgScales] = len[kCrcExpAvgSqScales] = b.format == MomentFormat::kInt8 ? 4 * blocks : 0;
  len[kCrcOut] = b.out ? dtype_size(b.out_dtype) * static_cast<size_t>(count) : 0;
}

}  // namespace

void moment_step_crc_scalar(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end,
                            uint32_t* crcs) {
  step_crc_by_spans<moment_step_scalar>(b, c, begin, end, crcs);
}
void moment_step_crc_avx2(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end,
                          uint32_t* crcs) {
  step_crc_by_spans<moment_step_avx2>(b, c, begin, end, crcs);
}
void moment_step_crc_avx512bw(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end,
                              uint32_t* crcs) {
  step_crc_by_spans<moment_step_avx512bw>(b, c, begin, end, crcs);
}

void moments_step(const MomentBuffers& buffers, const AdamConstants& constants, int64_t n, ThreadPool* pool,
                  int num_threads, const MomentKernels& kernels, uint32_t* crcs) {
  if (!crcs) {
    const MomentStepFn fn = kernels.step;
    for_chunks(n, pool, num_threads, [&](int64_t begin, int64_t end) { fn(buffers, constants, begin, end); });
    return;
  }
  const MomentStepCrcFn fn = kernels.step_crc;
  for_chunks_with_crcs(
      n, pool, num_threads, [&](int64_t begin, int64_t end, uint32_t* part) { fn(buffers, constants, begin, end, part); },
      [&](int64_t begin, int64_t end, size_t* len) { piece_lengths(buffers, begin, end, len); }, crcs);
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
