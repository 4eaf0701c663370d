// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The router stage of every MoE layer: logits z = x W_r^T, the finite check, routing controls,
/// the policy's Selection (shape checked), the RoutingPlan; backward: the policy's VJP plus the
/// balance terms on the logits, the router weight's gradient and its term of dx. Not public API.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/layers/stages/work.hpp"
#include "moe/routing/controls.hpp"

namespace moe::stages {

/// What routing produced for a batch, the results every MoE layer's workspace holds (apart from
/// its stages' buffers and its training cache).
struct RoutingResults {
  std::vector<float> logits;  ///< [T, E] router logits (after routing controls)
  Selection selection;        ///< the router's choices and scores
  RoutingPlan plan;           ///< rows sorted by expert
  double aux_loss = 0.0;      ///< the balance policy's loss for the last routed call (0: none)

  ConstMatrixView<float> logits_view() const {
    return {logits.data(), selection.num_tokens, selection.num_experts};
  }
};

/// Who computed a logit, for the error message of a non-finite one.
struct LogitOrigin {
  char const* layer = "MoeFfn";
  int rank = -1;           ///< expert-parallel rank, or -1
  Index token_offset = 0;  ///< global index of the first token (expert parallelism)
};

/// logits [T, E] = x W_r^T (W_r [E, D]) on `queue`, always as dot products (kernels::gemm_nt on
/// the raw weights): each logit depends only on its token's row and W_r, never on T, on packing
/// or on threads, so the routing of a token never depends on the batch it came in (the panel
/// path, faster only at large T, would change the last bits with T; the router is under 1% of a
/// layer's work). This is also the fast path for decode-sized batches.
template <class RoutedX, class SharedX>
void router_logits(ConstMatrixView<float> x, float const* weight, Index E,
                   std::vector<float>& logits, ProjectionQueue& queue, ThreadPool* pool) {
  logits.resize(static_cast<std::size_t>(x.rows * E));
  detail::ExpertJob job;
  job.a = {x.data, x.row_stride, nullptr};
  job.rows = x.rows;
  job.depth = x.cols;
  job.w = weights_for(weight, E, nullptr, nullptr, x.cols, 0, false, /*path_rows=*/0);
  job.c = logits.data();
  job.ldc = E;
  job.cols = E;
  queue.add(job);
  queue.run<RoutedX, SharedX>(pool);
}

/// logits [T, E] += bias [E] (a router bias; nothing when `bias` is empty).
inline void add_router_bias(std::vector<float>& logits, std::span<float const> bias) {
  std::size_t const E = bias.size();
  for (std::size_t r = 0; E > 0 && r < logits.size(); r += E) {
    for (std::size_t e = 0; e < E; ++e) logits[r + e] += bias[e];
  }
}

/// Throws moe::Error naming the first non-finite logit (NaN or Inf in x or in W_r).
inline void check_finite_logits(ConstMatrixView<float> logits, LogitOrigin const& origin) {
  for (Index t = 0; t < logits.rows; ++t) {
    float const* z = logits.row(t);
    for (Index e = 0; e < logits.cols; ++e) {
      if (std::isfinite(z[e])) continue;
      if (origin.rank >= 0) {
        detail::fail(origin.layer, ": router logit [token ", t, " of rank ", origin.rank,
                     " (global token ", origin.token_offset + t, "), expert ", e, "] is ", z[e],
                     "; NaN or Inf in the input x or the router weight. Check the previous "
                     "layer's output");
      }
      detail::fail(origin.layer, ": router logit [token ", t, ", expert ", e, "] is ", z[e],
                   "; NaN or Inf in the input x or the router weight. Check the previous "
                   "layer's output (moe rejects non-finite logits instead of routing on them)");
    }
  }
}

/// Throws moe::Error unless a router policy left `sel` shaped for T tokens, its slots and E
/// experts, with every expert id in [-1, E): what build_plan and the backward index by.
inline void check_selection(Selection const& sel, Index T, Index slots, Index E, char const* who) {
  std::size_t const ts = static_cast<std::size_t>(T * slots);
  detail::check(sel.num_tokens == T && sel.slots == slots && sel.num_experts == E &&
                    sel.expert.size() == ts && sel.weight.size() == ts &&
                    sel.scores.size() == static_cast<std::size_t>(T * E),
                who, ": the router policy left a Selection of ", sel.num_tokens, " tokens x ",
                sel.slots, " slots over ", sel.num_experts, " experts (", sel.expert.size(),
                " experts, ", sel.weight.size(), " weights, ", sel.scores.size(), " scores) for ",
                T, " tokens x ", slots, " slots over ", E,
                " experts; a policy's select() must call sel.reset(T, slots_per_token(), E)");
  for (std::size_t i = 0; i < ts; ++i) {
    ExpertId const e = sel.expert[i];
    detail::check(e >= -1 && e < E, who, ": the router policy chose expert ", e, " for token ",
                  static_cast<Index>(i) / slots, "; ids must be in [0, ", E,
                  ") or -1 for an empty slot");
  }
}

/// Routing controls on the logits, the policy's choice, weight multipliers and the plan.
template <class Router>
void select_and_plan(Router const& router, MatrixView<float> logits,
                     routing::RoutingControls const* controls, Selection& sel, RoutingPlan& plan,
                     char const* who) {
  Index const E = router.expert_count();
  if (controls) {
    controls->validate(E);
    controls->apply_to_logits(logits);
  }
  router.select(ConstMatrixView<float>(logits), sel);
  check_selection(sel, logits.rows, router.slots_per_token(), E, who);
  if (controls) controls->apply_to_weights(sel);
  kernels::build_plan(sel, plan);
}

/// The router's part of a backward: dL/d(slot weights), dL/d(scores) (Default MoE, balance),
/// dL/d(logits) and the balance policy's terms directly on the logits.
struct RouterGrads {
  std::vector<float> dweight;        ///< [T, slots]
  std::vector<float> dscores;        ///< [T, E]
  std::vector<float> dlogits;        ///< [T, E]
  std::vector<float> dlogits_extra;  ///< [T, E] balance terms on the logits

  void reset(Index T, Index slots, Index E) {
    dweight.assign(static_cast<std::size_t>(T * slots), 0.0f);
    dscores.assign(static_cast<std::size_t>(T * E), 0.0f);
    dlogits.assign(static_cast<std::size_t>(T * E), 0.0f);
    dlogits_extra.assign(static_cast<std::size_t>(T * E), 0.0f);
  }
  /// The policy's VJP (dweight, dscores -> dlogits), then the logit terms added (unless the
  /// layer has none: `logit_terms` false).
  template <class Router>
  void vjp(Router const& router, ConstMatrixView<float> logits, Selection const& sel,
           bool logit_terms = true) {
    Index const T = logits.rows, E = logits.cols;
    router.backward(logits, sel, dweight.data(), MatrixView<float>(dscores.data(), T, E),
                    MatrixView<float>(dlogits.data(), T, E));
    if (!logit_terms) return;
    for (Index i = 0; i < T * E; ++i) {
      dlogits[static_cast<std::size_t>(i)] += dlogits_extra[static_cast<std::size_t>(i)];
    }
  }
  /// bias_grad [E] += sum_t dlogits[t] (tokens in ascending order), for a router bias.
  void add_bias_grad(Index T, Index E, float* bias_grad) const {
    for (Index t = 0; t < T; ++t) {
      for (Index e = 0; e < E; ++e) bias_grad[e] += dlogits[static_cast<std::size_t>(t * E + e)];
    }
  }
  /// grad [E, D] += dlogits^T x, in items of 64 rows of the gradient.
  void add_weight_grad(GradTasks& tasks, ConstMatrixView<float> x, Index E, float* grad) const {
    tasks.add(x, ConstMatrixView<float>(dlogits.data(), x.rows, E),
              MatrixView<float>(grad, E, x.cols));
  }
  /// dx += dlogits W_r.
  DxTerm dx_term(float const* weight, Index E, Index D) const {
    return {dlogits.data(), E, E, weight, D};
  }
};

}  // namespace moe::stages
