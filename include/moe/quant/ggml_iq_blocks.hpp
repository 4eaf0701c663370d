// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ggml's codebook ("i-quant") GGUF blocks, for reading GGUF files: the byte layouts of IQ2_XXS,
/// IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M (ggml-common.h) and their reference
/// dequantizers (ggml-quants.c: dequantize_row_*), written here from those definitions, with
/// ggml's grids (detail/ggml_iq_grids.hpp). Dequantization only: ggml's quantizers for these
/// formats search the grids with importance weights and are not here. Every block holds 256
/// weights in 8 groups of 32; each group of 8 (IQ3: 4) weights is a grid point of magnitudes,
/// with signs. Per format (d: fp16 super-block scale):
///
/// - IQ2_XXS: 66 bytes (2.0625 bits a weight): d, per 32: 4 grid indices (8 bits, iq2xxs grid)
///   and a 32-bit word of 4 x 7 sign bits and a 4-bit scale s; weight = d (0.5 + s) / 4 * g.
/// - IQ2_XS: 74 (2.3125): d, per 8 weights a 16-bit word (9-bit index, 7 sign bits), per 16
///   weights a 4-bit scale; d (0.5 + s) / 4 * g.
/// - IQ2_S: 82 (2.5625): d, 10-bit indices (8 in qs, 2 in qh), 8 explicit sign bits per 8
///   weights, 4-bit scales per 16; d (0.5 + s) / 4 * g.
/// - IQ3_XXS: 98 (3.0625): d, 8-bit indices per 4 weights (iq3xxs grid), per 32 a 32-bit word of
///   4 x 7 sign bits and a 4-bit scale; d (0.5 + s) / 2 * g.
/// - IQ3_S: 110 (3.4375): d, 9-bit indices per 4 weights (8 in qs, 1 in qh), explicit signs,
///   4-bit scales per 32; d (1 + 2 s) * g.
/// - IQ1_S: 50 (1.5625): d, per 8 weights an 11-bit index (8 in qs, 3 in qh) into the iq1s grid
///   (values -1, 0, 1), per 32 a 3-bit scale and a delta sign in qh; d (2 s + 1) (g +- 1/8).
/// - IQ1_M: 56 (1.75): no d field: its fp16 bits are the top nibbles of the 4 16-bit scale words;
///   11-bit indices, a delta sign per 8 weights, 3-bit scales per 16; d (2 s + 1) (g +- 1/8).
///
/// The 7 stored sign bits of 8 weights give the 8th by even parity (kKsignsIq2xs); bit j of a
/// sign byte (kKmaskIq2xs[j]) negates weight j. Operations as ggml's, in its order, each product
/// rounded (detail::mul); multi-byte fields are read as the host's integers (little-endian
/// hosts, as GGUF); typed pointers must be aligned for the block (alignof 1 or 2).
#pragma once

#include <cstdint>

#include "moe/core/float16.hpp"
#include "moe/core/types.hpp"
#include "moe/quant/detail/ggml_iq_grids.hpp"
#include "moe/quant/ggml_blocks.hpp"

namespace moe::quant {

/// ggml block types, byte for byte (static_asserts below check the sizes).
struct BlockIQ2_XXS {
  std::uint16_t d;       ///< fp16 scale
  std::uint16_t qs[32];  ///< per 32 weights 4 words: 4 grid indices (bytes), then signs + scale
};
struct BlockIQ2_XS {
  std::uint16_t d;         ///< fp16 scale
  std::uint16_t qs[32];    ///< per 8 weights: 9-bit grid index, 7 sign bits above it
  std::uint8_t scales[8];  ///< per 32 weights: 4-bit scales of the two 16s
};
struct BlockIQ2_S {
  std::uint16_t d;         ///< fp16 scale
  std::uint8_t qs[64];     ///< 32 low bytes of the grid indices, then 32 sign bytes
  std::uint8_t qh[8];      ///< per 32 weights: the indices' high 2 bits
  std::uint8_t scales[8];  ///< per 32 weights: 4-bit scales of the two 16s
};
struct BlockIQ3_XXS {
  std::uint16_t d;      ///< fp16 scale
  std::uint8_t qs[96];  ///< 64 grid indices (per 4 weights), then per 32 a signs + scale word
};
struct BlockIQ3_S {
  std::uint16_t d;         ///< fp16 scale
  std::uint8_t qs[64];     ///< low 8 bits of the grid indices (per 4 weights)
  std::uint8_t qh[8];      ///< per 32 weights: the 9th bits of its 8 indices
  std::uint8_t signs[32];  ///< a sign byte per 8 weights
  std::uint8_t scales[4];  ///< 4-bit scales, one per 32 weights
};
struct BlockIQ1_S {
  std::uint16_t d;      ///< fp16 scale
  std::uint8_t qs[32];  ///< low 8 bits of the grid indices (per 8 weights)
  std::uint16_t qh[8];  ///< per 32: 4 x 3 high index bits, 3-bit scale, delta sign (bit 15)
};
struct BlockIQ1_M {
  std::uint8_t qs[32];     ///< low 8 bits of the grid indices (per 8 weights)
  std::uint8_t qh[16];     ///< per 16 weights: 2 x (3 high index bits, delta sign)
  std::uint8_t scales[8];  ///< 4 16-bit words: 3-bit scales, and d's fp16 bits on top
};
static_assert(sizeof(BlockIQ2_XXS) == 66 && sizeof(BlockIQ2_XS) == 74 && sizeof(BlockIQ2_S) == 82);
static_assert(sizeof(BlockIQ3_XXS) == 98 && sizeof(BlockIQ3_S) == 110);
static_assert(sizeof(BlockIQ1_S) == 50 && sizeof(BlockIQ1_M) == 56);

template <>
inline constexpr Index block_elems_v<BlockIQ2_XXS> = 256;
template <>
inline constexpr Index block_elems_v<BlockIQ2_XS> = 256;
template <>
inline constexpr Index block_elems_v<BlockIQ2_S> = 256;
template <>
inline constexpr Index block_elems_v<BlockIQ3_XXS> = 256;
template <>
inline constexpr Index block_elems_v<BlockIQ3_S> = 256;
template <>
inline constexpr Index block_elems_v<BlockIQ1_S> = 256;
template <>
inline constexpr Index block_elems_v<BlockIQ1_M> = 256;

/// ggml's IQ1S_DELTA and IQ1M_DELTA: the shift of the IQ1 grid values.
inline constexpr float kIq1Delta = 0.125f;

namespace detail {

/// Byte j of a grid entry (ggml reads the entry's bytes in memory, on a little-endian host).
inline float grid_magnitude(std::uint64_t entry, int j) {
  return static_cast<float>((entry >> (8 * j)) & 0xFF);
}
/// Byte j of an iq1s grid entry as the int8 value it holds (-1, 0 or 1).
inline float grid_int8(std::uint64_t entry, int j) {
  return static_cast<float>(static_cast<std::int8_t>((entry >> (8 * j)) & 0xFF));
}
/// +1 or -1: ggml's (signs & kmask_iq2xs[j] ? -1.f : 1.f).
inline float sign_of(std::uint8_t signs, int j) {
  return (signs & kKmaskIq2xs[j]) != 0 ? -1.f : 1.f;
}
/// The 8 weights of one grid point of 8 magnitudes under scale db, signed.
inline void grid8(float db, std::uint64_t entry, std::uint8_t signs, float* y) {
  for (int j = 0; j < 8; ++j) y[j] = mul(mul(db, grid_magnitude(entry, j)), sign_of(signs, j));
}
/// The 8 weights of two grid points of 4 magnitudes (IQ3) under scale db, signed.
inline void grid4x2(float db, std::uint32_t entry1, std::uint32_t entry2, std::uint8_t signs,
                    float* y) {
  for (int j = 0; j < 4; ++j) {
    y[j] = mul(mul(db, grid_magnitude(entry1, j)), sign_of(signs, j));
    y[j + 4] = mul(mul(db, grid_magnitude(entry2, j)), sign_of(signs, j + 4));
  }
}
/// ggml's d * (0.5f + s) * f, the IQ2/IQ3_XXS group scale.
inline float half_step_scale(float d, std::uint32_t s, float f) {
  return mul(mul(d, 0.5f + static_cast<float>(s)), f);
}

}  // namespace detail

/// One block of each format decoded to 256 floats (ggml dequantize_row_* for one block).
inline void dequantize_block(BlockIQ2_XXS const& b, float* y) {
  float const d = detail::fp32(b.d);
  for (int ib32 = 0; ib32 < 8; ++ib32) {
    std::uint16_t const* q = b.qs + 4 * ib32;
    // ggml's aux32[0] holds the 4 index bytes, aux32[1] the signs and scale (little-endian).
    std::uint8_t const index[4] = {
        static_cast<std::uint8_t>(q[0] & 0xFF), static_cast<std::uint8_t>(q[0] >> 8),
        static_cast<std::uint8_t>(q[1] & 0xFF), static_cast<std::uint8_t>(q[1] >> 8)};
    std::uint32_t const aux =
        static_cast<std::uint32_t>(q[2]) | (static_cast<std::uint32_t>(q[3]) << 16);
    float const db = detail::half_step_scale(d, aux >> 28, 0.25f);
    for (int l = 0; l < 4; ++l, y += 8) {
      detail::grid8(db, kIq2xxsGrid[index[l]], kKsignsIq2xs[(aux >> (7 * l)) & 127], y);
    }
  }
}

inline void dequantize_block(BlockIQ2_XS const& b, float* y) {
  float const d = detail::fp32(b.d);
  for (int ib32 = 0; ib32 < 8; ++ib32) {
    float const db[2] = {detail::half_step_scale(d, b.scales[ib32] & 0xFu, 0.25f),
                         detail::half_step_scale(d, b.scales[ib32] >> 4u, 0.25f)};
    for (int l = 0; l < 4; ++l, y += 8) {
      std::uint16_t const q = b.qs[4 * ib32 + l];
      detail::grid8(db[l / 2], kIq2xsGrid[q & 511], kKsignsIq2xs[q >> 9], y);
    }
  }
}

inline void dequantize_block(BlockIQ2_S const& b, float* y) {
  float const d = detail::fp32(b.d);
  std::uint8_t const* qs = b.qs;
  std::uint8_t const* signs = b.qs + 32;
  for (int ib32 = 0; ib32 < 8; ++ib32, qs += 4, signs += 4) {
    float const db[2] = {detail::half_step_scale(d, b.scales[ib32] & 0xFu, 0.25f),
                         detail::half_step_scale(d, b.scales[ib32] >> 4u, 0.25f)};
    for (int l = 0; l < 4; ++l, y += 8) {
      int const index = qs[l] | ((b.qh[ib32] << (8 - 2 * l)) & 0x300);
      detail::grid8(db[l / 2], kIq2sGrid[index], signs[l], y);
    }
  }
}

inline void dequantize_block(BlockIQ3_XXS const& b, float* y) {
  float const d = detail::fp32(b.d);
  std::uint8_t const* qs = b.qs;
  std::uint8_t const* scales_and_signs = b.qs + 64;
  for (int ib32 = 0; ib32 < 8; ++ib32, qs += 8) {
    std::uint32_t const aux = detail::load_le32(scales_and_signs + 4 * ib32);
    float const db = detail::half_step_scale(d, aux >> 28, 0.5f);
    for (int l = 0; l < 4; ++l, y += 8) {
      detail::grid4x2(db, kIq3xxsGrid[qs[2 * l]], kIq3xxsGrid[qs[2 * l + 1]],
                      kKsignsIq2xs[(aux >> (7 * l)) & 127], y);
    }
  }
}

inline void dequantize_block(BlockIQ3_S const& b, float* y) {
  float const d = detail::fp32(b.d);
  std::uint8_t const* qs = b.qs;
  std::uint8_t const* signs = b.signs;
  for (int ib32 = 0; ib32 < 8; ++ib32, qs += 8, signs += 4) {
    // 32-blocks 2k and 2k + 1 share scales[k]: low nibble, then high.
    int const s = ib32 % 2 == 0 ? b.scales[ib32 / 2] & 0xF : b.scales[ib32 / 2] >> 4;
    float const db = detail::mul(d, static_cast<float>(1 + 2 * s));
    int const qh = b.qh[ib32];
    for (int l = 0; l < 4; ++l, y += 8) {
      int const i1 = qs[2 * l] | ((qh << (8 - 2 * l)) & 256);
      int const i2 = qs[2 * l + 1] | ((qh << (7 - 2 * l)) & 256);
      detail::grid4x2(db, kIq3sGrid[i1], kIq3sGrid[i2], signs[l], y);
    }
  }
}

inline void dequantize_block(BlockIQ1_S const& b, float* y) {
  float const d = detail::fp32(b.d);
  std::uint8_t const* qs = b.qs;
  for (int ib = 0; ib < 8; ++ib, qs += 4) {
    std::uint16_t const qh = b.qh[ib];
    float const dl = detail::mul(d, static_cast<float>(2 * ((qh >> 12) & 7) + 1));
    float const delta = (qh & 0x8000) != 0 ? -kIq1Delta : kIq1Delta;
    for (int l = 0; l < 4; ++l, y += 8) {
      std::uint64_t const entry = kIq1sGrid[qs[l] | (((qh >> (3 * l)) & 7) << 8)];
      for (int j = 0; j < 8; ++j) y[j] = detail::mul(dl, detail::grid_int8(entry, j) + delta);
    }
  }
}

/// IQ1_M's super-block scale: the fp16 whose 4 nibbles are the top nibbles of its 4 scale words.
inline std::uint16_t iq1m_scale_bits(BlockIQ1_M const& b) {
  std::uint16_t sc[4];
  for (int k = 0; k < 4; ++k) {
    sc[k] = static_cast<std::uint16_t>(b.scales[2 * k] | (b.scales[2 * k + 1] << 8));
  }
  return static_cast<std::uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) |
                                    ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000));
}

inline void dequantize_block(BlockIQ1_M const& b, float* y) {
  float const d = detail::fp32(iq1m_scale_bits(b));
  std::uint8_t const* qs = b.qs;
  std::uint8_t const* qh = b.qh;
  for (int ib = 0; ib < 8; ++ib, qs += 4, qh += 2) {
    int const sc = b.scales[2 * (ib / 2)] | (b.scales[2 * (ib / 2) + 1] << 8);
    float const dl1 = detail::mul(d, static_cast<float>(2 * ((sc >> (6 * (ib % 2))) & 7) + 1));
    float const dl2 = detail::mul(d, static_cast<float>(2 * ((sc >> (6 * (ib % 2) + 3)) & 7) + 1));
    int const index[4] = {qs[0] | ((qh[0] << 8) & 0x700), qs[1] | ((qh[0] << 4) & 0x700),
                          qs[2] | ((qh[1] << 8) & 0x700), qs[3] | ((qh[1] << 4) & 0x700)};
    float const delta[4] = {
        (qh[0] & 0x08) != 0 ? -kIq1Delta : kIq1Delta, (qh[0] & 0x80) != 0 ? -kIq1Delta : kIq1Delta,
        (qh[1] & 0x08) != 0 ? -kIq1Delta : kIq1Delta, (qh[1] & 0x80) != 0 ? -kIq1Delta : kIq1Delta};
    for (int l = 0; l < 4; ++l, y += 8) {
      float const dl = l < 2 ? dl1 : dl2;
      std::uint64_t const entry = kIq1sGrid[index[l]];
      for (int j = 0; j < 8; ++j) y[j] = detail::mul(dl, detail::grid_int8(entry, j) + delta[l]);
    }
  }
}

/// Rows: n weights (a positive multiple of 256; moe::Error otherwise) from n / 256 blocks.
inline void dequantize_row_iq2_xxs(BlockIQ2_XXS const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq2_xxs", "quant::dequantize_row_iq2_xxs");
}
inline void dequantize_row_iq2_xs(BlockIQ2_XS const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq2_xs", "quant::dequantize_row_iq2_xs");
}
inline void dequantize_row_iq2_s(BlockIQ2_S const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq2_s", "quant::dequantize_row_iq2_s");
}
inline void dequantize_row_iq3_xxs(BlockIQ3_XXS const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq3_xxs", "quant::dequantize_row_iq3_xxs");
}
inline void dequantize_row_iq3_s(BlockIQ3_S const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq3_s", "quant::dequantize_row_iq3_s");
}
inline void dequantize_row_iq1_s(BlockIQ1_S const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq1_s", "quant::dequantize_row_iq1_s");
}
inline void dequantize_row_iq1_m(BlockIQ1_M const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq1_m", "quant::dequantize_row_iq1_m");
}

}  // namespace moe::quant
