// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Exact scalar conversions between float and the 16- and 8-bit float formats of safetensors.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace moe::io {

static_assert(std::numeric_limits<float>::is_iec559, "moe::io needs IEEE 754 binary32 floats");

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
inline std::uint16_t float_to_bf16(float value) noexcept {
  std::uint32_t const x = std::bit_cast<std::uint32_t>(value);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

namespace detail {

// A minifloat with `mant_bits` mantissa bits and exponent bias `bias`, decoded from its fields;
// exact, since every such value is a binary32.
inline float minifloat_value(bool negative, unsigned exp, unsigned mant, int mant_bits,
                             int bias) noexcept {
  float const magnitude = exp == 0 ? std::ldexp(static_cast<float>(mant), 1 - bias - mant_bits)
                                   : std::ldexp(static_cast<float>(mant + (1u << mant_bits)),
                                                static_cast<int>(exp) - bias - mant_bits);
  return negative ? -magnitude : magnitude;
}

}  // namespace detail

/// F8_E4M3 (float8_e4m3fn: 1-4-3, bias 7, no inf; S.1111.111 is NaN; max 448) -> float.
inline float f8_e4m3_to_float(std::uint8_t v) noexcept {
  if ((v & 0x7Fu) == 0x7Fu) {
    return (v & 0x80u) != 0 ? -std::numeric_limits<float>::quiet_NaN()
                            : std::numeric_limits<float>::quiet_NaN();
  }
  return detail::minifloat_value((v & 0x80u) != 0, (v >> 3) & 0xFu, v & 0x7u, 3, 7);
}

/// F8_E5M2 (float8_e5m2: 1-5-2, bias 15, IEEE-like with inf and NaN) -> float. It is exactly
/// the upper byte of a binary16.
inline float f8_e5m2_to_float(std::uint8_t v) noexcept {
  return f16_to_float(static_cast<std::uint16_t>(v << 8));
}

/// F8_E8M0 (float8_e8m0fnu: 2^(v-127); 0xFF is NaN; no zero, no sign) -> float.
inline float f8_e8m0_to_float(std::uint8_t v) noexcept {
  if (v == 0xFFu) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(v) - 127);
}

/// F8_E4M3FNUZ (1-4-3, bias 8, no inf, no -0; 0x80 is NaN) -> float.
inline float f8_e4m3fnuz_to_float(std::uint8_t v) noexcept {
  if (v == 0x80u) return std::numeric_limits<float>::quiet_NaN();
  return detail::minifloat_value((v & 0x80u) != 0, (v >> 3) & 0xFu, v & 0x7u, 3, 8);
}

/// F8_E5M2FNUZ (1-5-2, bias 16, no inf, no -0; 0x80 is NaN) -> float.
inline float f8_e5m2fnuz_to_float(std::uint8_t v) noexcept {
  if (v == 0x80u) return std::numeric_limits<float>::quiet_NaN();
  return detail::minifloat_value((v & 0x80u) != 0, (v >> 2) & 0x1Fu, v & 0x3u, 2, 16);
}

}  // namespace moe::io
