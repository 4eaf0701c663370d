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
#include "moe/core/float16.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/simd.hpp"

#if MOE_HAS_AVX512BF16
#include <immintrin.h>
#endif

namespace moe::kernels {

/// float -> bf16 with round-to-nearest-even (NaN stays NaN, quiet): moe's one definition
/// (moe/core/float16.hpp). The bf16 value is the top 16 bits of the float.
using ::moe::float_to_bf16;
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
  Index const kp_count = (K + 1) / 2, full = K / 2;
  // Row by row (contiguous reads of W; the panel, at most a few hundred KiB, takes the strided
  // writes), as the weights are rounded again after every optimizer step in bf16-compute training.
  for (Index c = 0; c < nc; ++c) {
    float const* w = W + (n0 + c) * ldw;
    std::uint32_t* d = panel + c;
    for (Index kp = 0; kp < full; ++kp) {
      d[kp * NP] = std::uint32_t{float_to_bf16(w[2 * kp])} |
                   std::uint32_t{float_to_bf16(w[2 * kp + 1])} << 16;
    }
    if (full < kp_count) d[full * NP] = float_to_bf16(w[2 * full]);
  }
  for (Index kp = 0; kp < kp_count; ++kp) {
    for (Index c = nc; c < NP; ++c) panel[kp * NP + c] = 0u;
  }
}

/// The bf16 value nearest `f` (round to nearest even) as a float, with a denormal input taken as
/// (signed) zero and NaN kept NaN: the rounding bf16_pairs_rows (vcvtne2ps2bf16) applies to
/// activations, so a row rounded here and then paired is paired unchanged.
MOE_ALWAYS_INLINE float round_bf16_activation(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  // Branch-free (selects), so that loops over it vectorize.
  std::uint32_t const rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::uint32_t const nan = (u | 0x00400000u) & 0xFFFF0000u;
  std::uint32_t r = (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
  r = (u & 0x7F800000u) == 0 ? u & 0x80000000u : r;
  std::memcpy(&f, &r, 4);
  return f;
}
/// p[i] = round_bf16_activation(p[i]) for i < n: activations made bf16 operands in place (the
/// bf16-compute training mode's inputs, hidden activations and gradients).
inline void round_bf16_activations(float* p, Index n) {
  for (Index i = 0; i < n; ++i) p[i] = round_bf16_activation(p[i]);
}

/// Packs A [K, N] (fp32, row stride lda) into the bf16 panels pack_panel_bf16 makes from A^T:
/// ceil(N / NP) panels of ceil(K / 2) * NP words, panel p at panels + p * ceil(K / 2) * NP, with
/// panel_p[kp * NP + c] = (bf16(A[2kp+1, p NP + c]) << 16) | bf16(A[2kp, p NP + c]) and the pad
/// (columns past N, the odd-K row) 0. For products whose weight operand is stored the other way
/// round: the backward's dM = dY W_down (K = D rows of W_down) and dX = dH W_in, and the weight
/// gradients' activations (K = tokens). Values are rounded as activations
/// (round_bf16_activation: denormals to zero) when `activations`, else as weights (float_to_bf16,
/// as pack_panel_bf16). Made row pair by row pair: contiguous reads of A.
template <class Arch = simd::DefaultArch>
void pack_panels_bf16_t(float const* A, Index lda, Index N, Index K, std::uint32_t* panels,
                        bool activations = true) {
  constexpr Index NP = panel_width<Arch>();
  Index const kp_count = (K + 1) / 2, count = (N + NP - 1) / NP;
  auto act = [](float f) -> std::uint32_t {
    std::uint32_t u;
    f = round_bf16_activation(f);
    std::memcpy(&u, &f, 4);
    return u >> 16;
  };
  for (Index kp = 0; kp < kp_count; ++kp) {
    float const* lo = A + 2 * kp * lda;
    float const* hi = lo + lda;
    bool const pad = 2 * kp + 1 == K;
    for (Index p = 0; p < count; ++p) {
      std::uint32_t* d = panels + (p * kp_count + kp) * NP;
      Index const c0 = p * NP, nc = std::min(NP, N - c0);
      if (pad) {
        for (Index c = 0; c < nc; ++c) {
          d[c] = activations ? act(lo[c0 + c]) : float_to_bf16(lo[c0 + c]);
        }
      } else if (activations) {
        for (Index c = 0; c < nc; ++c) d[c] = act(lo[c0 + c]) | act(hi[c0 + c]) << 16;
      } else {
        for (Index c = 0; c < nc; ++c) {
          d[c] = std::uint32_t{float_to_bf16(lo[c0 + c])} | std::uint32_t{float_to_bf16(hi[c0 + c])}
                                                                << 16;
        }
      }
      for (Index c = nc; c < NP; ++c) d[c] = 0u;
    }
  }
}

}  // namespace moe::kernels

// Compiled once for our own binaries (see MOE_SDPA_INSTANTIATION in kernels/sdpa.hpp).
#define MOE_GEMM_BF16_INSTANTIATION(EXTERN, Arch)              \
  EXTERN template void moe::kernels::pack_panels_bf16_t<Arch>( \
      float const*, moe::Index, moe::Index, moe::Index, std::uint32_t*, bool)
#if defined(MOE_EXTERN_EXPERT_KERNELS)
MOE_GEMM_BF16_INSTANTIATION(extern, moe::kernels::simd::DefaultArch);
#endif
