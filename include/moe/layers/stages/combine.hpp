// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The combine stage of every MoE layer and its VJP:
///   y_t = sum_{j in slots of t} w_j Y_{row(t, j)}  +  sum_s g_{t,s} S_s(x_t)
/// rows summed in slot order, then the shared experts, each output row written once (no
/// atomics). Backward: dY_r = w_r dy_t, dL/dw_j = <dy_t, Y_r>, dS_s = g dy_t and the gate's
/// logit gradient <dy_t, S_s> g (1 - g). Not public API.
#pragma once

#include <algorithm>

#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/kernels/combine.hpp"

namespace moe::stages {

/// Tokens per combine work item (row-independent work: any value gives the same bits).
inline constexpr Index kTokenTile = 64;

/// What a combine reads: the routed rows [R, D] (in plan row order), their weights (null: the
/// rows are already weighted, or the dispatch VJP's weight 1), and S shared-expert planes
/// [S, T, D] with their gates [T, S] (null: ungated).
struct CombineSource {
  float const* rows = nullptr;
  float const* row_weight = nullptr;
  RoutingPlan const* plan = nullptr;
  float const* shared = nullptr;  ///< null when S = 0
  Index num_shared = 0;
  float const* shared_gate = nullptr;
};

/// out rows [t0, t1) = the combine of `src` (T = plan->num_tokens, D = out.cols).
inline void combine_tile(CombineSource const& src, Index t0, Index t1, MatrixView<float> out) {
  Index const D = out.cols, T = src.plan->num_tokens;
  kernels::CombineParams p;
  p.expert_out = src.rows;
  p.ld_expert_out = D;
  p.row_weight = src.row_weight;
  p.token_offsets = src.plan->token_offsets.data();
  p.token_rows = src.plan->token_rows.data();
  p.shared_out = src.num_shared > 0 ? src.shared : nullptr;
  p.ld_shared = D;
  p.shared_plane = T * D;
  p.num_shared = src.num_shared;
  p.shared_gate = src.num_shared > 0 ? src.shared_gate : nullptr;
  p.token_begin = t0;
  p.token_end = t1;
  p.cols = D;
  p.out = out.data;
  p.ld_out = out.row_stride;
  kernels::combine_rows(p);
}

/// The combine over every token, in tiles of kTokenTile; after(t0, n) runs on each tile once it
/// is written (the input gradient's projection terms).
template <class After>
void combine(CombineSource const& src, MatrixView<float> out, ThreadPool* pool, After&& after) {
  Index const T = out.rows;
  parallel_for(pool, (T + kTokenTile - 1) / kTokenTile, [&](Index i, int) {
    Index const t0 = i * kTokenTile, t1 = std::min(T, t0 + kTokenTile);
    combine_tile(src, t0, t1, out);
    after(t0, t1 - t0);
  });
}
inline void combine(CombineSource const& src, MatrixView<float> out, ThreadPool* pool) {
  combine(src, out, pool, [](Index, Index) {});
}

/// Where the combine VJP writes: dL/d(rows) [R, D], dL/d(slot weights) [T, slots],
/// dL/d(shared rows) [S, T, D] and dL/d(shared gate logits) [T, S] (gated only).
struct CombineGrads {
  float* d_rows = nullptr;
  float* dweight = nullptr;
  float* d_shared = nullptr;
  float* dgate = nullptr;
};

/// The combine VJP for upstream gradient dy [T, D] of a combine of unweighted rows `src.rows`
/// with weights `src.row_weight` (training keeps the rows unweighted; null: weights 1, as for
/// input-scaled routing).
inline void combine_backward(ConstMatrixView<float> dy, CombineSource const& src,
                             Selection const& sel, CombineGrads const& g, ThreadPool* pool) {
  Index const T = dy.rows, D = dy.cols, S = sel.slots, ns = src.num_shared;
  RoutingPlan const& plan = *src.plan;
  parallel_for(pool, (T + kTokenTile - 1) / kTokenTile, [&](Index i, int) {
    Index const t0 = i * kTokenTile, t1 = std::min(T, t0 + kTokenTile);
    for (Index t = t0; t < t1; ++t) {
      float const* gy = dy.row(t);
      Index j = plan.token_offsets[t];
      for (Index s = 0; s < S; ++s) {
        if (sel.expert[static_cast<std::size_t>(t * S + s)] < 0) continue;
        Index const r = plan.token_rows[j++];
        g.dweight[t * S + s] = kernels::scale_dot(
            gy, src.rows + r * D, src.row_weight ? src.row_weight[r] : 1.0f, g.d_rows + r * D, D);
      }
      for (Index s = 0; s < ns; ++s) {
        float const gate = src.shared_gate ? src.shared_gate[t * ns + s] : 1.0f;
        float const dot = kernels::scale_dot(gy, src.shared + (s * T + t) * D, gate,
                                             g.d_shared + (s * T + t) * D, D);
        if (src.shared_gate) g.dgate[t * ns + s] = dot * gate * (1.0f - gate);
      }
    }
  });
}

}  // namespace moe::stages
