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

}  // namespace moe::kernels
