// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Decoding any GGUF tensor's bytes to floats by its GgmlType: the float types, the integer
/// types and every block format moe reads (quant/blocks.hpp, quant/ggml_blocks.hpp,
/// quant/ggml_iq_blocks.hpp), bit-exact with ggml's dequantize_row_* functions.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>

#include "moe/core/error.hpp"
#include "moe/core/float16.hpp"
#include "moe/core/types.hpp"
#include "moe/quant/blocks.hpp"
#include "moe/quant/ggml_blocks.hpp"
#include "moe/quant/ggml_iq_blocks.hpp"
#include "moe/quant/ggml_type.hpp"

namespace moe::quant {

/// Can ggml_dequantize() decode `type`? Every type but the activation-only Q8_1 and Q8_K, the
/// ternary TQ1_0 / TQ2_0 and the newest NVFP4, Q1_0 and Q2_0.
constexpr bool ggml_can_dequantize(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::kQ8_1:
    case GgmlType::kQ8_K:
    case GgmlType::kTQ1_0:
    case GgmlType::kTQ2_0:
    case GgmlType::kNVFP4:
    case GgmlType::kQ1_0:
    case GgmlType::kQ2_0:
      return false;
    default:
      return true;
  }
}

namespace detail {
template <class T, class Decode>
void decode_elements(std::byte const* in, Index n, float* out, Decode decode) {
  for (Index i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, in + i * static_cast<Index>(sizeof(T)), sizeof(T));
    out[i] = decode(v);
  }
}
template <class Block, class Row>
void decode_blocks(std::byte const* in, Index n, float* out, Row row) {
  static_assert(alignof(Block) <= 2, "GGUF blocks are read in place from 2-aligned rows");
  row(reinterpret_cast<Block const*>(in), out, n);
}
}  // namespace detail

/// Decodes the `n` elements whose bytes are `in` (n / block elements * block bytes of them, as
/// ggml_type_info(type) says) into out[0, n). `n` must be a multiple of the type's block and
/// `in` 2-aligned (GGUF tensor data is). The integer types convert exactly where a float can
/// hold the value (I32 / I64 round to nearest beyond 2^24); F64 beyond float's range gives
/// the infinity of its sign, NaN stays NaN. Throws moe::Error naming the type
/// for a type ggml_can_dequantize() refuses, a wrong byte count or a partial block.
inline void ggml_dequantize(GgmlType type, std::span<std::byte const> in, Index n, float* out) {
  GgmlTypeInfo const* info = ggml_type_info(static_cast<std::uint32_t>(type));
  moe::detail::check(info != nullptr, "quant::ggml_dequantize: unknown ggml type ",
                     static_cast<std::uint32_t>(type));
  moe::detail::check(ggml_can_dequantize(type), "quant::ggml_dequantize: ", info->name,
                     " tensors cannot be read by moe (activation-only or unsupported block "
                     "format); convert the file with another type for this tensor");
  auto const elems = static_cast<Index>(info->block_elements);
  moe::detail::check(n >= 0 && n % elems == 0, "quant::ggml_dequantize: ", n, " elements of ",
                     info->name, " are not whole ", elems, "-element blocks");
  auto const bytes = static_cast<std::size_t>(n / elems) * info->block_bytes;
  moe::detail::check(in.size() == bytes, "quant::ggml_dequantize: ", n, " elements of ", info->name,
                     " take ", bytes, " bytes, but ", in.size(), " were given");
  if (n == 0) return;
  std::byte const* p = in.data();
  switch (type) {
    case GgmlType::kF32:
      return detail::decode_elements<float>(p, n, out, [](float v) { return v; });
    case GgmlType::kF64:
      return detail::decode_elements<double>(p, n, out, [](double v) {
        // Out of float's range: the infinity of its sign (a plain cast would be undefined).
        return std::fabs(v) > std::numeric_limits<float>::max()
                   ? std::copysign(std::numeric_limits<float>::infinity(),
                                   static_cast<float>(v > 0 ? 1 : -1))
                   : static_cast<float>(v);
      });
    case GgmlType::kF16:
      return detail::decode_elements<std::uint16_t>(p, n, out, moe::f16_to_float);
    case GgmlType::kBF16:
      return detail::decode_elements<std::uint16_t>(p, n, out, moe::bf16_to_float);
    case GgmlType::kI8:
      return detail::decode_elements<std::int8_t>(p, n, out,
                                                  [](std::int8_t v) { return float(v); });
    case GgmlType::kI16:
      return detail::decode_elements<std::int16_t>(p, n, out,
                                                   [](std::int16_t v) { return float(v); });
    case GgmlType::kI32:
      return detail::decode_elements<std::int32_t>(
          p, n, out, [](std::int32_t v) { return static_cast<float>(v); });
    case GgmlType::kI64:
      return detail::decode_elements<std::int64_t>(
          p, n, out, [](std::int64_t v) { return static_cast<float>(v); });
    case GgmlType::kQ8_0:
      return dequantize_row(Format::kQ8_0, p, n, out);
    case GgmlType::kQ4_0:
      return dequantize_row(Format::kQ4_0, p, n, out);
    case GgmlType::kQ2_K:
      return dequantize_row(Format::kQ2_K, p, n, out);
    case GgmlType::kQ3_K:
      return dequantize_row(Format::kQ3_K, p, n, out);
    case GgmlType::kQ4_K:
      return dequantize_row(Format::kQ4_K, p, n, out);
    case GgmlType::kQ6_K:
      return dequantize_row(Format::kQ6_K, p, n, out);
    case GgmlType::kQ4_1:
      return detail::decode_blocks<BlockQ4_1>(p, n, out, dequantize_row_q4_1);
    case GgmlType::kQ5_0:
      return detail::decode_blocks<BlockQ5_0>(p, n, out, dequantize_row_q5_0);
    case GgmlType::kQ5_1:
      return detail::decode_blocks<BlockQ5_1>(p, n, out, dequantize_row_q5_1);
    case GgmlType::kQ5_K:
      return dequantize_row(Format::kQ5_K, p, n, out);
    case GgmlType::kIQ4_NL:
      return detail::decode_blocks<BlockIQ4_NL>(p, n, out, dequantize_row_iq4_nl);
    case GgmlType::kIQ4_XS:
      return detail::decode_blocks<BlockIQ4_XS>(p, n, out, dequantize_row_iq4_xs);
    case GgmlType::kMXFP4:
      return detail::decode_blocks<BlockMXFP4>(p, n, out, dequantize_row_mxfp4);
    case GgmlType::kIQ2_XXS:
      return detail::decode_blocks<BlockIQ2_XXS>(p, n, out, dequantize_row_iq2_xxs);
    case GgmlType::kIQ2_XS:
      return detail::decode_blocks<BlockIQ2_XS>(p, n, out, dequantize_row_iq2_xs);
    case GgmlType::kIQ2_S:
      return detail::decode_blocks<BlockIQ2_S>(p, n, out, dequantize_row_iq2_s);
    case GgmlType::kIQ3_XXS:
      return detail::decode_blocks<BlockIQ3_XXS>(p, n, out, dequantize_row_iq3_xxs);
    case GgmlType::kIQ3_S:
      return detail::decode_blocks<BlockIQ3_S>(p, n, out, dequantize_row_iq3_s);
    case GgmlType::kIQ1_S:
      return detail::decode_blocks<BlockIQ1_S>(p, n, out, dequantize_row_iq1_s);
    case GgmlType::kIQ1_M:
      return detail::decode_blocks<BlockIQ1_M>(p, n, out, dequantize_row_iq1_m);
    default:
      break;
  }
  moe::detail::fail("quant::ggml_dequantize: ", info->name, " has no decoder");
}

}  // namespace moe::quant
