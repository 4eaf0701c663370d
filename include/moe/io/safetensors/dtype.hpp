// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Dtype: the element types of the safetensors format, their names and bit sizes.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace moe::io {

/// A safetensors element type. The enumerators are declared in the order of the reference
/// implementation's `enum Dtype` (huggingface/safetensors, safetensors/src/tensor.rs), which is
/// increasing alignment; the writer sorts tensors by this order, descending, as the reference
/// writer does. All are little-endian; sub-byte types (F4, F6_*) are packed.
enum class Dtype : std::uint8_t {
  kBool,        ///< "BOOL", 1 byte, 0 or 1
  kF4,          ///< "F4", 4 bits, MXFP4 E2M1 (packed two per byte)
  kF6E2M3,      ///< "F6_E2M3", 6 bits (packed)
  kF6E3M2,      ///< "F6_E3M2", 6 bits (packed)
  kU8,          ///< "U8"
  kI8,          ///< "I8"
  kF8E5M2,      ///< "F8_E5M2" (torch.float8_e5m2: IEEE-like, has inf)
  kF8E4M3,      ///< "F8_E4M3" (torch.float8_e4m3fn: no inf, NaN = S.1111.111)
  kF8E8M0,      ///< "F8_E8M0" (torch.float8_e8m0fnu: 2^(e-127), NaN = 0xFF; MX block scales)
  kF8E4M3Fnuz,  ///< "F8_E4M3FNUZ" (bias 8, no inf, no -0, NaN = 0x80)
  kF8E5M2Fnuz,  ///< "F8_E5M2FNUZ" (bias 16, no inf, no -0, NaN = 0x80)
  kI16,         ///< "I16"
  kU16,         ///< "U16"
  kF16,         ///< "F16", IEEE 754 binary16
  kBf16,        ///< "BF16", bfloat16: the upper 16 bits of a binary32
  kI32,         ///< "I32"
  kU32,         ///< "U32"
  kF32,         ///< "F32", IEEE 754 binary32
  kC64,         ///< "C64", complex64: two F32 (real, imaginary)
  kF64,         ///< "F64", IEEE 754 binary64
  kI64,         ///< "I64"
  kU64,         ///< "U64"
};

/// Every Dtype, in declaration order.
inline constexpr std::array<Dtype, 22> kAllDtypes = {
    Dtype::kBool,       Dtype::kF4,     Dtype::kF6E2M3, Dtype::kF6E3M2, Dtype::kU8,
    Dtype::kI8,         Dtype::kF8E5M2, Dtype::kF8E4M3, Dtype::kF8E8M0, Dtype::kF8E4M3Fnuz,
    Dtype::kF8E5M2Fnuz, Dtype::kI16,    Dtype::kU16,    Dtype::kF16,    Dtype::kBf16,
    Dtype::kI32,        Dtype::kU32,    Dtype::kF32,    Dtype::kC64,    Dtype::kF64,
    Dtype::kI64,        Dtype::kU64};

/// The name used in safetensors headers ("F32", "BF16", "F8_E4M3", ...).
constexpr std::string_view dtype_name(Dtype dtype) noexcept {
  switch (dtype) {
    case Dtype::kBool:
      return "BOOL";
    case Dtype::kF4:
      return "F4";
    case Dtype::kF6E2M3:
      return "F6_E2M3";
    case Dtype::kF6E3M2:
      return "F6_E3M2";
    case Dtype::kU8:
      return "U8";
    case Dtype::kI8:
      return "I8";
    case Dtype::kF8E5M2:
      return "F8_E5M2";
    case Dtype::kF8E4M3:
      return "F8_E4M3";
    case Dtype::kF8E8M0:
      return "F8_E8M0";
    case Dtype::kF8E4M3Fnuz:
      return "F8_E4M3FNUZ";
    case Dtype::kF8E5M2Fnuz:
      return "F8_E5M2FNUZ";
    case Dtype::kI16:
      return "I16";
    case Dtype::kU16:
      return "U16";
    case Dtype::kF16:
      return "F16";
    case Dtype::kBf16:
      return "BF16";
    case Dtype::kI32:
      return "I32";
    case Dtype::kU32:
      return "U32";
    case Dtype::kF32:
      return "F32";
    case Dtype::kC64:
      return "C64";
    case Dtype::kF64:
      return "F64";
    case Dtype::kI64:
      return "I64";
    case Dtype::kU64:
      return "U64";
  }
  return "?";
}

/// Bits per element: 4 (F4), 6 (F6_*), 8, 16, 32 or 64.
constexpr unsigned dtype_bits(Dtype dtype) noexcept {
  switch (dtype) {
    case Dtype::kF4:
      return 4;
    case Dtype::kF6E2M3:
    case Dtype::kF6E3M2:
      return 6;
    case Dtype::kBool:
    case Dtype::kU8:
    case Dtype::kI8:
    case Dtype::kF8E5M2:
    case Dtype::kF8E4M3:
    case Dtype::kF8E8M0:
    case Dtype::kF8E4M3Fnuz:
    case Dtype::kF8E5M2Fnuz:
      return 8;
    case Dtype::kI16:
    case Dtype::kU16:
    case Dtype::kF16:
    case Dtype::kBf16:
      return 16;
    case Dtype::kI32:
    case Dtype::kU32:
    case Dtype::kF32:
      return 32;
    case Dtype::kC64:
    case Dtype::kF64:
    case Dtype::kI64:
    case Dtype::kU64:
      return 64;
  }
  return 0;
}

/// The Dtype named `name` (case-sensitive, as in headers), or nullopt for an unknown name.
constexpr std::optional<Dtype> parse_dtype(std::string_view name) noexcept {
  for (Dtype const dtype : kAllDtypes) {
    if (dtype_name(dtype) == name) return dtype;
  }
  return std::nullopt;
}

/// True when to_float() can convert this dtype: every dtype except the packed sub-byte ones
/// (F4, F6_*) and the complex C64.
constexpr bool converts_to_float(Dtype dtype) noexcept {
  return dtype != Dtype::kF4 && dtype != Dtype::kF6E2M3 && dtype != Dtype::kF6E3M2 &&
         dtype != Dtype::kC64;
}

}  // namespace moe::io
