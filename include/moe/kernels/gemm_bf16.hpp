// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// bf16 weight panels: half the bytes of fp32, multiplied by kernels::expert_cols with AVX512-BF16
/// dot products where the CPU (and the compiler flags) have them, and by widening to fp32
/// otherwise. This header holds the conversions and the panel packing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/simd.hpp"

#if MOE_HAS_AVX512BF16
#include <immintrin.h>
#endif

namespace moe::kernels {

/// float -> bf16 with round-to-nearest-even (NaN stays NaN, quiet). The bf16 value is the top 16
/// bits of the float.
MOE_ALWAYS_INLINE std::uint16_t float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
/// dst[i] = float_to_bf16(src[i]) for i < n: the bf16 copy of an fp32 weight matrix.
inline void round_to_bf16(float const* src, std::size_t n, std::uint16_t* dst) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}
/// bf16 -> float (exact).
MOE_ALWAYS_INLINE float bf16_to_float(std::uint16_t h) { return simd::widen_bf16(h); }

/// True when this build has the AVX512-BF16 kernel (compiled with -mavx512bf16 or a -march that
/// implies it); the caller must also run on a CPU that has the instructions.
constexpr bool has_avx512_bf16() { return MOE_HAS_AVX512BF16 != 0; }

/// Packs weight rows [n0, n0 + nc) of W [N, K] (fp32, ldw) into a bf16 panel for expert_cols:
/// K rounded up to even Kp; panel[kp * NP + c] = (bf16(W[n0+c, 2kp+1]) << 16) | bf16(W[n0+c, 2kp])
/// as 32-bit words, NP = panel_width(); missing columns and the odd-K pad are 0.
/// `panel` holds (Kp / 2) * NP words (half the bytes of the fp32 panel).
template <class Arch = simd::DefaultArch>
void pack_panel_bf16(float const* W, Index ldw, Index n0, Index nc, Index K, std::uint32_t* panel) {
  constexpr Index NP = panel_width<Arch>();
  Index const kp_count = (K + 1) / 2;
  for (Index kp = 0; kp < kp_count; ++kp) {
    for (Index c = 0; c < NP; ++c) {
      std::uint32_t word = 0;
      if (c < nc) {
        float const* w = W + (n0 + c) * ldw;
        std::uint32_t const lo = float_to_bf16(w[2 * kp]);
        std::uint32_t const hi = 2 * kp + 1 < K ? float_to_bf16(w[2 * kp + 1]) : 0u;
        word = lo | (hi << 16);
      }
      panel[kp * NP + c] = word;
    }
  }
}

/// The bf16 value nearest `f` (round to nearest even) as a float, with a denormal input taken as
/// (signed) zero and NaN kept NaN: the rounding bf16_pairs_rows (vcvtne2ps2bf16) applies to
/// activations, so a row rounded here and then paired is paired unchanged.
MOE_ALWAYS_INLINE float round_bf16_activation(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0) {
    u &= 0x80000000u;
  } else if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    u = (u | 0x00400000u) & 0xFFFF0000u;
  } else {
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  }
  std::memcpy(&f, &u, 4);
  return f;
}
/// p[i] = round_bf16_activation(p[i]) for i < n: activations made bf16 operands in place (the
/// bf16-compute training mode's inputs, hidden activations and gradients).
inline void round_bf16_activations(float* p, Index n) {
  for (Index i = 0; i < n; ++i) p[i] = round_bf16_activation(p[i]);
}

/// Packs columns [n0, n0 + nc) of A [K, N] (fp32, row stride lda) into a bf16 panel of the
/// layout pack_panel_bf16 makes from A^T: panel[kp * NP + c] = (bf16(A[2kp+1, n0+c]) << 16) |
/// bf16(A[2kp, n0+c]), the pad (c >= nc, the odd-K row) 0. For products whose weight operand is
/// stored the other way round: the backward's dM = dY W_down (K = D rows of W_down) and
/// dX = dH W_in, and the weight gradients' activations (K = tokens). Values are rounded as
/// activations (round_bf16_activation: denormals to zero) when `activations`, else as weights
/// (float_to_bf16, as pack_panel_bf16).
template <class Arch = simd::DefaultArch>
void pack_panel_bf16_t(float const* A, Index lda, Index n0, Index nc, Index K, std::uint32_t* panel,
                       bool activations = true) {
  constexpr Index NP = panel_width<Arch>();
  Index const kp_count = (K + 1) / 2;
  auto bits = [activations](float f) -> std::uint32_t {
    if (!activations) return float_to_bf16(f);
    std::uint32_t u;
    f = round_bf16_activation(f);
    std::memcpy(&u, &f, 4);
    return u >> 16;
  };
  for (Index kp = 0; kp < kp_count; ++kp) {
    float const* lo = A + 2 * kp * lda + n0;
    float const* hi = 2 * kp + 1 < K ? lo + lda : nullptr;
    std::uint32_t* d = panel + kp * NP;
    for (Index c = 0; c < nc; ++c) d[c] = bits(lo[c]) | (hi ? bits(hi[c]) << 16 : 0u);
    for (Index c = nc; c < NP; ++c) d[c] = 0u;
  }
}

}  // namespace moe::kernels
