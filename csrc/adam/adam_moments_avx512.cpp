// AVX-512 moment kernels for CPUs with AVX512_VBMI and AVX512_BF16 (Zen 4, Sapphire Rapids and later; the others,
// Skylake-X or Ice Lake, run adam_moments_avx512bw.cpp). The same codes, scales and values as the scalar reference,
// bit for bit (tests/test_moments.py; the encoder was also checked against the reference for every fp32 y in
// [0, 1 + 2^-19], and to_bf16_fast against to_bf16 for every fp32 input):
//   * the int8 maps and midpoints are byte planes (byte j of every float of a table) looked up with vpermt2b, 64 codes
//     a lookup (the F/BW kernel looks up 16-bit halves, 32 a lookup: twice the lookups and three times the blends);
//   * encode finds the one bucket edge near y as the minimum of two lines, those of the two decades its binade can
//     hold, without a compare (Encoder), then compares y with that midpoint;
//   * bf16 results (out, bf16 moments) with vcvtneps2bf16, which rounds as the integer code does except that it
//     flushes subnormal inputs to zero: a vector holding one takes the integer code (to_bf16).
// Measured on one Zen 4 core with the data in L2 (bf16 gradient in, bf16 copy out): int8 3.9 cycles a parameter
// against the F/BW kernel's 5.3, bf16 1.6 against 2.3 (the divider's bound, two divisions and a square root per
// 16 lanes, is 1.4). step_crc: the int8 step feeds the CRCs of what it writes to crc32 chains inside its loops
// (StepCrcs, GroupCrcs: 4.3 -> 3.8 cycles a parameter, the step without CRCs 3.8); the bf16 step folds what it stores
// from the registers, one carry-less folding accumulator per piece (Fold: 2.2 -> 2.1 cycles, without CRCs 1.6).
// Headers with templates are included before the target pragma, so their instantiations stay baseline x86-64.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "adam/adam_moments.h"
#include "common/crc32c.h"

#pragma GCC push_options
// gcc 12 warns inside its own avx512 intrinsics (their _mm512_undefined_* placeholders): a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// No contraction of a*b+c into fma beyond the ones written: keep the rounding steps of adam_kernels.h.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,fma,f16c,sse4.2,pclmul,vpclmulqdq")
#include "adam/avx512_common.h"
#include "adam/moment_codes.h"

namespace offload {
namespace {

// The lookups and codes below are small and hot: inlined into the block loops, where their tables can stay in
// registers (gcc leaves some out of line otherwise, and calls them once per 64 elements).
#define OFFLOAD_HOT inline __attribute__((always_inline))

inline __mmask16 lanes(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xffff) : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1u);
}
inline __mmask64 lanes64(int64_t count) { return count >= 64 ? ~__mmask64{0} : (__mmask64{1} << count) - 1; }

// --- bf16 ------------------------------------------------------------------------------------------------------

// Round to nearest even as to_bf16 (and torch): vcvtneps2bf16, except for subnormal inputs, which it flushes to zero.
OFFLOAD_HOT __m256i to_bf16_fast(__m512 x) {
  const __mmask16 subnormal = _mm512_fpclass_ps_mask(x, 0x20);
  if (__builtin_expect(subnormal != 0, 0)) return to_bf16(x);
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
}

template <DType O>
OFFLOAD_HOT void store_out(void* out, int64_t i, __m512 x, __mmask16 k) {
  if constexpr (O == DType::kBFloat16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k, to_bf16_fast(x));
  } else {
    store16<O, false>(out, i, x, k);
  }
}

// --- int8 codes --------------------------------------------------------------------------------------------------

// "T order" of 64 lanes: position 16L + 4r + k holds element 16r + 4L + k (L, r, k in 0..3). It is the order
// packus_epi32 then packus_epi16 leave four vectors of 16 in, and the one whose byte-plane lookups come out of the
// unpack ladder below as four vectors of floats in natural order. The permutation is its own inverse.
inline __m512i transpose_index() {
  alignas(64) uint8_t idx[64];
  for (int L = 0; L < 4; ++L)
    for (int r = 0; r < 4; ++r)
      for (int k = 0; k < 4; ++k) idx[16 * L + 4 * r + k] = static_cast<uint8_t>(16 * r + 4 * L + k);
  return _mm512_load_si512(idx);
}

// Four vectors of 16 values in [0, 255] as 64 bytes in T order.
OFFLOAD_HOT __m512i pack_t(const __m512i (&c)[4]) {
  return _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
}

// A table of N floats (N = 128 or 256) as four byte planes of N/64 registers each, looked up 64 lanes at a time:
// vpermt2b picks from 128 bytes by the index's low 7 bits; for N = 256 a blend on bit 7 picks the register pair.
template <int N>
struct ByteTable {
  static_assert(N == 128 || N == 256, "one or two register pairs per plane");
  __m512i plane[4][N / 64];
  explicit ByteTable(const float* values) {
    for (int j = 0; j < 4; ++j) {
      for (int r = 0; r < N / 64; ++r) {
        alignas(64) uint8_t bytes[64];
        for (int i = 0; i < 64; ++i) {
          uint32_t bits;
          std::memcpy(&bits, values + 64 * r + i, 4);
          bytes[i] = static_cast<uint8_t>(bits >> (8 * j));
        }
        plane[j][r] = _mm512_load_si512(bytes);
      }
    }
  }
  OFFLOAD_HOT __m512i pick(int j, __m512i idx, __mmask64 bit7) const {
    const __m512i lo = _mm512_permutex2var_epi8(plane[j][0], idx, plane[j][1]);
    if constexpr (N == 128) {
      (void)bit7;
      return lo;
    } else {
      return _mm512_mask_blend_epi8(bit7, lo, _mm512_permutex2var_epi8(plane[j][2], idx, plane[j][3]));
    }
  }
  // table[idx] for 64 indices in T order, as four vectors of floats (bits) in natural order. `sign`: OR bit 7 of
  // each index into its float's sign bit (m's codes: the sign bit of the code is the sign of the value).
  template <bool kSign = false>
  OFFLOAD_HOT void operator()(__m512i idx, __m512i (&f)[4]) const {
    const __mmask64 bit7 = N == 256 ? _mm512_movepi8_mask(idx) : 0;
    const __m512i p0 = pick(0, idx, bit7), p1 = pick(1, idx, bit7), p2 = pick(2, idx, bit7);
    __m512i p3 = pick(3, idx, bit7);
    if constexpr (kSign) p3 = _mm512_ternarylogic_epi32(p3, idx, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
    const __m512i w01lo = _mm512_unpacklo_epi8(p0, p1), w01hi = _mm512_unpackhi_epi8(p0, p1);
    const __m512i w23lo = _mm512_unpacklo_epi8(p2, p3), w23hi = _mm512_unpackhi_epi8(p2, p3);
    f[0] = _mm512_unpacklo_epi16(w01lo, w23lo);
    f[1] = _mm512_unpackhi_epi16(w01lo, w23lo);
    f[2] = _mm512_unpacklo_epi16(w01hi, w23hi);
    f[3] = _mm512_unpackhi_epi16(w01hi, w23hi);
  }
};

// One map's encoder: code = #{midpoints < y}, exactly, with no gathers and no branch per vector.
//   1. Decade d of the map holds K = 2^(d+1) evenly spaced values, codes K-1 .. 2K-2; in units of its bucket width,
//      u_d = y * a[d] - b[d] puts its inner midpoints at the half-integers between those codes, so e = floor(u_d)
//      names the one midpoint within half a bucket of y; every other one is more than a quarter bucket away (the
//      border midpoints, to the neighbouring decade's values or to 0 or 1, included), far beyond the ~1e-5 of fp32
//      rounding in u. (adam_moments_avx512bw.cpp's Encoder has the same steps.)
//   2. The decade, without finding it: a binade of y (its exponent field: slot) spans a factor 2, so at most two
//      decades, its lowest d and d + 1; the table gives a[d], b[d], and a[d+1] = a[d] / 5, b[d+1] = 2 b[d] - 1.5.
//      Both lines pass through u = 2K - 1.5 at the power of ten between the decades, u_d five times as steep, so
//      min(u_d, u_d+1) is u_d below it and u_d+1 above it: e = floor(min(u_d, u_d+1)). (Near that power of ten both
//      are 2K - 1.5 to a rounding, floor 2K - 2 either way; for a binade inside one decade, y stays below the next
//      power of ten and the min is u_d.) Two lookups and no compare: the F/BW kernel's decade lookup, compare and
//      masked adjustments took 1.7x the time (the masked operations wait for the compare).
//   3. code = e + (y > mid[e]), the midpoints looked up as byte planes.
// A y of 0 gives e = 0 and code 0. For v the first midpoint is replaced by 0: a positive y never takes code 0.
template <int N>
struct Encoder {
  static constexpr int kFirstExp = 96;  // binades of y below 2^(kFirstExp - 126) share slot 0: all in decade 0
  ByteTable<N> mids;
  __m512 a_of[2], b_of[2];
  explicit Encoder(const float* midpoints, int decades, bool floor_at_one) : mids(padded(midpoints, floor_at_one)) {
    alignas(64) float av[32], bv[32];
    for (int s = 0; s < 32; ++s) {
      const double bottom = s == 0 ? 0.0 : std::ldexp(1.0, kFirstExp + s - 127);
      int d = 0;  // the binade's lowest decade
      for (int i = 0; i + 1 < decades; ++i) {
        if (static_cast<float>(std::pow(10.0, i + 1 - decades)) <= bottom) ++d;  // y >= 10^(i+1-decades): decade > i
      }
      const double k = std::ldexp(1.0, d + 1);
      av[s] = static_cast<float>(k / (0.9 * std::pow(10.0, d - decades + 1)));
      bv[s] = static_cast<float>(k / 9.0 - k + 1.5);
    }
    for (int h = 0; h < 2; ++h) {
      a_of[h] = _mm512_load_ps(av + 16 * h);
      b_of[h] = _mm512_load_ps(bv + 16 * h);
    }
  }
  static const float* padded(const float* midpoints, bool floor_at_one) {
    thread_local float table[N];
    std::memcpy(table, midpoints, sizeof(float) * (N - 1));
    table[N - 1] = INFINITY;  // never looked up: e <= N - 2
    if (floor_at_one) table[0] = 0.0f;
    return table;
  }

  // e of step 1 for y in [0, 1 + 2^-20]: lanes of a finite, normal (or zero) scale.
  OFFLOAD_HOT __m512i edge(__m512 y) const {
    const __m512i slot = _mm512_subs_epu16(_mm512_srli_epi32(_mm512_castps_si512(y), 23), _mm512_set1_epi32(kFirstExp));
    const __m512 a = _mm512_permutex2var_ps(a_of[0], slot, a_of[1]);
    const __m512 b = _mm512_permutex2var_ps(b_of[0], slot, b_of[1]);
    const __m512 u_lo = _mm512_fmsub_ps(y, a, b);
    const __m512 u_hi = _mm512_fmsub_ps(y, _mm512_mul_ps(a, _mm512_set1_ps(0.2f)),
                                        _mm512_fmsub_ps(b, _mm512_set1_ps(2.0f), _mm512_set1_ps(1.5f)));
    return _mm512_cvttps_epi32(_mm512_min_ps(u_lo, u_hi));
  }

  // Codes of 64 values y (4 vectors, natural order) as 64 bytes in natural order.
  OFFLOAD_HOT __m512i codes(const __m512 (&y)[4], __m512i transpose) const {
    __m512i e[4];
    for (int q = 0; q < 4; ++q) e[q] = edge(y[q]);
    const __m512i et = pack_t(e);
    __m512i mid[4];
    mids(et, mid);
    const __mmask64 up = _mm512_kunpackd(
        _mm512_kunpackw(_mm512_cmp_ps_mask(y[3], _mm512_castsi512_ps(mid[3]), _CMP_GT_OQ),
                        _mm512_cmp_ps_mask(y[2], _mm512_castsi512_ps(mid[2]), _CMP_GT_OQ)),
        _mm512_kunpackw(_mm512_cmp_ps_mask(y[1], _mm512_castsi512_ps(mid[1]), _CMP_GT_OQ),
                        _mm512_cmp_ps_mask(y[0], _mm512_castsi512_ps(mid[0]), _CMP_GT_OQ)));
    const __m512i en = _mm512_permutexvar_epi8(transpose, et);
    return _mm512_mask_sub_epi8(en, up, en, _mm512_set1_epi8(-1));
  }
};

// The 64-bit mask of the sign bits of four vectors (natural order).
OFFLOAD_HOT __mmask64 sign_mask(const __m512 (&x)[4]) {
  return _mm512_kunpackd(_mm512_kunpackw(_mm512_movepi32_mask(_mm512_castps_si512(x[3])),
                                         _mm512_movepi32_mask(_mm512_castps_si512(x[2]))),
                         _mm512_kunpackw(_mm512_movepi32_mask(_mm512_castps_si512(x[1])),
                                         _mm512_movepi32_mask(_mm512_castps_si512(x[0]))));
}

struct Int8Codec {
  const MomentMaps& maps;
  __m512i transpose;
  ByteTable<128> m_map;
  ByteTable<256> v_map;
  Encoder<128> m_enc;
  Encoder<256> v_enc;
  Int8Codec()
      : maps(moment_maps()),
        transpose(transpose_index()),
        m_map(maps.m),
        v_map(maps.v),
        m_enc(maps.m_mid, 6, false),
        v_enc(maps.v_mid, 7, true) {}

  // 64 decoded values of codes[0..63] against a scale that is not NaN (lanes beyond k decode code 0): m signed, the
  // map value with the code's sign times the scale (= -(map * scale) for any scale but NaN).
  OFFLOAD_HOT void decode_m(const uint8_t* codes, __mmask64 k, __m512 scale, __m512 (&x)[4]) const {
    __m512i f[4];
    m_map.operator()<true>(_mm512_permutexvar_epi8(transpose, _mm512_maskz_loadu_epi8(k, codes)), f);
    for (int q = 0; q < 4; ++q) x[q] = _mm512_mul_ps(_mm512_castsi512_ps(f[q]), scale);
  }
  OFFLOAD_HOT void decode_sqrt_v(const uint8_t* codes, __mmask64 k, __m512 scale, __m512 (&x)[4]) const {
    __m512i f[4];
    v_map(_mm512_permutexvar_epi8(transpose, _mm512_maskz_loadu_epi8(k, codes)), f);
    for (int q = 0; q < 4; ++q) x[q] = _mm512_mul_ps(_mm512_castsi512_ps(f[q]), scale);
  }

  // A block scale the vector encoder takes: zero or a normal number (no NaN, no infinity in the block; a
  // subnormal scale would make y = |x| / scale overflow).
  static OFFLOAD_HOT bool encodes_fast(float scale) {
    return !moment_code::holds_inf(scale) && (scale == 0.0f || (scale >= FLT_MIN && scale <= FLT_MAX));
  }
  static OFFLOAD_HOT float inverse(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

  // The codes of 64 values of m (sign-bearing) at vals[0..63] in a block of the given inverse scale (encodes_fast).
  OFFLOAD_HOT __m512i m_codes(const float* vals, __m512 inv) const {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 x[4], y[4];
    for (int q = 0; q < 4; ++q) {
      x[q] = _mm512_load_ps(vals + 16 * q);
      y[q] = _mm512_mul_ps(_mm512_and_ps(x[q], abs_mask), inv);
    }
    const __m512i c = m_enc.codes(y, transpose);
    // sign bit for x < 0 unless the code is 0 (a -0.0 has code 0; no NaN here: the scale would be NaN); the codes
    // are <= 127, so adding 0x80 sets the bit
    const __mmask64 neg = sign_mask(x) & _mm512_test_epi8_mask(c, c);
    return _mm512_mask_add_epi8(c, neg, c, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  // The codes of 64 values of sqrt(v) (>= 0).
  OFFLOAD_HOT __m512i v_codes(const float* vals, __m512 inv) const {
    __m512 y[4];
    for (int q = 0; q < 4; ++q) y[q] = _mm512_mul_ps(_mm512_load_ps(vals + 16 * q), inv);
    return v_enc.codes(y, transpose);
  }

  // Codes of one block of `count` values (m, sign-bearing, for kExpAvg; sqrt(v) for kExpAvgSq; a buffer of
  // kInt8Block floats, lanes past count unused) with the given scale, the block's largest magnitude (NaN if it
  // holds a NaN; negated largest finite one if it holds an inf).
  void encode_block(const float* vals, uint8_t* codes, int64_t count, float scale, int which) const {
    if (!encodes_fast(scale)) return encode_special(vals, codes, count, scale, which);
    const __m512 inv = _mm512_set1_ps(inverse(scale));
    for (int64_t i = 0; i < count; i += 64) {
      const __m512i c = which == kExpAvg ? m_codes(vals + i, inv) : v_codes(vals + i, inv);
      _mm512_mask_storeu_epi8(codes + i, lanes64(count - i), c);
    }
  }

  // A block holding an infinity, or whose scale is NaN or subnormal: the scalar kernel's rule, element by element.
  void encode_special(const float* vals, uint8_t* codes, int64_t count, float scale, int which) const {
    const bool inf_block = moment_code::holds_inf(scale);
    const float inv = moment_code::inverse(moment_code::magnitude_scale(scale));
    for (int64_t i = 0; i < count; ++i) codes[i] = moment_code::encode(vals[i], inv, which, inf_block, maps);
  }
};

// Built once; each kernel call keeps a reference (its tables are read from L1 as memory operands).
const Int8Codec& int8_codec() {
  static const Int8Codec codec;
  return codec;
}

// The block scale from the integer max of |x|'s bits: NaN bits exceed +inf's, so a NaN anywhere shows; an
// infinity (+inf's bits) makes it the largest finite magnitude of `vals` (count values), negated (rare: a scan).
inline float scale_from_bits(__m512i max_bits, const float* vals, int64_t count) {
  const uint32_t bits = _mm512_reduce_max_epu32(max_bits);
  if (bits > 0x7f800000u) return NAN;
  if (bits == 0x7f800000u) {
    float finite_max = 0.0f;
    for (int64_t i = 0; i < count; ++i) {
      const float a = std::fabs(vals[i]);
      finite_max = a > finite_max && a != INFINITY ? a : finite_max;
    }
    return moment_code::block_scale(finite_max, false, true);
  }
  float scale;
  std::memcpy(&scale, &bits, 4);
  return scale;
}

// A stored scale the fast decode takes: not NaN, no infinity in the block (the sign bit clear).
OFFLOAD_HOT bool plain_scale(float scale) { return !std::signbit(scale) && !std::isnan(scale); }

// --- the CRCs of what a step writes ------------------------------------------------------------------------------

// The running CRC-32C of each piece a step writes (StepCrc), as raw states (complemented, as the crc32 instruction
// runs them). The kernels feed them with the crc32 instruction, which runs beside the vector work (its own unit: on
// Zen 4 a crc32 and a vector multiply or permute issue together), from the bytes of the group of 16 vectors before
// the one being stepped (in L1). A chain of crc32 is serial (3 cycles a word), and one chain per piece fell behind
// the vector work and stalled it; so each group's piece is cut in 256-byte ranges, one chain each (a p range is 4
// vectors' bytes), fed in turn so each chain gets a word every ~2 cycles of vector work, and joined when the group
// is done by carry-less shifts (crc32c_xpow).
struct StepCrcs {
  uint64_t s[kCrcCount];
  uint64_t shift[4];  // keys of x^(8 d) for d = 0 (unused), 256, 512, 768 bytes
  explicit StepCrcs(const uint32_t* crcs) {
    for (int k = 0; k < kCrcCount; ++k) s[k] = ~crcs[k] & 0xffffffffu;
    static const ShiftKeys keys;
    for (int j = 0; j < 4; ++j) shift[j] = keys.k[j];
  }
  void store(uint32_t* crcs) const {
    for (int k = 0; k < kCrcCount; ++k) crcs[k] = ~static_cast<uint32_t>(s[k]);
  }
  // Continues piece k over n bytes at data (any n: the library's path; for the ends of a range).
  void add(int k, const void* data, int64_t n) {
    if (n > 0) s[k] = ~crc32c(data, static_cast<size_t>(n), ~static_cast<uint32_t>(s[k])) & 0xffffffffu;
  }
  struct ShiftKeys {
    uint64_t k[4];
    ShiftKeys() : k{0, crc32c_xpow(8 * 256 - 33), crc32c_xpow(8 * 512 - 33), crc32c_xpow(8 * 768 - 33)} {}
  };
};

OFFLOAD_HOT uint64_t load64(const void* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// A raw CRC state after 256 * j more zero bytes (j = 1..3).
OFFLOAD_HOT uint64_t crc_shift(uint64_t state, uint64_t key) {
  const __m128i product = _mm_clmulepi64_si128(_mm_cvtsi64_si128(static_cast<int64_t>(state)),
                                               _mm_cvtsi64_si128(static_cast<int64_t>(key)), 0x00);
  return _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(product)));
}

// One piece of a group of 16 vectors: kBytes per vector (a multiple of 16), 16 * kBytes in all, as kChains = kBytes / 16
// ranges of 256 bytes. Chain 0 continues the piece's state; the others start from 0.
template <int kBytes>
struct PieceChains {
  static constexpr int kChains = kBytes / 16;
  static_assert(kBytes % 16 == 0 && kChains >= 1 && kChains <= 4, "256-byte ranges, at most 4");
  uint64_t c[kChains];
  OFFLOAD_HOT void start(uint64_t state) {
    c[0] = state;
    for (int j = 1; j < kChains; ++j) c[j] = 0;
  }
  // Vector q's bytes (kBytes at group + q * kBytes) go to chain q % kChains, at (q / kChains) * kBytes of its range.
  OFFLOAD_HOT void feed(const uint8_t* group, int q) {
    const int j = q % kChains;
    const uint8_t* at = group + 256 * j + (q / kChains) * kBytes;
#pragma GCC unroll 8
    for (int w = 0; w < kBytes / 8; ++w) c[j] = _mm_crc32_u64(c[j], load64(at + 8 * w));
  }
  OFFLOAD_HOT uint64_t finish(const uint64_t* shift) const {
    uint64_t state = c[kChains - 1];
    for (int j = 0; j + 1 < kChains; ++j) state ^= crc_shift(c[j], shift[kChains - 1 - j]);
    return state;
  }
};

// The chains of every piece of one group: p (64 bytes a vector), out (kOutBytes a value; 0: none), both moments
// (kCodeBytes a value).
template <int kOutBytes, int kCodeBytes>
struct GroupCrcs {
  PieceChains<64> p;
  PieceChains<16 * kCodeBytes> m, v;
  PieceChains<kOutBytes ? 16 * kOutBytes : 16> out;
  const uint8_t *gp, *gm, *gv, *gout;  // the group's bytes of each piece
  OFFLOAD_HOT void start(const StepCrcs& crc, const MomentBuffers& b, int64_t first) {
    gp = reinterpret_cast<const uint8_t*>(b.p + first);
    gm = static_cast<const uint8_t*>(b.m) + kCodeBytes * first;
    gv = static_cast<const uint8_t*>(b.v) + kCodeBytes * first;
    p.start(crc.s[kCrcParam]);
    m.start(crc.s[kCrcExpAvg]);
    v.start(crc.s[kCrcExpAvgSq]);
    if constexpr (kOutBytes > 0) {
      gout = static_cast<const uint8_t*>(b.out) + kOutBytes * first;
      out.start(crc.s[kCrcOut]);
    }
  }
  // The chains carry zeros instead (a range's first block: nothing before it; its chains are dropped).
  OFFLOAD_HOT void carry_zeros() {
    alignas(64) static const uint8_t zeros[64 * kLanes] = {};  // the largest piece of a group: p
    gp = gm = gv = gout = zeros;
  }
  OFFLOAD_HOT void feed(int q) {
    p.feed(gp, q);
    m.feed(gm, q);
    v.feed(gv, q);
    if constexpr (kOutBytes > 0) out.feed(gout, q);
  }
  OFFLOAD_HOT void finish(StepCrcs& crc) const {
    crc.s[kCrcParam] = p.finish(crc.shift);
    crc.s[kCrcExpAvg] = m.finish(crc.shift);
    crc.s[kCrcExpAvgSq] = v.finish(crc.shift);
    if constexpr (kOutBytes > 0) crc.s[kCrcOut] = out.finish(crc.shift);
  }
};

// Bytes of one out value of a step (0: no out).
template <DType O, bool kHasOut>
constexpr int out_bytes() {
  return !kHasOut ? 0 : O == DType::kFloat32 ? 4 : 2;
}

// The pieces of elements [begin, end) from memory (the ends of a range, that no later vector carried).
inline void crc_range(StepCrcs& crc, const MomentBuffers& b, int out_size, int code_size, int64_t begin, int64_t end) {
  const int64_t n = end - begin;
  crc.add(kCrcParam, b.p + begin, 4 * n);
  if (out_size > 0) crc.add(kCrcOut, static_cast<const uint8_t*>(b.out) + out_size * begin, out_size * n);
  crc.add(kCrcExpAvg, static_cast<const uint8_t*>(b.m) + code_size * begin, code_size * n);
  crc.add(kCrcExpAvgSq, static_cast<const uint8_t*>(b.v) + code_size * begin, code_size * n);
}

// --- the step --------------------------------------------------------------------------------------------------

// The operands of one call, in locals (the compiler reloads a struct's pointers after every store through them).
struct Operands {
  float* p;
  const void* g;
  void* out;
  explicit Operands(const MomentBuffers& b) : p(b.p), g(b.g), out(b.out) {}
};

// adam_kernels.h's maths on decoded m and sqrt(v) of 16 lanes (k), storing p (and out); m and s become the new
// m and sqrt(v). v = s * s as the scalar kernel decodes it.
template <DType G, DType O, bool kHasOut>
OFFLOAD_HOT void adam16(const Operands& o, const Constants512& c, int64_t i, __mmask16 k, __m512& m, __m512& s) {
  __m512 v = _mm512_mul_ps(s, s);
  const __m512 p = adam_math16(c, load16<G>(o.g, i, k), _mm512_maskz_loadu_ps(k, o.p + i), m, v, s);
  _mm512_mask_storeu_ps(o.p + i, k, p);
  if constexpr (kHasOut) store_out<O>(o.out, i, p, k);
}

// 16 elements from i (k: those in the range) of a bf16-moment step.
template <DType G, DType O, bool kHasOut>
OFFLOAD_HOT void bf16_vector(const Operands& o, uint16_t* m16, uint16_t* v16, const Constants512& c, int64_t i,
                             __mmask16 k) {
  __m512 m = load16<DType::kBFloat16>(m16, i, k), v = load16<DType::kBFloat16>(v16, i, k), s;
  const __m512 p = adam_math16(c, load16<G>(o.g, i, k), _mm512_maskz_loadu_ps(k, o.p + i), m, v, s);
  _mm512_mask_storeu_ps(o.p + i, k, p);
  if constexpr (kHasOut) store_out<O>(o.out, i, p, k);
  _mm256_mask_storeu_epi16(m16 + i, k, to_bf16_fast(m));
  _mm256_mask_storeu_epi16(v16 + i, k, to_bf16_fast(v));
}

template <DType G, DType O, bool kHasOut>
void step_bf16(const MomentBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end) {
  const Constants512 c(constants);
  const Operands o(b);
  uint16_t* m16 = static_cast<uint16_t*>(b.m);
  uint16_t* v16 = static_cast<uint16_t*>(b.v);
  int64_t i = begin;
  for (; i + 16 * kLanes <= end; i += 16 * kLanes) {
    for (int q = 0; q < 16; ++q) bf16_vector<G, O, kHasOut>(o, m16, v16, c, i + kLanes * q, 0xffff);
  }
  for (; i < end; i += kLanes) bf16_vector<G, O, kHasOut>(o, m16, v16, c, i, lanes(end - i));
}

// --- the bf16 step's CRCs: carry-less folding from registers ------------------------------------------------------

// The keys of crc32c.cpp's folding (its FoldKey): a 128-bit lane moved D bytes later is multiplied by x^(8D+31) (low
// qword) and x^(8D-33) (high qword), modulo the polynomial.
struct FoldKeys {
  __m512i k64, last;  // 64 bytes on; lanes 0-2 moved 48, 32, 16 bytes onto lane 3
  FoldKeys() {
    auto key = [](int d, int half) { return static_cast<int64_t>(crc32c_xpow(half ? 8 * d - 33 : 8 * d + 31)); };
    k64 = _mm512_set_epi64(key(64, 1), key(64, 0), key(64, 1), key(64, 0), key(64, 1), key(64, 0), key(64, 1), key(64, 0));
    last = _mm512_set_epi64(0, 0, key(16, 1), key(16, 0), key(32, 1), key(32, 0), key(48, 1), key(48, 0));
  }
};

const FoldKeys& fold_keys() {
  static const FoldKeys keys;
  return keys;
}

OFFLOAD_HOT __m512i fold512(__m512i z, __m512i k, __m512i block) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z, k, 0x00), _mm512_clmulepi64_epi128(z, k, 0x11), block,
                                   0x96);  // a ^ b ^ c
}

// One piece's CRC as a folding accumulator fed 64 bytes at a time from registers: crc32c.cpp's fold512_update with one
// register, whose chain (a multiply and a ternary XOR, ~7 cycles) keeps up with the bf16 step (22 cycles a vector).
struct Fold {
  __m512i z;
  OFFLOAD_HOT void start(uint64_t state, __m512i first) {
    z = _mm512_xor_si512(first, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(state))));
  }
  OFFLOAD_HOT void feed(__m512i block, __m512i k64) { z = fold512(z, k64, block); }
  // The raw CRC state of everything fed.
  uint64_t finish(const FoldKeys& keys) const {
    const __m512i moved = fold512(z, keys.last, _mm512_setzero_si512());
    __m128i x = _mm_xor_si128(_mm512_maskz_extracti32x4_epi32(0xF, moved, 0), _mm512_maskz_extracti32x4_epi32(0xF, moved, 1));
    x = _mm_xor_si128(x, _mm_xor_si128(_mm512_maskz_extracti32x4_epi32(0xF, moved, 2),
                                       _mm512_maskz_extracti32x4_epi32(0xF, z, 3)));
    const uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
    return _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  }
};

OFFLOAD_HOT __m512i concat(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// A full vector of the bf16 step (bf16_vector) that also hands back what it stored: p, m and v (bf16), out (its
// dtype's bytes: a zmm of fp32, or the low half of one).
template <DType G, DType O, bool kHasOut>
OFFLOAD_HOT void bf16_vector_out(const Operands& o, uint16_t* m16, uint16_t* v16, const Constants512& c, int64_t i,
                                 __m512i& pv, __m256i& mb, __m256i& vb, __m512i& ov) {
  constexpr __mmask16 k = 0xffff;
  __m512 m = load16<DType::kBFloat16>(m16, i, k), v = load16<DType::kBFloat16>(v16, i, k), s;
  const __m512 p = adam_math16(c, load16<G>(o.g, i, k), _mm512_loadu_ps(o.p + i), m, v, s);
  _mm512_storeu_ps(o.p + i, p);
  pv = _mm512_castps_si512(p);
  if constexpr (kHasOut) {
    if constexpr (O == DType::kFloat32) {
      _mm512_storeu_ps(static_cast<float*>(o.out) + i, p);
      ov = pv;
    } else {
      const __m256i h = O == DType::kBFloat16 ? to_bf16_fast(p) : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o.out) + i), h);
      ov = _mm512_castsi256_si512(h);
    }
  }
  mb = to_bf16_fast(m);
  vb = to_bf16_fast(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(m16 + i), mb);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(v16 + i), vb);
}

// The bf16 step with its CRCs: each pair of vectors' results are folded into one accumulator per piece from the
// registers that stored them (the clmul unit and spare vector slots work beside the divider, the bf16 step's bound);
// the tail (under 32 elements) is read back. One Zen 4 core, data in L2: 0.63 -> 0.60 ns a parameter (the step
// without CRCs 0.45: the step is bound by the divider and by how many vectors its window holds, and the folds, like
// crc32 chains, take room in it).
template <DType G, DType O, bool kHasOut>
void step_bf16_crc(const MomentBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end, StepCrcs* crc) {
  const Constants512 c(constants);
  const Operands o(b);
  uint16_t* m16 = static_cast<uint16_t*>(b.m);
  uint16_t* v16 = static_cast<uint16_t*>(b.v);
  constexpr int kOut = out_bytes<O, kHasOut>();
  constexpr int64_t kPair = 2 * kLanes;
  int64_t i = begin;
  if (i + kPair <= end) {
    const FoldKeys& keys = fold_keys();
    const __m512i k64 = keys.k64;
    Fold fp, fm, fv, fo;
    __m512i p0, p1, o0, o1;
    __m256i m0, m1, v0, v1;
    bf16_vector_out<G, O, kHasOut>(o, m16, v16, c, i, p0, m0, v0, o0);
    bf16_vector_out<G, O, kHasOut>(o, m16, v16, c, i + kLanes, p1, m1, v1, o1);
    fp.start(crc->s[kCrcParam], p0);
    fp.feed(p1, k64);
    fm.start(crc->s[kCrcExpAvg], concat(m0, m1));
    fv.start(crc->s[kCrcExpAvgSq], concat(v0, v1));
    if constexpr (kOut == 4) {
      fo.start(crc->s[kCrcOut], o0);
      fo.feed(o1, k64);
    } else if constexpr (kOut == 2) {
      fo.start(crc->s[kCrcOut], concat(_mm512_castsi512_si256(o0), _mm512_castsi512_si256(o1)));
    }
#pragma GCC unroll 4
    for (i += kPair; i + kPair <= end; i += kPair) {
      bf16_vector_out<G, O, kHasOut>(o, m16, v16, c, i, p0, m0, v0, o0);
      bf16_vector_out<G, O, kHasOut>(o, m16, v16, c, i + kLanes, p1, m1, v1, o1);
      fp.feed(p0, k64);
      fp.feed(p1, k64);
      fm.feed(concat(m0, m1), k64);
      fv.feed(concat(v0, v1), k64);
      if constexpr (kOut == 4) {
        fo.feed(o0, k64);
        fo.feed(o1, k64);
      } else if constexpr (kOut == 2) {
        fo.feed(concat(_mm512_castsi512_si256(o0), _mm512_castsi512_si256(o1)), k64);
      }
    }
    crc->s[kCrcParam] = fp.finish(keys);
    crc->s[kCrcExpAvg] = fm.finish(keys);
    crc->s[kCrcExpAvgSq] = fv.finish(keys);
    if constexpr (kOut > 0) crc->s[kCrcOut] = fo.finish(keys);
  }
  const int64_t tail = i;
  for (; i < end; i += kLanes) bf16_vector<G, O, kHasOut>(o, m16, v16, c, i, lanes(end - i));
  crc_range(*crc, b, kOut, 2, tail, end);
}

// Decodes the block [start, stop) element by element (a block with a NaN or infinite scale: rare) into m and s.
inline void decode_block_scalar(const MomentBuffers& b, int64_t start, int64_t stop, float* m, float* s) {
  const MomentMaps& maps = moment_maps();
  const uint8_t* mc = static_cast<const uint8_t*>(b.m);
  const uint8_t* vc = static_cast<const uint8_t*>(b.v);
  const int64_t blk = start / kInt8Block;
  for (int64_t i = start; i < stop; ++i) {
    m[i - start] = moment_code::decode(mc[i], b.m_scales[blk], kExpAvg, maps);
    s[i - start] = moment_code::decode(vc[i], b.v_scales[blk], kExpAvgSq, maps);
  }
  for (int64_t i = stop - start; i < kInt8Block; ++i) m[i] = s[i] = 0.0f;
}

// The new m and sqrt(v) of one int8 block before they are encoded, and its new scales.
struct NewBlock {
  alignas(64) float m[kInt8Block];
  alignas(64) float s[kInt8Block];
  float m_scale, s_scale;
  bool fast;  // both scales take the vector encoder
};

// The block's new scales into the CRCs of the scales pieces.
OFFLOAD_HOT void int8_scale_crcs(const NewBlock& nb, StepCrcs* crc) {
  uint32_t m_bits, s_bits;
  std::memcpy(&m_bits, &nb.m_scale, 4);
  std::memcpy(&s_bits, &nb.s_scale, 4);
  crc->s[kCrcExpAvgScales] = _mm_crc32_u32(static_cast<uint32_t>(crc->s[kCrcExpAvgScales]), m_bits);
  crc->s[kCrcExpAvgSqScales] = _mm_crc32_u32(static_cast<uint32_t>(crc->s[kCrcExpAvgSqScales]), s_bits);
}

// The first sweep over an int8 block [start, start + count) (count = kInt8Block when kFull): decode m and sqrt(v)
// 64 at a time and run the Adam maths on them, into `nb` with the running maxima of their magnitudes; then the
// block's new scales (stored: its old ones are read) and their CRCs.
// A full block's vectors also carry the bytes of the same 16 elements of the block before (`start - kInt8Block`,
// whose codes are written) into *crc when `crc` is non-null; the first block of a range (`first`) has none before
// it: its chains carry zeros and are dropped. A partial block (the range's last; once per call) leaves its bytes to
// crc_range and is not unrolled: its code would cost compile time and nothing measurable at run time.
template <DType G, DType O, bool kHasOut, bool kFull>
OFFLOAD_HOT void int8_update(const MomentBuffers& b, const Operands& o, const Constants512& c, const Int8Codec& codec,
                             int64_t start, int64_t count, NewBlock& nb, StepCrcs* crc, bool first) {
  const uint8_t* mc = static_cast<const uint8_t*>(b.m);
  const uint8_t* vc = static_cast<const uint8_t*>(b.v);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const int64_t blk = start / kInt8Block;
  const float m_stored = b.m_scales[blk], v_stored = b.v_scales[blk];
  const bool plain = plain_scale(m_stored) && plain_scale(v_stored);
  if (!plain) decode_block_scalar(b, start, start + count, nb.m, nb.s);
  const __m512 m_scale = _mm512_set1_ps(m_stored), v_scale = _mm512_set1_ps(v_stored);
  auto decode64 = [&](int64_t at, __mmask64 k) __attribute__((always_inline)) {
    __m512 m[4], s[4];
    codec.decode_m(mc + start + at, k, m_scale, m);
    codec.decode_sqrt_v(vc + start + at, k, v_scale, s);
    for (int q = 0; q < 4; ++q) {
      _mm512_store_ps(nb.m + at + 16 * q, m[q]);
      _mm512_store_ps(nb.s + at + 16 * q, s[q]);
    }
  };
  if (__builtin_expect(plain, 1)) {  // decode first: the map tables and the Adam constants do not share registers
    if constexpr (kFull) {
#pragma GCC unroll 4
      for (int64_t at = 0; at < kInt8Block; at += 64) decode64(at, ~__mmask64{0});
    } else {
      for (int64_t at = 0; at < count; at += 64) decode64(at, lanes64(count - at));
    }
  }
  __m512i m_max = _mm512_setzero_si512(), s_max = _mm512_setzero_si512();
  auto update16 = [&](int64_t at, __mmask16 k) __attribute__((always_inline)) {
    __m512 m = _mm512_load_ps(nb.m + at), s = _mm512_load_ps(nb.s + at);
    adam16<G, O, kHasOut>(o, c, start + at, k, m, s);
    _mm512_store_ps(nb.m + at, m);
    _mm512_store_ps(nb.s + at, s);
    // masked: past the block's end the values are not the block's
    m_max = _mm512_mask_max_epu32(m_max, k, m_max, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
    s_max = _mm512_mask_max_epu32(s_max, k, s_max, _mm512_and_si512(_mm512_castps_si512(s), abs_mask));
  };
  if constexpr (kFull) {
    GroupCrcs<out_bytes<O, kHasOut>(), 1> g;
    if (crc) {
      g.start(*crc, b, start - kInt8Block);
      if (first) g.carry_zeros();
    }
#pragma GCC unroll 16
    for (int64_t at = 0; at < kInt8Block; at += kLanes) {
      update16(at, static_cast<__mmask16>(0xffff));
      if (crc) g.feed(static_cast<int>(at / kLanes));
    }
    if (crc && !first) g.finish(*crc);
  } else {
    for (int64_t at = 0; at < count; at += kLanes) update16(at, lanes(count - at));
  }
  nb.m_scale = scale_from_bits(m_max, nb.m, count);
  nb.s_scale = scale_from_bits(s_max, nb.s, count);
  nb.fast = Int8Codec::encodes_fast(nb.m_scale) && Int8Codec::encodes_fast(nb.s_scale);
  b.m_scales[blk] = nb.m_scale;
  b.v_scales[blk] = nb.s_scale;
  if (crc) int8_scale_crcs(nb, crc);
}

// The second sweep: the codes of the block computed into `nb`, 64 at a time.
template <bool kFull>
OFFLOAD_HOT void int8_encode(const MomentBuffers& b, const Int8Codec& codec, const NewBlock& nb, int64_t start,
                             int64_t count) {
  uint8_t* mc = static_cast<uint8_t*>(b.m) + start;
  uint8_t* vc = static_cast<uint8_t*>(b.v) + start;
  if (!nb.fast) {
    codec.encode_block(nb.m, mc, count, nb.m_scale, kExpAvg);
    codec.encode_block(nb.s, vc, count, nb.s_scale, kExpAvgSq);
    return;
  }
  const __m512 m_inv = _mm512_set1_ps(Int8Codec::inverse(nb.m_scale));
  const __m512 s_inv = _mm512_set1_ps(Int8Codec::inverse(nb.s_scale));
  auto encode64 = [&](int64_t at, __mmask64 k) __attribute__((always_inline)) {
    _mm512_mask_storeu_epi8(mc + at, k, codec.m_codes(nb.m + at, m_inv));
    _mm512_mask_storeu_epi8(vc + at, k, codec.v_codes(nb.s + at, s_inv));
  };
  if constexpr (kFull) {
#pragma GCC unroll 4
    for (int64_t at = 0; at < kInt8Block; at += 64) encode64(at, ~__mmask64{0});
  } else {
    for (int64_t at = 0; at < count; at += 64) encode64(at, lanes64(count - at));
  }
}

// Each block in two sweeps (the scale needs the whole block before any code is written). Interleaving the codes of
// block k - 1 with the update of block k, so that the divider (the Adam maths' divisions and square roots) and the
// lookups would work side by side, measured slower (4.3 cycles a parameter against 4.0).
// With CRCs (crc non-null) the update of block k carries block k - 1's bytes into them, and the last full block and
// a partial one are read back at the end. A step without them skips the chains at run time (one copy of the code).
// Before, it fed scratch chains, and GCC 12 allocated the registers of that loop worse for both paths: one Zen 4
// core, data in L2, four buffer layouts, 1.68-1.79 ns a parameter (up to 2.3 in some layouts) -> 1.08-1.12, with
// or without CRCs (the F/BW kernel: 1.45, 1.60 with CRCs).
template <DType G, DType O, bool kHasOut>
void step_int8(const MomentBuffers& b, const AdamConstants& constants, int64_t begin, int64_t end, StepCrcs* crc) {
  const Constants512 c(constants);
  const Operands o(b);
  const Int8Codec& codec = int8_codec();
  NewBlock nb;
  int64_t start = begin;
  for (; start + kInt8Block <= end; start += kInt8Block) {
    int8_update<G, O, kHasOut, true>(b, o, c, codec, start, kInt8Block, nb, crc, start == begin);
    int8_encode<true>(b, codec, nb, start, kInt8Block);
  }
  const int64_t pending = start > begin ? start - kInt8Block : begin;  // the first element not yet in the CRCs
  if (start < end) {
    int8_update<G, O, kHasOut, false>(b, o, c, codec, start, end - start, nb, crc, true);
    int8_encode<false>(b, codec, nb, start, end - start);
  }
  if (crc) crc_range(*crc, b, out_bytes<O, kHasOut>(), 1, pending, end);
}

template <DType G, DType O, bool kHasOut, bool kCrc>
void step_format(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end, StepCrcs* crc) {
  if (b.format == MomentFormat::kBFloat16) {
    if constexpr (kCrc) step_bf16_crc<G, O, kHasOut>(b, c, begin, end, crc);
    else step_bf16<G, O, kHasOut>(b, c, begin, end);
  }
  else step_int8<G, O, kHasOut>(b, c, begin, end, kCrc ? crc : nullptr);
}

// p of [begin, end) into out in out's dtype, rounded as the fused store rounds it; and into out's CRC.
template <DType O>
void cast_out(const MomentBuffers& b, int64_t begin, int64_t end, StepCrcs* crc) {
  for (int64_t i = begin; i < end; i += kLanes) {
    const __mmask16 k = lanes(end - i);
    store_out<O>(b.out, i, _mm512_maskz_loadu_ps(k, b.p + i), k);
  }
  constexpr int kBytes = O == DType::kFloat32 ? 4 : 2;
  if (crc) crc->add(kCrcOut, static_cast<const uint8_t*>(b.out) + kBytes * begin, kBytes * (end - begin));
}

// Only out = none and out dtype = grad dtype are compiled into the step (the engine's gradient home and compute
// weights share the group's compute dtype); any other out dtype is the step without out, then a cast of p (its
// bytes are the same: one rounding of the same p). Each fused (G, O) pair would cost seconds of compile time.
template <DType G, bool kCrc>
void step_out(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end, StepCrcs* crc) {
  if (!b.out) return step_format<G, DType::kFloat32, false, kCrc>(b, c, begin, end, crc);
  if (b.out_dtype == G) return step_format<G, G, true, kCrc>(b, c, begin, end, crc);
  MomentBuffers without_out = b;
  without_out.out = nullptr;
  step_format<G, DType::kFloat32, false, kCrc>(without_out, c, begin, end, crc);
  switch (b.out_dtype) {
    case DType::kBFloat16: return cast_out<DType::kBFloat16>(b, begin, end, crc);
    case DType::kFloat16: return cast_out<DType::kFloat16>(b, begin, end, crc);
    default: return cast_out<DType::kFloat32>(b, begin, end, crc);
  }
}

template <bool kCrc>
void step_grad(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end, StepCrcs* crc) {
  switch (b.g_dtype) {
    case DType::kBFloat16: return step_out<DType::kBFloat16, kCrc>(b, c, begin, end, crc);
    case DType::kFloat16: return step_out<DType::kFloat16, kCrc>(b, c, begin, end, crc);
    default: return step_out<DType::kFloat32, kCrc>(b, c, begin, end, crc);
  }
}

}  // namespace

void moment_step_avx512(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  step_grad<false>(b, c, begin, end, nullptr);
}

void moment_step_crc_avx512(const MomentBuffers& b, const AdamConstants& c, int64_t begin, int64_t end,
                            uint32_t* crcs) {
  StepCrcs crc(crcs);
  step_grad<true>(b, c, begin, end, &crc);
  crc.store(crcs);
}

void moment_encode_avx512(const float* src, void* codes, float* scales, MomentFormat format, int which,
                          int64_t begin, int64_t end) {
  if (format == MomentFormat::kBFloat16) {
    for (int64_t i = begin; i < end; i += kLanes) {
      const __mmask16 k = lanes(end - i);
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(codes) + i, k, to_bf16_fast(_mm512_maskz_loadu_ps(k, src + i)));
    }
    return;
  }
  const Int8Codec& codec = int8_codec();
  alignas(64) float mags[kInt8Block];
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block);
    __m512i max_bits = _mm512_setzero_si512();
    for (int64_t i = start; i < stop; i += kLanes) {
      const __mmask16 k = lanes(stop - i);
      __m512 x = _mm512_maskz_loadu_ps(k, src + i);
      if (which == kExpAvgSq) x = _mm512_sqrt_ps(x);
      _mm512_store_ps(mags + (i - start), x);
      max_bits = _mm512_max_epu32(max_bits, _mm512_and_si512(_mm512_castps_si512(x), abs_mask));
    }
    const float scale = scale_from_bits(max_bits, mags, stop - start);
    codec.encode_block(mags, static_cast<uint8_t*>(codes) + start, stop - start, scale, which);
    scales[start / kInt8Block] = scale;
  }
}

void moment_decode_avx512(const void* codes, const float* scales, MomentFormat format, int which, float* out,
                          int64_t begin, int64_t end) {
  if (format == MomentFormat::kBFloat16) {
    for (int64_t i = begin; i < end; i += kLanes) {
      const __mmask16 k = lanes(end - i);
      _mm512_mask_storeu_ps(out + i, k, load16<DType::kBFloat16>(codes, i, k));
    }
    return;
  }
  const Int8Codec& codec = int8_codec();
  const MomentMaps& maps = moment_maps();
  const uint8_t* c8 = static_cast<const uint8_t*>(codes);
  for (int64_t start = begin; start < end; start += kInt8Block) {
    const int64_t stop = std::min(end, start + kInt8Block);
    const float stored = scales[start / kInt8Block];
    if (!plain_scale(stored)) {  // NaN, or a block holding an infinity: element by element (rare)
      for (int64_t i = start; i < stop; ++i) {
        const float x = moment_code::decode(c8[i], stored, which, maps);
        out[i] = which == kExpAvg ? x : x * x;
      }
      continue;
    }
    const __m512 scale = _mm512_set1_ps(stored);
    for (int64_t i = start; i < stop; i += 64) {
      __m512 x[4];
      if (which == kExpAvg) {
        codec.decode_m(c8 + i, lanes64(stop - i), scale, x);
      } else {
        codec.decode_sqrt_v(c8 + i, lanes64(stop - i), scale, x);
        for (__m512& s : x) s = _mm512_mul_ps(s, s);
      }
      for (int q = 0; q < 4; ++q) _mm512_mask_storeu_ps(out + i + 16 * q, lanes(stop - i - 16 * q), x[q]);
    }
  }
}

}  // namespace offload
#pragma GCC diagnostic pop
#pragma GCC pop_options
