// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The gated delta rule of one head (Gated DeltaNet, Yang et al. 2024; Qwen3-Next, Qwen3.5): a
/// state S [d_k, d_v] that decays, is corrected towards each new (key, value) pair and is read
/// by each query. Three routines on raw pointers: the token-by-token recurrence (decode steps),
/// the chunked form (prompts: most of its work is small matrix products inside a chunk) and the
/// backward of the recurrence (checkpointed: the state is kept every `chunk` tokens and
/// recomputed inside a chunk). Allocation-free; each output is a fixed sequence of operations.
#pragma once

#include <algorithm>
#include <cmath>

#include "moe/core/types.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

namespace detail {
/// sum_i a[i] b[i] over SIMD lanes (one batch accumulator, reduced with simd::reduce_add, then
/// the scalar tail in order): a fixed order for a given n.
template <class Arch = simd::DefaultArch>
float dot(float const* a, float const* b, Index n) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B acc(0.0f);
  Index i = 0;
  for (; i + L <= n; i += L)
    acc = xsimd::fma(B::load_unaligned(a + i), B::load_unaligned(b + i), acc);
  float s = simd::reduce_add(acc);
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}
}  // namespace detail

/// One head's inputs and output over T tokens, rows with strides (the layer's [T, heads * dim]
/// buffers read in place). q, k: [T, d_k] (q already L2-normalised and scaled, k L2-normalised),
/// v, o: [T, d_v], g: log decay per token (<= 0), beta: write strength per token in (0, 1).
struct DeltaRuleHead {
  float const* q = nullptr;
  float const* k = nullptr;
  float const* v = nullptr;
  float const* g = nullptr;
  float const* beta = nullptr;
  float* o = nullptr;
  Index ldq = 0, ldk = 0, ldv = 0, ldg = 1, ldbeta = 1, ldo = 0;
  Index tokens = 0, dk = 0, dv = 0;
};

/// Recurrent form, token by token, from the state S [d_k, d_v] (row-major; updated in place):
///   S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
/// (transformers' torch_recurrent_gated_delta_rule). With `checkpoints` (not null), the state
/// before tokens 0, chunk, 2 chunk, ... is copied to checkpoints + i d_k d_v (what
/// delta_rule_backward reads). `scratch`: d_v floats.
inline void delta_rule_recurrent(DeltaRuleHead const& p, float* S, float* scratch,
                                 float* checkpoints = nullptr, Index chunk = 64) {
  Index const dk = p.dk, dv = p.dv;
  float* const delta = scratch;
  for (Index t = 0; t < p.tokens; ++t) {
    if (checkpoints && t % chunk == 0) std::copy(S, S + dk * dv, checkpoints + t / chunk * dk * dv);
    float const a = std::exp(p.g[t * p.ldg]), b = p.beta[t * p.ldbeta];
    float const* k = p.k + t * p.ldk;
    float const* q = p.q + t * p.ldq;
    float const* v = p.v + t * p.ldv;
    float* o = p.o + t * p.ldo;
    std::fill(delta, delta + dv, 0.0f);
    for (Index i = 0; i < dk; ++i) {  // S *= a; delta = S^T k
      float* s = S + i * dv;
      for (Index j = 0; j < dv; ++j) {
        s[j] *= a;
        delta[j] = std::fma(s[j], k[i], delta[j]);
      }
    }
    for (Index j = 0; j < dv; ++j) delta[j] = b * (v[j] - delta[j]);
    std::fill(o, o + dv, 0.0f);
    for (Index i = 0; i < dk; ++i) {  // S += k delta^T; o = S^T q
      float* s = S + i * dv;
      for (Index j = 0; j < dv; ++j) {
        s[j] = std::fma(k[i], delta[j], s[j]);
        o[j] = std::fma(s[j], q[i], o[j]);
      }
    }
  }
}

/// Floats of delta_rule_chunked's scratch.
inline Index delta_rule_chunked_scratch(Index chunk, Index dk, Index dv) {
  return chunk + 2 * chunk * chunk + chunk * (4 * dk + 3 * dv);
}

/// Chunked form (transformers' torch_chunk_gated_delta_rule), the same function as
/// delta_rule_recurrent up to rounding. Per chunk of n <= `chunk` tokens, with c_i the cumulative
/// sum of g inside the chunk and the state S at its start:
///   A = -(strictly lower part of) beta_i (k_i . k_j) exp(c_i - c_j);  T = (I - A)^-1 by forward
///   substitution (row i += sum_m A_im T_m);  U = T diag(beta) V;  W = T diag(beta exp(c)) K;
///   V' = U - W S;  o_i = exp(c_i) q_i^T S + sum_{j <= i} (q_i . k_j) exp(c_i - c_j) V'_j;
///   S <- exp(c_n) S + sum_j exp(c_n - c_j) k_j V'_j^T.
/// Eight of its steps are matrix products (K K^T, Q K^T, T (beta V), T (beta e^c K), W S, Q S,
/// (Q K^T) V', K^T V'), run by gemm_strided on the operands in place; the rest is O(n^2 + n d)
/// elementwise work and the forward substitution (n^3 / 6). A shorter last chunk is the padded
/// chunk of the reference with the padding dropped (padded tokens have k = 0, g = 0).
/// Checkpoints as in delta_rule_recurrent (only where a chunk starts: pass the same `chunk`).
/// `scratch`: delta_rule_chunked_scratch(chunk, d_k, d_v) floats.
inline void delta_rule_chunked(DeltaRuleHead const& p, float* S, float* scratch, Index chunk = 64,
                               float* checkpoints = nullptr) {
  Index const dk = p.dk, dv = p.dv, C = chunk;
  float* const ec = scratch;      // [C] exp(c_i), c the cumulative log decay
  float* const A = ec + C;        // [C, C] -beta K K^T decayed, then T
  float* const QK = A + C * C;    // [C, C] Q K^T decayed
  float* const kT = QK + C * C;   // [dk, C] K^T
  float* const bk = kT + dk * C;  // [C, dk] beta exp(c) K, then exp(c_n - c) K
  float* const W = bk + C * dk;   // [C, dk]
  float* const bv = W + C * dk;   // [C, dv] beta V
  float* const U = bv + C * dv;   // [C, dv] U, then V'
  float* const tmp = U + C * dv;  // [C, dv] W S
  for (Index t0 = 0, ci = 0; t0 < p.tokens; t0 += C, ++ci) {
    if (checkpoints) std::copy(S, S + dk * dv, checkpoints + ci * dk * dv);
    Index const n = std::min(C, p.tokens - t0);
    float const* Kc = p.k + t0 * p.ldk;
    float const* Qc = p.q + t0 * p.ldq;
    float* const Oc = p.o + t0 * p.ldo;
    // Decays from sums of g in double: c_i - c_j from two long fp32 cumulative sums loses
    // |c| eps in the exponent (c reaches -1000 under strong decay: 6e-5 relative error).
    double acc = 0.0;
    for (Index i = 0; i < n; ++i) {
      acc += static_cast<double>(p.g[(t0 + i) * p.ldg]);
      ec[i] = static_cast<float>(std::exp(acc));
    }
    for (Index i = 0; i < n; ++i) {
      for (Index a = 0; a < dk; ++a) kT[a * C + i] = Kc[i * p.ldk + a];
    }
    gemm_strided(n, n, dk, Kc, p.ldk, 1, kT, C, A, C, false);
    gemm_strided(n, n, dk, Qc, p.ldq, 1, kT, C, QK, C, false);
    for (Index i = 0; i < n; ++i) {
      float const bi = p.beta[(t0 + i) * p.ldbeta];
      double d = 0.0;  // c_i - c_j = g_{j+1} + ... + g_i
      for (Index j = i; j >= 0; --j) {
        float const decay = static_cast<float>(std::exp(d));
        A[i * C + j] = j < i ? -bi * A[i * C + j] * decay : 0.0f;
        QK[i * C + j] *= decay;
        d += static_cast<double>(p.g[(t0 + j) * p.ldg]);
      }
      for (Index j = i + 1; j < n; ++j) A[i * C + j] = QK[i * C + j] = 0.0f;
    }
    // Forward substitution, in place: row i += sum_{m < i} A_im T_m (rows m < i final); A_im is
    // read before any write to column m of row i (those come from rows m' > m).
    for (Index i = 1; i < n; ++i) {
      float* ri = A + i * C;
      for (Index m = 1; m < i; ++m) {
        float const f = ri[m];
        float const* rm = A + m * C;
        for (Index j = 0; j < m; ++j) ri[j] = std::fma(f, rm[j], ri[j]);
      }
    }
    for (Index i = 0; i < n; ++i) {
      A[i * C + i] = 1.0f;
      float const b = p.beta[(t0 + i) * p.ldbeta], be = b * ec[i];
      float const* vi = p.v + (t0 + i) * p.ldv;
      for (Index j = 0; j < dv; ++j) bv[i * dv + j] = b * vi[j];
      for (Index a = 0; a < dk; ++a) bk[i * dk + a] = be * Kc[i * p.ldk + a];
    }
    gemm_strided(n, dv, n, A, C, 1, bv, dv, U, dv, false);  // U = T beta V
    gemm_strided(n, dk, n, A, C, 1, bk, dk, W, dk, false);  // W = T beta e^c K
    gemm_strided(n, dv, dk, W, dk, 1, S, dv, tmp, dv, false);
    for (Index i = 0; i < n * dv; ++i) U[i] -= tmp[i];               // V' = U - W S
    gemm_strided(n, dv, dk, Qc, p.ldq, 1, S, dv, Oc, p.ldo, false);  // q S
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < dv; ++j) Oc[i * p.ldo + j] *= ec[i];
    }
    gemm_strided(n, dv, n, QK, C, 1, U, dv, Oc, p.ldo, true);  // + (Q K^T) V'
    float const el = ec[n - 1];
    for (Index a = 0; a < dk * dv; ++a) S[a] *= el;
    double d = 0.0;  // c_n - c_j
    for (Index j = n - 1; j >= 0; --j) {
      float const e = static_cast<float>(std::exp(d));
      for (Index a = 0; a < dk; ++a) bk[j * dk + a] = e * Kc[j * p.ldk + a];
      d += static_cast<double>(p.g[(t0 + j) * p.ldg]);
    }
    gemm_strided(dk, dv, n, bk, 1, dk, U, dv, S, dv, true);  // S += (e K)^T V'
  }
}

/// Floats of delta_rule_backward's scratch.
inline Index delta_rule_backward_scratch(Index chunk, Index dk, Index dv) {
  return (chunk + 2) * dk * dv + 2 * chunk * dv + 2 * dv;
}

/// The gradients of one head's outputs and final state under the recurrence of
/// delta_rule_recurrent: given do [T, d_v] (stride lddo) and dS [d_k, d_v], the gradient of the
/// state after the last token (zeros for none; it becomes the gradient of the initial state),
/// writes dq, dk [T, d_k], dv [T, d_v], dg, dbeta [T] (overwritten; the layer's strides). The
/// states are recomputed chunk by chunk from `checkpoints` (the state before tokens 0, chunk,
/// ...: what the forward kept with the same `chunk`). Per token, backwards:
///   dS += q do^T; dq = S_t do; dk = dS delta; dd = dS^T k; dv = beta dd;
///   dbeta = dd . (v - m); dm = -beta dd; dS' = dS + k dm^T; dk += S' dm; dg = <dS', S'>;
///   dS = exp(g) dS'      (S' = exp(g) S_{t-1}, m = S'^T k, delta = beta (v - m)).
/// `scratch`: delta_rule_backward_scratch(chunk, d_k, d_v) floats.
inline void delta_rule_backward(DeltaRuleHead const& p, float const* checkpoints, Index chunk,
                                float const* dout, Index lddo, float* dS, float* dq, Index lddq,
                                float* dk, Index lddk, float* dv, Index lddv, float* dg,
                                float* dbeta, float* scratch) {
  Index const DK = p.dk, DV = p.dv, SS = DK * DV;
  float* const states = scratch;                 // [chunk + 1, DK, DV]
  float* const dSp = states + (chunk + 1) * SS;  // [DK, DV] dS'
  float* const M = dSp + SS;                     // [chunk, DV] m per token
  float* const Dl = M + chunk * DV;              // [chunk, DV] delta per token
  float* const dd = Dl + chunk * DV;             // [DV]
  float* const dm = dd + DV;                     // [DV]
  Index const chunks = (p.tokens + chunk - 1) / chunk;
  for (Index ci = chunks - 1; ci >= 0; --ci) {
    Index const t0 = ci * chunk, n = std::min(chunk, p.tokens - t0);
    std::copy(checkpoints + ci * SS, checkpoints + (ci + 1) * SS, states);
    for (Index i = 0; i < n; ++i) {  // recompute S_t, m_t, delta_t
      Index const t = t0 + i;
      float const a = std::exp(p.g[t * p.ldg]), b = p.beta[t * p.ldbeta];
      float const* k = p.k + t * p.ldk;
      float const* v = p.v + t * p.ldv;
      float const* prev = states + i * SS;
      float* cur = states + (i + 1) * SS;
      float* m = M + i * DV;
      float* delta = Dl + i * DV;
      std::fill(m, m + DV, 0.0f);
      for (Index r = 0; r < DK; ++r) {
        for (Index j = 0; j < DV; ++j) {
          float const s = prev[r * DV + j] * a;
          cur[r * DV + j] = s;
          m[j] = std::fma(s, k[r], m[j]);
        }
      }
      for (Index j = 0; j < DV; ++j) delta[j] = b * (v[j] - m[j]);
      for (Index r = 0; r < DK; ++r) {
        for (Index j = 0; j < DV; ++j) cur[r * DV + j] = std::fma(k[r], delta[j], cur[r * DV + j]);
      }
    }
    for (Index i = n - 1; i >= 0; --i) {
      Index const t = t0 + i;
      float const a = std::exp(p.g[t * p.ldg]), b = p.beta[t * p.ldbeta];
      float const* k = p.k + t * p.ldk;
      float const* q = p.q + t * p.ldq;
      float const* v = p.v + t * p.ldv;
      float const* d_o = dout + t * lddo;
      float const* St = states + (i + 1) * SS;
      float const* Sp = states + i * SS;  // S_{t-1}; S' = a S_{t-1}
      float const* m = M + i * DV;
      float const* delta = Dl + i * DV;
      float* dqt = dq + t * lddq;
      float* dkt = dk + t * lddk;
      float* dvt = dv + t * lddv;
      // Row by row: vector loops over d_v, the reductions by detail::dot (fixed lane order).
      std::fill(dd, dd + DV, 0.0f);
      for (Index r = 0; r < DK; ++r) {
        float* ds = dS + r * DV;
        for (Index j = 0; j < DV; ++j) ds[j] = std::fma(q[r], d_o[j], ds[j]);  // dS += q do^T
        dqt[r] = detail::dot(St + r * DV, d_o, DV);                            // dq = S_t do
        dkt[r] = detail::dot(ds, delta, DV);                                   // dk = dS delta
        for (Index j = 0; j < DV; ++j) dd[j] = std::fma(ds[j], k[r], dd[j]);   // dd = dS^T k
      }
      float db = 0.0f;
      for (Index j = 0; j < DV; ++j) {
        dvt[j] = b * dd[j];
        db = std::fma(dd[j], v[j] - m[j], db);
        dm[j] = -b * dd[j];
      }
      dbeta[t * p.ldbeta] = db;
      float dgt = 0.0f;
      for (Index r = 0; r < DK; ++r) {
        float const* ds = dS + r * DV;
        float const* sp = Sp + r * DV;
        float* dsp = dSp + r * DV;
        for (Index j = 0; j < DV; ++j) dsp[j] = std::fma(k[r], dm[j], ds[j]);  // dS' = dS + k dm^T
        dkt[r] = std::fma(a, detail::dot(sp, dm, DV), dkt[r]);                 // dk += S' dm
        dgt = std::fma(a, detail::dot(dsp, sp, DV), dgt);                      // dg = <dS', S'>
      }
      dg[t * p.ldg] = dgt;
      for (Index r = 0; r < SS; ++r) dS[r] = dSp[r] * a;
    }
  }
}

}  // namespace moe::kernels
