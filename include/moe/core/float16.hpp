// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Exact scalar conversions between float and the 16-bit float formats (IEEE binary16 and
/// bfloat16): the one definition the checkpoint readers, the GGUF blocks and the kernels use.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace moe {

static_assert(std::numeric_limits<float>::is_iec559, "moe needs IEEE 754 binary32 floats");

/// binary16 -> binary32, exact: subnormals become normal floats, +-inf stays inf, and a NaN
/// keeps its sign and payload (shifted into the top of the binary32 mantissa).
inline float f16_to_float(std::uint16_t h) noexcept {
  std::uint32_t const sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t const exp = (h >> 10) & 0x1Fu;
  std::uint32_t const mant = h & 0x3FFu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in binary32.
    float const magnitude = std::ldexp(static_cast<float>(mant), -24);
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(magnitude) | sign);
  }
  if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + (127 - 15)) << 23) | (mant << 13));
}

/// binary32 -> binary16 with round-to-nearest, ties to even (the IEEE default, as numpy and
/// torch do it). Overflow (|x| >= 65520) gives +-inf; results below the normal range are
/// rounded to subnormals or +-0; a NaN stays a quiet NaN with its sign and top payload bits.
inline std::uint16_t float_to_f16(float value) noexcept {
  std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  auto const sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) {  // NaN: keep the payload's top bits, force the quiet bit
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((x >> 13) & 0x3FFu));
  }
  if (x >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (x >= 0x38800000u) {  // normal binary16 range, |x| >= 2^-14
    std::uint32_t const rounded = x + 0x0FFFu + ((x >> 13) & 1u);  // ties to even at bit 13
    return static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  // Subnormal binary16: q = round(|x| / 2^-24). |x| = m * 2^(e - 150) with the implicit bit.
  std::uint32_t const e = x >> 23;
  if (e < 102) return sign;  // |x| < 2^-25: rounds to 0 (2^-25 itself is a tie, to even 0)
  std::uint32_t const m = (x & 0x7FFFFFu) | 0x800000u;
  std::uint32_t const shift = 126 - e;  // 14..24
  std::uint32_t q = m >> shift;
  std::uint32_t const rem = m & ((1u << shift) - 1u);
  std::uint32_t const half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;  // may carry into the smallest normal
  return static_cast<std::uint16_t>(sign | q);
}

/// bfloat16 -> binary32, exact: bfloat16 is the upper half of a binary32.
inline float bf16_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/// binary32 -> bfloat16 with round-to-nearest, ties to even (as torch and Eigen::bfloat16).
/// Overflow rounds to +-inf; a NaN stays a quiet NaN with its sign and top payload bits.
/// Branch-free (a select), so that loops over it vectorize.
inline std::uint16_t float_to_bf16(float value) noexcept {
  std::uint32_t const x = std::bit_cast<std::uint32_t>(value);
  std::uint32_t const r = (x & 0x7FFFFFFFu) > 0x7F800000u ? (x >> 16) | 0x0040u
                                                          : (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(r);
}

}  // namespace moe
