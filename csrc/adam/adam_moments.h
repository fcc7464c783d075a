// The fused Adam/AdamW step over compressed moments (bf16 or int8), and their encode/decode.
//
// Formats (offload/optim/moments.py [Note: int8 moment codes] is the full description):
//   * bf16: m and v are n bfloat16 values each, rounded to nearest even.
//   * int8: m and v are n code bytes each plus one fp32 scale per kInt8Block elements (the block's largest
//     magnitude). m: bit 7 = sign, bits 0-6 index the 128-entry map; v is stored as sqrt(v): the byte indexes
//     the 256-entry map. value = map[code] * scale (m negated by the sign bit; v squared).
//     Encoding: y = |x| * (1/scale) (0 when scale is 0); code = #{midpoints between consecutive map values < y},
//     i.e. round to nearest with ties to the lower code; a magnitude that rounds to 0 has no sign bit; a positive
//     sqrt(v) never takes code 0. A NaN in a block makes its scale NaN.
//     A block holding an infinity (and no NaN: a v whose g*g overflowed fp32) stores its scale negated, sign bit
//     set (-0.0 included): |scale| is the largest finite magnitude, and the map's second-highest value (magnitude
//     code kInfCode: 126 for m, 254 for v) stands for infinity (m: signed); finite values round to the nearest of
//     the other map values (moment_codes.h). Its finite neighbours keep their values, as in fp32 moments.
//
// Contract (offload/optim/moments.py validates all of this before calling):
//   * p: fp32; g: fp32/bf16/fp16; out: null or fp32/bf16/fp16; n elements each, as in adam_kernels.h.
//   * codes: n elements of the format; scales (int8 only): ceil(n / kInt8Block) floats; element 0 starts a block.
//   * nothing overlaps.
// The step: decode m and v to fp32, then exactly the maths of adam_kernels.h (the same fp32 operations in the same
// order), the new p from the new fp32 m and v, then encode m and v. One pass over memory; int8 blocks are
// updated in two sweeps over a 2 KiB stack buffer (new m and sqrt(v) of the block: the scale needs the whole block
// before any code can be written).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "adam/adam_kernels.h"
#include "adam/step_crcs.h"
#include "common/thread_pool.h"

namespace offload {

enum class MomentFormat { kBFloat16 = 1, kInt8 = 2 };

constexpr int64_t kInt8Block = 256;  // elements per scale; the threads' chunks are whole blocks
constexpr int kExpAvg = 1, kExpAvgSq = 2;  // `which`: picks the int8 map

// The maps and the midpoints between their consecutive values: built once, in double, each value rounded once
// to fp32 (offload/optim/moments.py builds the same numbers; a test compares).
struct MomentMaps {
  float m[128];      // |m| / scale: bitsandbytes' unsigned dynamic map over 6 decades (0, 126 values, 1)
  float m_mid[127];
  float v[256];      // sqrt(v) / scale: the unsigned dynamic map over 7 decades (0, 254 values, 1)
  float v_mid[255];
  // In a block holding an infinity the second-highest value means infinity: the midpoint between its two
  // neighbours (map[N-3] and 1) then splits the finite values between them.
  float m_skip_mid, v_skip_mid;
  // The search-free encoder's lines (moment_code::plain_code), by the binade slot of y: u = y * a - b.
  float m_line_a[32], m_line_b[32], v_line_a[32], v_line_b[32];
};
// Binades of y below 2^(kLineFirstExp - 126) share slot 0 of the lines: all lie in decade 0.
constexpr int kLineFirstExp = 96;
const MomentMaps& moment_maps();

struct MomentBuffers {
  float* p;
  const void* g;
  DType g_dtype;
  void* m;          // bf16 values or int8 codes
  float* m_scales;  // int8 only
  void* v;
  float* v_scales;
  MomentFormat format;
  void* out;  // may be null
  DType out_dtype;
};

// One ISA's kernels over elements [begin, end); begin is a multiple of kInt8Block.
using MomentStepFn = void (*)(const MomentBuffers&, const AdamConstants&, int64_t begin, int64_t end);
using MomentEncodeFn = void (*)(const float* src, void* codes, float* scales, MomentFormat format, int which,
                                int64_t begin, int64_t end);
using MomentDecodeFn = void (*)(const void* codes, const float* scales, MomentFormat format, int which, float* out,
                                int64_t begin, int64_t end);

// A range kernel that also continues the CRCs of what it writes (StepCrc, step_crcs.h): crcs[kCrcCount] hold the
// CRC-32C of the pieces before `begin` (0 at the start of a piece) and receive those up to `end`, in one pass over
// DRAM: the portable variants step spans of a few thousand elements and checksum each span's pieces right after,
// while they are in L1/L2 (adam_moments_dispatch.cpp); the AVX-512 int8 step feeds crc32 chains inside its loops
// (adam_moments_avx512.cpp).
using MomentStepCrcFn = void (*)(const MomentBuffers&, const AdamConstants&, int64_t begin, int64_t end,
                                 uint32_t* crcs);

struct MomentKernels {
  MomentStepFn step;
  MomentEncodeFn encode;
  MomentDecodeFn decode;
  MomentStepCrcFn step_crc;
  const char* name;
};

#define OFFLOAD_MOMENT_KERNELS(isa)                                                                        \
  void moment_step_##isa(const MomentBuffers&, const AdamConstants&, int64_t, int64_t);                   \
  void moment_encode_##isa(const float*, void*, float*, MomentFormat, int, int64_t, int64_t);             \
  void moment_decode_##isa(const void*, const float*, MomentFormat, int, float*, int64_t, int64_t);       \
  void moment_step_crc_##isa(const MomentBuffers&, const AdamConstants&, int64_t, int64_t, uint32_t*);
OFFLOAD_MOMENT_KERNELS(scalar)
OFFLOAD_MOMENT_KERNELS(avx2)      // AVX2 + FMA + F16C: 8 lanes, the int8 maps looked up with gathers
OFFLOAD_MOMENT_KERNELS(avx512bw)  // AVX-512 F/BW: the int8 maps and midpoints in registers as 16-bit planes
OFFLOAD_MOMENT_KERNELS(avx512)    // + VBMI and AVX512_BF16: byte planes, 64 codes a lookup
#undef OFFLOAD_MOMENT_KERNELS

// The CRCs of the pieces of [begin, end) (appended to crcs), read back from memory: the portable kernels' way.
void moment_crcs_after(const MomentBuffers& b, int64_t begin, int64_t end, uint32_t* crcs);

// The kernels of one named variant: "avx512" (the VBMI kernel where the CPU has AVX512_VBMI and AVX512_BF16, else
// the F/BW one), "avx512bw", "avx2", "scalar"; "" = the best for this CPU, as for adam_step. Throws
// std::invalid_argument for an unknown or unsupported name.
const MomentKernels& moment_kernels_for(const std::string& isa);

// The variants this CPU runs, best first ("avx512" and "avx512bw" name two kernels only where it has VBMI and BF16).
std::vector<std::string> moment_isas();

// Whole-buffer operations, threaded like adam_step (pool, or num_threads for this call; inline when small).
// crcs: null, or kCrcCount entries that receive the CRC-32C of each piece written (StepCrc), computed in the
// same pass; with several threads each chunk's, joined with crc32c_combine.
void moments_step(const MomentBuffers& buffers, const AdamConstants& constants, int64_t n, ThreadPool* pool,
                  int num_threads, const MomentKernels& kernels, uint32_t* crcs = nullptr);
void moments_encode(const float* src, void* codes, float* scales, MomentFormat format, int which, int64_t n,
                    ThreadPool* pool, int num_threads, const MomentKernels& kernels);
void moments_decode(const void* codes, const float* scales, MomentFormat format, int which, float* out, int64_t n,
                    ThreadPool* pool, int num_threads, const MomentKernels& kernels);

}  // namespace offload
