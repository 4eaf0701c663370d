// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Panel GEMM for expert projections: pack a block of weight rows once, then stream every row of
/// activations through an outer-product micro-kernel. Allocation-free and bitwise reproducible.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/gemm.hpp"
#include "moe/kernels/simd.hpp"

/// Prefetch of the 64-byte line at p into L2 (a hint; nothing where the compiler has none).
#if defined(__GNUC__) || defined(__clang__)
#define MOE_PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#else
#define MOE_PREFETCH_L2(p) ((void)(p))
#endif

#include "moe/kernels/detail/diagnostics_push.hpp"

namespace moe::kernels {

/// Columns of one packed weight panel: two SIMD batches (32 floats with AVX-512, 16 with AVX2).
template <class Arch = simd::DefaultArch>
constexpr Index panel_width() {
  return 2 * static_cast<Index>(simd::Batch<float, Arch>::size);
}

namespace detail {
#if defined(__AVX512F__)
/// dst[j * ldd + i] = src[i * lds + j] for a 16 x 16 block (unpack 32/64-bit, then two rounds
/// of 128-bit lane shuffles).
MOE_ALWAYS_INLINE void transpose16x16(float const* src, Index lds, float* dst, Index ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 16; i += 4) {
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(dst + j * ldd, r[j]);
}
#endif
#if defined(__AVX__)
/// dst[j * ldd + i] = src[i * lds + j] for an 8 x 8 block of rows already in registers
/// (unpack 32-bit pairs, shuffle 64-bit pairs, swap 128-bit halves).
MOE_ALWAYS_INLINE void transpose8x8(__m256 const (&r)[8], float* dst, Index ldd) {
  __m256 const t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 const t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 const t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 const t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 const s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 const s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 const s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 const s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ldd, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(dst + 1 * ldd, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#endif
}  // namespace detail

/// Packs weight rows [n0, n0 + nc) of W [N, K] (row-major, ldw) into a K x NP panel,
/// panel[k * NP + c] = W[n0 + c, k], NP = panel_width(); columns c >= nc are zero.
/// `panel` holds K * panel_width() floats. Full panels are transposed in registers, 16 x 16
/// blocks with AVX-512 (fp32 weights), 8 x 8 blocks with AVX (fp32 or bf16): the per-call packing
/// of training forwards, whose weights change every step, of prefill projections and of the
/// SDPA's key blocks.
/// W may be bf16 (std::uint16_t): the panel holds the widened values (exact).
template <class Arch = simd::DefaultArch, class Wt = float>
void pack_panel(Wt const* W, Index ldw, Index n0, Index nc, Index K, float* panel) {
  static_assert(detail::is_weight_type<Wt>, "pack_panel: W is float or bf16 (std::uint16_t)");
  constexpr Index NP = panel_width<Arch>();
  Index kdone = 0;
#if defined(__AVX512F__)
  if constexpr (NP == 32 && std::is_same_v<Wt, float>) {
    if (nc == NP) {
      kdone = K / 16 * 16;
      for (Index k0 = 0; k0 < kdone; k0 += 16) {
        for (Index c0 = 0; c0 < NP; c0 += 16) {
          detail::transpose16x16(W + (n0 + c0) * ldw + k0, ldw, panel + k0 * NP + c0, NP);
        }
      }
    }
  }
#endif
#if defined(__AVX__)
  if constexpr (NP == 16) {
    if (nc == NP) {
      using Bt = simd::Batch<float, Arch>;
      kdone = K / 8 * 8;
      for (Index k0 = 0; k0 < kdone; k0 += 8) {
        for (Index c0 = 0; c0 < NP; c0 += 8) {
          __m256 r[8];
          for (int i = 0; i < 8; ++i) {
            r[i] = detail::load_weights<Bt>(W + (n0 + c0 + i) * ldw + k0);
          }
          detail::transpose8x8(r, panel + k0 * NP + c0, NP);
        }
      }
    }
  }
#endif
  // k outer, c inner: contiguous writes; the NP source rows stay in L1 across consecutive k.
  Index const kb = 64;
  for (Index k0 = kdone; k0 < K; k0 += kb) {
    Index const k1 = std::min(K, k0 + kb);
    for (Index c = 0; c < nc; ++c) {
      Wt const* w = W + (n0 + c) * ldw;
      for (Index k = k0; k < k1; ++k) panel[k * NP + c] = detail::weight_value(w[k]);
    }
    for (Index c = nc; c < NP; ++c) {
      for (Index k = k0; k < k1; ++k) panel[k * NP + c] = 0.0f;
    }
  }
}

namespace detail {

/// Calls tile.template operator()<mr>(i0) for a balanced split of M rows into tiles of at most
/// MaxMR rows (e.g. 32 rows -> 8 8 8 8, 30 -> 8 8 7 7): no narrow remainder tile, whose few
/// accumulators could not hide the FMA latency.
template <Index MaxMR, class Tile>
MOE_ALWAYS_INLINE void for_each_row_tile(Index M, Tile&& tile) {
  Index const nt = (M + MaxMR - 1) / MaxMR;
  Index const base = M / nt, extra = M % nt;
  Index i0 = 0;
  for (Index t = 0; t < nt; ++t) {
    Index const mr = base + (t < extra ? 1 : 0);
    switch (mr) {
      case 8:
        if constexpr (MaxMR >= 8) tile.template operator()<8>(t, nt, i0);
        break;
      case 7:
        if constexpr (MaxMR >= 7) tile.template operator()<7>(t, nt, i0);
        break;
      case 6:
        if constexpr (MaxMR >= 6) tile.template operator()<6>(t, nt, i0);
        break;
      case 5:
        if constexpr (MaxMR >= 5) tile.template operator()<5>(t, nt, i0);
        break;
      case 4:
        if constexpr (MaxMR >= 4) tile.template operator()<4>(t, nt, i0);
        break;
      case 3:
        if constexpr (MaxMR >= 3) tile.template operator()<3>(t, nt, i0);
        break;
      case 2:
        tile.template operator()<2>(t, nt, i0);
        break;
      default:
        tile.template operator()<1>(t, nt, i0);
        break;
    }
    i0 += mr;
  }
}

/// C[r, c] = sum_k A[r, k] * panel[k, c] for r < MR, c < nc: MR x 2 batch accumulators, one
/// broadcast of A per (row, k), k in ascending order (a single FMA chain per output).
template <Index MR, class Arch>
MOE_ALWAYS_INLINE void panel_tile(float const* a, Index lda, float const* panel, Index K, float* c,
                                  Index ldc, Index nc) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B acc0[MR], acc1[MR];
  for (Index r = 0; r < MR; ++r) acc0[r] = acc1[r] = B(0.0f);
  for (Index k = 0; k < K; ++k) {
    B const b0 = B::load_aligned(panel + k * 2 * L);
    B const b1 = B::load_aligned(panel + k * 2 * L + L);
    for (Index r = 0; r < MR; ++r) {
      B const av(a[r * lda + k]);
      acc0[r] = xsimd::fma(av, b0, acc0[r]);
      acc1[r] = xsimd::fma(av, b1, acc1[r]);
    }
  }
  if (nc == 2 * L) {
    for (Index r = 0; r < MR; ++r) {
      acc0[r].store_unaligned(c + r * ldc);
      acc1[r].store_unaligned(c + r * ldc + L);
    }
  } else {
    alignas(64) float tmp[2 * L];
    for (Index r = 0; r < MR; ++r) {
      acc0[r].store_aligned(tmp);
      acc1[r].store_aligned(tmp + L);
      std::copy(tmp, tmp + nc, c + r * ldc);
    }
  }
}

}  // namespace detail

/// C[i, c] = sum_k A[i, k] * panel[k, c] for i < M, c < nc: the rows of A [M, K] (lda) times one
/// packed panel (see pack_panel), into columns [0, nc) of C [M, *] (ldc). Every output is one FMA
/// chain over k in ascending order, so a row's result never depends on M or on other rows.
/// Preconditions: panel is 64-byte aligned; nc <= panel_width().
template <class Arch = simd::DefaultArch>
void gemm_panel(float const* A, Index lda, float const* panel, Index M, Index K, float* C,
                Index ldc, Index nc) {
  constexpr Index MR = 6;
  Index i = 0;
  for (; i + MR <= M; i += MR) {
    detail::panel_tile<MR, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
  }
  switch (M - i) {
    case 5:
      detail::panel_tile<5, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    case 4:
      detail::panel_tile<4, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    case 3:
      detail::panel_tile<3, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    case 2:
      detail::panel_tile<2, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    case 1:
      detail::panel_tile<1, Arch>(A + i * lda, lda, panel, K, C + i * ldc, ldc, nc);
      break;
    default:
      break;
  }
}

/// Below this many rows a projection uses gemm_nt (weights streamed once, no packing); from it on,
/// packed panels (packing is amortised over the rows).
inline constexpr Index kPanelMinRows = 8;

/// Floats of scratch one panel of depth K needs (plus room to align it to 64 bytes).
template <class Arch = simd::DefaultArch>
constexpr Index panel_scratch_size(Index K) {
  return K * panel_width<Arch>() + 16;
}

}  // namespace moe::kernels

#include "moe/kernels/detail/diagnostics_pop.hpp"
