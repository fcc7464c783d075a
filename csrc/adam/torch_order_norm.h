// The L2 norm of a bf16/fp16 gradient with the bits torch.linalg.vector_norm(x.float()) gives, read in place.
//
// Clipping must reproduce torch's norm bit for bit (docs/design.md [Note: clipping parity]). torch reduces a
// contiguous fp32 vector in one thread: `lanes` fp32 accumulators over consecutive groups of `lanes` elements,
// then the accumulators added left to right, then the remaining elements one by one, then sqrt. Doing the same
// here from the 16-bit values skips the fp32 copy torch's conversion needs (3x the bytes, and more time than the
// norm). Which lane count and whether the square is fused into the add (it only matters for bf16 squares that
// underflow fp32) is torch's build's choice: offload/optim/functional.py `TorchNorm` checks them against torch
// once per process and uses this only when every check agrees. The additions are one IEEE-rounded fp32
// operation each, so every ISA's compilation gives the same bits.
//
// Included by each ISA's kernel file after its target pragma (static inline: no copy leaks across files).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam/adam_kernels.h"
#include "adam/scalar_math.h"

namespace offload {
namespace torch_order {

template <DType G>
static inline float widen(uint16_t h) {
  if constexpr (G == DType::kBFloat16) {
    return scalar::bf16_to_float(h);
  } else {
    return scalar::fp16_to_float(h);
  }
}

template <bool kFused>
static inline float add_square(float acc, float x) {
  if constexpr (kFused) {
    return __builtin_fmaf(x, x, acc);
  } else {
    return acc + x * x;  // two roundings: the file compiles with fp-contract=off
  }
}

// kLanes accumulators as one GCC vector (kept in registers; each ISA's file compiles it to its widest fit).
template <int kLanes>
struct Lanes;
template <>
struct Lanes<8> {
  typedef float Floats __attribute__((vector_size(32)));
  typedef uint32_t Words __attribute__((vector_size(32)));
  typedef uint16_t Halves __attribute__((vector_size(16)));
  typedef _Float16 Fp16s __attribute__((vector_size(16)));
};
template <>
struct Lanes<16> {
  typedef float Floats __attribute__((vector_size(64)));
  typedef uint32_t Words __attribute__((vector_size(64)));
  typedef uint16_t Halves __attribute__((vector_size(32)));
  typedef _Float16 Fp16s __attribute__((vector_size(32)));
};

template <DType G, int kLanes, bool kFused>
static inline float norm_loop(const uint16_t* x, int64_t n) {
  using Floats = typename Lanes<kLanes>::Floats;
  using Words = typename Lanes<kLanes>::Words;
  using Halves = typename Lanes<kLanes>::Halves;
  using Fp16s = typename Lanes<kLanes>::Fp16s;
  Floats acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Halves h;
    std::memcpy(&h, x + i, sizeof h);
    Floats v;
    if constexpr (G == DType::kBFloat16) {
      const Words w = __builtin_convertvector(h, Words) << 16;
      std::memcpy(&v, &w, sizeof v);
    } else {
      Fp16s f;
      std::memcpy(&f, &h, sizeof f);
      v = __builtin_convertvector(f, Floats);
    }
    if constexpr (kFused) {
      for (int j = 0; j < kLanes; ++j) acc[j] = __builtin_fmaf(v[j], v[j], acc[j]);
    } else {
      acc = acc + v * v;  // two roundings: the file compiles with fp-contract=off
    }
  }
  float total = acc[0];
  for (int j = 1; j < kLanes; ++j) total += acc[j];
  for (; i < n; ++i) total = add_square<kFused>(total, widen<G>(x[i]));
  return std::sqrt(total);
}

template <DType G>
static inline float norm_of(const uint16_t* x, int64_t n, int lanes, bool fused) {
  if (lanes == 8) return fused ? norm_loop<G, 8, true>(x, n) : norm_loop<G, 8, false>(x, n);
  return fused ? norm_loop<G, 16, true>(x, n) : norm_loop<G, 16, false>(x, n);
}

// dtype bf16 or fp16 and lanes 8 or 16: the binding checks.
static inline float norm_range(const uint16_t* x, DType dtype, int64_t n, int lanes, bool fused) {
  return dtype == DType::kBFloat16 ? norm_of<DType::kBFloat16>(x, n, lanes, fused)
                                   : norm_of<DType::kFloat16>(x, n, lanes, fused);
}

}  // namespace torch_order
}  // namespace offload
