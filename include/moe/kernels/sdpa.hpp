// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Scaled-dot-product attention over one head, blocked over keys with an online softmax
/// (running max and sum), and its backward; causal, sliding-window and padding (key) masks and
/// an attention sink (gpt-oss).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/detail/diagnostics_push.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

/// Query rows per block of the SDPA kernels (any value gives the same results).
inline constexpr Index kSdpaQueryBlock = 64;
/// Keys per block: the online softmax folds in one block of keys at a time. Block boundaries are
/// multiples of kSdpaKeyBlock counted from key 0, whatever rows a call covers, so a query row's
/// result does not depend on how rows are split across calls or threads.
inline constexpr Index kSdpaKeyBlock = 64;

/// One attention head (see sdpa_forward for the formula). Plain pointers, strides and counts.
///
/// | member   | shape          | notes                                                        |
/// |----------|----------------|--------------------------------------------------------------|
/// | q        | [Tq, d] (ldq)  | queries                                                      |
/// | k        | [Tk, d] (ldk)  | keys; key j sits at position j                               |
/// | v        | [Tk, dv] (ldv) | values (dv may differ from d: UMoE mixes hidden states)       |
/// | q_pos    | [Tq] or null   | position of each query row; null: row i is at i + causal_offset |
/// | key_mask | [Tk] or null   | 1 = attend, 0 = padding (never attended); null: all keys      |
///
/// Key j is visible to query row i iff (!causal || j <= pos_i) && (window == 0 || j > pos_i -
/// window) && (chunk == 0 || j + o >= chunk floor((pos_i + o) / chunk)) && (!key_mask ||
/// key_mask[j]), o = key_origin (chunked attention: a query sees the keys of its own chunk of
/// `chunk` positions, counted from absolute position 0; Llama 4). With a finite `sink` logit z the
/// softmax of every row gets one more term in its denominator: P_ij = exp(s_ij) / (exp(z) + sum_j
/// exp(s_ij)) (a key with logit z and a zero value; gpt-oss's per-head sinks). With `row_sink`, row
/// i's sink is row_sink[i] (query rows of different heads in one call, as MoeAttention's experts).
struct SdpaParams {
  float const* q = nullptr;
  Index ldq = 0;
  float const* k = nullptr;
  Index ldk = 0;
  float const* v = nullptr;
  Index ldv = 0;
  Index q_rows = 0;     ///< Tq
  Index kv_rows = 0;    ///< Tk
  Index head_dim = 0;   ///< d (of q and k)
  Index value_dim = 0;  ///< dv (of v and the output)
  float scale = 1.0f;   ///< usually 1 / sqrt(d)
  bool causal = false;
  Index causal_offset = 0;                 ///< pos_i = i + causal_offset when q_pos is null
  Index const* q_pos = nullptr;            ///< [Tq] query positions (causal only), or null
  std::uint8_t const* key_mask = nullptr;  ///< [Tk] 1 = real key, 0 = padding, or null
  Index window = 0;                        ///< sliding window: the last `window` positions; 0: all
  Index chunk = 0;       ///< chunked attention: keys of the query's own chunk only; 0: all
  Index key_origin = 0;  ///< the absolute position of key 0 (where chunks are counted from)
  float sink = -std::numeric_limits<float>::infinity();  ///< sink logit (unscaled); -inf: none
  float const* row_sink = nullptr;  ///< [Tq] a sink logit per query row (replaces sink), or null
  /// bf16 keys and values (a KvCache of KvFormat::kBf16), read instead of k and v when set
  /// (both or neither; the same strides, in elements): each value is widened to fp32 as it is
  /// loaded, so the result equals, bitwise, that of fp32 arrays holding the widened values.
  /// sdpa_forward only.
  std::uint16_t const* k_bf16 = nullptr;
  std::uint16_t const* v_bf16 = nullptr;
};

/// What the backward reads and writes, besides SdpaParams. The gradients are accumulated (+=):
/// zero them first unless adding to other contributions is intended.
///
/// | member | shape           | notes                                                     |
/// |--------|-----------------|-----------------------------------------------------------|
/// | o      | [Tq, dv] (ldo)  | the forward's output                                       |
/// | dout   | [Tq, dv] (lddo) | dL/do                                                      |
/// | lse    | [Tq]            | the forward's row logsumexp (-inf for a fully masked row)   |
/// | delta  | [Tq]            | rowsum(dout * o), from sdpa_backward_delta                  |
/// | dq     | [Tq, d] (lddq)  | += dL/dq (may be null in sdpa_backward_dkv)                 |
/// | dk     | [Tk, d] (lddk)  | += dL/dk (may be null in sdpa_backward_dq)                  |
/// | dv     | [Tk, dv] (lddv) | += dL/dv (may be null in sdpa_backward_dq)                  |
struct SdpaGrads {
  float const* o = nullptr;
  Index ldo = 0;
  float const* dout = nullptr;
  Index lddo = 0;
  float const* lse = nullptr;
  float const* delta = nullptr;
  float* dq = nullptr;
  Index lddq = 0;
  float* dk = nullptr;
  Index lddk = 0;
  float* dv = nullptr;
  Index lddv = 0;
};

/// Floats of scratch one SDPA call needs (forward or backward): a packed key (or value) block,
/// two score blocks, a mask row and the running statistics, plus room to align to 64 bytes.
/// Independent of the sequence length: nothing of size Tq x Tk is ever allocated.
template <class Arch = simd::DefaultArch>
constexpr Index sdpa_scratch_size(Index head_dim, Index value_dim) {
  Index const depth = std::max<Index>(1, std::max(head_dim, value_dim));
  return (depth * kSdpaKeyBlock + 15) / 16 * 16 + 2 * kSdpaQueryBlock * kSdpaKeyBlock +
         kSdpaKeyBlock + 3 * kSdpaQueryBlock + 16;
}

namespace detail {

/// The next key block's keys [rows, d] (ldk) and values [rows, dv] (ldv), prefetched into L2
/// while the forward multiplies this block's probabilities by its values: row k's columns of the
/// current value chunk [c0, c1) (and, in the last chunk, the keys' columns past dv) as the kernel
/// reaches value row k. A decode step's few query rows do little work per key, and fetched on
/// demand the keys and values of a long context arrive a few misses at a time. Measured on a
/// Zen 5 VM, 2 threads, one decode step's 4 KV groups of 8 query rows over 4096 cached keys
/// (16 MB, from DRAM): 0.72-0.75 ms against 0.96-1.26 without (and 0.83 prefetching into L1).
/// T: the element type of the keys and values (float, or bf16 as std::uint16_t).
template <class T>
struct KvPrefetchT {
  static constexpr Index kLine = 64 / static_cast<Index>(sizeof(T));  ///< elements a line
  T const* k = nullptr;
  Index ldk = 0, d = 0;
  T const* v = nullptr;
  Index ldv = 0, dv = 0;
  Index rows = 0;

  /// What to prefetch for each row of the chunk of columns [c0, c1): the 64-byte lines of the
  /// values' columns [c0, min(c1, dv)) and of the keys' columns [c0, c1 >= dv ? d : min(c1, d)).
  struct Chunk {
    T const* v;
    Index ldv, v_lines;
    T const* k;
    Index ldk, k_lines;
    Index rows;
    MOE_ALWAYS_INLINE void touch(Index row) const {
      for (Index i = 0; i < v_lines; ++i) __builtin_prefetch(v + row * ldv + kLine * i, 0, 2);
      for (Index i = 0; i < k_lines; ++i) __builtin_prefetch(k + row * ldk + kLine * i, 0, 2);
    }
  };
  Chunk chunk(Index c0, Index c1) const {
    auto lines = [](Index n) { return n > 0 ? (n + kLine - 1) / kLine : Index{0}; };
    Index const k1 = c1 >= dv ? d : std::min(c1, d);
    return {v + c0, ldv, lines(std::min(c1, dv) - c0), k + c0, ldk, lines(k1 - c0), rows};
  }
};
using KvPrefetch = KvPrefetchT<float>;

/// C[r, c] = beta_r * C[r, c] + sum_{k < K} A(r, k) B[k, c] for r < MR and the columns of one
/// chunk [c0, c0 + NB*L): A(r, k) = a[r * a_rs + k * a_cs]; beta null means 1. Each output is one
/// chain: beta * C, then one FMA per k in ascending order. pf (or null): what to prefetch for
/// row k of the chunk starting at column c0.
template <Index MR, Index NB, class Arch, class T>
MOE_ALWAYS_INLINE void rank_update_tile(float const* a, Index a_rs, Index a_cs, T const* b,
                                        Index ldb, float* c, Index ldc, Index K, float const* beta,
                                        KvPrefetchT<T> const* pf, Index c0) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B acc[MR][NB];
  for (Index r = 0; r < MR; ++r) {
    for (Index n = 0; n < NB; ++n) {
      acc[r][n] = B::load_unaligned(c + r * ldc + n * L);
      if (beta) acc[r][n] = acc[r][n] * B(beta[r]);
    }
  }
  auto step = [&](Index k) {
    B bv[NB];
    for (Index n = 0; n < NB; ++n) bv[n] = load_weights<B>(b + k * ldb + n * L);
    for (Index r = 0; r < MR; ++r) {
      B const av(a[r * a_rs + k * a_cs]);
      for (Index n = 0; n < NB; ++n) acc[r][n] = xsimd::fma(av, bv[n], acc[r][n]);
    }
  };
  Index k = 0;
  if (pf) {  // the rows that have a next-block row to prefetch, then the rest
    typename KvPrefetchT<T>::Chunk const next = pf->chunk(c0, c0 + NB * L);
    for (Index const kp = std::min(K, next.rows); k < kp; ++k) {
      next.touch(k);
      step(k);
    }
  }
  for (; k < K; ++k) step(k);
  for (Index r = 0; r < MR; ++r) {
    for (Index n = 0; n < NB; ++n) acc[r][n].store_unaligned(c + r * ldc + n * L);
  }
}

template <Index MR, class Arch, class T>
MOE_ALWAYS_INLINE void rank_update_rows(float const* a, Index a_rs, Index a_cs, T const* b,
                                        Index ldb, float* c, Index ldc, Index N, Index K,
                                        float const* beta, KvPrefetchT<T> const* pf) {
  constexpr Index L = static_cast<Index>(simd::Batch<float, Arch>::size);
  Index c0 = 0;
  for (; c0 + 2 * L <= N; c0 += 2 * L) {
    rank_update_tile<MR, 2, Arch, T>(a, a_rs, a_cs, b + c0, ldb, c + c0, ldc, K, beta, pf, c0);
  }
  for (; c0 + L <= N; c0 += L) {
    rank_update_tile<MR, 1, Arch, T>(a, a_rs, a_cs, b + c0, ldb, c + c0, ldc, K, beta, pf, c0);
  }
  if (pf && c0 < N) {  // the scalar tail's columns (and the keys' past them)
    typename KvPrefetchT<T>::Chunk const next = pf->chunk(c0, N);
    for (Index k = 0, kp = std::min(K, next.rows); k < kp; ++k) next.touch(k);
  }
  for (; c0 < N; ++c0) {  // scalar tail: the same chain as one lane
    for (Index r = 0; r < MR; ++r) {
      float acc = c[r * ldc + c0];
      if (beta) acc *= beta[r];
      for (Index k = 0; k < K; ++k) {
        acc = std::fma(a[r * a_rs + k * a_cs], weight_value(b[k * ldb + c0]), acc);
      }
      c[r * ldc + c0] = acc;
    }
  }
}

/// C [M, N] (ldc) = diag(beta) C + A B, A(r, k) = a[r * a_rs + k * a_cs] [M, K], B [K, N] (ldb).
/// An output element's value depends only on its row of A, its column of B, beta_r and K (never
/// on M or on the tiling), so results are reproducible however rows are blocked. pf (or null):
/// the next key block, prefetched during the first tile of rows.
template <class Arch, class T>
void rank_update(float const* a, Index a_rs, Index a_cs, T const* b, Index ldb, float* c, Index ldc,
                 Index M, Index N, Index K, float const* beta,
                 std::type_identity_t<KvPrefetchT<T>> const* pf = nullptr) {
  constexpr Index MR = simd::Batch<float, Arch>::size >= 16 ? 8 : 6;  // 32 or 16 registers
  Index r = 0;
  for (; r + MR <= M; r += MR) {
    rank_update_rows<MR, Arch, T>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, N, K,
                                  beta ? beta + r : nullptr, r == 0 ? pf : nullptr);
  }
  if (r > 0) pf = nullptr;
  float const* bt = beta ? beta + r : nullptr;
  switch (M - r) {
    case 7:
      rank_update_rows<7, Arch, T>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, N, K, bt,
                                   pf);
      break;
    case 6:
      rank_update_rows<6, Arch, T>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, N, K, bt,
                                   pf);
      break;
    case 5:
      rank_update_rows<5, Arch, T>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, N, K, bt,
                                   pf);
      break;
    case 4:
      rank_update_rows<4, Arch, T>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, N, K, bt,
                                   pf);
      break;
    case 3:
      rank_update_rows<3, Arch, T>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, N, K, bt,
                                   pf);
      break;
    case 2:
      rank_update_rows<2, Arch, T>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, N, K, bt,
                                   pf);
      break;
    case 1:
      rank_update_rows<1, Arch, T>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, N, K, bt,
                                   pf);
      break;
    default:
      break;
  }
}

/// The scratch of one SDPA call, carved out of the caller's buffer.
struct SdpaScratch {
  float* panels;  // [kSdpaKeyBlock / NP][depth][NP] packed keys (or values)
  float* s;       // [Br, Bc] scores, then probabilities
  float* dp;      // [Br, Bc] dP, then dS (backward)
  float* bias;    // [Bc] 0 or -inf per key of the block (padding, tail)
  float* m;       // [Br] running max
  float* l;       // [Br] running sum
  float* alpha;   // [Br] rescale factor of the current block
};

template <class Arch>
SdpaScratch carve(float* scratch, Index head_dim, Index value_dim) {
  auto const addr = reinterpret_cast<std::uintptr_t>(scratch);
  float* p = scratch + ((64 - addr % 64) % 64) / sizeof(float);
  Index const depth = std::max<Index>(1, std::max(head_dim, value_dim));
  SdpaScratch s;
  s.panels = p;
  p += (depth * kSdpaKeyBlock + 15) / 16 * 16;
  s.s = p;
  p += kSdpaQueryBlock * kSdpaKeyBlock;
  s.dp = p;
  p += kSdpaQueryBlock * kSdpaKeyBlock;
  s.bias = p;
  p += kSdpaKeyBlock;
  s.m = p;
  s.l = p + kSdpaQueryBlock;
  s.alpha = p + 2 * kSdpaQueryBlock;
  return s;
}

inline Index query_pos(SdpaParams const& p, Index i) {
  return p.q_pos ? p.q_pos[i] : i + p.causal_offset;
}

/// The first key a query at position pos can see by the window and chunk masks (may be <= 0).
inline Index first_visible_key(SdpaParams const& p, Index pos) {
  Index first = 0;
  if (p.window > 0) first = pos - p.window + 1;
  if (p.chunk > 0) {
    Index const a = pos + p.key_origin;  // absolute position, >= 0
    first = std::max(first, a - a % p.chunk - p.key_origin);
  }
  return first;
}

/// Key blocks a block of query rows [i0, i1) can see: [first_key_block(...), key_blocks_for(...)).
/// With a sliding window or chunks the blocks wholly before every row's first key are skipped.
inline Index first_key_block(SdpaParams const& p, Index i0, Index i1) {
  if ((p.window <= 0 && p.chunk <= 0) || i1 <= i0) return 0;
  Index minpos = std::numeric_limits<Index>::max();
  for (Index i = i0; i < i1; ++i) minpos = std::min(minpos, query_pos(p, i));
  Index const first_key = first_visible_key(p, minpos);  // non-decreasing in pos
  return first_key <= 0 ? 0 : first_key / kSdpaKeyBlock;
}
inline Index key_blocks_for(SdpaParams const& p, Index i0, Index i1) {
  Index const nkb = (p.kv_rows + kSdpaKeyBlock - 1) / kSdpaKeyBlock;
  if (!p.causal || i1 <= i0) return nkb;
  Index maxpos = std::numeric_limits<Index>::min();
  for (Index i = i0; i < i1; ++i) maxpos = std::max(maxpos, query_pos(p, i));
  if (maxpos < 0) return 0;
  return std::min(nkb, maxpos / kSdpaKeyBlock + 1);
}

/// Packs rows [j0, j0 + kc) of W [*, depth] (ldw) as kSdpaKeyBlock / NP panels; returns the
/// padded width kw (a multiple of NP) of the score block they produce.
template <class Arch, class T>
Index pack_block(T const* w, Index ldw, Index j0, Index kc, Index depth, float* panels) {
  constexpr Index NP = panel_width<Arch>();
  Index kw = 0;
  for (Index c = 0; c < kc; c += NP, kw += NP) {
    pack_panel<Arch, T>(w, ldw, j0 + c, std::min(NP, kc - c), depth, panels + c * depth);
  }
  return kw;
}

/// S [nq, kw] (ld kSdpaKeyBlock) = A [nq, depth] (lda) times the packed block.
template <class Arch>
void block_scores(float const* a, Index lda, Index nq, Index depth, float const* panels, Index kw,
                  float* s) {
  constexpr Index NP = panel_width<Arch>();
  for (Index c = 0; c < kw; c += NP) {
    gemm_panel<Arch>(a, lda, panels + c * depth, nq, depth, s + c, kSdpaKeyBlock, NP);
  }
}

/// bias[c] = 0 if key j0 + c exists and is not padding, else -inf, for c < kw.
inline void block_bias(SdpaParams const& p, Index j0, Index kc, Index kw, float* bias) {
  float const ninf = -std::numeric_limits<float>::infinity();
  for (Index c = 0; c < kw; ++c) {
    bias[c] = c < kc && (!p.key_mask || p.key_mask[j0 + c]) ? 0.0f : ninf;
  }
}

/// s[c] = s[c] * scale + bias[c] for c < kw, then -inf for the keys after position pos (causal).
template <class Arch>
MOE_ALWAYS_INLINE void mask_row(SdpaParams const& p, float* s, float const* bias, Index kw,
                                Index j0, Index pos) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B const sc(p.scale);
  for (Index c = 0; c < kw; c += L) {
    xsimd::fma(B::load_unaligned(s + c), sc, B::load_unaligned(bias + c)).store_unaligned(s + c);
  }
  if (p.causal) {
    Index const lim = std::max<Index>(0, std::min(kw, pos - j0 + 1));
    std::fill(s + lim, s + kw, -std::numeric_limits<float>::infinity());
  }
  if (p.window > 0 || p.chunk > 0) {  // keys before the window or the query's chunk
    Index const lim = std::max<Index>(0, std::min(kw, first_visible_key(p, pos) - j0));
    std::fill(s, s + lim, -std::numeric_limits<float>::infinity());
  }
}

template <class Arch>
MOE_ALWAYS_INLINE float row_max(float const* s, Index kw) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B mb = B::load_unaligned(s);
  for (Index c = L; c < kw; c += L) mb = xsimd::max(mb, B::load_unaligned(s + c));
  return simd::reduce_max(mb);
}

/// s[c] = exp(s[c] - shift) for c < kw; returns the sum (lanes, then reduce).
template <class Arch>
MOE_ALWAYS_INLINE float exp_row(float* s, Index kw, float shift) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B const sh(shift);
  B sum(0.0f);
  for (Index c = 0; c < kw; c += L) {
    B const e = xsimd::exp(B::load_unaligned(s + c) - sh);
    e.store_unaligned(s + c);
    sum += e;
  }
  return simd::reduce_add(sum);
}

/// One (query block, key block) pair of the backward: recomputes P from lse, dP = dO V^T and
/// dS = scale * P * (dP - delta), then applies the requested updates.
template <class Arch>
void backward_pair(SdpaParams const& p, SdpaGrads const& g, SdpaScratch const& w, Index i0,
                   Index nq, Index j0, bool want_dq, bool want_dkv) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index const d = p.head_dim, dv = p.value_dim;
  Index const kc = std::min(kSdpaKeyBlock, p.kv_rows - j0);
  Index const kw = pack_block<Arch>(p.k, p.ldk, j0, kc, d, w.panels);
  block_scores<Arch>(p.q + i0 * p.ldq, p.ldq, nq, d, w.panels, kw, w.s);
  block_bias(p, j0, kc, kw, w.bias);
  for (Index r = 0; r < nq; ++r) {
    float* s = w.s + r * kSdpaKeyBlock;
    float const lse = g.lse[i0 + r];
    if (lse == -std::numeric_limits<float>::infinity()) {
      std::fill(s, s + kw, 0.0f);
      continue;
    }
    mask_row<Arch>(p, s, w.bias, kw, j0, query_pos(p, i0 + r));
    exp_row<Arch>(s, kw, lse);
  }
  pack_block<Arch>(p.v, p.ldv, j0, kc, dv, w.panels);
  block_scores<Arch>(g.dout + i0 * g.lddo, g.lddo, nq, dv, w.panels, kw, w.dp);
  B const sc(p.scale);
  for (Index r = 0; r < nq; ++r) {
    float const* s = w.s + r * kSdpaKeyBlock;
    float* ds = w.dp + r * kSdpaKeyBlock;
    B const dl(g.delta[i0 + r]);
    for (Index c = 0; c < kw; c += L) {
      B const pv = B::load_unaligned(s + c);
      (pv * (B::load_unaligned(ds + c) - dl) * sc).store_unaligned(ds + c);
    }
  }
  if (want_dkv) {
    // dV[j] += sum_i P[i, j] dO[i];  dK[j] += sum_i dS[i, j] Q[i]   (A = P^T, dS^T)
    rank_update<Arch>(w.s, 1, kSdpaKeyBlock, g.dout + i0 * g.lddo, g.lddo, g.dv + j0 * g.lddv,
                      g.lddv, kc, dv, nq, nullptr);
    rank_update<Arch>(w.dp, 1, kSdpaKeyBlock, p.q + i0 * p.ldq, p.ldq, g.dk + j0 * g.lddk, g.lddk,
                      kc, d, nq, nullptr);
  }
  if (want_dq) {
    // dQ[i] += sum_j dS[i, j] K[j]
    rank_update<Arch>(w.dp, kSdpaKeyBlock, 1, p.k + j0 * p.ldk, p.ldk, g.dq + i0 * g.lddq, g.lddq,
                      nq, d, kc, nullptr);
  }
}

}  // namespace detail

namespace detail {

/// sdpa_forward over keys K and values V of element type T (float or bf16).
template <class Arch, class T>
void sdpa_forward_rows(SdpaParams const& p, T const* K, T const* V, float* o, Index ldo, float* lse,
                       Index q_begin, Index q_end, float* scratch) {
  Index const d = p.head_dim, dv = p.value_dim;
  float const ninf = -std::numeric_limits<float>::infinity();
  detail::SdpaScratch const w = detail::carve<Arch>(scratch, d, dv);
  for (Index i0 = q_begin; i0 < q_end; i0 += kSdpaQueryBlock) {
    Index const nq = std::min(kSdpaQueryBlock, q_end - i0);
    // The sink is the first term of the online softmax: m = z, l = exp(z - z) = 1, o = 0.
    for (Index r = 0; r < nq; ++r) {
      std::fill(o + (i0 + r) * ldo, o + (i0 + r) * ldo + dv, 0.0f);
      float const z = p.row_sink ? p.row_sink[i0 + r] : p.sink;
      w.m[r] = z;
      w.l[r] = z != ninf ? 1.0f : 0.0f;
    }
    Index const nkb = detail::key_blocks_for(p, i0, i0 + nq);
    for (Index kb = detail::first_key_block(p, i0, i0 + nq); kb < nkb; ++kb) {
      Index const j0 = kb * kSdpaKeyBlock, kc = std::min(kSdpaKeyBlock, p.kv_rows - j0);
      Index const kw = detail::pack_block<Arch, T>(K, p.ldk, j0, kc, d, w.panels);
      detail::block_scores<Arch>(p.q + i0 * p.ldq, p.ldq, nq, d, w.panels, kw, w.s);
      detail::block_bias(p, j0, kc, kw, w.bias);
      for (Index r = 0; r < nq; ++r) {
        float* s = w.s + r * kSdpaKeyBlock;
        detail::mask_row<Arch>(p, s, w.bias, kw, j0, detail::query_pos(p, i0 + r));
        float const m_new = std::max(w.m[r], detail::row_max<Arch>(s, kw));
        if (m_new == ninf) {  // nothing visible yet: the row stays 0 (exp(-inf - -inf) is NaN)
          std::fill(s, s + kw, 0.0f);
          w.alpha[r] = 1.0f;
          continue;
        }
        w.alpha[r] = std::exp(w.m[r] - m_new);  // exactly 1 when the max did not move
        w.l[r] = w.l[r] * w.alpha[r] + detail::exp_row<Arch>(s, kw, m_new);
        w.m[r] = m_new;
      }
      // o = diag(alpha) o + P V over the kc keys of the block, the next block prefetched.
      Index const j1 = j0 + kSdpaKeyBlock;
      detail::KvPrefetchT<T> const next{K + j1 * p.ldk,
                                        p.ldk,
                                        d,
                                        V + j1 * p.ldv,
                                        p.ldv,
                                        dv,
                                        kb + 1 < nkb ? std::min(kSdpaKeyBlock, p.kv_rows - j1) : 0};
      detail::rank_update<Arch, T>(w.s, kSdpaKeyBlock, 1, V + j0 * p.ldv, p.ldv, o + i0 * ldo, ldo,
                                   nq, dv, kc, w.alpha, next.rows > 0 ? &next : nullptr);
    }
    for (Index r = 0; r < nq; ++r) {
      float* orow = o + (i0 + r) * ldo;
      if (w.l[r] > 0.0f) {
        float const inv = 1.0f / w.l[r];
        for (Index c = 0; c < dv; ++c) orow[c] *= inv;
        if (lse) lse[i0 + r] = w.m[r] + std::log(w.l[r]);
      } else {
        std::fill(orow, orow + dv, 0.0f);
        if (lse) lse[i0 + r] = ninf;
      }
    }
  }
}

}  // namespace detail

/// Scaled-dot-product attention of query rows [q_begin, q_end) of one head:
///
///   s_ij = scale * <q_i, k_j>  for visible keys j (see SdpaParams), -inf otherwise
///   o_i  = sum_j softmax_j(s_i)_j v_j,        lse_i = log sum_j exp(s_ij)
///   (with a sink z: the softmax and lse_i also sum exp(z); o_i has no term for it)
///
/// computed FlashAttention-style: keys in blocks of kSdpaKeyBlock, a running max m_i and sum l_i
/// per row (m' = max(m, max_j s_ij); l' = l e^{m - m'} + sum_j e^{s_ij - m'};
/// o' = o e^{m - m'} + sum_j e^{s_ij - m'} v_j), o_i /= l_i at the end. Numerically stable for any
/// score magnitude; scratch is sdpa_scratch_size floats, independent of Tq and Tk (no Tq x Tk
/// matrix). Causal: key blocks after the last visible key of a query block are skipped.
///
/// A row that sees no key at all (every key padding, or causal with pos_i < 0) gets o_i = 0 and
/// lse_i = -inf (with a sink: o_i = 0, lse_i = z). `lse` may be null (inference); training keeps
/// it for sdpa_backward. Sliding window: key blocks before every row's window are skipped.
/// Outputs: o [Tq, dv] (ldo), rows [q_begin, q_end) overwritten; lse [Tq] likewise.
/// Keys and values are fp32 (k, v) or bf16 (k_bf16, v_bf16), widened as they are loaded.
/// Bitwise reproducible: a row's result depends only on its query, its position and K, V, never
/// on q_begin/q_end or on other rows. Single-threaded; calls on disjoint rows may run in parallel.
template <class Arch = simd::DefaultArch>
void sdpa_forward(SdpaParams const& p, float* o, Index ldo, float* lse, Index q_begin, Index q_end,
                  float* scratch) {
  if (p.k_bf16 != nullptr) {
    detail::sdpa_forward_rows<Arch, std::uint16_t>(p, p.k_bf16, p.v_bf16, o, ldo, lse, q_begin,
                                                   q_end, scratch);
  } else {
    detail::sdpa_forward_rows<Arch, float>(p, p.k, p.v, o, ldo, lse, q_begin, q_end, scratch);
  }
}

/// delta_i = sum_c dout[i, c] * o[i, c] for rows [q_begin, q_end) (the softmax VJP's row term),
/// one FMA chain per row in ascending c.
inline void sdpa_backward_delta(SdpaGrads const& g, Index value_dim, Index q_begin, Index q_end,
                                float* delta) {
  for (Index i = q_begin; i < q_end; ++i) {
    float const* o = g.o + i * g.ldo;
    float const* d = g.dout + i * g.lddo;
    float acc = 0.0f;
    for (Index c = 0; c < value_dim; ++c) acc = std::fma(d[c], o[c], acc);
    delta[i] = acc;
  }
}

/// dL/dz of the sink logit z of one head from its rows' lse and delta (sdpa_backward_delta):
///   dz = -sum_i exp(z - lse_i) delta_i   (the sink is a key whose value is 0: dP = 0, so
///   dS_i,sink = P_i,sink (0 - delta_i)), rows with lse = -inf skipped, in ascending i.
inline float sdpa_sink_grad(float sink, float const* lse, float const* delta, Index rows) {
  float acc = 0.0f;
  for (Index i = 0; i < rows; ++i) {
    if (lse[i] == -std::numeric_limits<float>::infinity()) continue;
    acc -= std::exp(sink - lse[i]) * delta[i];
  }
  return acc;
}

/// Backward of sdpa_forward over all rows, accumulating into g.dq, g.dk and g.dv:
///
///   P_ij = exp(s_ij - lse_i);  dP_ij = <dout_i, v_j>;  dS_ij = P_ij (dP_ij - delta_i)
///   dq_i += scale sum_j dS_ij k_j;   dk_j += scale sum_i dS_ij q_i;   dv_j += sum_i P_ij dout_i
///
/// P is recomputed block by block from the forward's lse (FlashAttention-2), so the backward
/// keeps nothing of size Tq x Tk either. Requires g.delta (sdpa_backward_delta). Rows with
/// lse = -inf contribute nothing. Single-threaded. The result equals, bitwise, that of
/// sdpa_backward_dq over all rows plus sdpa_backward_dkv over all keys (the parallel split).
template <class Arch = simd::DefaultArch>
void sdpa_backward(SdpaParams const& p, SdpaGrads const& g, float* scratch) {
  detail::SdpaScratch const w = detail::carve<Arch>(scratch, p.head_dim, p.value_dim);
  for (Index i0 = 0; i0 < p.q_rows; i0 += kSdpaQueryBlock) {
    Index const nq = std::min(kSdpaQueryBlock, p.q_rows - i0);
    Index const nkb = detail::key_blocks_for(p, i0, i0 + nq);
    for (Index kb = detail::first_key_block(p, i0, i0 + nq); kb < nkb; ++kb) {
      detail::backward_pair<Arch>(p, g, w, i0, nq, kb * kSdpaKeyBlock, true, true);
    }
  }
}

/// The dq part of sdpa_backward for query rows [q_begin, q_end) (dk, dv untouched). Calls on
/// disjoint row ranges may run in parallel.
template <class Arch = simd::DefaultArch>
void sdpa_backward_dq(SdpaParams const& p, SdpaGrads const& g, Index q_begin, Index q_end,
                      float* scratch) {
  detail::SdpaScratch const w = detail::carve<Arch>(scratch, p.head_dim, p.value_dim);
  for (Index i0 = q_begin; i0 < q_end; i0 += kSdpaQueryBlock) {
    Index const nq = std::min(kSdpaQueryBlock, q_end - i0);
    Index const nkb = detail::key_blocks_for(p, i0, i0 + nq);
    for (Index kb = detail::first_key_block(p, i0, i0 + nq); kb < nkb; ++kb) {
      detail::backward_pair<Arch>(p, g, w, i0, nq, kb * kSdpaKeyBlock, true, false);
    }
  }
}

/// The dk and dv part of sdpa_backward for key blocks [kb_begin, kb_end) (keys
/// [kb_begin * kSdpaKeyBlock, min(Tk, kb_end * kSdpaKeyBlock)); dq untouched). Calls on disjoint
/// key blocks may run in parallel.
template <class Arch = simd::DefaultArch>
void sdpa_backward_dkv(SdpaParams const& p, SdpaGrads const& g, Index kb_begin, Index kb_end,
                       float* scratch) {
  detail::SdpaScratch const w = detail::carve<Arch>(scratch, p.head_dim, p.value_dim);
  for (Index kb = kb_begin; kb < kb_end; ++kb) {
    Index const j0 = kb * kSdpaKeyBlock;
    for (Index i0 = 0; i0 < p.q_rows; i0 += kSdpaQueryBlock) {
      Index const nq = std::min(kSdpaQueryBlock, p.q_rows - i0);
      if (kb >= detail::key_blocks_for(p, i0, i0 + nq) ||
          kb < detail::first_key_block(p, i0, i0 + nq)) {
        continue;
      }
      detail::backward_pair<Arch>(p, g, w, i0, nq, j0, false, true);
    }
  }
}

}  // namespace moe::kernels

#include "moe/kernels/detail/diagnostics_pop.hpp"

// The SDPA kernels compiled once for our own binaries, the way kernels/expert_gemm.hpp's expert
// kernels are: MOE_SDPA_INSTANTIATION(extern, Arch) declares them extern where
// MOE_EXTERN_EXPERT_KERNELS is defined, MOE_SDPA_INSTANTIATION(, Arch) instantiates them
// (src/precompiled/kernels_common.cpp). Nothing changes without the macro.
#define MOE_SDPA_INSTANTIATION(EXTERN, Arch)                                                      \
  EXTERN template void moe::kernels::detail::rank_update<Arch, float>(                            \
      float const*, moe::Index, moe::Index, float const*, moe::Index, float*, moe::Index,         \
      moe::Index, moe::Index, moe::Index, float const*,                                           \
      moe::kernels::detail::KvPrefetchT<float> const*);                                           \
  EXTERN template void moe::kernels::detail::rank_update<Arch, std::uint16_t>(                    \
      float const*, moe::Index, moe::Index, std::uint16_t const*, moe::Index, float*, moe::Index, \
      moe::Index, moe::Index, moe::Index, float const*,                                           \
      moe::kernels::detail::KvPrefetchT<std::uint16_t> const*);                                   \
  EXTERN template void moe::kernels::detail::backward_pair<Arch>(                                 \
      moe::kernels::SdpaParams const&, moe::kernels::SdpaGrads const&,                            \
      moe::kernels::detail::SdpaScratch const&, moe::Index, moe::Index, moe::Index, bool, bool);  \
  EXTERN template void moe::kernels::detail::sdpa_forward_rows<Arch, float>(                      \
      moe::kernels::SdpaParams const&, float const*, float const*, float*, moe::Index, float*,    \
      moe::Index, moe::Index, float*);                                                            \
  EXTERN template void moe::kernels::detail::sdpa_forward_rows<Arch, std::uint16_t>(              \
      moe::kernels::SdpaParams const&, std::uint16_t const*, std::uint16_t const*, float*,        \
      moe::Index, float*, moe::Index, moe::Index, float*);                                        \
  EXTERN template void moe::kernels::sdpa_forward<Arch>(moe::kernels::SdpaParams const&, float*,  \
                                                        moe::Index, float*, moe::Index,           \
                                                        moe::Index, float*);                      \
  EXTERN template void moe::kernels::sdpa_backward<Arch>(moe::kernels::SdpaParams const&,         \
                                                         moe::kernels::SdpaGrads const&, float*); \
  EXTERN template void moe::kernels::sdpa_backward_dq<Arch>(moe::kernels::SdpaParams const&,      \
                                                            moe::kernels::SdpaGrads const&,       \
                                                            moe::Index, moe::Index, float*);      \
  EXTERN template void moe::kernels::sdpa_backward_dkv<Arch>(moe::kernels::SdpaParams const&,     \
                                                             moe::kernels::SdpaGrads const&,      \
                                                             moe::Index, moe::Index, float*)
#if defined(MOE_EXTERN_EXPERT_KERNELS)
MOE_SDPA_INSTANTIATION(extern, moe::kernels::simd::DefaultArch);
#endif
