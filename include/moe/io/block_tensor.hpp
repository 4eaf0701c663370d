// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Matrices a checkpoint stores as ggml blocks, row by row: a U8 tensor [rows, row bytes] that
/// the checkpoint's metadata marks "moe.quant.<tensor name>" = its ggml type, lower case ("q4_k",
/// "q6_k", "iq2_xxs", ...). save_hf_layer_quantized (moe_quantize) writes them; gguf_as_hf
/// (moe/io/gguf/hf_view.hpp) presents a GGUF file's quantized tensors this way, in place in the
/// mapped file. The loaders multiply a block tensor as stored when its type has a kernel
/// (experts::native_format: the blocks are re-packed, never re-quantized) and decode it
/// (bit-exact with ggml) otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/safetensors/sharded.hpp"
#include "moe/io/safetensors/tensor_view.hpp"
#include "moe/quant/ggml_dequantize.hpp"
#include "moe/quant/ggml_type.hpp"

namespace moe::io {

/// The metadata key that records how tensor `name` is stored ("moe.quant.<name>").
inline std::string block_type_key(std::string_view name) {
  return detail::concat("moe.quant.", name);
}

/// The ggml type a "moe.quant.*" value names: a ggml type name in any case ("q4_k", "Q4_K",
/// "iq2_xxs") or a WeightFormat name ("fp32", "bf16"); nullopt for anything else.
inline std::optional<quant::GgmlType> parse_block_type(std::string_view value) {
  std::string upper(value);
  for (char& c : upper) c = static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  if (upper == "FP32") return quant::GgmlType::kF32;
  return quant::parse_ggml_type(upper);
}

/// The lower-case name a "moe.quant.*" entry records for type `t` ("q4_k").
inline std::string block_type_value(quant::GgmlType t) {
  std::string s(quant::ggml_type_name(t));
  for (char& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return s;
}

/// A matrix [rows, cols] stored as ggml blocks of a quantized type, row by row: row r is
/// row_bytes() bytes at bytes.data() + r * row_bytes(), exactly a GGUF tensor of ne = {cols,
/// rows}. A view: the checkpoint keeps the bytes alive.
struct BlockTensor {
  quant::GgmlType type = quant::GgmlType::kQ8_0;
  Index rows = 0, cols = 0;
  std::span<std::byte const> bytes;

  Index row_bytes() const {
    quant::GgmlTypeInfo const& info = quant::ggml_type_info(type);
    return cols / static_cast<Index>(info.block_elements) * static_cast<Index>(info.block_bytes);
  }
  std::byte const* row(Index r) const { return bytes.data() + r * row_bytes(); }
  /// The format that multiplies these blocks as stored, or nullopt (experts::native_format).
  std::optional<experts::WeightFormat> native() const { return experts::native_format(type); }
  /// Does `f` multiply these blocks as stored (f is their native format)?
  bool runs_as(experts::WeightFormat f) const { return native() == f; }
  /// The values the blocks encode, [rows, cols] row-major (ggml's dequantizers, bit-exact).
  std::vector<float> dequantize() const {
    std::vector<float> out(static_cast<std::size_t>(rows * cols));
    if (reinterpret_cast<std::uintptr_t>(bytes.data()) % 2 == 0) {
      quant::ggml_dequantize(type, bytes, rows * cols, out.data());
      return out;
    }
    // ggml's block structs are read in place from 2-aligned bytes: copy a misaligned view first.
    std::vector<std::byte> aligned(bytes.begin(), bytes.end());
    quant::ggml_dequantize(type, aligned, rows * cols, out.data());
    return out;
  }
};

/// Tensor `name` of `ckpt` as a BlockTensor of logical shape {rows, cols} when the checkpoint
/// marks it as ggml blocks of a quantized type; nullopt when it is stored as floats (unmarked, or
/// marked "fp32", "bf16" or "f16") or absent. Checked from the header alone: a mark naming no
/// ggml type, a type moe cannot decode, a width that is not whole blocks, or a view that is not
/// U8 [rows, cols / block elements * block bytes] throws moe::Error naming the file and tensor.
inline std::optional<BlockTensor> find_block_tensor(ShardedCheckpoint const& ckpt,
                                                    std::string const& name, Index rows,
                                                    Index cols) {
  std::string const* mark = ckpt.shard_metadata(name, block_type_key(name));
  if (mark == nullptr) return std::nullopt;
  std::string const& src = ckpt.source();
  std::optional<quant::GgmlType> const type = parse_block_type(*mark);
  moe::detail::check(type.has_value(), "io: ", src, ": tensor ", detail::printable_name(name),
                     " is marked as stored in '", detail::printable_name(*mark),
                     "', which is no ggml type or weight format; the checkpoint is corrupt or "
                     "needs a newer moe");
  quant::GgmlTypeInfo const& info = quant::ggml_type_info(*type);
  if (!info.quantized) return std::nullopt;
  moe::detail::check(quant::ggml_can_dequantize(*type), "io: ", src, ": tensor ",
                     detail::printable_name(name), " is stored as ", info.name,
                     ", which moe cannot read (activation-only or unsupported blocks)");
  moe::detail::check(cols % static_cast<Index>(info.block_elements) == 0, "io: ", src, ": tensor ",
                     detail::printable_name(name), " is stored as ", info.name, " but its rows of ",
                     cols, " weights are not whole ", info.block_elements, "-blocks");
  BlockTensor t{*type, rows, cols, {}};
  TensorView const* view = ckpt.find(name);
  moe::detail::check(view != nullptr, "io: ", src, ": tensor ", detail::printable_name(name),
                     " is marked as ", info.name, " but is missing");
  std::vector<std::int64_t> const want = {rows, t.row_bytes()};
  moe::detail::check(view->dtype == Dtype::kU8 && view->shape == want, "io: ", src, ": tensor ",
                     detail::printable_name(name), " is marked ", block_type_value(*type),
                     " but is ", dtype_name(view->dtype), " ", detail::shape_string(view->shape),
                     "; a ", block_type_value(*type), " tensor of [", rows, ", ", cols, "] is U8 ",
                     detail::shape_string(want), " (GGUF blocks, row by row)");
  t.bytes = view->bytes;
  return t;
}

}  // namespace moe::io
