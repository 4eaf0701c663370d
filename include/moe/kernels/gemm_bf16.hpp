// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// bf16 weight panels: half the bytes of fp32, multiplied with AVX512-BF16 dot products where the
/// CPU (and the compiler flags) have them, and by widening to fp32 otherwise.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/simd.hpp"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MOE_HAS_AVX512BF16 1
#else
#define MOE_HAS_AVX512BF16 0
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
/// bf16 -> float (exact).
MOE_ALWAYS_INLINE float bf16_to_float(std::uint16_t h) {
  std::uint32_t const u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Which bf16 kernel gemm_panel_bf16 uses.
enum class Bf16Path {
  kAuto,   ///< AVX512-BF16 dot products if compiled in (-mavx512bf16), else kWiden
  kWiden,  ///< widen weights to fp32 and FMA with fp32 activations (any SIMD arch)
};

/// True when this build has the AVX512-BF16 kernel (compiled with -mavx512bf16 or a -march that
/// implies it); the caller must also run on a CPU that has the instructions.
constexpr bool has_avx512_bf16() { return MOE_HAS_AVX512BF16 != 0; }

/// Packs weight rows [n0, n0 + nc) of W [N, K] (fp32, ldw) into a bf16 panel for gemm_panel_bf16:
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

namespace detail {

/// Widening path: weights bf16 -> fp32 in registers, activations stay fp32.
template <Index MR, class Arch>
MOE_ALWAYS_INLINE void panel_tile_bf16_widen(float const* a, Index lda, std::uint32_t const* panel,
                                             Index K, float* c, Index ldc, Index nc) {
  using B = simd::Batch<float, Arch>;
  using U = simd::Batch<std::uint32_t, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr Index NP = 2 * L;
  B acc0[MR], acc1[MR];
  for (Index r = 0; r < MR; ++r) acc0[r] = acc1[r] = B(0.0f);
  U const hi_mask(0xFFFF0000u);
  auto widen_lo = [&](U w) { return xsimd::bitwise_cast<B>(w << 16); };
  auto widen_hi = [&](U w) { return xsimd::bitwise_cast<B>(w & hi_mask); };
  Index const kp_count = (K + 1) / 2;
  for (Index kp = 0; kp < kp_count; ++kp) {
    U const w0 = U::load_aligned(panel + kp * NP);
    U const w1 = U::load_aligned(panel + kp * NP + L);
    B const b0e = widen_lo(w0), b0o = widen_hi(w0), b1e = widen_lo(w1), b1o = widen_hi(w1);
    bool const odd = 2 * kp + 1 < K;
    for (Index r = 0; r < MR; ++r) {
      B const ae(a[r * lda + 2 * kp]);
      acc0[r] = xsimd::fma(ae, b0e, acc0[r]);
      acc1[r] = xsimd::fma(ae, b1e, acc1[r]);
      if (odd) {
        B const ao(a[r * lda + 2 * kp + 1]);
        acc0[r] = xsimd::fma(ao, b0o, acc0[r]);
        acc1[r] = xsimd::fma(ao, b1o, acc1[r]);
      }
    }
  }
  alignas(64) float tmp[NP];
  for (Index r = 0; r < MR; ++r) {
    acc0[r].store_aligned(tmp);
    acc1[r].store_aligned(tmp + L);
    std::copy(tmp, tmp + nc, c + r * ldc);
  }
}

#if MOE_HAS_AVX512BF16
/// AVX512-BF16 path: activations rounded to bf16 pairs, vdpbf16ps with fp32 accumulation.
/// `apairs` holds MR rows of (Kp / 2) bf16 pairs.
template <Index MR>
MOE_ALWAYS_INLINE void panel_tile_bf16_dp(std::uint32_t const* apairs, Index kp_count,
                                          std::uint32_t const* panel, float* c, Index ldc,
                                          Index nc) {
  __m512 acc0[MR], acc1[MR];
  for (Index r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (Index kp = 0; kp < kp_count; ++kp) {
    __m512bh const b0 = reinterpret_cast<__m512bh>(_mm512_load_si512(panel + kp * 32));
    __m512bh const b1 = reinterpret_cast<__m512bh>(_mm512_load_si512(panel + kp * 32 + 16));
    for (Index r = 0; r < MR; ++r) {
      __m512bh const av = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int>(apairs[r * kp_count + kp])));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
    }
  }
  alignas(64) float tmp[32];
  for (Index r = 0; r < MR; ++r) {
    _mm512_store_ps(tmp, acc0[r]);
    _mm512_store_ps(tmp + 16, acc1[r]);
    std::copy(tmp, tmp + nc, c + r * ldc);
  }
}
#endif

}  // namespace detail

/// Floats of scratch gemm_panel_bf16 needs for depth K (the bf16 activation pairs of one tile).
constexpr Index bf16_scratch_words(Index K) { return 6 * ((K + 1) / 2) + 16; }

/// C[i, c] = sum_k A[i, k] * W[c, k] for i < M, c < nc with W given as a bf16 panel
/// (pack_panel_bf16). kAuto on a build with AVX512-BF16: activations are rounded to bf16 and
/// multiplied with vdpbf16ps (fp32 accumulation; each output a fixed chain over k pairs);
/// otherwise (kWiden) weights are widened to fp32 and multiplied with fp32 activations.
/// Either way a row's result never depends on M or on other rows. `scratch` holds
/// bf16_scratch_words(K) words. Preconditions: panel 64-byte aligned; nc <= panel_width().
template <class Arch = simd::DefaultArch>
void gemm_panel_bf16(float const* A, Index lda, std::uint32_t const* panel, Index M, Index K,
                     float* C, Index ldc, Index nc, std::uint32_t* scratch,
                     Bf16Path path = Bf16Path::kAuto) {
  constexpr Index MR = 6;
#if MOE_HAS_AVX512BF16
  if (path == Bf16Path::kAuto && panel_width<Arch>() == 32) {
    Index const kp_count = (K + 1) / 2;
    for (Index i = 0; i < M; i += MR) {
      Index const mr = std::min(MR, M - i);
      for (Index r = 0; r < mr; ++r) {
        float const* a = A + (i + r) * lda;
        std::uint32_t* dst = scratch + r * kp_count;
        Index kp = 0;
        // 32 floats -> 16 bf16 pairs per instruction (round to nearest even, like float_to_bf16).
        for (; 2 * kp + 32 <= K; kp += 16) {
          __m512bh const v =
              _mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + 2 * kp + 16), _mm512_loadu_ps(a + 2 * kp));
          _mm512_storeu_si512(dst + kp, reinterpret_cast<__m512i>(v));
        }
        for (; kp < kp_count; ++kp) {
          std::uint32_t const lo = float_to_bf16(a[2 * kp]);
          std::uint32_t const hi = 2 * kp + 1 < K ? float_to_bf16(a[2 * kp + 1]) : 0u;
          dst[kp] = lo | (hi << 16);
        }
      }
      float* c = C + i * ldc;
      switch (mr) {
        case 6:
          detail::panel_tile_bf16_dp<6>(scratch, kp_count, panel, c, ldc, nc);
          break;
        case 5:
          detail::panel_tile_bf16_dp<5>(scratch, kp_count, panel, c, ldc, nc);
          break;
        case 4:
          detail::panel_tile_bf16_dp<4>(scratch, kp_count, panel, c, ldc, nc);
          break;
        case 3:
          detail::panel_tile_bf16_dp<3>(scratch, kp_count, panel, c, ldc, nc);
          break;
        case 2:
          detail::panel_tile_bf16_dp<2>(scratch, kp_count, panel, c, ldc, nc);
          break;
        default:
          detail::panel_tile_bf16_dp<1>(scratch, kp_count, panel, c, ldc, nc);
          break;
      }
    }
    return;
  }
#endif
  (void)scratch;
  (void)path;
  Index i = 0;
  for (; i + MR <= M; i += MR) {
    detail::panel_tile_bf16_widen<MR, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
  }
  switch (M - i) {
    case 5:
      detail::panel_tile_bf16_widen<5, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    case 4:
      detail::panel_tile_bf16_widen<4, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    case 3:
      detail::panel_tile_bf16_widen<3, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    case 2:
      detail::panel_tile_bf16_widen<2, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    case 1:
      detail::panel_tile_bf16_widen<1, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    default:
      break;
  }
}

/// project_cols_packed for bf16 panels: columns [c0, c1) (c0 a multiple of panel_width()) of
/// C = A W^T with `panels` = ceil(N / NP) contiguous bf16 panels of ((K + 1) / 2) * NP words.
template <class Arch = simd::DefaultArch>
void project_cols_bf16(float const* A, Index lda, Index M, std::uint32_t const* panels, Index K,
                       Index c0, Index c1, float* C, Index ldc, std::uint32_t* scratch,
                       Bf16Path path = Bf16Path::kAuto) {
  constexpr Index NP = panel_width<Arch>();
  Index const words = (K + 1) / 2 * NP;
  for (Index n0 = c0; n0 < c1; n0 += NP) {
    gemm_panel_bf16<Arch>(A, lda, panels + (n0 / NP) * words, M, K, C + n0, ldc,
                          std::min(NP, c1 - n0), scratch, path);
  }
}

}  // namespace moe::kernels
