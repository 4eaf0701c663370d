// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Exact scalar conversions between float and the 16- and 8-bit float formats of safetensors
/// (the 16-bit ones from moe/core/float16.hpp).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "moe/core/float16.hpp"

namespace moe::io {

// The 16-bit conversions are moe's one definition (moe/core/float16.hpp), named here too.
using ::moe::bf16_to_float;
using ::moe::f16_to_float;
using ::moe::float_to_bf16;
using ::moe::float_to_f16;

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
