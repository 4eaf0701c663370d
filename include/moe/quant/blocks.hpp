// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GGUF weight blocks: the byte layouts of ggml's Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, IQ4_XS,
/// Q4_1, IQ4_NL, Q4_0, MXFP4, Q3_K and Q2_K (ggml-common.h), and their reference quantizers and
/// dequantizers (ggml-quants.c: quantize_row_*_ref, dequantize_row_*), written here from those
/// definitions. A row of k weights is k / block_elems consecutive blocks, little-endian, as in a
/// GGUF tensor:
///
/// | format | weights a block | bytes | bits a weight | value of weight i                      |
/// |--------|-----------------|-------|---------------|----------------------------------------|
/// | Q8_0   | 32              | 34    | 8.5           | d * qs[i]                              |
/// | Q6_K   | 256 (16 x 16)   | 210   | 6.5625        | d * scales[i / 16] * (q6 - 32)         |
/// | Q5_K   | 256 (8 x 32)    | 176   | 5.5           | d * sc[i / 32] * q5 - dmin * m[i / 32] |
/// | Q5_1   | 32              | 24    | 6             | d * q5 + m                             |
/// | Q5_0   | 32              | 22    | 5.5           | d * (q5 - 16)                          |
/// | Q4_K   | 256 (8 x 32)    | 144   | 4.5           | d * sc[i / 32] * q4 - dmin * m[i / 32] |
/// | IQ4_XS | 256 (8 x 32)    | 136   | 4.25          | d * (ls[i / 32] - 32) * kv[q4]         |
/// | Q4_1   | 32              | 20    | 5             | d * q4 + m                             |
/// | IQ4_NL | 32              | 18    | 4.5           | d * kv[q4]                             |
/// | Q4_0   | 32              | 18    | 4.5           | d * (q4 - 8)                           |
/// | MXFP4  | 32              | 17    | 4.25          | 2^(e - 128) * kmx[q4]                  |
/// | Q3_K   | 256 (16 x 16)   | 110   | 3.4375        | d * (sc[i / 16] - 32) * (q3 - 4)       |
/// | Q2_K   | 256 (16 x 16)   | 84    | 2.625         | d * sc[i / 16] * q2 - dmin * m[i / 16] |
///
/// (d, dmin, m: fp16; sc, m: 6-bit (Q5_K, Q4_K, Q3_K) or 4-bit (Q2_K); q6 in [0, 64), q5 in
/// [0, 32), q4 in [0, 16), q3 in [0, 8), q2 in [0, 4); kv: kIq4nlValues, ls: 6 bits; e: an
/// E8M0 byte, kmx: kMxfp4Values, the E2M1 values doubled, hence 2^(e - 128) for OCP's
/// 2^(e - 127).) The
/// quantizers are ggml's round-to-nearest references, the K-quants with their scale searches,
/// operation for operation and without floating-point contraction (each product is rounded before
/// it is added, as ggml compiled without -ffp-contract=fast does), so the bytes do not depend on
/// the compiler flags. NaN policy: quantize_row refuses a non-finite weight (moe::Error naming its
/// position); dequantize_row decodes any bytes (an fp16 scale may be inf or NaN).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "moe/core/error.hpp"
#include "moe/core/float16.hpp"
#include "moe/core/types.hpp"

namespace moe::quant {

/// A GGUF block format for weights.
enum class Format : std::uint8_t {
  kQ8_0,    ///< 8-bit, 32-blocks, one fp16 scale
  kQ6_K,    ///< 6-bit, 256-super-blocks of 16 sub-blocks with int8 scales
  kQ4_K,    ///< 4-bit, 256-super-blocks of 8 sub-blocks with 6-bit scales and mins
  kQ4_0,    ///< 4-bit, 32-blocks, one fp16 scale, offset 8
  kQ3_K,    ///< 3-bit, 256-super-blocks of 16 sub-blocks with 6-bit scales
  kQ2_K,    ///< 2-bit, 256-super-blocks of 16 sub-blocks with 4-bit scales and mins
  kQ5_K,    ///< 5-bit, 256-super-blocks of 8 sub-blocks with 6-bit scales and mins (Q4_K + a bit)
  kQ5_0,    ///< 5-bit, 32-blocks, one fp16 scale, offset 16 (Q4_0 + a bit)
  kQ4_1,    ///< 4-bit, 32-blocks, an fp16 scale and an fp16 min (added)
  kQ5_1,    ///< 5-bit, 32-blocks, an fp16 scale and an fp16 min (Q4_1 + a bit)
  kIQ4_NL,  ///< 4-bit indices into 16 non-uniform levels (kIq4nlValues), 32-blocks, fp16 scale
  kIQ4_XS,  ///< IQ4_NL's levels in 256-super-blocks of 8 sub-blocks with 6-bit scales
  kMXFP4,   ///< OCP MX FP4: E2M1 codes (kMxfp4Values), 32-blocks, an E8M0 power-of-two scale
};

/// Every format, in order of falling precision.
inline constexpr Format kFormats[] = {
    Format::kQ8_0,  Format::kQ6_K,   Format::kQ5_K, Format::kQ5_1,   Format::kQ5_0,
    Format::kQ4_K,  Format::kIQ4_XS, Format::kQ4_1, Format::kIQ4_NL, Format::kQ4_0,
    Format::kMXFP4, Format::kQ3_K,   Format::kQ2_K};

/// ggml block types, byte for byte (static_asserts below check the sizes).
struct BlockQ8_0 {
  std::uint16_t d;     ///< fp16 scale
  std::int8_t qs[32];  ///< weights
};
struct BlockQ4_0 {
  std::uint16_t d;      ///< fp16 scale
  std::uint8_t qs[16];  ///< weight j in the low nibble of qs[j], weight j + 16 in the high one
};
struct BlockQ4_K {
  std::uint16_t d;          ///< fp16 super-block scale of the sub-block scales
  std::uint16_t dmin;       ///< fp16 super-block scale of the sub-block mins
  std::uint8_t scales[12];  ///< 8 6-bit scales and 8 6-bit mins (get_scale_min below)
  std::uint8_t qs[128];     ///< per 64 weights: 32 bytes, weight l low nibble, l + 32 high
};
struct BlockQ5_K {
  std::uint16_t d;          ///< fp16 super-block scale of the sub-block scales
  std::uint16_t dmin;       ///< fp16 super-block scale of the sub-block mins
  std::uint8_t scales[12];  ///< 8 6-bit scales and 8 6-bit mins (get_scale_min), as Q4_K's
  std::uint8_t qh[32];      ///< 5th bits: bit 2c (+ 1) of qh[l] for weight 64 c + l (+ 32)
  std::uint8_t qs[128];     ///< low 4 bits, as Q4_K's: per 64 weights 32 bytes, l low, l + 32 high
};
struct BlockQ6_K {
  std::uint8_t ql[128];    ///< low 4 bits
  std::uint8_t qh[64];     ///< high 2 bits
  std::int8_t scales[16];  ///< int8 scale per 16 weights
  std::uint16_t d;         ///< fp16 super-block scale
};
struct BlockQ3_K {
  std::uint8_t hmask[32];   ///< high bit of each level (bit j of byte l: weight 32 j + l)
  std::uint8_t qs[64];      ///< low 2 bits, 4 per byte (see q3k_level)
  std::uint8_t scales[12];  ///< 16 6-bit scales, stored + 32 (see q3k_scale)
  std::uint16_t d;          ///< fp16 super-block scale
};
struct BlockQ2_K {
  std::uint8_t scales[16];  ///< per 16 weights: scale (low nibble) and min (high nibble)
  std::uint8_t qs[64];      ///< 2-bit levels, 4 per byte (see q2k_level)
  std::uint16_t d;          ///< fp16 scale of the scales
  std::uint16_t dmin;       ///< fp16 scale of the mins
};
struct BlockQ4_1 {
  std::uint16_t d;      ///< fp16 scale
  std::uint16_t m;      ///< fp16 min (added)
  std::uint8_t qs[16];  ///< weight j in the low nibble of qs[j], weight j + 16 in the high one
};
struct BlockQ5_0 {
  std::uint16_t d;      ///< fp16 scale
  std::uint8_t qh[4];   ///< 5th bits, a little-endian uint32: bit j for weight j
  std::uint8_t qs[16];  ///< low 4 bits, as Q4_0
};
struct BlockQ5_1 {
  std::uint16_t d;      ///< fp16 scale
  std::uint16_t m;      ///< fp16 min (added)
  std::uint8_t qh[4];   ///< 5th bits, a little-endian uint32: bit j for weight j
  std::uint8_t qs[16];  ///< low 4 bits, as Q4_0
};
struct BlockIQ4_NL {
  std::uint16_t d;      ///< fp16 scale
  std::uint8_t qs[16];  ///< indices into kIq4nlValues, as Q4_0's nibbles
};
struct BlockIQ4_XS {
  std::uint16_t d;           ///< fp16 super-block scale
  std::uint16_t scales_h;    ///< bits 2 ib + 1 .. 2 ib: high 2 bits of 32-block ib's scale
  std::uint8_t scales_l[4];  ///< low 4 bits: block ib in nibble ib % 2 of scales_l[ib / 2]
  std::uint8_t qs[128];      ///< per 32 weights 16 bytes of indices, as Q4_0's nibbles
};
struct BlockMXFP4 {
  std::uint8_t e;       ///< E8M0 shared exponent
  std::uint8_t qs[16];  ///< E2M1 codes (kMxfp4Values), as Q4_0's nibbles
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ3_K) == 110 && sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136);
static_assert(sizeof(BlockMXFP4) == 17);

/// ggml's kvalues_iq4nl: the 16 levels of IQ4_NL and IQ4_XS.
inline constexpr std::int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                 1,    13,   25,  38,  53,  69,  89,  113};
/// ggml's kvalues_mxfp4 (kvalues_fp4): the E2M1 values doubled, codes 8..15 the negatives
/// (code 8, -0, decodes as +0).
inline constexpr std::int8_t kMxfp4Values[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                                 0, -1, -2, -3, -4, -6, -8, -12};

/// Weights per block.
constexpr Index block_elems(Format f) {
  return f == Format::kQ6_K || f == Format::kQ5_K || f == Format::kQ4_K || f == Format::kQ3_K ||
                 f == Format::kQ2_K || f == Format::kIQ4_XS
             ? 256
             : 32;
}
/// Bytes per block.
constexpr Index block_bytes(Format f) {
  switch (f) {
    case Format::kQ8_0:
      return 34;
    case Format::kQ6_K:
      return 210;
    case Format::kQ4_K:
      return 144;
    case Format::kQ4_0:
      return 18;
    case Format::kQ3_K:
      return 110;
    case Format::kQ2_K:
      return 84;
    case Format::kQ5_K:
      return 176;
    case Format::kQ5_0:
      return 22;
    case Format::kQ4_1:
      return 20;
    case Format::kQ5_1:
      return 24;
    case Format::kIQ4_NL:
      return 18;
    case Format::kIQ4_XS:
      return 136;
    case Format::kMXFP4:
      return 17;
  }
  return 0;
}
/// Bits per weight, scales included.
constexpr double bits_per_weight(Format f) {
  return 8.0 * static_cast<double>(block_bytes(f)) / static_cast<double>(block_elems(f));
}
/// Bytes of a row of k weights (k a multiple of block_elems(f)).
constexpr Index row_bytes(Format f, Index k) { return k / block_elems(f) * block_bytes(f); }

/// The lower-case ggml name: "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "iq4_xs", "q4_1",
/// "iq4_nl", "q4_0", "mxfp4", "q3_k", "q2_k".
constexpr char const* name(Format f) {
  switch (f) {
    case Format::kQ8_0:
      return "q8_0";
    case Format::kQ6_K:
      return "q6_k";
    case Format::kQ4_K:
      return "q4_k";
    case Format::kQ4_0:
      return "q4_0";
    case Format::kQ3_K:
      return "q3_k";
    case Format::kQ2_K:
      return "q2_k";
    case Format::kQ5_K:
      return "q5_k";
    case Format::kQ5_0:
      return "q5_0";
    case Format::kQ4_1:
      return "q4_1";
    case Format::kQ5_1:
      return "q5_1";
    case Format::kIQ4_NL:
      return "iq4_nl";
    case Format::kIQ4_XS:
      return "iq4_xs";
    case Format::kMXFP4:
      return "mxfp4";
  }
  return "?";
}

/// The format named `s` (case-insensitive: "q8_0", "Q4_K", ...); moe::Error for any other.
inline Format parse_format(std::string_view s) {
  std::string lower(s);
  for (char& c : lower) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  for (Format f : kFormats) {
    if (lower == name(f)) return f;
  }
  detail::fail("quant::parse_format: unknown weight format '", s,
               "'; use one of q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, iq4_xs, q4_1, iq4_nl, q4_0, "
               "mxfp4, q3_k, q2_k");
}

namespace detail {

/// a * b rounded to float and kept from being fused into a following add (an empty asm that
/// takes the product as an input and output), so the arithmetic is the same with or without
/// -ffp-contract=fast and FMA in the target flags.
inline float mul(float a, float b) {
  float p = a * b;
#if defined(__GNUC__) || defined(__clang__)
  __asm__("" : "+g"(p));
#endif
  return p;
}

/// ggml's nearest_int: round to nearest, ties to even, for |v| <= 4194303.
inline int nearest_int(float v) {
  float const s = v + 12582912.f;
  std::int32_t i;
  std::memcpy(&i, &s, sizeof i);
  return (i & 0x007fffff) - 0x00400000;
}

inline std::uint16_t fp16(float v) { return moe::float_to_f16(v); }

/// ggml's `d ? 1.0f/d : 0.0f`, and 0 too where 1/d overflows (a block of subnormal weights, whose
/// fp16 scale is 0 anyway): levels stay finite, never an undefined float-to-int conversion.
inline float inverse(float d) {
  float const id = d != 0.0f ? 1.0f / d : 0.0f;
  return std::isfinite(id) ? id : 0.0f;
}
inline float fp32(std::uint16_t h) { return moe::f16_to_float(h); }

/// ggml_e8m0_to_fp32_half: 2^(e - 128) as a float (e = 0, 1: the subnormals 2^-128, 2^-127;
/// e = 255 gives 2^127, no NaN, as ggml's).
inline float e8m0_to_fp32_half(std::uint8_t e) {
  std::uint32_t const bits = e < 2 ? 0x00200000u << e : static_cast<std::uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr float kGroupMaxEps = 1e-15f;

/// The first of the values of largest magnitude (0 for none): ggml's amax / max scan.
inline float signed_absmax(float const* x, int n) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  return max;
}

/// ggml's MIN(hi, (int8_t)(v)) for the level of a legacy quantizer: v truncated towards zero and
/// clamped to [0, hi]. In ggml's defined cases v > -1 (x >= min, or |x / d| <= 16); a NaN
/// (only from an infinite inverse scale, which moe avoids with detail::inverse) gives 0 here.
inline int trunc_level(float v, int hi) {
  if (!(v > -1.0f)) return 0;
  return v >= static_cast<float>(hi) ? hi : static_cast<int>(v);
}

/// The 32-bit little-endian value of 4 bytes.
inline std::uint32_t load_le32(std::uint8_t const* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
inline void store_le32(std::uint32_t v, std::uint8_t* p) {
  for (int b = 0; b < 4; ++b) p[b] = static_cast<std::uint8_t>(v >> (8 * b));
}

/// ggml best_index_int8: the index of the nearest of n ascending values (the upper on a tie
/// only if it is strictly nearer, as ggml's comparison).
inline int best_index_int8(int n, std::int8_t const* val, float x) {
  if (x <= static_cast<float>(val[0])) return 0;
  if (x >= static_cast<float>(val[n - 1])) return n - 1;
  int ml = 0, mu = n - 1;
  while (mu - ml > 1) {
    int const mav = (ml + mu) / 2;
    if (x < static_cast<float>(val[mav])) {
      mu = mav;
    } else {
      ml = mav;
    }
  }
  return x - static_cast<float>(val[mu - 1]) < static_cast<float>(val[mu]) - x ? mu - 1 : mu;
}

/// ggml quantize_row_iq4_nl_impl without importance weights (weight = x^2) for one super-block
/// of `super` weights in 32-blocks, with kIq4nlValues: per 32-block the best scale of 2 ntry + 1
/// candidates (none for ntry < 0), then for super > 32 6-bit block scales under dh. L holds the
/// levels across calls: a block of |x| < 1e-15 keeps the levels L had (ggml's too; its first
/// block's are uninitialized, moe's caller starts L at zero).
inline void quantize_iq4_impl(int super, float const* x, std::uint16_t* dh, std::uint8_t* q4,
                              std::uint16_t* scales_h, std::uint8_t* scales_l, float* scales,
                              std::uint8_t* L, int ntry) {
  constexpr std::int8_t const* values = kIq4nlValues;
  float const v0 = static_cast<float>(values[0]);
  float weight[32];
  std::memset(q4, 0, static_cast<std::size_t>(super / 2));
  *dh = fp16(0.f);
  float max_scale = 0, amax_scale = 0;
  int const nblocks = super / 32;
  for (int ib = 0; ib < nblocks; ++ib) {
    float const* xb = x + 32 * ib;
    std::uint8_t* Lb = L + 32 * ib;
    for (int j = 0; j < 32; ++j) weight[j] = mul(xb[j], xb[j]);
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
      float const ax = std::fabs(xb[j]);
      if (ax > amax) {
        amax = ax;
        max = xb[j];
      }
    }
    if (amax < kGroupMaxEps) {
      scales[ib] = 0;
      continue;
    }
    float d = ntry > 0 ? -max / v0 : max / v0;
    float id = 1 / d;
    float sumqx = 0, sumq2 = 0;
    for (int j = 0; j < 32; ++j) {
      int const l = best_index_int8(16, values, mul(id, xb[j]));
      Lb[j] = static_cast<std::uint8_t>(l);
      float const q = static_cast<float>(values[l]), w = weight[j];
      sumqx += mul(mul(w, q), xb[j]);
      sumq2 += mul(mul(w, q), q);
    }
    d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
    float best = mul(d, sumqx);
    for (int itry = -ntry; itry <= ntry; ++itry) {
      id = static_cast<float>(itry + values[0]) / max;
      sumqx = sumq2 = 0;
      for (int j = 0; j < 32; ++j) {
        int const l = best_index_int8(16, values, mul(id, xb[j]));
        float const q = static_cast<float>(values[l]), w = weight[j];
        sumqx += mul(mul(w, q), xb[j]);
        sumq2 += mul(mul(w, q), q);
      }
      if (sumq2 > 0 && mul(sumqx, sumqx) > mul(best, sumq2)) {
        d = sumqx / sumq2;
        best = mul(d, sumqx);
      }
    }
    scales[ib] = d;
    if (std::fabs(d) > amax_scale) {
      amax_scale = std::fabs(d);
      max_scale = d;
    }
  }
  if (nblocks > 1) {
    *scales_h = 0;
    float const d = -max_scale / 32;  // -0.0 for an all-zero super-block, as ggml
    *dh = fp16(d);
    float const id = d != 0.0f ? 1 / d : 0.f;
    for (int ib = 0; ib < nblocks; ++ib) {
      int l = nearest_int(mul(id, scales[ib]));
      l = l < -32 ? -32 : (l > 31 ? 31 : l);
      float const dl = mul(d, static_cast<float>(l));
      float const idl = dl != 0.0f ? 1 / dl : 0.f;
      std::uint8_t* Lb = L + 32 * ib;
      float const* xb = x + 32 * ib;
      for (int j = 0; j < 32; ++j) {
        Lb[j] = static_cast<std::uint8_t>(best_index_int8(16, values, mul(idl, xb[j])));
      }
      l += 32;
      auto const l_l = static_cast<std::uint8_t>(l & 0xF);
      auto const l_h = static_cast<std::uint16_t>(l >> 4);
      scales_l[ib / 2] =
          ib % 2 == 0 ? l_l : static_cast<std::uint8_t>(scales_l[ib / 2] | (l_l << 4));
      *scales_h = static_cast<std::uint16_t>(*scales_h | (l_h << (2 * (ib % 8))));
    }
  } else {
    *dh = fp16(scales[0]);
    if (ntry > 0) {
      float const id = scales[0] != 0.0f ? 1 / scales[0] : 0.f;
      for (int j = 0; j < super; ++j) {
        L[j] = static_cast<std::uint8_t>(best_index_int8(16, values, mul(id, x[j])));
      }
    }
  }
  for (int i = 0; i < super / 32; ++i) {
    for (int j = 0; j < 16; ++j) {
      q4[16 * i + j] = static_cast<std::uint8_t>(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
    }
  }
}

/// The smallest and the largest of a 32-block's weights (ggml's loop for Q4_1 and Q5_1).
struct MinMax {
  float min, max;
};
inline MinMax block_min_max(float const* x) {
  MinMax r{std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()};
  for (int j = 0; j < 32; ++j) {
    if (x[j] < r.min) r.min = x[j];
    if (x[j] > r.max) r.max = x[j];
  }
  return r;
}

/// ggml make_qx_quants with rmse_type 1 and no importance weights: symmetric levels
/// L in [0, 2 nmax) for x with the best of 19 candidate scales (weighted by x^2).
inline float make_qx_quants(int n, int nmax, float const* x, std::int8_t* L) {
  float const max = signed_absmax(x, n);
  if (std::fabs(max) < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  auto clamp_l = [nmax](int l) { return l < -nmax ? -nmax : (l > nmax - 1 ? nmax - 1 : l); };
  float iscale = -static_cast<float>(nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int const l = clamp_l(nearest_int(iscale * x[i]));
    L[i] = static_cast<std::int8_t>(l + nmax);
    float const w = mul(x[i], x[i]);
    sumlx += mul(mul(w, x[i]), static_cast<float>(l));
    suml2 += mul(mul(w, static_cast<float>(l)), static_cast<float>(l));
  }
  float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
  float best = mul(scale, sumlx);
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + mul(0.1f, static_cast<float>(is))) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int const l = clamp_l(nearest_int(iscale * x[i]));
      float const w = mul(x[i], x[i]);
      sumlx += mul(mul(w, x[i]), static_cast<float>(l));
      suml2 += mul(mul(w, static_cast<float>(l)), static_cast<float>(l));
    }
    if (suml2 > 0 && mul(sumlx, sumlx) > mul(best, suml2)) {
      for (int i = 0; i < n; ++i) {
        L[i] = static_cast<std::int8_t>(nmax + clamp_l(nearest_int(iscale * x[i])));
      }
      scale = sumlx / suml2;
      best = mul(scale, sumlx);
    }
  }
  return scale;
}

/// ggml make_qkx2_quants: asymmetric levels L in [0, nmax] with a min, the best of nstep + 1
/// candidate scales by weighted squared (or, with use_mad, absolute) error. Returns the scale,
/// and the negated min in *the_min.
inline float make_qkx2_quants(int n, int nmax, float const* x, float const* weights,
                              std::uint8_t* L, float* the_min, std::uint8_t* Laux, float rmin,
                              float rdelta, int nstep, bool use_mad = false) {
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = mul(sum_w, x[0]);
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    float const w = weights[i];
    sum_w += w;
    sum_x += mul(w, x[i]);
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  auto clamp_l = [nmax](int l) { return l < 0 ? 0 : (l > nmax ? nmax : l); };
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    int const l = nearest_int(mul(iscale, x[i] - min));
    L[i] = static_cast<std::uint8_t>(clamp_l(l));
    float diff = mul(scale, static_cast<float>(L[i])) + min - x[i];
    diff = use_mad ? std::fabs(diff) : mul(diff, diff);
    best_error += mul(weights[i], diff);
  }
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + mul(rdelta, static_cast<float>(is)) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int const l = clamp_l(nearest_int(mul(iscale, x[i] - min)));
      Laux[i] = static_cast<std::uint8_t>(l);
      float const w = weights[i], fl = static_cast<float>(l);
      sum_l += mul(w, fl);
      sum_l2 += mul(mul(w, fl), fl);
      sum_xl += mul(mul(w, fl), x[i]);
    }
    float const D = mul(sum_w, sum_l2) - mul(sum_l, sum_l);
    if (D > 0) {
      float this_scale = (mul(sum_w, sum_xl) - mul(sum_x, sum_l)) / D;
      float this_min = (mul(sum_l2, sum_x) - mul(sum_l, sum_xl)) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = mul(this_scale, static_cast<float>(Laux[i])) + this_min - x[i];
        diff = use_mad ? std::fabs(diff) : mul(diff, diff);
        cur_error += mul(weights[i], diff);
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

/// ggml make_q3_quants with do_rmse: symmetric levels L in [0, 2 nmax) refined by up to 5
/// passes of coordinate descent on the x^2-weighted error. Returns the scale.
inline float make_q3_quants(int n, int nmax, float const* x, std::int8_t* L) {
  float const max = signed_absmax(x, n);
  if (std::fabs(max) < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  auto clamp_l = [nmax](int l) { return l < -nmax ? -nmax : (l > nmax - 1 ? nmax - 1 : l); };
  float const iscale = -static_cast<float>(nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int const l = clamp_l(nearest_int(iscale * x[i]));
    L[i] = static_cast<std::int8_t>(l);
    float const w = mul(x[i], x[i]);
    sumlx += mul(mul(w, x[i]), static_cast<float>(l));
    suml2 += mul(mul(w, static_cast<float>(l)), static_cast<float>(l));
  }
  for (int itry = 0; itry < 5; ++itry) {
    int n_changed = 0;
    for (int i = 0; i < n; ++i) {
      float const w = mul(x[i], x[i]);
      float slx = sumlx - mul(mul(w, x[i]), static_cast<float>(L[i]));
      if (slx > 0) {
        float sl2 = suml2 - mul(mul(w, static_cast<float>(L[i])), static_cast<float>(L[i]));
        int const new_l = clamp_l(nearest_int(mul(x[i], sl2) / slx));
        if (new_l != L[i]) {
          slx += mul(mul(w, x[i]), static_cast<float>(new_l));
          sl2 += mul(mul(w, static_cast<float>(new_l)), static_cast<float>(new_l));
          if (sl2 > 0 && mul(mul(slx, slx), suml2) > mul(mul(sumlx, sumlx), sl2)) {
            L[i] = static_cast<std::int8_t>(new_l);
            sumlx = slx;
            suml2 = sl2;
            ++n_changed;
          }
        }
      }
    }
    if (n_changed == 0) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<std::int8_t>(L[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

}  // namespace detail

/// Q4_K sub-block j's 6-bit scale and min from the 12 packed bytes (ggml get_scale_min_k4).
inline void get_scale_min(int j, std::uint8_t const* q, std::uint8_t* sc, std::uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<std::uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<std::uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/// One block of each format from block_elems floats (ggml quantize_row_*_ref for one block).
inline void quantize_block(float const* x, BlockQ8_0& y) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  float const d = amax / 127;
  float const id = detail::inverse(d);
  y.d = detail::fp16(d);
  for (int j = 0; j < 32; ++j) y.qs[j] = static_cast<std::int8_t>(std::round(x[j] * id));
}

inline void quantize_block(float const* x, BlockQ4_0& y) {
  float const d = detail::signed_absmax(x, 32) / -8;
  float const id = detail::inverse(d);
  y.d = detail::fp16(d);
  for (int j = 0; j < 16; ++j) {
    // ggml: MIN(15, (int8_t)(x * id + 8.5f)); the sum lies in [0.5, 16.5], so the cast is exact.
    int const lo = static_cast<int>(detail::mul(x[j], id) + 8.5f);
    int const hi = static_cast<int>(detail::mul(x[j + 16], id) + 8.5f);
    y.qs[j] = static_cast<std::uint8_t>((lo < 15 ? lo : 15) | ((hi < 15 ? hi : 15) << 4));
  }
}

namespace detail {
/// The second half of Q4_K's and Q5_K's quantizer, as ggml: the 8 sub-block scales and mins to
/// 6 bits each (packed into `packed`, with their fp16 maxima `d` and `dmin`), then the levels
/// L[0, 256) of x again from the stored scales, in [0, nmax].
inline void pack_k_scales(float const* x, float const* scales, float const* mins, float max_scale,
                          float max_min, std::uint8_t* packed, std::uint16_t& d,
                          std::uint16_t& dmin, std::uint8_t* L, int nmax) {
  float const inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  float const inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < 8; ++j) {
    // ggml stores nearest_int into a uint8_t, then clamps to 63 (the value is never negative).
    auto ls = static_cast<std::uint8_t>(nearest_int(mul(inv_scale, scales[j])));
    auto lm = static_cast<std::uint8_t>(nearest_int(mul(inv_min, mins[j])));
    ls = ls < 63 ? ls : 63;
    lm = lm < 63 ? lm : 63;
    if (j < 4) {
      packed[j] = ls;
      packed[j + 4] = lm;
    } else {
      packed[j + 4] = static_cast<std::uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      packed[j - 4] = static_cast<std::uint8_t>(packed[j - 4] | ((ls >> 4) << 6));
      packed[j] = static_cast<std::uint8_t>(packed[j] | ((lm >> 4) << 6));
    }
  }
  d = fp16(max_scale / 63.f);
  dmin = fp16(max_min / 63.f);
  for (int j = 0; j < 8; ++j) {
    std::uint8_t sc, m;
    get_scale_min(j, packed, &sc, &m);
    float const dj = mul(fp32(d), static_cast<float>(sc));
    if (dj == 0.0f) continue;
    float const dm = mul(fp32(dmin), static_cast<float>(m));
    for (int ii = 0; ii < 32; ++ii) {
      int const l = nearest_int((x[32 * j + ii] + dm) / dj);
      L[32 * j + ii] = static_cast<std::uint8_t>(l < 0 ? 0 : (l > nmax ? nmax : l));
    }
  }
}

/// Q4_K's and Q5_K's search (ggml's quantize_row_q4_K_ref / q5_K_ref): per 32 weights
/// make_qkx2_quants (levels 0..nmax, rmin, rdelta 0.1, nstep steps, weights av_x + |x|), then
/// the 6-bit scales and mins packed and the levels L[256] again from the stored scales.
inline void k_scales_and_levels(float const* x, int nmax, float rmin, int nstep, std::uint8_t* L,
                                std::uint8_t* packed_scales, std::uint16_t& d,
                                std::uint16_t& dmin) {
  std::uint8_t Laux[32];
  float weights[32], mins[8], scales[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += mul(x[32 * j + l], x[32 * j + l]);
    float const av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin,
                                 0.1f, nstep);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  pack_k_scales(x, scales, mins, max_scale, max_min, packed_scales, d, dmin, L, nmax);
}
}  // namespace detail

inline void quantize_block(float const* x, BlockQ4_K& y) {
  std::uint8_t L[256];
  detail::k_scales_and_levels(x, 15, -1.f, 20, L, y.scales, y.d, y.dmin);
  std::uint8_t* q = y.qs;
  for (int j = 0; j < 256; j += 64) {
    for (int l = 0; l < 32; ++l) q[l] = static_cast<std::uint8_t>(L[j + l] | (L[j + l + 32] << 4));
    q += 32;
  }
}

/// Q5_K: Q4_K's algorithm with 5-bit levels: per 32 weights make_qkx2_quants (nmax 31, rmin
/// -0.5, rdelta 0.1, 15 steps, weights av_x + |x|), 6-bit scales and mins, then the levels again
/// from the stored scales.
inline void quantize_block(float const* x, BlockQ5_K& y) {
  std::uint8_t L[256];
  detail::k_scales_and_levels(x, 31, -0.5f, 15, L, y.scales, y.d, y.dmin);
  std::memset(y.qh, 0, sizeof y.qh);
  std::uint8_t m1 = 1, m2 = 2;
  std::uint8_t* ql = y.qs;
  for (int n = 0; n < 256; n += 64, ql += 32) {
    for (int j = 0; j < 32; ++j) {
      int l1 = L[n + j], l2 = L[n + j + 32];
      if (l1 > 15) {
        l1 -= 16;
        y.qh[j] = static_cast<std::uint8_t>(y.qh[j] | m1);
      }
      if (l2 > 15) {
        l2 -= 16;
        y.qh[j] = static_cast<std::uint8_t>(y.qh[j] | m2);
      }
      ql[j] = static_cast<std::uint8_t>(l1 | (l2 << 4));
    }
    m1 = static_cast<std::uint8_t>(m1 << 2);
    m2 = static_cast<std::uint8_t>(m2 << 2);
  }
}

inline void quantize_block(float const* x, BlockQ6_K& y) {
  using detail::mul;
  std::int8_t L[256];
  float scales[16];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < 16; ++ib) {
    float const scale = detail::make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
    scales[ib] = scale;
    if (std::fabs(scale) > max_abs_scale) {
      max_abs_scale = std::fabs(scale);
      max_scale = scale;
    }
  }
  if (max_abs_scale < detail::kGroupMaxEps) {
    std::memset(&y, 0, sizeof y);
    y.d = detail::fp16(0.f);
    return;
  }
  float const iscale = -128.f / max_scale;
  y.d = detail::fp16(1 / iscale);
  for (int ib = 0; ib < 16; ++ib) {
    int const l = detail::nearest_int(mul(iscale, scales[ib]));
    y.scales[ib] = static_cast<std::int8_t>(l < 127 ? l : 127);
  }
  for (int j = 0; j < 16; ++j) {
    float const d = mul(detail::fp32(y.d), static_cast<float>(y.scales[j]));
    if (d == 0.0f) continue;
    for (int ii = 0; ii < 16; ++ii) {
      int const l = detail::nearest_int(x[16 * j + ii] / d);
      L[16 * j + ii] = static_cast<std::int8_t>((l < -32 ? -32 : (l > 31 ? 31 : l)) + 32);
    }
  }
  std::uint8_t* ql = y.ql;
  std::uint8_t* qh = y.qh;
  for (int j = 0; j < 256; j += 128) {
    for (int l = 0; l < 32; ++l) {
      auto const q1 = static_cast<std::uint8_t>(L[j + l] & 0xF);
      auto const q2 = static_cast<std::uint8_t>(L[j + l + 32] & 0xF);
      auto const q3 = static_cast<std::uint8_t>(L[j + l + 64] & 0xF);
      auto const q4 = static_cast<std::uint8_t>(L[j + l + 96] & 0xF);
      ql[l] = static_cast<std::uint8_t>(q1 | (q3 << 4));
      ql[l + 32] = static_cast<std::uint8_t>(q2 | (q4 << 4));
      qh[l] = static_cast<std::uint8_t>((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                        ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
    }
    ql += 64;
    qh += 32;
  }
}

/// Q3_K sub-block j's scale, stored + 32 in 6 bits: the signed value in [-32, 32).
inline int q3k_scale(BlockQ3_K const& b, int j) {
  int const lo = j < 8 ? b.scales[j] & 0xF : b.scales[j - 8] >> 4;
  int const hi = (b.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

inline void quantize_block(float const* x, BlockQ3_K& y) {
  using detail::mul;
  std::int8_t L[256];
  float scales[16];
  float max_scale = 0, amax = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = detail::make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
    float const scale = std::fabs(scales[j]);
    if (scale > amax) {
      amax = scale;
      max_scale = scales[j];
    }
  }
  std::memset(y.scales, 0, 12);
  if (max_scale != 0.0f) {
    float const iscale = -32.f / max_scale;
    for (int j = 0; j < 16; ++j) {
      // ggml: int8_t l = nearest_int(...), clamped to [-32, 31], + 32.
      int l = static_cast<std::int8_t>(detail::nearest_int(mul(iscale, scales[j])));
      l = (l < -32 ? -32 : (l > 31 ? 31 : l)) + 32;
      if (j < 8) {
        y.scales[j] = static_cast<std::uint8_t>(l & 0xF);
      } else {
        y.scales[j - 8] = static_cast<std::uint8_t>(y.scales[j - 8] | ((l & 0xF) << 4));
      }
      l >>= 4;
      y.scales[j % 4 + 8] = static_cast<std::uint8_t>(y.scales[j % 4 + 8] | (l << (2 * (j / 4))));
    }
    y.d = detail::fp16(1 / iscale);
  } else {
    y.d = detail::fp16(0.f);
  }
  for (int j = 0; j < 16; ++j) {
    float const d = mul(detail::fp32(y.d), static_cast<float>(q3k_scale(y, j)));
    if (d == 0.0f) continue;
    for (int ii = 0; ii < 16; ++ii) {
      int const l = detail::nearest_int(x[16 * j + ii] / d);
      L[16 * j + ii] = static_cast<std::int8_t>((l < -4 ? -4 : (l > 3 ? 3 : l)) + 4);
    }
  }
  std::memset(y.hmask, 0, 32);
  int m = 0;
  std::uint8_t hm = 1;
  for (int j = 0; j < 256; ++j) {
    if (L[j] > 3) {
      y.hmask[m] = static_cast<std::uint8_t>(y.hmask[m] | hm);
      L[j] = static_cast<std::int8_t>(L[j] - 4);
    }
    if (++m == 32) {
      m = 0;
      hm = static_cast<std::uint8_t>(hm << 1);
    }
  }
  for (int j = 0; j < 256; j += 128) {
    for (int l = 0; l < 32; ++l) {
      y.qs[j / 4 + l] = static_cast<std::uint8_t>(L[j + l] | (L[j + l + 32] << 2) |
                                                  (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
  }
}

inline void quantize_block(float const* x, BlockQ2_K& y) {
  using detail::mul;
  std::uint8_t L[256], Laux[16];
  float weights[16], mins[16], scales[16];
  constexpr float q4scale = 15.f;
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 16; ++j) {
    for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
    scales[j] = detail::make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux,
                                         -0.5f, 0.1f, 15, true);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  if (max_scale > 0) {
    float const iscale = q4scale / max_scale;
    for (int j = 0; j < 16; ++j) {
      y.scales[j] = static_cast<std::uint8_t>(detail::nearest_int(mul(iscale, scales[j])));
    }
    y.d = detail::fp16(max_scale / q4scale);
  } else {
    for (int j = 0; j < 16; ++j) y.scales[j] = 0;
    y.d = detail::fp16(0.f);
  }
  if (max_min > 0) {
    float const iscale = q4scale / max_min;
    for (int j = 0; j < 16; ++j) {
      int const l = detail::nearest_int(mul(iscale, mins[j]));
      y.scales[j] = static_cast<std::uint8_t>(y.scales[j] | (l << 4));
    }
    y.dmin = detail::fp16(max_min / q4scale);
  } else {
    y.dmin = detail::fp16(0.f);
  }
  for (int j = 0; j < 16; ++j) {
    float const d = mul(detail::fp32(y.d), static_cast<float>(y.scales[j] & 0xF));
    if (d == 0.0f) continue;
    float const dm = mul(detail::fp32(y.dmin), static_cast<float>(y.scales[j] >> 4));
    for (int ii = 0; ii < 16; ++ii) {
      int const l = detail::nearest_int((x[16 * j + ii] + dm) / d);
      L[16 * j + ii] = static_cast<std::uint8_t>(l < 0 ? 0 : (l > 3 ? 3 : l));
    }
  }
  for (int j = 0; j < 256; j += 128) {
    for (int l = 0; l < 32; ++l) {
      y.qs[j / 4 + l] = static_cast<std::uint8_t>(L[j + l] | (L[j + l + 32] << 2) |
                                                  (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
  }
}

/// The 3-bit level (0..7) of weight i of a Q3_K block and the 2-bit level of a Q2_K block.
inline int q3k_level(BlockQ3_K const& b, int i) {
  int const half = i / 128, r = i % 128, j = r / 32, l = r % 32;
  int const low = (b.qs[32 * half + l] >> (2 * j)) & 3;
  int const high = (b.hmask[l] >> (4 * half + j)) & 1;
  return low | (high << 2);
}
inline int q2k_level(BlockQ2_K const& b, int i) {
  int const half = i / 128, r = i % 128, j = r / 32, l = r % 32;
  return (b.qs[32 * half + l] >> (2 * j)) & 3;
}

/// One block of each format decoded to block_elems floats (ggml dequantize_row_*).
inline void dequantize_block(BlockQ8_0 const& b, float* y) {
  float const d = detail::fp32(b.d);
  for (int j = 0; j < 32; ++j) y[j] = detail::mul(static_cast<float>(b.qs[j]), d);
}
inline void dequantize_block(BlockQ4_0 const& b, float* y) {
  float const d = detail::fp32(b.d);
  for (int j = 0; j < 16; ++j) {
    y[j] = detail::mul(static_cast<float>((b.qs[j] & 0x0F) - 8), d);
    y[j + 16] = detail::mul(static_cast<float>((b.qs[j] >> 4) - 8), d);
  }
}
inline void dequantize_block(BlockQ4_K const& b, float* y) {
  using detail::mul;
  float const d = detail::fp32(b.d), min = detail::fp32(b.dmin);
  std::uint8_t const* q = b.qs;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    std::uint8_t sc, m;
    get_scale_min(is, b.scales, &sc, &m);
    float const d1 = mul(d, static_cast<float>(sc)), m1 = mul(min, static_cast<float>(m));
    get_scale_min(is + 1, b.scales, &sc, &m);
    float const d2 = mul(d, static_cast<float>(sc)), m2 = mul(min, static_cast<float>(m));
    for (int l = 0; l < 32; ++l) *y++ = mul(d1, static_cast<float>(q[l] & 0xF)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = mul(d2, static_cast<float>(q[l] >> 4)) - m2;
  }
}
inline void dequantize_block(BlockQ5_K const& b, float* y) {
  using detail::mul;
  float const d = detail::fp32(b.d), min = detail::fp32(b.dmin);
  std::uint8_t const* ql = b.qs;
  std::uint8_t u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
    std::uint8_t sc, m;
    get_scale_min(is, b.scales, &sc, &m);
    float const d1 = mul(d, static_cast<float>(sc)), m1 = mul(min, static_cast<float>(m));
    get_scale_min(is + 1, b.scales, &sc, &m);
    float const d2 = mul(d, static_cast<float>(sc)), m2 = mul(min, static_cast<float>(m));
    for (int l = 0; l < 32; ++l) {
      int const q = (ql[l] & 0xF) + ((b.qh[l] & u1) != 0 ? 16 : 0);
      *y++ = mul(d1, static_cast<float>(q)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      int const q = (ql[l] >> 4) + ((b.qh[l] & u2) != 0 ? 16 : 0);
      *y++ = mul(d2, static_cast<float>(q)) - m2;
    }
    u1 = static_cast<std::uint8_t>(u1 << 2);
    u2 = static_cast<std::uint8_t>(u2 << 2);
  }
}
inline void dequantize_block(BlockQ6_K const& b, float* y) {
  using detail::mul;
  float const d = detail::fp32(b.d);
  std::uint8_t const* ql = b.ql;
  std::uint8_t const* qh = b.qh;
  std::int8_t const* sc = b.scales;
  for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      int const is = l / 16;
      int const q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      int const q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      int const q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      int const q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = mul(mul(d, static_cast<float>(sc[is])), static_cast<float>(q1));
      y[l + 32] = mul(mul(d, static_cast<float>(sc[is + 2])), static_cast<float>(q2));
      y[l + 64] = mul(mul(d, static_cast<float>(sc[is + 4])), static_cast<float>(q3));
      y[l + 96] = mul(mul(d, static_cast<float>(sc[is + 6])), static_cast<float>(q4));
    }
  }
}

inline void dequantize_block(BlockQ3_K const& b, float* y) {
  using detail::mul;
  float const d = detail::fp32(b.d);
  for (int i = 0; i < 256; ++i) {
    float const dl = mul(d, static_cast<float>(q3k_scale(b, i / 16)));
    y[i] = mul(dl, static_cast<float>(q3k_level(b, i) - 4));
  }
}
inline void dequantize_block(BlockQ2_K const& b, float* y) {
  using detail::mul;
  float const d = detail::fp32(b.d), min = detail::fp32(b.dmin);
  for (int i = 0; i < 256; ++i) {
    std::uint8_t const sc = b.scales[i / 16];
    float const dl = mul(d, static_cast<float>(sc & 0xF)),
                ml = mul(min, static_cast<float>(sc >> 4));
    y[i] = mul(dl, static_cast<float>(q2k_level(b, i))) - ml;
  }
}

/// Q4_1: d = (max - min) / 15, q = min(15, trunc((x - min) / d + 0.5)).
inline void quantize_block(float const* x, BlockQ4_1& y) {
  auto const [min, max] = detail::block_min_max(x);
  float const d = (max - min) / 15;
  float const id = detail::inverse(d);
  y.d = detail::fp16(d);
  y.m = detail::fp16(min);
  for (int j = 0; j < 16; ++j) {
    int const lo = detail::trunc_level(detail::mul(x[j] - min, id) + 0.5f, 15);
    int const hi = detail::trunc_level(detail::mul(x[j + 16] - min, id) + 0.5f, 15);
    y.qs[j] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
}
inline void dequantize_block(BlockQ4_1 const& b, float* y) {
  float const d = detail::fp32(b.d), m = detail::fp32(b.m);
  for (int j = 0; j < 16; ++j) {
    y[j] = detail::mul(static_cast<float>(b.qs[j] & 0x0F), d) + m;
    y[j + 16] = detail::mul(static_cast<float>(b.qs[j] >> 4), d) + m;
  }
}

/// Q5_0: d = max / -16 (max: the first value of largest magnitude), q = min(31, trunc(x / d +
/// 16.5)).
inline void quantize_block(float const* x, BlockQ5_0& y) {
  float const d = detail::signed_absmax(x, 32) / -16;
  float const id = detail::inverse(d);
  y.d = detail::fp16(d);
  std::uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    int const lo = detail::trunc_level(detail::mul(x[j], id) + 16.5f, 31);
    int const hi = detail::trunc_level(detail::mul(x[j + 16], id) + 16.5f, 31);
    y.qs[j] = static_cast<std::uint8_t>((lo & 0x0F) | ((hi & 0x0F) << 4));
    qh |= static_cast<std::uint32_t>(lo >> 4) << j;
    qh |= static_cast<std::uint32_t>(hi >> 4) << (j + 16);
  }
  detail::store_le32(qh, y.qh);
}
inline void dequantize_block(BlockQ5_0 const& b, float* y) {
  float const d = detail::fp32(b.d);
  std::uint32_t const qh = detail::load_le32(b.qh);
  for (int j = 0; j < 16; ++j) {
    int const x0 = static_cast<int>((b.qs[j] & 0x0F) | (((qh >> j) & 1u) << 4)) - 16;
    int const x1 = static_cast<int>((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
    y[j] = detail::mul(static_cast<float>(x0), d);
    y[j + 16] = detail::mul(static_cast<float>(x1), d);
  }
}

/// Q5_1: d = (max - min) / 31, q = trunc((x - min) / d + 0.5) (ggml's (uint8_t) cast; the value
/// is at most 31.5 plus rounding, so the clamp to 31 never changes a defined result).
inline void quantize_block(float const* x, BlockQ5_1& y) {
  auto const [min, max] = detail::block_min_max(x);
  float const d = (max - min) / 31;
  float const id = detail::inverse(d);
  y.d = detail::fp16(d);
  y.m = detail::fp16(min);
  std::uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    int const lo = detail::trunc_level(detail::mul(x[j] - min, id) + 0.5f, 31);
    int const hi = detail::trunc_level(detail::mul(x[j + 16] - min, id) + 0.5f, 31);
    y.qs[j] = static_cast<std::uint8_t>((lo & 0x0F) | ((hi & 0x0F) << 4));
    qh |= static_cast<std::uint32_t>(lo >> 4) << j;
    qh |= static_cast<std::uint32_t>(hi >> 4) << (j + 16);
  }
  detail::store_le32(qh, y.qh);
}
inline void dequantize_block(BlockQ5_1 const& b, float* y) {
  float const d = detail::fp32(b.d), m = detail::fp32(b.m);
  std::uint32_t const qh = detail::load_le32(b.qh);
  for (int j = 0; j < 16; ++j) {
    auto const x0 = static_cast<int>((b.qs[j] & 0x0F) | (((qh >> j) & 1u) << 4));
    auto const x1 = static_cast<int>((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
    y[j] = detail::mul(static_cast<float>(x0), d) + m;
    y[j + 16] = detail::mul(static_cast<float>(x1), d) + m;
  }
}

/// IQ4_NL (ggml quantize_row_iq4_nl_ref: no importance weights, no scale search): d0 = max /
/// -127, each level the nearest of kIq4nlValues to x / d0, d the x^2-weighted least-squares
/// scale of those levels. `L` carries levels from block to block of a row (detail::
/// quantize_iq4_impl); start it at zero.
inline void quantize_block(float const* x, BlockIQ4_NL& y, std::uint8_t (&L)[32]) {
  std::uint16_t unused_h = 0;
  float scale = 0;
  detail::quantize_iq4_impl(32, x, &y.d, y.qs, &unused_h, nullptr, &scale, L, -1);
}
inline void dequantize_block(BlockIQ4_NL const& b, float* y) {
  float const d = detail::fp32(b.d);
  for (int j = 0; j < 16; ++j) {
    y[j] = detail::mul(d, static_cast<float>(kIq4nlValues[b.qs[j] & 0xF]));
    y[j + 16] = detail::mul(d, static_cast<float>(kIq4nlValues[b.qs[j] >> 4]));
  }
}

/// IQ4_XS (ggml quantize_row_iq4_xs_ref, i.e. quantize_iq4_xs without importance weights): per
/// 32 weights the best of 15 scales (x^2-weighted), then 6-bit scales under d = -max / 32.
inline void quantize_block(float const* x, BlockIQ4_XS& y) {
  std::uint8_t L[256] = {};
  float scales[8];
  detail::quantize_iq4_impl(256, x, &y.d, y.qs, &y.scales_h, y.scales_l, scales, L, 7);
}
/// The 6-bit scale (0..63, used as ls - 32) of 32-block ib of an IQ4_XS block.
inline int iq4xs_scale(BlockIQ4_XS const& b, int ib) {
  return ((b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((b.scales_h >> (2 * ib)) & 3) << 4);
}
inline void dequantize_block(BlockIQ4_XS const& b, float* y) {
  float const d = detail::fp32(b.d);
  std::uint8_t const* qs = b.qs;
  for (int ib = 0; ib < 8; ++ib, y += 32, qs += 16) {
    float const dl = detail::mul(d, static_cast<float>(iq4xs_scale(b, ib) - 32));
    for (int j = 0; j < 16; ++j) {
      y[j] = detail::mul(dl, static_cast<float>(kIq4nlValues[qs[j] & 0xF]));
      y[j + 16] = detail::mul(dl, static_cast<float>(kIq4nlValues[qs[j] >> 4]));
    }
  }
}

/// MXFP4 (ggml quantize_row_mxfp4_ref): e = floor(log2(amax)) - 2 + 127 (0 for amax = 0), each
/// code the first of kMxfp4Values nearest to x / 2^(e - 128). ggml's conversion to uint8_t is
/// undefined for amax < 2^-125 (a negative e): e = 0 here, the smallest scale. The exponent
/// comes from the C library's log2f, as ggml's does.
inline void quantize_block(float const* x, BlockMXFP4& y) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) {
    if (amax < std::fabs(x[j])) amax = std::fabs(x[j]);
  }
  float const ef = amax > 0.0f ? std::floor(std::log2(amax)) - 2 + 127 : 0.0f;
  auto const e = static_cast<std::uint8_t>(ef > 0.0f ? ef : 0.0f);
  float const d = detail::e8m0_to_fp32_half(e);
  y.e = e;
  auto best = [d](float v) {
    int best_index = 0;
    float best_err = std::fabs(detail::mul(static_cast<float>(kMxfp4Values[0]), d) - v);
    for (int i = 1; i < 16; ++i) {
      float const err = std::fabs(detail::mul(static_cast<float>(kMxfp4Values[i]), d) - v);
      if (err < best_err) {
        best_index = i;
        best_err = err;
      }
    }
    return best_index;
  };
  for (int j = 0; j < 16; ++j) {
    y.qs[j] = static_cast<std::uint8_t>(best(x[j]) | (best(x[j + 16]) << 4));
  }
}
inline void dequantize_block(BlockMXFP4 const& b, float* y) {
  float const d = detail::e8m0_to_fp32_half(b.e);
  for (int j = 0; j < 16; ++j) {
    y[j] = detail::mul(static_cast<float>(kMxfp4Values[b.qs[j] & 0x0F]), d);
    y[j + 16] = detail::mul(static_cast<float>(kMxfp4Values[b.qs[j] >> 4]), d);
  }
}

/// The 6-bit level (0..63) of weight i of a Q6_K block, and the 4-bit level of a Q4_K block:
/// the integers the kernels multiply.
inline int q6_level(BlockQ6_K const& b, int i) {
  int const half = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
  std::uint8_t const* ql = b.ql + 64 * half;
  std::uint8_t const qh = b.qh[32 * half + l];
  int const lo = quarter == 0   ? ql[l] & 0xF
                 : quarter == 1 ? ql[l + 32] & 0xF
                 : quarter == 2 ? ql[l] >> 4
                                : ql[l + 32] >> 4;
  return lo | (((qh >> (2 * quarter)) & 3) << 4);
}
inline int q4k_level(BlockQ4_K const& b, int i) {
  int const chunk = i / 64, r = i % 64;
  std::uint8_t const v = b.qs[32 * chunk + r % 32];
  return r < 32 ? v & 0xF : v >> 4;
}
/// The 5-bit level (0..31) of weight i of a Q5_K block: Q4_K's nibble plus 16 times the fifth
/// bit, bit 2 (i / 64) + (i % 64) / 32 of qh[i % 32].
inline int q5k_level(BlockQ5_K const& b, int i) {
  int const chunk = i / 64, r = i % 64;
  std::uint8_t const v = b.qs[32 * chunk + r % 32];
  int const high = (b.qh[r % 32] >> (2 * chunk + r / 32)) & 1;
  return (r < 32 ? v & 0xF : v >> 4) | high << 4;
}
/// The 5-bit level (0..31) of weight i of a 32-block with Q5_0's / Q5_1's layout: nibble i of
/// qs (weights 0..15 low, 16..31 high, as Q4_0) plus 16 times bit i of the little-endian qh.
template <class Block>
int q5_level(Block const& b, int i) {
  int const nib = i < 16 ? b.qs[i] & 0xF : b.qs[i - 16] >> 4;
  return nib | static_cast<int>((detail::load_le32(b.qh) >> i) & 1u) << 4;
}

namespace detail {
/// Weights per block of a block type: the 32-blocks are at most 34 bytes, the 256-blocks at least
/// 84.
template <class Block>
constexpr Index block_elems_of() {
  return sizeof(Block) <= 34 ? 32 : 256;
}
template <class Block>
void quantize_blocks(float const* x, Index k, void* out) {
  auto* blocks = static_cast<Block*>(out);
  constexpr Index elems = block_elems_of<Block>();
  [[maybe_unused]] std::uint8_t L[32] = {};  // IQ4_NL: levels carried from block to block
  for (Index b = 0; b < k / elems; ++b) {
    Block blk;
    std::memset(&blk, 0, sizeof blk);
    if constexpr (std::is_same_v<Block, BlockIQ4_NL>) {
      quantize_block(x + b * elems, blk, L);
    } else {
      quantize_block(x + b * elems, blk);
    }
    std::memcpy(blocks + b, &blk, sizeof blk);
  }
}
template <class Block>
void dequantize_blocks(void const* in, Index k, float* y) {
  constexpr Index elems = block_elems_of<Block>();
  auto const* bytes = static_cast<unsigned char const*>(in);
  for (Index b = 0; b < k / elems; ++b) {
    Block blk;
    std::memcpy(&blk, bytes + b * static_cast<Index>(sizeof(Block)), sizeof blk);
    dequantize_block(blk, y + b * elems);
  }
}
}  // namespace detail

/// Checks that a row of k weights can be stored in format f (k a positive multiple of
/// block_elems(f)); `who` names the caller in the message.
inline void check_row_length(Format f, Index k, char const* who) {
  moe::detail::check(k > 0 && k % block_elems(f) == 0, who, ": rows of ", k, " weights cannot be ",
                     name(f), " (its blocks hold ", block_elems(f),
                     " weights; GGUF rows are whole blocks); use ",
                     block_elems(f) == 256 ? "q8_0 or q4_0 (32-blocks)" : "fp32 or bf16",
                     " for this projection, or a width that is a multiple of ", block_elems(f));
}

/// Quantizes k weights (a multiple of block_elems(f)) into row_bytes(f, k) bytes at out.
/// Throws moe::Error for a non-finite weight or a bad k.
inline void quantize_row(Format f, float const* x, Index k, void* out) {
  check_row_length(f, k, "quant::quantize_row");
  for (Index i = 0; i < k; ++i) {
    moe::detail::check(std::isfinite(x[i]), "quant::quantize_row: weight ", i, " of the row is ",
                       x[i], "; only finite weights can be quantized (fix or drop the tensor)");
  }
  switch (f) {
    case Format::kQ8_0:
      return detail::quantize_blocks<BlockQ8_0>(x, k, out);
    case Format::kQ6_K:
      return detail::quantize_blocks<BlockQ6_K>(x, k, out);
    case Format::kQ4_K:
      return detail::quantize_blocks<BlockQ4_K>(x, k, out);
    case Format::kQ4_0:
      return detail::quantize_blocks<BlockQ4_0>(x, k, out);
    case Format::kQ3_K:
      return detail::quantize_blocks<BlockQ3_K>(x, k, out);
    case Format::kQ2_K:
      return detail::quantize_blocks<BlockQ2_K>(x, k, out);
    case Format::kQ5_K:
      return detail::quantize_blocks<BlockQ5_K>(x, k, out);
    case Format::kQ5_0:
      return detail::quantize_blocks<BlockQ5_0>(x, k, out);
    case Format::kQ4_1:
      return detail::quantize_blocks<BlockQ4_1>(x, k, out);
    case Format::kQ5_1:
      return detail::quantize_blocks<BlockQ5_1>(x, k, out);
    case Format::kIQ4_NL:
      return detail::quantize_blocks<BlockIQ4_NL>(x, k, out);
    case Format::kIQ4_XS:
      return detail::quantize_blocks<BlockIQ4_XS>(x, k, out);
    case Format::kMXFP4:
      return detail::quantize_blocks<BlockMXFP4>(x, k, out);
  }
}

/// Decodes row_bytes(f, k) bytes at in into k floats.
inline void dequantize_row(Format f, void const* in, Index k, float* y) {
  check_row_length(f, k, "quant::dequantize_row");
  switch (f) {
    case Format::kQ8_0:
      return detail::dequantize_blocks<BlockQ8_0>(in, k, y);
    case Format::kQ6_K:
      return detail::dequantize_blocks<BlockQ6_K>(in, k, y);
    case Format::kQ4_K:
      return detail::dequantize_blocks<BlockQ4_K>(in, k, y);
    case Format::kQ4_0:
      return detail::dequantize_blocks<BlockQ4_0>(in, k, y);
    case Format::kQ3_K:
      return detail::dequantize_blocks<BlockQ3_K>(in, k, y);
    case Format::kQ2_K:
      return detail::dequantize_blocks<BlockQ2_K>(in, k, y);
    case Format::kQ5_K:
      return detail::dequantize_blocks<BlockQ5_K>(in, k, y);
    case Format::kQ5_0:
      return detail::dequantize_blocks<BlockQ5_0>(in, k, y);
    case Format::kQ4_1:
      return detail::dequantize_blocks<BlockQ4_1>(in, k, y);
    case Format::kQ5_1:
      return detail::dequantize_blocks<BlockQ5_1>(in, k, y);
    case Format::kIQ4_NL:
      return detail::dequantize_blocks<BlockIQ4_NL>(in, k, y);
    case Format::kIQ4_XS:
      return detail::dequantize_blocks<BlockIQ4_XS>(in, k, y);
    case Format::kMXFP4:
      return detail::dequantize_blocks<BlockMXFP4>(in, k, y);
  }
}

}  // namespace moe::quant

// Every format's block codec compiled once for our own binaries (see MOE_SDPA_INSTANTIATION in
// kernels/sdpa.hpp): the reference quantizers are the largest code a unit that packs quantized
// weights compiles.
#define MOE_QUANT_CODEC_INSTANTIATION(EXTERN, Block)                                              \
  EXTERN template void moe::quant::detail::quantize_blocks<moe::quant::Block>(float const*,       \
                                                                              moe::Index, void*); \
  EXTERN template void moe::quant::detail::dequantize_blocks<moe::quant::Block>(                  \
      void const*, moe::Index, float*)
#define MOE_QUANT_CODECS_INSTANTIATION(EXTERN)        \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ8_0);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ6_K);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ4_K);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ4_0);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ3_K);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ2_K);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ5_K);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ5_0);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ4_1);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockQ5_1);   \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockIQ4_NL); \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockIQ4_XS); \
  MOE_QUANT_CODEC_INSTANTIATION(EXTERN, BlockMXFP4)
#if defined(MOE_EXTERN_EXPERT_KERNELS)
MOE_QUANT_CODECS_INSTANTIATION(extern);
#endif
