// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// More GGUF weight blocks, for reading GGUF files: typed row entry points for ggml's Q4_1, Q5_0,
/// Q5_1, Q5_K, IQ4_NL and IQ4_XS, which are also quant::Formats with kernels (their blocks,
/// quantizers and decoders are in blocks.hpp), and the byte layout of MXFP4 (ggml-common.h);
/// their reference dequantizers
/// (ggml-quants.c: dequantize_row_*) and reference quantizers (quantize_row_*_ref), written
/// here from those definitions, and F16 / BF16 rows. A row of n weights is n / block_elems_v<B>
/// consecutive blocks, as in a GGUF tensor. Per format (d, m, dmin: fp16; q: the level):
///
/// - Q4_1: 32 weights in 20 bytes (5 bits a weight): d, m, 16 bytes of nibbles;
///   weight j = d * q + m, q in [0, 16) (j < 16: low nibble of qs[j]; else high of qs[j - 16]).
/// - Q5_0: 32 in 22 (5.5): d, qh (the 5th bits, bit j for weight j), 16 bytes of nibbles;
///   d * (q - 16), q in [0, 32).
/// - Q5_1: 32 in 24 (6): d, m, qh, nibbles; d * q + m, q in [0, 32).
/// - Q5_K: 256 in 176 (5.5): d, dmin, 12 bytes of 6-bit scales and mins packed as Q4_K's,
///   32 bytes of 5th bits, 128 of nibbles; d * sc[i / 32] * q - dmin * m[i / 32]. Q5_K is also a
///   quant::Format with kernels (kQ5_K): its block, quantizer and decoder are in blocks.hpp,
///   and dequantize_row_q5_k / quantize_row_q5_k_ref here are typed entry points to them.
/// - IQ4_NL: 32 in 18 (4.5): d, nibbles as Q4_0's; d * kIq4nlValues[q].
/// - IQ4_XS: 256 in 136 (4.25): d, 8 6-bit scales (high 2 bits in scales_h, low 4 in
///   scales_l), nibbles per 32; d * (ls[i / 32] - 32) * kIq4nlValues[q].
/// - MXFP4: 32 in 17 (4.25): an E8M0 exponent e and nibbles as Q4_0's; an E2M1 value per
///   nibble. ggml stores the E2M1 values doubled (kMxfp4Values) and halves the scale instead:
///   weight = kMxfp4Values[q] * 2^(e - 128) (ggml_e8m0_to_fp32_half), the same number as
///   e2m1(q) * 2^(e - 127).
///
/// As in blocks.hpp the arithmetic is ggml's operation for operation, each product rounded
/// before it is added (detail::mul), so the bytes and floats do not depend on compiler flags;
/// multi-byte fields are read as the host's integers (little-endian hosts, as GGUF). Typed
/// pointers must be aligned for the block (alignof is 1 or 2; GGUF tensor data is 32-aligned).
/// NaN policy as blocks.hpp's: the quantizers refuse a non-finite weight (moe::Error naming its
/// position); the dequantizers decode any bytes. Where ggml's reference is undefined (a
/// float-to-int conversion of a NaN or out-of-range value, an uninitialized level), moe's
/// choice is documented at the function; everywhere else the bytes are ggml's.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "moe/core/error.hpp"
#include "moe/core/float16.hpp"
#include "moe/core/types.hpp"
#include "moe/quant/blocks.hpp"

namespace moe::quant {

/// ggml block types, byte for byte (static_asserts below check the sizes).
struct BlockMXFP4 {
  std::uint8_t e;       ///< E8M0 shared exponent
  std::uint8_t qs[16];  ///< E2M1 codes (kMxfp4Values), as Q4_0's nibbles
};
static_assert(sizeof(BlockMXFP4) == 17);

/// Weights per block of a ggml block type.
template <class Block>
inline constexpr Index block_elems_v = 32;
template <>
inline constexpr Index block_elems_v<BlockQ5_K> = 256;
template <>
inline constexpr Index block_elems_v<BlockIQ4_XS> = 256;

/// ggml's kvalues_mxfp4 (kvalues_fp4): the E2M1 values doubled, codes 8..15 the negatives
/// (code 8, -0, decodes as +0).
inline constexpr std::int8_t kMxfp4Values[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                                 0, -1, -2, -3, -4, -6, -8, -12};

namespace detail {

/// ggml_e8m0_to_fp32_half: 2^(e - 128) as a float (e = 0, 1: the subnormals 2^-128, 2^-127;
/// e = 255 gives 2^127, no NaN, as ggml's).
inline float e8m0_to_fp32_half(std::uint8_t e) {
  std::uint32_t const bits = e < 2 ? 0x00200000u << e : static_cast<std::uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

/// Checks that a row of n weights is whole blocks of `elems` (n a positive multiple).
inline void check_block_row(Index n, Index elems, char const* format, char const* who) {
  moe::detail::check(n > 0 && n % elems == 0, who, ": rows of ", n, " weights cannot be ", format,
                     " (its blocks hold ", elems,
                     " weights; GGUF rows are whole blocks); pass a positive multiple of ", elems);
}

/// Checks that the n weights at x are finite (the quantizers' precondition).
inline void check_finite_row(float const* x, Index n, char const* who) {
  for (Index i = 0; i < n; ++i) {
    moe::detail::check(std::isfinite(x[i]), who, ": weight ", i, " of the row is ", x[i],
                       "; only finite weights can be quantized (fix or drop the tensor)");
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// One block (ggml quantize_row_*_ref and dequantize_row_* for one block), overloads of
// blocks.hpp's quantize_block / dequantize_block.

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

// ---------------------------------------------------------------------------------------------
// Rows: n weights (a positive multiple of block_elems_v<Block>; moe::Error otherwise) from or to
// n / block_elems_v<Block> blocks. The quantizers also throw moe::Error for a non-finite weight.

namespace detail {
template <class Block>
void dequantize_ggml_row(Block const* blocks, float* out, Index n, char const* format,
                         char const* who) {
  constexpr Index elems = block_elems_v<Block>;
  check_block_row(n, elems, format, who);
  for (Index b = 0; b < n / elems; ++b) dequantize_block(blocks[b], out + b * elems);
}
template <class Block>
void quantize_ggml_row(float const* x, Block* blocks, Index n, char const* format,
                       char const* who) {
  constexpr Index elems = block_elems_v<Block>;
  check_block_row(n, elems, format, who);
  check_finite_row(x, n, who);
  for (Index b = 0; b < n / elems; ++b) {
    Block blk;
    std::memset(&blk, 0, sizeof blk);
    quantize_block(x + b * elems, blk);
    blocks[b] = blk;
  }
}
}  // namespace detail

inline void dequantize_row_q4_1(BlockQ4_1 const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "q4_1", "quant::dequantize_row_q4_1");
}
inline void dequantize_row_q5_0(BlockQ5_0 const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "q5_0", "quant::dequantize_row_q5_0");
}
inline void dequantize_row_q5_1(BlockQ5_1 const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "q5_1", "quant::dequantize_row_q5_1");
}
inline void dequantize_row_q5_k(BlockQ5_K const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "q5_k", "quant::dequantize_row_q5_k");
}
inline void dequantize_row_iq4_nl(BlockIQ4_NL const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq4_nl", "quant::dequantize_row_iq4_nl");
}
inline void dequantize_row_iq4_xs(BlockIQ4_XS const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "iq4_xs", "quant::dequantize_row_iq4_xs");
}
inline void dequantize_row_mxfp4(BlockMXFP4 const* blocks, float* out, Index n) {
  detail::dequantize_ggml_row(blocks, out, n, "mxfp4", "quant::dequantize_row_mxfp4");
}

inline void quantize_row_q4_1_ref(float const* x, BlockQ4_1* blocks, Index n) {
  detail::quantize_ggml_row(x, blocks, n, "q4_1", "quant::quantize_row_q4_1_ref");
}
inline void quantize_row_q5_0_ref(float const* x, BlockQ5_0* blocks, Index n) {
  detail::quantize_ggml_row(x, blocks, n, "q5_0", "quant::quantize_row_q5_0_ref");
}
inline void quantize_row_q5_1_ref(float const* x, BlockQ5_1* blocks, Index n) {
  detail::quantize_ggml_row(x, blocks, n, "q5_1", "quant::quantize_row_q5_1_ref");
}
inline void quantize_row_q5_k_ref(float const* x, BlockQ5_K* blocks, Index n) {
  detail::quantize_ggml_row(x, blocks, n, "q5_k", "quant::quantize_row_q5_k_ref");
}
inline void quantize_row_iq4_xs_ref(float const* x, BlockIQ4_XS* blocks, Index n) {
  detail::quantize_ggml_row(x, blocks, n, "iq4_xs", "quant::quantize_row_iq4_xs_ref");
}
inline void quantize_row_mxfp4_ref(float const* x, BlockMXFP4* blocks, Index n) {
  detail::quantize_ggml_row(x, blocks, n, "mxfp4", "quant::quantize_row_mxfp4_ref");
}
/// IQ4_NL's levels of a block whose weights are all below 1e-15 in magnitude are the previous
/// block's (ggml's reference leaves its level buffer as it was; for the row's first block,
/// uninitialized in ggml, zero here). They decode to +-0 either way (d = 0).
inline void quantize_row_iq4_nl_ref(float const* x, BlockIQ4_NL* blocks, Index n) {
  char const* who = "quant::quantize_row_iq4_nl_ref";
  detail::check_block_row(n, 32, "iq4_nl", who);
  detail::check_finite_row(x, n, who);
  std::uint8_t L[32] = {};
  for (Index b = 0; b < n / 32; ++b) {
    BlockIQ4_NL blk;
    std::memset(&blk, 0, sizeof blk);
    quantize_block(x + b * 32, blk, L);
    blocks[b] = blk;
  }
}

/// F16 and BF16 rows: n >= 0 values converted one by one (moe/core/float16.hpp; to 16 bits with
/// round-to-nearest-even, NaN kept quiet, as ggml's conversions).
inline void dequantize_row_f16(std::uint16_t const* in, float* out, Index n) {
  moe::detail::check(n >= 0, "quant::dequantize_row_f16: negative length ", n);
  for (Index i = 0; i < n; ++i) out[i] = moe::f16_to_float(in[i]);
}
inline void dequantize_row_bf16(std::uint16_t const* in, float* out, Index n) {
  moe::detail::check(n >= 0, "quant::dequantize_row_bf16: negative length ", n);
  for (Index i = 0; i < n; ++i) out[i] = moe::bf16_to_float(in[i]);
}
inline void quantize_row_f16_ref(float const* x, std::uint16_t* out, Index n) {
  moe::detail::check(n >= 0, "quant::quantize_row_f16_ref: negative length ", n);
  for (Index i = 0; i < n; ++i) out[i] = moe::float_to_f16(x[i]);
}
inline void quantize_row_bf16_ref(float const* x, std::uint16_t* out, Index n) {
  moe::detail::check(n >= 0, "quant::quantize_row_bf16_ref: negative length ", n);
  for (Index i = 0; i < n; ++i) out[i] = moe::float_to_bf16(x[i]);
}

}  // namespace moe::quant
