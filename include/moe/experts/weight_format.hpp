// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// WeightFormat: how a packed weight matrix is stored (an expert's projections, an attention
/// projection, an LM head: any matrix the projection engine multiplies), its names, block formats
/// and bits, and the fallback chain of a format whose blocks do not divide a matrix's depth.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/quant/blocks.hpp"
#include "moe/quant/ggml_type.hpp"

namespace moe::experts {

/// Storage of packed weights (ExpertBank::pack per projection of each expert; moe::Linear for a
/// dense matrix: attention projections, LM head, dense MLPs).
enum class WeightFormat {
  kF32,     ///< fp32 panels: exact
  kBf16,    ///< bf16 panels: half the bytes; inference only (forward_train uses fp32)
  kQ8_0,    ///< GGUF Q8_0 blocks (8.5 bits a weight); inference only, like every quantized format
  kQ6_K,    ///< GGUF Q6_K (6.5625 bits, in bit planes in the kernel layout: kernels/quant_gemm.hpp)
  kQ4_K,    ///< GGUF Q4_K (4.5 bits)
  kQ4_0,    ///< GGUF Q4_0 (4.5 bits)
  kQ3_K,    ///< GGUF Q3_K (3.4375 bits; the kernel layout's int8 sub-block scales make it 3.5625)
  kQ2_K,    ///< GGUF Q2_K (2.625 bits, in the kernel layout too)
  kQ5_K,    ///< GGUF Q5_K (5.5 bits; Q4_K's nibbles and a bit plane: 5.625 in the kernel layout)
  kQ5_0,    ///< GGUF Q5_0 (5.5 bits; Q5_K's level layout under Q4_0's scales, 5.5 in the kernels)
  kQ4_1,    ///< GGUF Q4_1 (5 bits: Q4_0's levels, an fp16 scale and an fp16 min per 32)
  kQ5_1,    ///< GGUF Q5_1 (6 bits: Q5_0's levels, an fp16 scale and an fp16 min per 32)
  kIQ4_NL,  ///< GGUF IQ4_NL (4.5 bits: Q4_0's shape, the nibbles index kvalues_iq4nl)
  kIQ4_XS,  ///< GGUF IQ4_XS (4.25 bits; int8 sub-block scales: 4.3125 in the kernel layout)
  kMXFP4,   ///< GGUF MXFP4 (4.25 bits: E2M1 codes under an E8M0 scale; 4.5 in the kernel layout)
};

/// The formats of one expert's two projections (in = gate and up, down).
struct ExpertFormat {
  WeightFormat in = WeightFormat::kF32;
  WeightFormat down = WeightFormat::kF32;
  bool operator==(ExpertFormat const&) const = default;
};

/// The block formats, in order of falling precision (quant::kFormats' order).
inline constexpr WeightFormat kBlockFormats[] = {
    WeightFormat::kQ8_0,   WeightFormat::kQ6_K, WeightFormat::kQ5_K,   WeightFormat::kQ5_1,
    WeightFormat::kQ5_0,   WeightFormat::kQ4_K, WeightFormat::kIQ4_XS, WeightFormat::kQ4_1,
    WeightFormat::kIQ4_NL, WeightFormat::kQ4_0, WeightFormat::kMXFP4,  WeightFormat::kQ3_K,
    WeightFormat::kQ2_K};

/// Is f one of the GGUF block formats (multiplied by the integer kernels)?
constexpr bool is_quantized(WeightFormat f) {
  return f != WeightFormat::kF32 && f != WeightFormat::kBf16;
}
/// The block format of a quantized WeightFormat.
constexpr quant::Format quant_format(WeightFormat f) {
  switch (f) {
    case WeightFormat::kQ6_K:
      return quant::Format::kQ6_K;
    case WeightFormat::kQ5_K:
      return quant::Format::kQ5_K;
    case WeightFormat::kQ5_0:
      return quant::Format::kQ5_0;
    case WeightFormat::kQ4_1:
      return quant::Format::kQ4_1;
    case WeightFormat::kQ5_1:
      return quant::Format::kQ5_1;
    case WeightFormat::kIQ4_NL:
      return quant::Format::kIQ4_NL;
    case WeightFormat::kIQ4_XS:
      return quant::Format::kIQ4_XS;
    case WeightFormat::kMXFP4:
      return quant::Format::kMXFP4;
    case WeightFormat::kQ4_K:
      return quant::Format::kQ4_K;
    case WeightFormat::kQ4_0:
      return quant::Format::kQ4_0;
    case WeightFormat::kQ3_K:
      return quant::Format::kQ3_K;
    case WeightFormat::kQ2_K:
      return quant::Format::kQ2_K;
    default:
      return quant::Format::kQ8_0;
  }
}
/// "fp32", "bf16", and the block formats' quant::name: "q8_0", "q6_k", ..., "q2_k".
constexpr char const* name(WeightFormat f) {
  return f == WeightFormat::kF32    ? "fp32"
         : f == WeightFormat::kBf16 ? "bf16"
                                    : quant::name(quant_format(f));
}
/// Parses name(f) (case-insensitive; "f32" is fp32 too); moe::Error for anything else.
inline WeightFormat parse_weight_format(std::string_view s) {
  std::string lower(s);
  for (char& c : lower) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (lower == "fp32" || lower == "f32") return WeightFormat::kF32;
  if (lower == "bf16") return WeightFormat::kBf16;
  std::string names = "fp32, bf16";
  for (WeightFormat const f : kBlockFormats) {
    if (lower == name(f)) return f;
    names += std::string(", ") + name(f);
  }
  detail::fail("parse_weight_format: unknown weight format '", s, "'; use one of ", names);
}
/// Bits per weight of a format as stored by ExpertBank::pack (scales included).
constexpr double bits_per_weight(WeightFormat f) {
  return f == WeightFormat::kF32    ? 32.0
         : f == WeightFormat::kBf16 ? 16.0
                                    : quant::bits_per_weight(quant_format(f));
}

/// Can a matrix of depth K (its input width, the length of a row of W [N, K]) be stored in `f`?
/// fp32 and bf16 hold any K >= 1; a GGUF block format needs K to be a multiple of its block
/// (32 for Q8_0, Q5_1, Q5_0, Q4_1, IQ4_NL, Q4_0 and MXFP4, 256 for the K-quants and IQ4_XS).
constexpr bool holds_depth(WeightFormat f, Index K) {
  return K >= 1 && (!is_quantized(f) || K % quant::block_elems(quant_format(f)) == 0);
}

/// The next format of the fallback chain, for a matrix whose depth `f` cannot hold; each step
/// keeps about the size or grows it, never the other way (llama.cpp's quantizer does the same per
/// tensor, with Q5_0 where moe has Q4_0):
///   q2_k, q3_k, q4_k -> q4_0 -> q8_0 -> bf16;   q5_k -> q5_1 -> q8_0 -> bf16;
///   iq4_xs -> iq4_nl -> q8_0 -> bf16;   q6_k, q5_0, q4_1, mxfp4 -> q8_0 -> bf16;
///   bf16, fp32: none.
/// (q5_k goes to q5_1 and iq4_xs to iq4_nl, as llama.cpp sends them; q5_k not to q4_0, whose 4.5
/// bits would lose one of its 5.5; the 32-block formats all hold the same depths, so from one of
/// them the chain ends in bf16.)
constexpr WeightFormat fallback_format(WeightFormat f) {
  switch (f) {
    case WeightFormat::kQ2_K:
    case WeightFormat::kQ3_K:
    case WeightFormat::kQ4_K:
      return WeightFormat::kQ4_0;
    case WeightFormat::kQ5_K:
      return WeightFormat::kQ5_1;
    case WeightFormat::kIQ4_XS:
      return WeightFormat::kIQ4_NL;
    case WeightFormat::kQ6_K:
    case WeightFormat::kQ5_0:
    case WeightFormat::kQ4_1:
    case WeightFormat::kQ5_1:
    case WeightFormat::kIQ4_NL:
    case WeightFormat::kQ4_0:
    case WeightFormat::kMXFP4:
      return WeightFormat::kQ8_0;
    case WeightFormat::kQ8_0:
    case WeightFormat::kBf16:
      return WeightFormat::kBf16;
    default:
      return WeightFormat::kF32;
  }
}

/// The format a matrix of depth K asked to be `f` gets: f when it holds K, else the first format
/// of f's fallback chain that does (bf16 at the latest). Precondition: K >= 1.
constexpr WeightFormat resolve_format(WeightFormat f, Index K) {
  while (!holds_depth(f, K)) f = fallback_format(f);
  return f;
}

/// The formats of the chain from `f` on that hold depth K, as "q4_0, q8_0, bf16": what an error
/// message may suggest instead of a format that cannot hold the shape.
inline std::string formats_holding(WeightFormat f, Index K) {
  std::string out;
  for (WeightFormat g = f;; g = fallback_format(g)) {
    if (holds_depth(g, K)) out += (out.empty() ? "" : ", ") + std::string(name(g));
    if (g == WeightFormat::kBf16 || g == WeightFormat::kF32) break;
  }
  return out + (out.find("fp32") == std::string::npos ? ", fp32" : "");
}

/// The ggml tensor type that stores a format's values exactly as the format does (kF32: F32,
/// kBf16: BF16, a block format: its GGUF type): what a GGUF file or a moe_quantize checkpoint
/// records for a matrix stored in `f`.
constexpr quant::GgmlType ggml_type(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32:
      return quant::GgmlType::kF32;
    case WeightFormat::kBf16:
      return quant::GgmlType::kBF16;
    case WeightFormat::kQ8_0:
      return quant::GgmlType::kQ8_0;
    case WeightFormat::kQ6_K:
      return quant::GgmlType::kQ6_K;
    case WeightFormat::kQ4_K:
      return quant::GgmlType::kQ4_K;
    case WeightFormat::kQ4_0:
      return quant::GgmlType::kQ4_0;
    case WeightFormat::kQ3_K:
      return quant::GgmlType::kQ3_K;
    case WeightFormat::kQ2_K:
      return quant::GgmlType::kQ2_K;
    case WeightFormat::kQ5_K:
      return quant::GgmlType::kQ5_K;
    case WeightFormat::kQ5_0:
      return quant::GgmlType::kQ5_0;
    case WeightFormat::kQ4_1:
      return quant::GgmlType::kQ4_1;
    case WeightFormat::kQ5_1:
      return quant::GgmlType::kQ5_1;
    case WeightFormat::kIQ4_NL:
      return quant::GgmlType::kIQ4_NL;
    case WeightFormat::kIQ4_XS:
      return quant::GgmlType::kIQ4_XS;
    case WeightFormat::kMXFP4:
      return quant::GgmlType::kMXFP4;
  }
  return quant::GgmlType::kF32;
}

/// The format that multiplies ggml type `t` as stored (its blocks re-packed for the kernels, the
/// values unchanged): F32, BF16 and the block formats' types (Q8_0, Q6_K, Q5_K, Q5_1, Q5_0,
/// Q4_K, IQ4_XS, Q4_1, IQ4_NL, Q4_0, MXFP4, Q3_K, Q2_K) have one; nullopt for the others (F16,
/// the IQ1-IQ3 types, ...), which moe decodes at load.
constexpr std::optional<WeightFormat> native_format(quant::GgmlType t) {
  if (t == quant::GgmlType::kF32) return WeightFormat::kF32;
  if (t == quant::GgmlType::kBF16) return WeightFormat::kBf16;
  for (WeightFormat const f : kBlockFormats) {
    if (ggml_type(f) == t) return f;
  }
  return std::nullopt;
}

/// The format a matrix stored as ggml type `t` is loaded into when no format is asked for: its
/// native format, else (a block type without a kernel in moe: IQ1..IQ3) q8_0, which holds
/// each of them to within a 255th of its block's largest weight at 8.5 bits a weight (the weights
/// are decoded bit-exactly with ggml, then quantized with Q8_0's fast reference quantizer), and
/// fp32 for F16 and the other float types.
constexpr WeightFormat load_format(quant::GgmlType t) {
  if (std::optional<WeightFormat> const f = native_format(t)) return *f;
  return quant::ggml_type_info(t).quantized ? WeightFormat::kQ8_0 : WeightFormat::kF32;
}

/// The arithmetic of training forwards and backwards over an expert bank
/// (ExpertBank::set_train_compute, FfnLayerBase::set_train_compute).
enum class TrainCompute {
  kF32,   ///< fp32 operands and accumulation (the default): exact
  kBf16,  ///< bf16 operands, fp32 accumulation, fp32 master weights and gradients (opt-in)
};

}  // namespace moe::experts
