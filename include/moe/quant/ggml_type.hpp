// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GgmlType: ggml's tensor types with their numeric ids (as stored in GGUF files), names and
/// block geometry (elements and bytes per block). Standard library only.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace moe::quant {

/// A ggml tensor type, with the numeric id ggml.h gives it (enum ggml_type). These ids are what a
/// GGUF tensor info stores. Ids 4, 5 (Q4_2, Q4_3), 31-33 (Q4_0_4_4, Q4_0_4_8, Q4_0_8_8) and
/// 36-38 (IQ4_NL_4_4, IQ4_NL_4_8, IQ4_NL_8_8) were removed from ggml and have no enumerator;
/// ggml_type_info() returns nullptr for them. Checked against ggml-org/ggml d99724f2
/// (include/ggml.h, src/ggml.c type_traits, src/ggml-common.h block static_asserts).
enum class GgmlType : std::uint32_t {
  kF32 = 0,       ///< IEEE binary32
  kF16 = 1,       ///< IEEE binary16
  kQ4_0 = 2,      ///< 4-bit, 32-blocks, fp16 scale
  kQ4_1 = 3,      ///< 4-bit, 32-blocks, fp16 scale and min
  kQ5_0 = 6,      ///< 5-bit, 32-blocks, fp16 scale
  kQ5_1 = 7,      ///< 5-bit, 32-blocks, fp16 scale and min
  kQ8_0 = 8,      ///< 8-bit, 32-blocks, fp16 scale
  kQ8_1 = 9,      ///< 8-bit, 32-blocks, fp16 scale and sum (activations)
  kQ2_K = 10,     ///< 2-bit k-quant, 256-super-blocks
  kQ3_K = 11,     ///< 3-bit k-quant
  kQ4_K = 12,     ///< 4-bit k-quant
  kQ5_K = 13,     ///< 5-bit k-quant
  kQ6_K = 14,     ///< 6-bit k-quant
  kQ8_K = 15,     ///< 8-bit k-quant (activations; fp32 scale and 16 sums)
  kIQ2_XXS = 16,  ///< 2.06 bits a weight, lattice codebook
  kIQ2_XS = 17,   ///< 2.31 bits
  kIQ3_XXS = 18,  ///< 3.06 bits
  kIQ1_S = 19,    ///< 1.56 bits
  kIQ4_NL = 20,   ///< 4-bit non-linear, 32-blocks
  kIQ3_S = 21,    ///< 3.44 bits
  kIQ2_S = 22,    ///< 2.56 bits
  kIQ4_XS = 23,   ///< 4.25 bits, non-linear, 256-super-blocks
  kI8 = 24,       ///< int8
  kI16 = 25,      ///< int16
  kI32 = 26,      ///< int32
  kI64 = 27,      ///< int64
  kF64 = 28,      ///< IEEE binary64
  kIQ1_M = 29,    ///< 1.75 bits
  kBF16 = 30,     ///< bfloat16
  kTQ1_0 = 34,    ///< ternary, 1.69 bits
  kTQ2_0 = 35,    ///< ternary, 2.06 bits
  kMXFP4 = 39,    ///< OCP MX FP4 (E2M1 with an E8M0 scale), 32-blocks
  kNVFP4 = 40,    ///< NVIDIA FP4 (E2M1 with four E4M3 scales), 64-blocks
  kQ1_0 = 41,     ///< 1-bit, 128-blocks, fp16 scale
  kQ2_0 = 42,     ///< 2-bit, 64-blocks, fp16 scale
};

/// What a GgmlType stores: a row of `n` elements (n a multiple of block_elements) takes
/// n / block_elements * block_bytes bytes.
struct GgmlTypeInfo {
  GgmlType type;
  std::string_view name;         ///< as gguf-py spells it: "F32", "Q4_K", "IQ2_XXS", "BF16"
  std::uint32_t block_elements;  ///< elements per block (1 for the plain types)
  std::uint32_t block_bytes;     ///< bytes per block
  bool quantized;                ///< a block format (not F32/F16/BF16/F64/I8..I64)
};

/// ggml's QK_K: the elements of a super-block of the k-quants and i-quants.
inline constexpr std::uint32_t kGgmlQkK = 256;

/// Every known type, sorted by id. Block sizes are ggml-common.h's static_asserts, evaluated.
inline constexpr std::array<GgmlTypeInfo, 35> kGgmlTypes = {{
    {GgmlType::kF32, "F32", 1, 4, false},
    {GgmlType::kF16, "F16", 1, 2, false},
    {GgmlType::kQ4_0, "Q4_0", 32, 2 + 16, true},
    {GgmlType::kQ4_1, "Q4_1", 32, 2 + 2 + 16, true},
    {GgmlType::kQ5_0, "Q5_0", 32, 2 + 4 + 16, true},
    {GgmlType::kQ5_1, "Q5_1", 32, 2 + 2 + 4 + 16, true},
    {GgmlType::kQ8_0, "Q8_0", 32, 2 + 32, true},
    {GgmlType::kQ8_1, "Q8_1", 32, 2 + 2 + 32, true},
    {GgmlType::kQ2_K, "Q2_K", kGgmlQkK, 2 + 2 + kGgmlQkK / 16 + kGgmlQkK / 4, true},
    {GgmlType::kQ3_K, "Q3_K", kGgmlQkK, 2 + kGgmlQkK / 4 + kGgmlQkK / 8 + 12, true},
    {GgmlType::kQ4_K, "Q4_K", kGgmlQkK, 2 + 2 + 12 + kGgmlQkK / 2, true},
    {GgmlType::kQ5_K, "Q5_K", kGgmlQkK, 2 + 2 + 12 + kGgmlQkK / 2 + kGgmlQkK / 8, true},
    {GgmlType::kQ6_K, "Q6_K", kGgmlQkK, 2 + kGgmlQkK / 16 + 3 * kGgmlQkK / 4, true},
    {GgmlType::kQ8_K, "Q8_K", kGgmlQkK, 4 + kGgmlQkK + kGgmlQkK / 16 * 2, true},
    {GgmlType::kIQ2_XXS, "IQ2_XXS", kGgmlQkK, 2 + kGgmlQkK / 8 * 2, true},
    {GgmlType::kIQ2_XS, "IQ2_XS", kGgmlQkK, 2 + kGgmlQkK / 8 * 2 + kGgmlQkK / 32, true},
    {GgmlType::kIQ3_XXS, "IQ3_XXS", kGgmlQkK, 2 + 3 * (kGgmlQkK / 8), true},
    {GgmlType::kIQ1_S, "IQ1_S", kGgmlQkK, 2 + kGgmlQkK / 8 + kGgmlQkK / 16, true},
    {GgmlType::kIQ4_NL, "IQ4_NL", 32, 2 + 16, true},
    {GgmlType::kIQ3_S, "IQ3_S", kGgmlQkK, 2 + 13 * (kGgmlQkK / 32) + kGgmlQkK / 64, true},
    {GgmlType::kIQ2_S, "IQ2_S", kGgmlQkK, 2 + kGgmlQkK / 4 + kGgmlQkK / 16, true},
    {GgmlType::kIQ4_XS, "IQ4_XS", kGgmlQkK, 2 + 2 + kGgmlQkK / 64 + kGgmlQkK / 2, true},
    {GgmlType::kI8, "I8", 1, 1, false},
    {GgmlType::kI16, "I16", 1, 2, false},
    {GgmlType::kI32, "I32", 1, 4, false},
    {GgmlType::kI64, "I64", 1, 8, false},
    {GgmlType::kF64, "F64", 1, 8, false},
    {GgmlType::kIQ1_M, "IQ1_M", kGgmlQkK, kGgmlQkK / 8 + kGgmlQkK / 16 + kGgmlQkK / 32, true},
    {GgmlType::kBF16, "BF16", 1, 2, false},
    {GgmlType::kTQ1_0, "TQ1_0", kGgmlQkK, 2 + kGgmlQkK / 64 + (kGgmlQkK - 4 * kGgmlQkK / 64) / 5,
     true},
    {GgmlType::kTQ2_0, "TQ2_0", kGgmlQkK, 2 + kGgmlQkK / 4, true},
    {GgmlType::kMXFP4, "MXFP4", 32, 1 + 16, true},
    {GgmlType::kNVFP4, "NVFP4", 64, 4 + 32, true},
    {GgmlType::kQ1_0, "Q1_0", 128, 2 + 128 / 8, true},
    {GgmlType::kQ2_0, "Q2_0", 64, 2 + 64 / 4, true},
}};

/// The index of ggml type id `id` in kGgmlTypes, or -1. (Indices, not pointers: GCC does not
/// fold pointer comparisons in constant expressions under -fsanitize.) No `detail` namespace
/// here: moe::quant's headers call moe::detail::fail as `detail::fail`.
constexpr int ggml_type_index(std::uint32_t id) noexcept {
  for (std::size_t i = 0; i < kGgmlTypes.size(); ++i) {
    if (static_cast<std::uint32_t>(kGgmlTypes[i].type) == id) return static_cast<int>(i);
  }
  return -1;
}

/// The entry of ggml type id `id`, or nullptr for an id ggml does not define (or removed).
constexpr GgmlTypeInfo const* ggml_type_info(std::uint32_t id) noexcept {
  int const i = ggml_type_index(id);
  return i < 0 ? nullptr : &kGgmlTypes[static_cast<std::size_t>(i)];
}

/// The entry of `type` (for a value that is no enumerator: F32's).
constexpr GgmlTypeInfo const& ggml_type_info(GgmlType type) noexcept {
  int const i = ggml_type_index(static_cast<std::uint32_t>(type));
  return kGgmlTypes[i < 0 ? 0 : static_cast<std::size_t>(i)];
}

/// "Q4_K" for GgmlType::kQ4_K.
constexpr std::string_view ggml_type_name(GgmlType type) noexcept {
  return ggml_type_info(type).name;
}

/// The type named `name` ("Q4_K"; case-sensitive, gguf-py's spelling), or nullopt.
constexpr std::optional<GgmlType> parse_ggml_type(std::string_view name) noexcept {
  for (GgmlTypeInfo const& info : kGgmlTypes) {
    if (info.name == name) return info.type;
  }
  return std::nullopt;
}

static_assert(ggml_type_info(GgmlType::kQ4_K).block_bytes == 144);
static_assert(ggml_type_info(GgmlType::kQ6_K).block_bytes == 210);
static_assert(ggml_type_info(GgmlType::kQ8_0).block_bytes == 34);
static_assert(ggml_type_info(GgmlType::kIQ3_S).block_bytes == 110);
static_assert(ggml_type_info(GgmlType::kTQ1_0).block_bytes == 54);
static_assert(ggml_type_index(4) < 0 && ggml_type_index(31) < 0);

}  // namespace moe::quant
