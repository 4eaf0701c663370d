// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// More GGUF weight blocks, for reading GGUF files: typed row entry points for ggml's Q4_1, Q5_0,
/// Q5_1, Q5_K, IQ4_NL and IQ4_XS, which are also quant::Formats with kernels, and MXFP4 (their
/// blocks, quantizers and decoders are in blocks.hpp; the byte layouts are ggml-common.h's):
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

/// Weights per block of a ggml block type.
template <class Block>
inline constexpr Index block_elems_v = 32;
template <>
inline constexpr Index block_elems_v<BlockQ5_K> = 256;
template <>
inline constexpr Index block_elems_v<BlockIQ4_XS> = 256;

namespace detail {

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
