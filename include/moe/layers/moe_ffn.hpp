// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MoeFfn: the sparse Mixture-of-Experts feed-forward layer, composed from policies.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>
#include <vector>

#include "moe/balance/none.hpp"
#include "moe/core/concepts.hpp"
#include "moe/core/eigen_interop.hpp"
#include "moe/core/error.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/kernels/combine.hpp"
#include "moe/kernels/gather.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/kernels/softmax.hpp"
#include "moe/routing/controls.hpp"

namespace moe {

/// Per-call options of MoeFfn::forward.
struct ForwardOptions {
  routing::RoutingControls const* controls = nullptr;  ///< inference-time steering / masking
  ThreadPool* pool = nullptr;                          ///< null: run on the calling thread
};

/// Everything one MoeFfn call writes besides its output: router logits, the Selection, the
/// RoutingPlan, expert outputs and per-thread scratch. Reused across calls: once it has seen the
/// largest batch (or after `MoeFfn::reserve`), a call allocates nothing. One workspace per
/// concurrent caller; the layer itself is read-only during forward.
struct MoeFfnWorkspace {
  std::vector<float> logits;       ///< [T, E] router logits (after routing controls)
  Selection selection;             ///< the router's choices and scores
  RoutingPlan plan;                ///< rows sorted by expert
  std::vector<float> expert_out;   ///< [R, D] expert outputs, row r = E_{e(r)}(x[token(r)])
  std::vector<float> shared_out;   ///< [S, T, D] shared-expert outputs
  std::vector<float> shared_gate;  ///< [T, S] sigmoid gates of the shared experts
  std::vector<float> scratch;      ///< per-thread gather + hidden buffers
  double aux_loss = 0.0;           ///< the balance policy's loss for the last routed call

  struct Item {
    Index expert;  // < E: routed expert; >= E: shared expert (expert - E)
    Index begin;   // routed: plan rows; shared: tokens
    Index end;
  };
  std::vector<Item> items;

  ConstMatrixView<float> logits_view() const {
    return {logits.data(), selection.num_tokens, selection.num_experts};
  }
};

/// A sparse Mixture-of-Experts feed-forward layer (GShard / Switch "dispatch, experts, combine"):
///
///   z_t = W_r x_t                                   router logits [T, E]
///   (A_t, w_t) = Router(z_t)                        chosen experts and their weights
///   y_t = sum_{i in A_t} w_{t,i} E_i(x_t)  +  shared experts (optionally sigmoid-gated)
///
/// \tparam Router_  a RouterPolicy (SoftmaxTopK, TopKSoftmax, GroupLimitedTopK, ExpertChoice, ...)
/// \tparam Expert_  an ExpertPolicy (SwiGlu, GeGlu, ReluMlp, ...), used by every routed expert
/// \tparam Shared_  a SharedExpertPolicy (NoSharedExperts, SharedExperts<X, gated>)
/// \tparam Balance_ a BalancePolicy (balance::None)
///
/// | tensor            | shape   |                                                    |
/// |-------------------|---------|----------------------------------------------------|
/// | x, y              | [T, D]  | row-major; y may be x (in-place)                   |
/// | router_weight()   | [E, D]  | HF `gate.weight`, no bias                          |
/// | experts()         | E experts of D -> F -> D                             |
///
/// Preconditions (checked, moe::Error otherwise): x.cols == y.cols == d_model, x.rows == y.rows,
/// the router's configuration valid, router logits finite (NaN or Inf in x or W_r is reported
/// with the offending token). Sizes are run-time values; only the policies are types.
/// Threads: forward is const; results are bitwise identical for any pool size and from run to run
/// (work items are fixed tiles, each reduced in a fixed order). Cost: 2*T*E*D for the router plus
/// 2*R*D*F*(gated ? 3 : 2) for the experts, R = routed rows.
template <RouterPolicy Router_, ExpertPolicy Expert_,
          SharedExpertPolicy Shared_ = experts::NoSharedExperts,
          BalancePolicy Balance_ = balance::None>
class MoeFfn {
 public:
  using Router = Router_;
  using Expert = Expert_;
  using Shared = Shared_;
  using Balance = Balance_;
  using Bank = experts::ExpertBank<Expert>;

  /// Rows per expert work item; fixed so that results never depend on the thread count.
  static constexpr Index kTileRows = 64;

  MoeFfn() = default;
  /// A layer with zero weights. Throws moe::Error if the router is invalid or the sizes disagree.
  MoeFfn(Index d_model, Index d_ffn, Router router, Shared shared = {}, Balance balance = {})
      : router_(std::move(router)),
        shared_(std::move(shared)),
        balance_(std::move(balance)),
        d_model_(d_model) {
    router_.validate();
    Index const E = router_.expert_count();
    detail::check(d_model >= 1 && d_ffn >= 1, "MoeFfn: d_model = ", d_model, ", d_ffn = ", d_ffn,
                  "; both must be >= 1");
    bank_ = Bank(E, d_model, d_ffn);
    router_weight_.assign(static_cast<std::size_t>(E * d_model), 0.0f);
    if constexpr (Shared::has_experts) {
      detail::check(shared_.count() == 0 || shared_.bank().d_model() == d_model,
                    "MoeFfn: shared experts have d_model = ", shared_.bank().d_model(),
                    " but the layer has ", d_model, "; build them with the layer's d_model");
    }
  }

  Index d_model() const { return d_model_; }
  Index d_ffn() const { return bank_.d_ffn(); }
  Index num_experts() const { return router_.expert_count(); }

  Router& router() { return router_; }
  Router const& router() const { return router_; }
  Bank& experts() { return bank_; }
  Bank const& experts() const { return bank_; }
  Shared& shared_experts() { return shared_; }
  Shared const& shared_experts() const { return shared_; }
  Balance& balance() { return balance_; }
  Balance const& balance() const { return balance_; }
  /// [E, D] router projection, logits = x W_r^T.
  MatrixView<float> router_weight() { return {router_weight_.data(), num_experts(), d_model_}; }
  ConstMatrixView<float> router_weight() const {
    return {router_weight_.data(), num_experts(), d_model_};
  }

  /// Grows `ws` for batches of up to max_tokens tokens and `threads` threads, so that later calls
  /// allocate nothing.
  void reserve(MoeFfnWorkspace& ws, Index max_tokens, int threads = 1) const {
    Index const E = num_experts(), S = router_.slots_per_token(), D = d_model_;
    Index const R = max_tokens * S;
    ws.logits.reserve(static_cast<std::size_t>(max_tokens * E));
    ws.selection.expert.reserve(static_cast<std::size_t>(R));
    ws.selection.weight.reserve(static_cast<std::size_t>(R));
    ws.selection.scores.reserve(static_cast<std::size_t>(max_tokens * E));
    ws.selection.scratch.reserve(static_cast<std::size_t>(max_tokens * E + R + 2 * E + max_tokens));
    ws.selection.scratch_ids.reserve(static_cast<std::size_t>(max_tokens + 2 * E));
    ws.plan.expert_offsets.reserve(static_cast<std::size_t>(E + 1));
    ws.plan.token_offsets.reserve(static_cast<std::size_t>(max_tokens + 1));
    ws.plan.row_token.reserve(static_cast<std::size_t>(R));
    ws.plan.row_weight.reserve(static_cast<std::size_t>(R));
    ws.plan.token_rows.reserve(static_cast<std::size_t>(R));
    ws.expert_out.reserve(static_cast<std::size_t>(R * D));
    Index const ns = shared_.count();
    ws.shared_out.reserve(static_cast<std::size_t>(ns * max_tokens * D));
    ws.shared_gate.reserve(static_cast<std::size_t>(ns * max_tokens));
    ws.scratch.reserve(static_cast<std::size_t>(threads * scratch_per_thread()));
    ws.items.reserve(
        static_cast<std::size_t>(E + R / kTileRows + 1 + ns * (max_tokens / kTileRows + 1)));
  }

  /// Routes x: computes ws.logits, ws.selection, ws.plan and ws.aux_loss, without running experts.
  void route(ConstMatrixView<float> x, MoeFfnWorkspace& ws, ForwardOptions const& opt = {}) const {
    check_input(x);
    Index const T = x.rows, E = num_experts();
    ws.logits.resize(static_cast<std::size_t>(T * E));
    MatrixView<float> logits(ws.logits.data(), T, E);
    Index const tiles = (T + kTileRows - 1) / kTileRows;
    parallel_for(opt.pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, n = std::min(kTileRows, T - t0);
      as_eigen(logits.middle_rows(t0, n)).noalias() =
          as_eigen(x.middle_rows(t0, n)) * as_eigen(router_weight()).transpose();
    });
    for (Index t = 0; t < T; ++t) {
      float const* z = logits.row(t);
      for (Index e = 0; e < E; ++e) {
        if (!std::isfinite(z[e])) {
          detail::fail("MoeFfn: router logit [token ", t, ", expert ", e, "] is ", z[e],
                       "; NaN or Inf in the input x or the router weight. Check the previous "
                       "layer's output (moe rejects non-finite logits instead of routing on them)");
        }
      }
    }
    if (opt.controls) {
      opt.controls->validate(E);
      opt.controls->apply_to_logits(logits);
    }
    router_.select(logits, ws.selection);
    if (opt.controls) opt.controls->apply_to_weights(ws.selection);
    kernels::build_plan(ws.selection, ws.plan);
    ws.aux_loss = balance_.aux_loss(BalanceInputs{logits, ws.selection, ws.plan});
  }

  /// y = MoE(x): route, run the routed and shared experts, combine. See the class comment.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, MoeFfnWorkspace& ws,
               ForwardOptions const& opt = {}) const {
    check_input(x);
    check_output(x, y);
    route(x, ws, opt);
    run_experts(x, ws.plan, y, ws, opt.pool);
  }

  /// y = MoE(x) with a routing decision made elsewhere (another layer's ws.plan, a plan shared by
  /// several expert banks, or one built by hand). The plan is validated first; ws.selection and
  /// ws.logits are left untouched.
  void forward_with_plan(ConstMatrixView<float> x, RoutingPlan const& plan, MatrixView<float> y,
                         MoeFfnWorkspace& ws, ThreadPool* pool = nullptr) const {
    check_input(x);
    check_output(x, y);
    plan.validate(x.rows, num_experts());
    run_experts(x, plan, y, ws, pool);
  }

  /// Convenience: forward with a workspace owned by the layer (not for concurrent callers).
  void operator()(ConstMatrixView<float> x, MatrixView<float> y, ForwardOptions const& opt = {}) {
    forward(x, y, own_ws_, opt);
  }
  MoeFfnWorkspace const& last_workspace() const { return own_ws_; }

 private:
  Index scratch_per_thread() const {
    Index s = kTileRows * d_model_ + bank_.scratch_size(kTileRows);
    if constexpr (Shared::has_experts) {
      s = std::max(s, shared_.bank().scratch_size(kTileRows));
    }
    return s;
  }

  void check_input(ConstMatrixView<float> x) const {
    detail::check(x.cols == d_model_, "MoeFfn: x has ", x.cols, " columns but d_model = ", d_model_,
                  "; pass activations of shape [tokens, d_model]");
    detail::check(x.rows >= 0 && x.row_stride >= x.cols && (x.data || x.rows == 0),
                  "MoeFfn: x is not a valid view (rows = ", x.rows, ", row_stride = ", x.row_stride,
                  ")");
    detail::check(router_weight_.size() == static_cast<std::size_t>(num_experts() * d_model_),
                  "MoeFfn: the layer was default-constructed; construct it with sizes first");
  }
  void check_output(ConstMatrixView<float> x, MatrixView<float> y) const {
    detail::check(y.rows == x.rows && y.cols == d_model_, "MoeFfn: y is [", y.rows, ", ", y.cols,
                  "] but must be [", x.rows, ", ", d_model_, "] like x");
    detail::check(y.row_stride >= y.cols && (y.data || y.rows == 0),
                  "MoeFfn: y is not a valid view");
  }

  void run_experts(ConstMatrixView<float> x, RoutingPlan const& plan, MatrixView<float> y,
                   MoeFfnWorkspace& ws, ThreadPool* pool) const {
    Index const T = x.rows, D = d_model_, E = num_experts();
    Index const R = plan.num_rows();
    Index const ns = shared_.count();
    ws.expert_out.resize(static_cast<std::size_t>(R * D));
    ws.shared_out.resize(static_cast<std::size_t>(ns * T * D));
    ws.shared_gate.resize(static_cast<std::size_t>(Shared::gated ? ns * T : 0));
    int const threads = pool ? pool->size() : 1;
    Index const per_thread = scratch_per_thread();
    ws.scratch.resize(static_cast<std::size_t>(threads * per_thread));
    ws.items.clear();
    for (Index e = 0; e < E; ++e) {
      for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; r += kTileRows) {
        ws.items.push_back({e, r, std::min(r + kTileRows, plan.expert_offsets[e + 1])});
      }
    }
    for (Index s = 0; s < ns; ++s) {
      for (Index t = 0; t < T; t += kTileRows)
        ws.items.push_back({E + s, t, std::min(t + kTileRows, T)});
    }
    parallel_for(pool, static_cast<Index>(ws.items.size()), [&](Index i, int thread) {
      auto const item = ws.items[i];
      float* scratch = ws.scratch.data() + thread * per_thread;
      Index const n = item.end - item.begin;
      if (item.expert < E) {
        MatrixView<float> xe(scratch, n, D);
        kernels::gather_rows(x.data, x.row_stride, plan.row_token.data() + item.begin, n, D,
                             xe.data, D);
        MatrixView<float> out(ws.expert_out.data() + item.begin * D, n, D);
        bank_.run(item.expert, xe, out, scratch + n * D);
      } else if constexpr (Shared::has_experts) {
        Index const s = item.expert - E;
        ConstMatrixView<float> xs = x.middle_rows(item.begin, n);
        MatrixView<float> out(ws.shared_out.data() + (s * T + item.begin) * D, n, D);
        shared_.bank().run(s, xs, out, scratch);
        if constexpr (Shared::gated) {
          float const* g = shared_.gate_weight().row(s);
          for (Index t = item.begin; t < item.end; ++t) {
            float const* xt = x.row(t);
            float z = 0.0f;
            for (Index d = 0; d < D; ++d) z = std::fma(g[d], xt[d], z);
            ws.shared_gate[t * ns + s] = z;
          }
          // Gates of this tile's tokens for expert s: sigmoid in place (strided by ns).
          for (Index t = item.begin; t < item.end; ++t) {
            float& v = ws.shared_gate[t * ns + s];
            v = 1.0f / (1.0f + std::exp(-v));
          }
        }
      }
    });
    Index const token_tiles = (T + kTileRows - 1) / kTileRows;
    parallel_for(pool, token_tiles, [&](Index i, int) {
      kernels::CombineParams p;
      p.expert_out = ws.expert_out.data();
      p.ld_expert_out = D;
      p.row_weight = plan.row_weight.data();
      p.token_offsets = plan.token_offsets.data();
      p.token_rows = plan.token_rows.data();
      p.shared_out = ns > 0 ? ws.shared_out.data() : nullptr;
      p.ld_shared = D;
      p.shared_plane = T * D;
      p.num_shared = ns;
      p.shared_gate = Shared::gated && ns > 0 ? ws.shared_gate.data() : nullptr;
      p.token_begin = i * kTileRows;
      p.token_end = std::min(T, p.token_begin + kTileRows);
      p.cols = D;
      p.out = y.data;
      p.ld_out = y.row_stride;
      kernels::combine_rows(p);
    });
  }

  Router router_{};
  Bank bank_;
  Shared shared_{};
  Balance balance_{};
  Index d_model_ = 0;
  std::vector<float> router_weight_;
  MoeFfnWorkspace own_ws_;
};

}  // namespace moe
