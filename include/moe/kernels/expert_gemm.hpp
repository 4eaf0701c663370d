// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The expert GEMM of the hot path: rows of activations read in place through an index (the
/// dispatch gather fused into the GEMM's reads) times packed weight panels, with the rest of the
/// expert applied in the epilogue while the tile is in registers:
///   - GLU in projection: gate and up panels in one pass, m = act(g) * u (or gpt-oss's clamped
///     GLU) stored, with the biases of biased experts (GluEpilogue);
///   - MLP in projection: m = act(h) (ActEpilogue);
///   - down projection: the output bias and the routing weight of each row applied before the
///     store (StoreEpilogue).
/// Weight panels come packed ahead of time (fp32 or bf16, ExpertBank::pack) or are packed per
/// call into scratch (fp32). While one panel is multiplied, the next one of the same work item is
/// prefetched into L2 in slices spread over the row tiles, so DRAM streaming overlaps the FMAs.
/// Every output element is one FMA chain over k in ascending order whose value depends only on its
/// row, its column and K: bitwise the same for any M, tiling, work split or thread count (for a
/// given path: M < kPanelMinRows with per-call packing uses dot products, see expert_cols).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "moe/core/config.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/activations.hpp"
#include "moe/kernels/detail/amx_bf16.hpp"
#include "moe/kernels/detail/diagnostics_push.hpp"
#include "moe/kernels/dispatch.hpp"
#include "moe/kernels/gemm.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/quant_gemm.hpp"
#include "moe/kernels/row_source.hpp"
#include "moe/kernels/simd.hpp"

// Kept out of line: one call per work item, and GCC 12 applies the diagnostic pragmas only
// to code that stays in this function.
#if defined(__GNUC__) || defined(__clang__)
#define MOE_NOINLINE __attribute__((noinline))
#else
#define MOE_NOINLINE
#endif

namespace moe::kernels {

namespace detail {
/// Columns [c0, c0 + nc) of `bias` (null: zeros) as NB batches, zero past nc.
template <class B, int NB>
MOE_ALWAYS_INLINE void load_bias(float const* bias, Index c0, Index nc, B (&out)[NB]) {
  constexpr Index L = static_cast<Index>(B::size);
  if (nc == NB * L) {
    for (int j = 0; j < NB; ++j) out[j] = B::load_unaligned(bias + c0 + j * L);
    return;
  }
  alignas(64) float tmp[NB * L] = {};
  std::copy(bias + c0, bias + c0 + nc, tmp);
  for (int j = 0; j < NB; ++j) out[j] = B::load_aligned(tmp + j * L);
}
}  // namespace detail

/// Epilogue of a plain projection: C[i, p*NP + c] = scale[i] * (acc + bias[p*NP + c]) (scale
/// null: 1, bias null: 0), for the columns c < N - p*NP that exist. With `stream`, full panels at
/// 64-byte aligned addresses are written with non-temporal stores (simd::store_stream: no read of
/// the line first, no cache displaced), for outputs too large to stay cached until they are
/// read; the caller then calls simd::stream_fence() before another thread reads C. Same values
/// either way. With `accumulate` (no scale, no stream) C[i, .] += acc + bias instead: the
/// weight gradients of the bf16-compute training mode add each block of rows to the fp32
/// gradient.
struct StoreEpilogue {
  float* c;                      ///< output [M, N] (ldc)
  Index ldc;                     ///< row stride of c
  Index cols;                    ///< N
  float const* scale = nullptr;  ///< [M] per-row factors (routing weights) or null
  bool stream = false;           ///< non-temporal stores where possible
  float const* bias = nullptr;   ///< [N] added before the scale (expert output biases) or null
  bool accumulate = false;       ///< add to C (scale and stream unset)
  static constexpr int kOperands = 1;
  template <class B, int NB>
  MOE_ALWAYS_INLINE void row(Index i, Index p, B const (&acc)[NB]) const {
    constexpr Index L = static_cast<Index>(B::size);
    Index const c0 = p * NB * L, nc = std::min(NB * L, cols - c0);
    B v[NB];
    if (bias) {
      B b[NB];
      detail::load_bias<B, NB>(bias, c0, nc, b);
      for (int j = 0; j < NB; ++j) v[j] = acc[j] + b[j];
    } else {
      for (int j = 0; j < NB; ++j) v[j] = acc[j];
    }
    float* dst = c + i * ldc + c0;
    if (accumulate) {
      if (nc == NB * L) {
        for (int j = 0; j < NB; ++j)
          (v[j] + B::load_unaligned(dst + j * L)).store_unaligned(dst + j * L);
      } else {
        alignas(64) float tmp[NB * L];
        for (int j = 0; j < NB; ++j) v[j].store_aligned(tmp + j * L);
        for (Index k = 0; k < nc; ++k) dst[k] += tmp[k];
      }
      return;
    }
    B s(1.0f);
    if (scale) s = B(scale[i]);
    if (stream && nc == NB * L && reinterpret_cast<std::uintptr_t>(dst) % 64 == 0) {
      for (int j = 0; j < NB; ++j) simd::store_stream(dst + j * L, scale ? v[j] * s : v[j]);
    } else if (nc == NB * L) {
      for (int j = 0; j < NB; ++j) {
        if (scale) {
          (v[j] * s).store_unaligned(dst + j * L);
        } else {
          v[j].store_unaligned(dst + j * L);
        }
      }
    } else {
      alignas(64) float tmp[NB * L];
      for (int j = 0; j < NB; ++j) (scale ? v[j] * s : v[j]).store_aligned(tmp + j * L);
      std::copy(tmp, tmp + nc, dst);
    }
  }
};

/// Epilogue of a gated (GLU) in projection over hidden units [p*NP, p*NP + NP): operand 0 is the
/// gate panel, operand 1 the up panel, each plus its bias when `bias` is set (g += bias[j],
/// u += bias[F + j]); m = act(g) * u (kernels::glu's batch arithmetic), or with Clamped the
/// clamped GLU of `clamp` (kernels::clamped_glu). With h set, the pre-activations (biases
/// included) are kept for the backward: g at h[i, j], u at h[i, F + j].
template <Activation A, bool Clamped = false>
struct GluEpilogue {
  float* m;            ///< [M, F] (ldm)
  Index ldm;           ///< row stride of m
  Index units;         ///< F
  float* h = nullptr;  ///< [M, 2F] (ldh) pre-activations, or null
  Index ldh = 0;
  float const* bias = nullptr;  ///< [2F] gate then up biases, or null
  GluClamp clamp{};             ///< Clamped only
  static constexpr int kOperands = 2;
  template <class B, int NB>
  MOE_ALWAYS_INLINE void row(Index i, Index p, B const (&acc)[NB]) const {
    constexpr Index L = static_cast<Index>(B::size);
    constexpr int H = NB / 2;  // batches per operand
    Index const j0 = p * H * L, nc = std::min(H * L, units - j0);
    B v[NB];
    if (bias) {
      B bg[H], bu[H];
      detail::load_bias<B, H>(bias, j0, nc, bg);
      detail::load_bias<B, H>(bias + units, j0, nc, bu);
      for (int j = 0; j < H; ++j) {
        v[j] = acc[j] + bg[j];
        v[H + j] = acc[H + j] + bu[j];
      }
    } else {
      for (int j = 0; j < NB; ++j) v[j] = acc[j];
    }
    alignas(64) float tmp[3][H * L];
    bool const full = nc == H * L;
    for (int j = 0; j < H; ++j) {
      B out;
      if constexpr (Clamped) {
        out = detail::clamped_glu(v[j], v[H + j], B(clamp.alpha), B(clamp.limit));
      } else {
        out = detail::activate<A>(v[j]) * v[H + j];
      }
      if (full) {
        out.store_unaligned(m + i * ldm + j0 + j * L);
        if (h) {
          v[j].store_unaligned(h + i * ldh + j0 + j * L);
          v[H + j].store_unaligned(h + i * ldh + units + j0 + j * L);
        }
      } else {
        out.store_aligned(tmp[0] + j * L);
        v[j].store_aligned(tmp[1] + j * L);
        v[H + j].store_aligned(tmp[2] + j * L);
      }
    }
    if (!full) {
      std::copy(tmp[0], tmp[0] + nc, m + i * ldm + j0);
      if (h) {
        std::copy(tmp[1], tmp[1] + nc, h + i * ldh + j0);
        std::copy(tmp[2], tmp[2] + nc, h + i * ldh + units + j0);
      }
    }
  }
};

/// Epilogue of an ungated (MLP) in projection: h = acc (+ bias[j] when set), m = act(h); with h
/// set the pre-activations too.
template <Activation A>
struct ActEpilogue {
  float* m;            ///< [M, F] (ldm)
  Index ldm;           ///< row stride of m
  Index units;         ///< F
  float* h = nullptr;  ///< [M, F] (ldh) pre-activations, or null
  Index ldh = 0;
  float const* bias = nullptr;  ///< [F] or null
  static constexpr int kOperands = 1;
  template <class B, int NB>
  MOE_ALWAYS_INLINE void row(Index i, Index p, B const (&acc)[NB]) const {
    constexpr Index L = static_cast<Index>(B::size);
    Index const j0 = p * NB * L, nc = std::min(NB * L, units - j0);
    B v[NB];
    if (bias) {
      B b[NB];
      detail::load_bias<B, NB>(bias, j0, nc, b);
      for (int j = 0; j < NB; ++j) v[j] = acc[j] + b[j];
    } else {
      for (int j = 0; j < NB; ++j) v[j] = acc[j];
    }
    alignas(64) float tmp[2][NB * L];
    for (int j = 0; j < NB; ++j) {
      detail::activate<A>(v[j]).store_aligned(tmp[0] + j * L);
      v[j].store_aligned(tmp[1] + j * L);
    }
    std::copy(tmp[0], tmp[0] + nc, m + i * ldm + j0);
    if (h) std::copy(tmp[1], tmp[1] + nc, h + i * ldh + j0);
  }
};

/// Largest row tile of the expert micro-kernels: 2 * kOperands * MR accumulators must fit the
/// register file (32 vector registers with AVX-512, 16 otherwise).
template <int Operands, class Arch = simd::DefaultArch>
constexpr Index expert_max_mr() {
  constexpr bool wide = simd::Batch<float, Arch>::size >= 16;
  if constexpr (Operands == 1) return wide ? 8 : 6;
  return wide ? 6 : 2;
}

/// Does expert_cols multiply bf16 panels by dot products of bf16 pairs in this process (and so
/// round activations to bf16 pairs and read RowSource::pairs): AVX512-BF16 vdpbf16ps, or AMX
/// tdpbf16ps tiles (bf16_amx())? Otherwise it widens the weights to fp32 in registers. Compiled
/// in (AVX512-BF16, 32-column panels) and chosen for the CPU at run time: moe::bf16_kernel()
/// (core/cpu.hpp: AMX where the CPU has it; Intel cores without it, whose vdpbf16ps runs at half
/// the fp32 FMA rate, widen; MOE_BF16_KERNEL=dot|widen|amx overrides), fixed for the process.
template <class Arch = simd::DefaultArch>
inline bool bf16_dot_products() {
  if constexpr (MOE_HAS_AVX512BF16 && panel_width<Arch>() == 32) {
    return bf16_kernel() != Bf16Kernel::kWiden;
  } else {
    return false;
  }
}

/// Does expert_cols multiply bf16 panels with AMX tiles in this process (moe::bf16_kernel() is
/// kAmx and this build has the AMX kernels: detail/amx_bf16.hpp)?
template <class Arch = simd::DefaultArch>
inline bool bf16_amx() {
  if constexpr (MOE_HAS_AMX_BF16 && panel_width<Arch>() == 32) {
    return bf16_kernel() == Bf16Kernel::kAmx;
  } else {
    return false;
  }
}

/// Rows [0, n) of `a` rounded to bf16 pairs, ceil(K / 2) words per row at dst + r * ldd: word kp
/// holds a[2 kp] (low half) and a[2 kp + 1] (high half; 0 past K), each rounded to nearest even
/// with denormal inputs taken as (signed) zero and NaN kept NaN, as vcvtne2ps2bf16 does (the
/// instruction used with AVX512-BF16; the same arithmetic in scalar code elsewhere), so a row's
/// pairs depend on nothing but the row. The activations expert_cols' bf16 dot products read.
/// With `piece_stride` (words; 16: contiguous), the row's pieces of 16 pairs lie that far apart:
/// word kp at dst + r * ldd + (kp / 16) * piece_stride + kp % 16 (AMX's A tiles, one piece a
/// tile row); nothing is written past word kp_count - 1 of the last piece.
inline void bf16_pairs_rows(RowSource a, Index n, Index K, std::uint32_t* dst, Index ldd,
                            Index piece_stride = 16) {
  Index const kp_count = (K + 1) / 2;
  for (Index r = 0; r < n; ++r) {
    float const* x = a.row(r);
    std::uint32_t* d = dst + r * ldd;
    Index kp = 0;
#if MOE_HAS_AVX512BF16
    for (; 2 * kp + 32 <= K; kp += 16) {
      __m512bh const v =
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 2 * kp + 16), _mm512_loadu_ps(x + 2 * kp));
      _mm512_storeu_si512(d + kp / 16 * piece_stride, reinterpret_cast<__m512i>(v));
    }
    if (kp < kp_count) {
      Index const rest = K - 2 * kp;  // 1..31 floats
      auto const lo_mask = static_cast<__mmask16>((1u << std::min<Index>(rest, 16)) - 1u);
      auto const hi_mask = static_cast<__mmask16>(rest > 16 ? (1u << (rest - 16)) - 1u : 0u);
      __m512bh const v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi_mask, x + 2 * kp + 16),
                                             _mm512_maskz_loadu_ps(lo_mask, x + 2 * kp));
      auto const words = static_cast<__mmask16>((1u << (kp_count - kp)) - 1u);
      _mm512_mask_storeu_epi32(d + kp / 16 * piece_stride, words, reinterpret_cast<__m512i>(v));
    }
#else
    auto round = [](float f) -> std::uint32_t {
      std::uint32_t u;
      std::memcpy(&u, &f, 4);
      if ((u & 0x7F800000u) == 0) u &= 0x80000000u;  // denormal -> signed zero
      if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
      u += 0x7FFFu + ((u >> 16) & 1u);
      return u >> 16;
    };
    for (; kp < kp_count; ++kp) {
      std::uint32_t const lo = round(x[2 * kp]);
      std::uint32_t const hi = 2 * kp + 1 < K ? round(x[2 * kp + 1]) : 0u;
      d[kp / 16 * piece_stride + kp % 16] = lo | (hi << 16);
    }
#endif
  }
}

namespace detail {

/// Prefetch cursors over the bytes of the next panel of each operand: one 64-byte line of each per
/// k step. Row tile t of nt takes slice t of each panel, so with nt >= 2 tiles (every tile runs K
/// steps, a panel has 2K lines) the whole next panel is in L2 by the time its first tile starts.
struct Prefetch {
  char const* next[2] = {nullptr, nullptr};
  char const* end[2] = {nullptr, nullptr};
  MOE_ALWAYS_INLINE void step() {
    for (int o = 0; o < 2; ++o) {
      if (next[o] < end[o]) {
        MOE_PREFETCH_L2(next[o]);
        next[o] += 64;
      }
    }
  }
};

/// Where a tile's accumulators start and end when K is cut into slices: the first slice starts
/// from zero, later ones reload the partial sums the previous slice stored (exact: the FMA chain
/// over k is the same as without slices); the last slice hands the sums to the epilogue.
struct Slice {
  float* partial;  ///< MR rows x (2 * Ops * L) floats, 64-byte aligned
  bool first, last;
};

template <Index MR, int NB, class B>
MOE_ALWAYS_INLINE void tile_begin(B (&acc)[NB][MR], Slice const& sl) {
  constexpr Index L = static_cast<Index>(B::size);
  for (Index r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) {
      acc[j][r] = sl.first ? B(0.0f) : B::load_aligned(sl.partial + (r * NB + j) * L);
    }
  }
}

template <Index MR, int NB, class B, class Epi>
MOE_ALWAYS_INLINE void tile_end(B const (&acc)[NB][MR], Slice const& sl, Epi const& epi, Index i0,
                                Index p) {
  constexpr Index L = static_cast<Index>(B::size);
  for (Index r = 0; r < MR; ++r) {
    if (sl.last) {
      B v[NB];
      for (int j = 0; j < NB; ++j) v[j] = acc[j][r];
      epi.row(i0 + r, p, v);
    } else {
      for (int j = 0; j < NB; ++j) acc[j][r].store_aligned(sl.partial + (r * NB + j) * L);
    }
  }
}

/// MR rows x (Ops operands x 2 batches) fp32 tile over one K slice:
///   acc[o*2+j][r] += sum_k a_r[k] panel_o[k, jL..], k in [0, K) of the slice.
template <Index MR, int Ops, class Arch, class Epi>
MOE_ALWAYS_INLINE void expert_tile_f32(float const* const* rows, float const* const* panels,
                                       Index K, Epi const& epi, Index i0, Index p, Prefetch pf,
                                       Slice const& sl) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr Index NP = 2 * L;
  constexpr int NB = 2 * Ops;
  B acc[NB][MR];
  tile_begin<MR, NB>(acc, sl);
  float const* a[MR];
  for (Index r = 0; r < MR; ++r) a[r] = rows[r];
  for (Index k = 0; k < K; ++k) {
    pf.step();
    B b[NB];
    for (int o = 0; o < Ops; ++o) {
      b[2 * o] = B::load_aligned(panels[o] + k * NP);
      b[2 * o + 1] = B::load_aligned(panels[o] + k * NP + L);
    }
    for (Index r = 0; r < MR; ++r) {
      B const av(a[r][k]);
      for (int j = 0; j < NB; ++j) acc[j][r] = xsimd::fma(av, b[j], acc[j][r]);
    }
  }
  tile_end<MR, NB>(acc, sl, epi, i0, p);
}

/// The bf16-weight tile without AVX512-BF16 (weights widened to fp32 in registers), one K slice
/// (even start; K = the slice's depth). Per pair of k the even weights are widened and multiplied
/// into every row, then the odd ones: each accumulator still adds k, then k + 1, but only one
/// half's NB widened batches are live beside the MR x NB accumulators (both halves at once did
/// not fit AVX2's 16 registers for gate + up: spills).
template <Index MR, int Ops, class Arch, class Epi>
MOE_ALWAYS_INLINE void expert_tile_bf16_widen(float const* const* rows,
                                              std::uint32_t const* const* panels, Index K,
                                              Epi const& epi, Index i0, Index p, Prefetch pf,
                                              Slice const& sl) {
  using B = simd::Batch<float, Arch>;
  using U = simd::Batch<std::uint32_t, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr Index NP = 2 * L;
  constexpr int NB = 2 * Ops;
  B acc[NB][MR];
  tile_begin<MR, NB>(acc, sl);
  float const* a[MR];
  for (Index r = 0; r < MR; ++r) a[r] = rows[r];
  U const hi_mask(0xFFFF0000u);
  auto half = [&](Index kp, Index k, auto widen) {
    B w[NB];
    for (int o = 0; o < Ops; ++o) {
      w[2 * o] = widen(U::load_aligned(panels[o] + kp * NP));
      w[2 * o + 1] = widen(U::load_aligned(panels[o] + kp * NP + L));
    }
    for (Index r = 0; r < MR; ++r) {
      B const av(a[r][k]);
      for (int j = 0; j < NB; ++j) acc[j][r] = xsimd::fma(av, w[j], acc[j][r]);
    }
  };
  auto even = [](U u) { return xsimd::bitwise_cast<B>(u << 16); };
  auto odd = [&](U u) { return xsimd::bitwise_cast<B>(u & hi_mask); };
  Index const full = K / 2;  // pairs with both halves; an odd K ends with one even half
  for (Index kp = 0; kp < full; ++kp) {
    pf.step();
    half(kp, 2 * kp, even);
    half(kp, 2 * kp + 1, odd);
  }
  if (K % 2 != 0) {
    pf.step();
    half(full, 2 * full, even);
  }
  tile_end<MR, NB>(acc, sl, epi, i0, p);
}

#if MOE_HAS_AVX512BF16
/// The AVX512-BF16 tile: MR rows of activations as bf16 pairs (`arows`, each at the slice's
/// first pair) times the panels' bf16 pairs with vdpbf16ps, one K slice. Kept out of line:
/// inlined into expert_cols' row-tile loop, GCC 12 kept the accumulators on the stack (half the
/// speed).
template <Index MR, int Ops, class Arch, class Epi>
MOE_NOINLINE void expert_tile_bf16_dp(std::uint32_t const* const* arows,
                                      std::uint32_t const* const* panels, Index K, Epi const& epi,
                                      Index i0, Index p, Prefetch pf, Slice const& sl) {
  using B = simd::Batch<float, Arch>;
  constexpr int NB = 2 * Ops;
  Index const kp_count = (K + 1) / 2;
  B acc[NB][MR];
  tile_begin<MR, NB>(acc, sl);
  std::uint32_t const* a[MR];
  for (Index r = 0; r < MR; ++r) a[r] = arows[r];
  for (Index kp = 0; kp < kp_count; ++kp) {
    pf.step();
    __m512bh b[NB];
    for (int o = 0; o < Ops; ++o) {
      b[2 * o] = reinterpret_cast<__m512bh>(_mm512_load_si512(panels[o] + kp * 32));
      b[2 * o + 1] = reinterpret_cast<__m512bh>(_mm512_load_si512(panels[o] + kp * 32 + 16));
    }
    for (Index r = 0; r < MR; ++r) {
      __m512bh const av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[r][kp])));
      for (int j = 0; j < NB; ++j) acc[j][r] = B(_mm512_dpbf16_ps(acc[j][r], av, b[j]));
    }
  }
  tile_end<MR, NB>(acc, sl, epi, i0, p);
}
#endif

/// Row tile t of nt prefetches slice t of the `bytes` bytes at next[o] (null: nothing).
inline Prefetch prefetch_slices(char const* const* next, int ops, Index bytes, Index t, Index nt) {
  Prefetch pf;
  if (nt < 2) return pf;
  Index const per = (bytes / nt + 63) / 64 * 64;
  Index const b0 = std::min(bytes, t * per), b1 = std::min(bytes, b0 + per);
  for (int o = 0; o < ops; ++o) {
    if (next[o]) {
      pf.next[o] = next[o] + b0;
      pf.end[o] = next[o] + b1;
    }
  }
  return pf;
}

}  // namespace detail

/// Where the weight panels of an expert projection come from.
///   f32:  operand o's panel p is f32[o] + p * K * NP (ExpertBank::packed_in/packed_down layout);
///   bf16: operand o's panel p is bf16[o] + p * ((K + 1) / 2) * NP words;
///   raw:  neither: panels are packed per call from raw[o] (rows of W, row stride K), the panel
///         of operand o covering W rows [p * NP, p * NP + NP) clipped to raw_rows[o]; or, with
///         dot_products, no packing: gemm_nt dot products row by row (weights streamed once);
///   quant: quantized panels (pack_quant_panels) of 32 columns, multiplied by quant_cols.
/// Exactly one of f32[0], bf16[0], raw[0], quant[0].data is set. The caller chooses dot_products by
/// the size of the whole projection (not of one call), so a row's arithmetic never depends on the
/// split. `widen_bf16`: bf16 panels are always widened to fp32 in registers (fp32 activations, the
/// FMA chain of fp32 panels of the same values: bitwise that product), never multiplied by bf16
/// dot products (AVX512-BF16, AMX) that round the activations (moe::Linear's bf16 matrices).
struct WeightPanels {
  float const* f32[2] = {nullptr, nullptr};
  std::uint32_t const* bf16[2] = {nullptr, nullptr};
  float const* raw[2] = {nullptr, nullptr};
  Index raw_rows[2] = {0, 0};
  bool dot_products = false;
  QuantWeights quant[2] = {};
  bool widen_bf16 = false;
};

/// The panel a caller multiplies after an expert_cols call (for example its next work item's
/// first panel): the call prefetches that panel's first K slice into L2 during its own last
/// slice, as it does between its own panels, so the next call does not start on a cold panel.
/// Only a hint: results never depend on it. Ignored for raw weights (w null: no next panel).
struct NextPanel {
  WeightPanels const* w = nullptr;  ///< the next panel's weights (fp32, bf16 or quantized)
  Index p = 0;                      ///< its panel index
  Index K = 0;                      ///< its depth
};

/// Rows whose partial sums persist across K slices (a chunk of an expert_cols call).
inline constexpr Index kExpertChunkRows = 128;

/// Default K-slice depth of expert_cols: each operand's slice of a panel is depth x 32 floats, so
/// the slices of one pass (16 KB x depth / 128) stay in L2 next to the prefetched next ones even
/// for the gate+up pass (Ops = 2), and are re-read from there by every row tile.
/// Compile-time tuning knobs (depths in k): MOE_EXPERT_K_SLICE_GLU for the gate+up pass,
/// MOE_EXPERT_K_SLICE for single-operand projections.
template <int Ops>
constexpr Index expert_k_slice() {
#ifndef MOE_EXPERT_K_SLICE_GLU
#define MOE_EXPERT_K_SLICE_GLU 256
#endif
#ifndef MOE_EXPERT_K_SLICE
#define MOE_EXPERT_K_SLICE 512
#endif
  return Ops > 1 ? MOE_EXPERT_K_SLICE_GLU : MOE_EXPERT_K_SLICE;
}

/// Floats of per-thread scratch expert_cols needs for depth K: two fp32 panels (per-call packing)
/// or a row chunk's bf16 activation pairs (bf16 panels; rows padded to whole AMX tiles), the
/// partial sums of a row chunk (the AMX path's C and tail tiles in the same place) and the
/// dot-product staging row, 64-byte aligned.
template <class Arch = simd::DefaultArch>
constexpr Index expert_scratch_floats(Index K) {
  constexpr Index NP = panel_width<Arch>();
  // bf16 pairs of a row chunk: rows padded to 16 pairs (the AMX path's A tiles).
  Index const operands = std::max(2 * K * NP, kExpertChunkRows * ((K + 1) / 2 + 15) / 16 * 16);
  return std::max(operands + kExpertChunkRows * 2 * NP + 2 * NP + 64,
                  K % 32 == 0 ? quant_scratch_floats(K) : Index{0});
}

#if MOE_HAS_AMX_BF16
namespace detail {
/// expert_cols over bf16 panels with AMX tiles. Row chunks of up to kExpertChunkRows rows are
/// rounded to bf16 pairs once (or taken from a.pairs) straight into A tiles (16 rows x 16 pairs,
/// 1 KiB each, zero-padded to whole tiles) in `abuf`. Then for each panel, each group of 32 rows
/// (2 row tiles; 1 for a last group of at most 16 rows) multiplies each operand's panel over the
/// whole depth (amx_panel_block) into `cbuf`, and the epilogue takes the group's rows from there;
/// the panel, read from memory by the first group, is in L2 for the others. (K slices that keep
/// a slice of the panel in L1 for every group, the C tiles stored between slices, were 10%
/// faster for one expert of 128 rows with cached weights and no faster in the layer: Sapphire
/// Rapids, 2026-12-02.) A panel depth that is not a multiple of 16 pairs ends in a zero-padded
/// copy of its last rows. `abuf` holds kExpertChunkRows * ceil(kp_all / 16) * 16 words (kp_all =
/// ceil(K / 2)); `cbuf` 2 * 16 * 32 + 2 * 32 * 32 floats; both 64-byte aligned.
template <class Epi, class Arch>
void expert_cols_amx(RowSource a, Index M, Index K, WeightPanels const& w, Index p0, Index p1,
                     Epi const& epi, std::uint32_t* abuf, float* cbuf) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr Index NP = 2 * L;
  static_assert(NP == 32, "AMX tiles take the 32-column panels of AVX-512");
  constexpr int Ops = Epi::kOperands;
  constexpr int NB = 2 * Ops;
  Index const kp_all = (K + 1) / 2, steps = (kp_all + 15) / 16, kp_full = kp_all / 16 * 16;
  auto* const tail = reinterpret_cast<std::uint32_t*>(cbuf);  // [Ops][16][32]
  float* const cout = cbuf + Ops * 16 * 32;                   // [Ops][32][32]: one group's C tiles
  amx_configure();
  for (Index c0 = 0; c0 < M; c0 += kExpertChunkRows) {
    Index const mc = std::min(kExpertChunkRows, M - c0);
    // A tiles: row r's piece of 16 pairs for step st at abuf + ((r / 16) * steps + st) * 256 +
    // (r % 16) * 16 words; pairs past kp_all and rows past mc (to whole tiles) are zero.
    Index const mpad = (mc + 15) / 16 * 16, rest = kp_all - kp_full;
    for (Index r = 0; r < mpad; ++r) {
      std::uint32_t* dst = abuf + (r / 16) * steps * 256 + (r % 16) * 16;
      if (r >= mc) {
        for (Index st = 0; st < steps; ++st) std::fill(dst + st * 256, dst + st * 256 + 16, 0u);
        continue;
      }
      if (a.pairs) {
        std::uint32_t const* src = a.pairs + a.at(c0 + r) * a.ldp;
        for (Index st = 0; st < steps; ++st) {
          std::copy(src + st * 16, src + st * 16 + std::min<Index>(16, kp_all - st * 16),
                    dst + st * 256);
        }
      } else {
        bf16_pairs_rows(a.from(c0 + r), 1, K, dst, 0, 256);
      }
      if (rest > 0) std::fill(dst + (steps - 1) * 256 + rest, dst + (steps - 1) * 256 + 16, 0u);
    }
    for (Index p = p0; p < p1; ++p) {
      std::uint32_t const* panel[2] = {nullptr, nullptr};
      for (int o = 0; o < Ops; ++o) panel[o] = w.bf16[o] + p * kp_all * NP;
      if (kp_full < kp_all) {
        for (int o = 0; o < Ops; ++o) {
          std::uint32_t* t = tail + o * 16 * 32;
          std::copy(panel[o] + kp_full * NP, panel[o] + kp_all * NP, t);
          std::fill(t + (kp_all - kp_full) * NP, t + 16 * 32, 0u);
        }
      }
      for (Index g0 = 0; g0 < mc; g0 += 32) {
        Index const rows = std::min<Index>(32, mc - g0);
        std::uint32_t const* ag = abuf + (g0 / 16) * steps * 256;
        for (int o = 0; o < Ops; ++o) {
          std::uint32_t const* bt = tail + o * 16 * 32;
          if (rows > 16) {
            amx_panel_block<2>(ag, steps, panel[o], kp_full / 16, bt, cout + o * 32 * 32);
          } else {
            amx_panel_block<1>(ag, steps, panel[o], kp_full / 16, bt, cout + o * 32 * 32);
          }
        }
        for (Index r = 0; r < rows; ++r) {
          B v[NB];
          for (int o = 0; o < Ops; ++o) {
            v[2 * o] = B::load_aligned(cout + o * 32 * 32 + r * 32);
            v[2 * o + 1] = B::load_aligned(cout + o * 32 * 32 + r * 32 + L);
          }
          epi.row(c0 + g0 + r, p, v);
        }
      }
    }
  }
  amx_release();
}
}  // namespace detail
#endif

/// Columns [p0 * NP, p1 * NP) (panels p0..p1-1; NP = panel_width()) of an expert projection of the
/// M rows of `a` (depth K) against `w`, finished by `epi` (StoreEpilogue, GluEpilogue,
/// ActEpilogue; Epi::kOperands weight operands). Paths, chosen by the weights only:
///   - packed fp32 or bf16 panels: the panel micro-kernels over row chunks of up to
///     kExpertChunkRows rows and K slices of `k_slice` (0: expert_k_slice()) depth, the partial
///     sums kept in scratch between slices (bitwise the same as one pass over K), row tiles of up
///     to expert_max_mr() rows; the next slice prefetched while one is multiplied. bf16 panels
///     with bf16_dot_products(): the rows as bf16 pairs (a.pairs, or each row chunk rounded once
///     by bf16_pairs_rows into scratch; bitwise the same) times the panels with vdpbf16ps, row
///     chunk by row chunk; without: weights widened to fp32 in registers;
///   - raw weights: per-call packing of each panel into scratch, then the same;
///   - raw weights with w.dot_products (for few rows): gemm_nt dot products per row (weights
///     streamed once, no packing), staged in scratch and passed to the epilogue;
///   - quantized panels: quant_cols (integer dot products; panels of 32 columns, so p0, p1 and
///     the epilogue's panel index count 32-column panels whatever NP is).
/// `scratch` holds expert_scratch_floats(K) floats. Allocates nothing. `after`: the panel the
/// caller multiplies next, prefetched during the last slice (a hint; see NextPanel).
template <class Epi, class Arch = simd::DefaultArch>
MOE_NOINLINE void expert_cols(RowSource a, Index M, Index K, WeightPanels const& w, Index p0,
                              Index p1, Epi const& epi, float* scratch, Index k_slice = 0,
                              NextPanel after = {}) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr Index NP = 2 * L;
  constexpr int Ops = Epi::kOperands;
  constexpr int NB = 2 * Ops;
  constexpr Index MaxMR = expert_max_mr<Ops, Arch>();
  if (M <= 0 || p1 <= p0) return;
  if (w.quant[0].data) {
    quant_cols<Epi, Arch>(a, M, K, w.quant, p0, p1, epi, scratch,
                          after.w && after.w->quant[0].data ? after.w->quant : nullptr, after.p);
    return;
  }
  auto const addr = reinterpret_cast<std::uintptr_t>(scratch);
  float* const panel_buf = scratch + ((64 - addr % 64) % 64) / sizeof(float);
  // bf16 panels: the activation pairs of a row chunk, in the space raw weights pack panels into.
  auto* const pairs = reinterpret_cast<std::uint32_t*>(panel_buf);
  float* const partial =
      panel_buf + std::max(2 * K * NP, kExpertChunkRows * ((K + 1) / 2 + 15) / 16 * 16);
  float* const stage = partial + kExpertChunkRows * 2 * NP;  // dot-product path: one row
  float const* row_ptr_storage[8];

  if (w.raw[0] && w.dot_products) {
    for (Index p = p0; p < p1; ++p) {
      for (Index i = 0; i < M; ++i) {
        float const* ai = a.row(i);
        for (int o = 0; o < Ops; ++o) {
          Index const n0 = p * NP, nc = std::min(NP, w.raw_rows[o] - n0);
          float* dst = stage + o * NP;
          std::fill(dst, dst + NP, 0.0f);
          if (nc > 0) gemm_nt<Arch>(ai, K, w.raw[o] + n0 * K, K, dst, NP, 1, nc, K);
        }
        B v[NB];
        for (int j = 0; j < NB; ++j) v[j] = B::load_aligned(stage + j * L);
        epi.row(i, p, v);
      }
    }
    return;
  }

  bool const bf16 = w.bf16[0] != nullptr;
#if MOE_HAS_AMX_BF16
  if constexpr (NP == 32) {
    if (bf16 && !w.widen_bf16 && bf16_amx<Arch>()) {
      detail::expert_cols_amx<Epi, Arch>(a, M, K, w, p0, p1, epi, pairs, partial);
      return;
    }
  }
#endif
  // vdpbf16ps: activations as bf16 pairs, from a.pairs or rounded once per row chunk into scratch.
  bool const dp = bf16 && !w.widen_bf16 && bf16_dot_products<Arch>();
  Index const kp_all = (K + 1) / 2;  // bf16 pairs of a row
  Index kc = k_slice > 0 ? k_slice : expert_k_slice<Ops>();
  kc = std::min(K, (kc + 1) / 2 * 2);  // even: bf16 pairs never straddle slices
  Index const slices = (K + kc - 1) / kc;
  Index const chunks = (M + kExpertChunkRows - 1) / kExpertChunkRows;
  Index const panels = p1 - p0;
  bool const packed = !w.raw[0];
  // Bytes of operand o's panel p from depth k on (fp32 floats or bf16 words of pairs).
  auto panel_at = [&](int o, Index p, Index k) -> char const* {
    if (bf16) {
      return reinterpret_cast<char const*>(w.bf16[o] + p * kp_all * NP + (k / 2) * NP);
    }
    if (w.f32[0]) return reinterpret_cast<char const*>(w.f32[o] + p * K * NP + k * NP);
    return reinterpret_cast<char const*>(panel_buf + o * K * NP + k * NP);
  };
  auto slice_bytes = [&](Index k) {
    Index const d = std::min(kc, K - k);
    return bf16 ? (d + 1) / 2 * NP * 4 : d * NP * 4;
  };
  // Step s runs (panel, chunk): chunk-major when the chunk's rows are converted to bf16 pairs
  // (once per chunk), panel-major otherwise (a raw panel is packed once, for all chunks).
  auto panel_of = [&](Index st) { return p0 + (dp ? st % panels : st / chunks); };
  auto chunk_of = [&](Index st) { return dp ? st / panels : st % chunks; };

  for (Index st = 0; st < panels * chunks; ++st) {
    Index const p = panel_of(st), c = chunk_of(st);
    Index const c0 = c * kExpertChunkRows, mc = std::min(kExpertChunkRows, M - c0);
    if (w.raw[0] && c == 0) {
      for (int o = 0; o < Ops; ++o) {
        Index const n0 = p * NP, nc = std::max<Index>(0, std::min(NP, w.raw_rows[o] - n0));
        pack_panel<Arch>(w.raw[o], K, n0, nc, K, panel_buf + o * K * NP);
      }
    }
    if (dp && !a.pairs && p == p0) {
      bf16_pairs_rows(a.from(c0), mc, K, pairs, kp_all);
    }
    for (Index sidx = 0; sidx < slices; ++sidx) {
      Index const k0 = sidx * kc, kk = std::min(kc, K - k0);
      detail::Slice sl{partial, sidx == 0, sidx + 1 == slices};
      // What comes next: the next slice, or the first slice of the next step's panel (packed
      // weights only; a raw panel is packed when its first chunk starts).
      char const* next[2] = {nullptr, nullptr};
      Index next_bytes = 0;
      Index np = p, nk = k0 + kc;
      bool have_next = true;
      if (sidx + 1 == slices) {
        nk = 0;
        have_next = st + 1 < panels * chunks;
        if (have_next) np = panel_of(st + 1);
      }
      if (have_next && (packed || np == p)) {
        for (int o = 0; o < Ops; ++o) next[o] = panel_at(o, np, nk);
        next_bytes = slice_bytes(nk);
      } else if (!have_next && after.w) {
        // The caller's next panel: its first slice, as deep as ours (a hint, for either layout).
        WeightPanels const& nw = *after.w;
        Index const d = std::min(kc, after.K), kpn = (after.K + 1) / 2;
        for (int o = 0; o < 2; ++o) {
          if (nw.bf16[o]) next[o] = reinterpret_cast<char const*>(nw.bf16[o] + after.p * kpn * NP);
          if (nw.f32[o])
            next[o] = reinterpret_cast<char const*>(nw.f32[o] + after.p * after.K * NP);
        }
        next_bytes = nw.bf16[0] ? (d + 1) / 2 * NP * 4 : d * NP * 4;
      }
      char const* cur[2] = {panel_at(0, p, k0), Ops > 1 ? panel_at(1, p, k0) : nullptr};
      detail::for_each_row_tile<MaxMR>(mc, [&]<Index MR>(Index t, Index nt, Index i0) {
        detail::Prefetch const pf = detail::prefetch_slices(next, 2, next_bytes, t, nt);
        detail::Slice const tsl{partial + i0 * NB * L, sl.first, sl.last};
        if (bf16) {
          std::uint32_t const* panels_u[2] = {reinterpret_cast<std::uint32_t const*>(cur[0]),
                                              reinterpret_cast<std::uint32_t const*>(cur[1])};
#if MOE_HAS_AVX512BF16
          if constexpr (NP == 32) {
            if (dp) {
              std::uint32_t const* arows[MR];
              for (Index r = 0; r < MR; ++r) {
                arows[r] =
                    (a.pairs ? a.pairs + a.at(c0 + i0 + r) * a.ldp : pairs + (i0 + r) * kp_all) +
                    k0 / 2;
              }
              detail::expert_tile_bf16_dp<MR, Ops, Arch>(arows, panels_u, kk, epi, c0 + i0, p, pf,
                                                         tsl);
              return;
            }
          }
#endif
          for (Index r = 0; r < MR; ++r) row_ptr_storage[r] = a.row(c0 + i0 + r) + k0;
          detail::expert_tile_bf16_widen<MR, Ops, Arch>(row_ptr_storage, panels_u, kk, epi, c0 + i0,
                                                        p, pf, tsl);
        } else {
          for (Index r = 0; r < MR; ++r) row_ptr_storage[r] = a.row(c0 + i0 + r) + k0;
          float const* panels_f[2] = {reinterpret_cast<float const*>(cur[0]),
                                      reinterpret_cast<float const*>(cur[1])};
          detail::expert_tile_f32<MR, Ops, Arch>(row_ptr_storage, panels_f, kk, epi, c0 + i0, p, pf,
                                                 tsl);
        }
      });
    }
  }
}

}  // namespace moe::kernels

#include "moe/kernels/detail/diagnostics_pop.hpp"

// A build may compile the expert kernels of the common epilogues once, in one translation unit
// that instantiates them explicitly (src/precompiled/expert_kernels_*.cpp do for moe::precompiled),
// instead of in every translation unit that runs a layer: define MOE_EXTERN_EXPERT_KERNELS in
// every TU built with the same flags and link that one. Nothing changes without the macro.
#if defined(MOE_EXTERN_EXPERT_KERNELS)
namespace moe::kernels {
extern template void expert_cols<StoreEpilogue>(RowSource, Index, Index, WeightPanels const&, Index,
                                                Index, StoreEpilogue const&, float*, Index,
                                                NextPanel);
extern template void expert_cols<GluEpilogue<Activation::kSilu, false>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    GluEpilogue<Activation::kSilu, false> const&, float*, Index, NextPanel);
extern template void expert_cols<GluEpilogue<Activation::kSilu, true>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    GluEpilogue<Activation::kSilu, true> const&, float*, Index, NextPanel);
extern template void expert_cols<GluEpilogue<Activation::kGeluTanh, false>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    GluEpilogue<Activation::kGeluTanh, false> const&, float*, Index, NextPanel);
extern template void expert_cols<GluEpilogue<Activation::kGeluErf, false>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    GluEpilogue<Activation::kGeluErf, false> const&, float*, Index, NextPanel);
extern template void expert_cols<ActEpilogue<Activation::kSilu>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    ActEpilogue<Activation::kSilu> const&, float*, Index, NextPanel);
extern template void expert_cols<ActEpilogue<Activation::kRelu>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    ActEpilogue<Activation::kRelu> const&, float*, Index, NextPanel);
extern template void expert_cols<ActEpilogue<Activation::kGeluErf>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    ActEpilogue<Activation::kGeluErf> const&, float*, Index, NextPanel);
extern template void expert_cols<ActEpilogue<Activation::kGeluTanh>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    ActEpilogue<Activation::kGeluTanh> const&, float*, Index, NextPanel);
}  // namespace moe::kernels
#endif
