// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MoeFfn: the sparse Mixture-of-Experts feed-forward layer, composed from policies.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "moe/balance/none.hpp"
#include "moe/core/concepts.hpp"
#include "moe/core/error.hpp"
#include "moe/core/in_use.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/layers/detail/expert_jobs.hpp"
#include "moe/layers/detail/ffn_base.hpp"
#include "moe/layers/stages/combine.hpp"
#include "moe/layers/stages/routed_experts.hpp"
#include "moe/layers/stages/router.hpp"
#include "moe/layers/stages/shared_experts.hpp"
#include "moe/layers/stages/work.hpp"
#include "moe/routing/controls.hpp"
#include "moe/routing/top_k_sigmoid.hpp"

namespace moe {

/// Per-call options of MoeFfn::forward.
struct ForwardOptions {
  routing::RoutingControls const* controls = nullptr;  ///< inference-time steering / masking
  ThreadPool* pool = nullptr;                          ///< null: run on the calling thread
  std::span<std::uint8_t const> token_mask = {};       ///< [T] 1 = real, 0 = padding (balance)
};

/// Default MoE (Panda et al., "Dense Backpropagation Improves Training for Sparse MoE"): a
/// per-expert EMA d_i of expert outputs stands in for the experts a token did not select, so the
/// router gets a gradient from every expert:
///   D_t = sum_{i not in A_t} p_{t,i} d_i          (p: the router's scores)
///   kForward:  y_t = S_t + D_t;     kGradOnly: y_t = S_t (value), gradient as if + D_t
///   dL/dp_{t,i} += <dy_t, d_i> for unselected i;  d gets no gradient, experts none through D.
/// After each training forward: d_i <- decay d_i + (1 - decay) mean_{rows of i} E_i(x) for every
/// expert with at least one row; an expert with no rows keeps its d_i. No effect at inference.
/// Precondition (checked by forward_train when enabled): 0 <= decay <= 1.
/// (ALGORITHMS.md section 1; the defaults follow the precursor code: kGradOnly; decay 0.95 as in
/// the LibMoE reimplementation, since the paper's value was not available.)
struct DefaultMoe {
  enum class Mode { kGradOnly, kForward };
  bool enabled = false;
  float decay = 0.95f;
  Mode mode = Mode::kGradOnly;
};

/// Everything one MoeFfn call writes besides its output. Its results (router logits, the
/// Selection, the RoutingPlan, the balance loss) are apart from the stages' buffers and from the
/// training cache. Reused across calls: once it has seen the largest batch (or after
/// `MoeFfn::reserve`), a forward allocates nothing, and so does a backward. One workspace per
/// concurrent caller (a second, overlapping call on one workspace throws moe::Error: `in_use`); the
/// layer itself is read-only during forward. A training forward
/// (`forward_train`) also keeps here what `backward` needs, stamped with the layer that made it.
/// A forward whose routed experts become readable in two steps (experts streamed from disk:
/// models::Decoder with an offload::ExpertStreamer): the experts e with ready[e] != 0 (and the
/// shared experts) run first, then `wait` is called, then the other routed experts. The outputs
/// are bit for bit those of one step: each expert's rows are computed alone, by the same
/// kernels. `ready` has one entry per routed expert.
struct ExpertSchedule {
  std::span<unsigned char const> ready;
  std::function<void()> wait;
};

struct MoeFfnWorkspace : stages::RoutingResults {
  InUse in_use;  ///< a call holds it: a second, overlapping call on this workspace throws
  // Results of the last call (stages::RoutingResults): logits [T, E], selection, plan, aux_loss.

  // The stages' buffers.
  /// The routed experts' rows: inputs (training), pre-activations, activations, outputs
  /// (scaled by the routing weight in inference forwards), bf16 pairs; backward rows.
  stages::RoutedExperts routed;
  stages::SharedStage shared;  ///< shared experts: gates, activations, outputs; backward rows
  /// Inference with bf16 panels and AVX512-BF16 (kernels::bf16_dot_products): x rounded to
  /// bf16 pairs once per forward (kernels::bf16_pairs_rows), [T, ceil(D / 2)].
  std::vector<std::uint32_t> x_pairs;
  /// x quantized to int8 rows once per forward when some expert is packed in a quantized format
  /// (kernels::quantize_rows_q8), [T] rows of kernels::q8_row_bytes(D) bytes.
  std::vector<std::byte> x_q8;
  stages::ProjectionQueue queue;  ///< projections of the current phase, per-thread scratch

  // Training cache (filled by forward_train, read once by backward).
  struct Training {
    std::vector<float> x;                  ///< [T, D] copy of the input
    std::vector<float> defaults;           ///< [E, D] Default-MoE outputs used by this forward
    std::vector<std::uint8_t> token_mask;  ///< [T] or empty
    stages::Stamp stamp;                   ///< the layer and shapes that filled it (or none)
  } train;
  // Backward scratch.
  stages::RouterGrads router_grads;  ///< dL/d(slot weights), d(scores), d(logits)
  stages::GradTasks grad_tasks;      ///< the weight-gradient items of a backward
  stages::ThreadScratch scratch;     ///< per-thread backward scratch
};

/// A sparse Mixture-of-Experts feed-forward layer (GShard / Switch "dispatch, experts, combine"):
///
///   z_t = W_r x_t                                   router logits [T, E]
///   (A_t, w_t) = Router(z_t)                        chosen experts and their weights
///   y_t = sum_{i in A_t} w_{t,i} E_i(x_t)  +  shared experts (optionally sigmoid-gated)
///   (a router with scale_input set, as TopKSigmoid for Llama 4: y_t = sum_i E_i(w_{t,i} x_t) +
///   ...)
///
/// \tparam Router_  a RouterPolicy (SoftmaxTopK, TopKSoftmax, GroupLimitedTopK, ExpertChoice, ...)
/// \tparam Expert_  an ExpertPolicy (SwiGlu, GeGlu, ReluMlp, ...), used by every routed expert
/// \tparam Shared_  a SharedExpertPolicy (NoSharedExperts, SharedExperts<X, gated>)
/// \tparam Balance_ a BalancePolicy (balance::None, balance::SwitchAux, ...)
///
/// | tensor            | shape   |                                                    |
/// |-------------------|---------|----------------------------------------------------|
/// | x, y              | [T, D]  | row-major; y may be x (in-place)                   |
/// | router_weight()   | [E, D]  | HF `gate.weight`                                   |
/// | router_bias()     | [E]     | after enable_router_bias() (gpt-oss `router.bias`) |
/// | experts()         | E experts of D -> F -> D                             |
///
/// Preconditions (checked, moe::Error otherwise): x.cols == y.cols == d_model, x.rows == y.rows,
/// the router's configuration valid, router logits finite (NaN or Inf in x or W_r is reported
/// with the offending token). Sizes are run-time values; only the policies are types.
/// Threads: forward is const; results are bitwise identical for any pool size and from run to run
/// (each output element is computed by one work item in a fixed order). Cost: 2*T*E*D for the
/// router plus 2*R*D*F*(gated ? 3 : 2) for the experts, R = routed rows.
///
/// Training: `forward_train` keeps what `backward(ws, dy, dx, grads)` needs in the workspace;
/// backward returns dx and accumulates into Gradients, laid out like `parameters()`.
template <RouterPolicy Router_, ExpertPolicy Expert_,
          SharedExpertPolicy Shared_ = experts::NoSharedExperts,
          BalancePolicy Balance_ = balance::None>
class MoeFfn : public detail::FfnLayerBase<Router_, Expert_, Shared_, Balance_> {
  using Base = detail::FfnLayerBase<Router_, Expert_, Shared_, Balance_>;

 public:
  using typename Base::Balance, typename Base::Bank, typename Base::Expert, typename Base::Router,
      typename Base::Shared;
  /// Gradients of every parameter, each buffer shaped like its parameter (router_weight [E, D],
  /// experts, shared). `groups()` lists them in the order of MoeFfn::parameters().
  using Gradients = typename Base::Gradients;

  MoeFfn() = default;
  /// A layer with zero weights. Throws moe::Error if the router is invalid or the sizes disagree.
  MoeFfn(Index d_model, Index d_ffn, Router router, Shared shared = {}, Balance balance = {}) {
    this->init(d_model, d_ffn, -1, std::move(router), std::move(shared), std::move(balance),
               "MoeFfn");
    defaults_.assign(static_cast<std::size_t>(num_experts() * d_model), 0.0f);
  }

  using Base::num_experts, Base::router_weight;
  /// The E routed experts.
  Bank& experts() { return bank_; }
  Bank const& experts() const { return bank_; }
  /// Default-MoE configuration (off by default) and its EMA state d [E, D].
  DefaultMoe& default_moe() { return default_moe_; }
  DefaultMoe const& default_moe() const { return default_moe_; }
  MatrixView<float> default_outputs() { return {defaults_.data(), num_experts(), d_model_}; }

  /// Grows `ws` for batches of up to max_tokens tokens and `threads` threads, so that later
  /// forwards allocate nothing.
  void reserve(MoeFfnWorkspace& ws, Index max_tokens, int threads = 1) const {
    Index const E = num_experts(), S = router_.slots_per_token(), D = d_model_;
    Index const R = max_tokens * S, ns = shared_.count();
    auto grow = [](auto& v, Index n) { v.reserve(static_cast<std::size_t>(n)); };
    grow(ws.logits, max_tokens * E);
    grow(ws.selection.expert, R);
    grow(ws.selection.weight, R);
    grow(ws.selection.scores, max_tokens * E);
    grow(ws.selection.scratch, max_tokens * E + R + 2 * E + max_tokens);
    grow(ws.selection.scratch_ids, max_tokens + 2 * E);
    grow(ws.selection.dropped_expert, R);
    grow(ws.plan.expert_offsets, E + 1);
    grow(ws.plan.token_offsets, max_tokens + 1);
    grow(ws.plan.row_token, R);
    grow(ws.plan.row_weight, R);
    grow(ws.plan.token_rows, R);
    ws.routed.reserve(bank_, R);
    ws.shared.reserve(shared_, max_tokens, D);
    if (kernels::bf16_dot_products()) grow(ws.x_pairs, max_tokens * ((D + 1) / 2));
    if (detail::uses_q8_rows(bank_, true) || stages::SharedStage::uses_q8(shared_, false)) {
      grow(ws.x_q8, max_tokens * kernels::q8_row_bytes(D));
    }
    // Items: per job at most one per panel and row chunk; every routed expert's rows are one
    // chunk unless it has more than detail::kItemRows rows.
    Index const jobs = 2 * (E + ns) + 1;
    Index const np = kernels::panel_width();
    Index const panels = (std::max({bank_.hidden_cols(), D, E}) + np - 1) / np;
    Index const items =
        (jobs + 2 * (R / detail::kItemRows + 1) + 2 * ns * (max_tokens / detail::kItemRows + 1)) *
        (panels + 1);
    ws.queue.reserve(jobs, items, threads, projection_depth());
  }

  /// Routes x: computes ws.logits, ws.selection, ws.plan and ws.aux_loss, without running experts.
  void route(ConstMatrixView<float> x, MoeFfnWorkspace& ws, ForwardOptions const& opt = {}) const;

  /// y = MoE(x): route, run the routed and shared experts, combine. See the class comment.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, MoeFfnWorkspace& ws,
               ForwardOptions const& opt = {}) const;

 private:
  void route_impl(ConstMatrixView<float> x, MoeFfnWorkspace& ws, ForwardOptions const& opt) const {
    check_input(x);
    this->check_policies();
    Index const T = x.rows, E = num_experts();
    stages::router_logits<Expert, SharedX>(x, router_weight_.data(), E, ws.logits, ws.queue,
                                           opt.pool);
    stages::add_router_bias(ws.logits, router_bias_);
    MatrixView<float> logits(ws.logits.data(), T, E);
    stages::check_finite_logits(logits, {"MoeFfn"});
    stages::select_and_plan(router_, logits, opt.controls, ws.selection, ws.plan, "MoeFfn");
    detail::check(opt.token_mask.empty() || static_cast<Index>(opt.token_mask.size()) == T,
                  "MoeFfn: token_mask has ", opt.token_mask.size(), " entries for ", T,
                  " tokens; pass one per token or none");
    ws.aux_loss =
        balance_.aux_loss(BalanceInputs{logits, ws.selection, ws.plan, {}, opt.token_mask});
  }

 public:
  /// y = MoE(x) with a routing decision made elsewhere (another layer's ws.plan, a plan shared by
  /// several expert banks, or one built by hand). The plan is validated first; ws.selection and
  /// ws.logits are left untouched.
  void forward_with_plan(ConstMatrixView<float> x, RoutingPlan const& plan, MatrixView<float> y,
                         MoeFfnWorkspace& ws, ThreadPool* pool = nullptr) const;
  /// forward_with_plan with the routed experts run in the two steps `schedule` says (while the
  /// ones not ready yet are read, the ready ones compute). Throws moe::Error for a `ready` of
  /// another length or without a `wait`.
  void forward_with_plan(ConstMatrixView<float> x, RoutingPlan const& plan, MatrixView<float> y,
                         MoeFfnWorkspace& ws, ThreadPool* pool,
                         ExpertSchedule const& schedule) const;

  /// Convenience: forward with a workspace owned by the layer (not for concurrent callers).
  void operator()(ConstMatrixView<float> x, MatrixView<float> y, ForwardOptions const& opt = {}) {
    forward(x, y, own_ws_, opt);
  }
  MoeFfnWorkspace const& last_workspace() const { return own_ws_; }

  /// Training forward: forward() that also keeps in `ws` what backward needs, applies Default MoE
  /// (if enabled) and lets stateful balance policies observe the routing. Weight multipliers in
  /// the routing controls are not supported here (they are an inference-time control).
  void forward_train(ConstMatrixView<float> x, MatrixView<float> y, MoeFfnWorkspace& ws,
                     ForwardOptions const& opt = {});

  /// Calls the balance policy's end_step(router) if it has one (auxiliary-loss-free bias
  /// updates, global-batch windows). Call once per optimizer step.
  void end_step() {
    if constexpr (requires(Balance & b, Router & r) { b.end_step(r); }) balance_.end_step(router_);
  }

  /// Backward of the last forward_train on `ws`: dx [T, D] = dL/dx (overwritten), and every
  /// parameter gradient accumulated (+=) into `grads`. dL/dy = dy [T, D]. The loss includes the
  /// balance policy's aux_loss (with its coefficient). Bitwise identical for any pool size.
  /// Throws moe::Error if `ws` holds no training forward of this layer (none since the last
  /// backward, or another layer's) or `grads` is not shaped like this layer's parameters.
  void backward(MoeFfnWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                Gradients& grads,
                ThreadPool* pool = nullptr) const requires TrainableRouterPolicy<Router_>;

 private:
  using Base::balance_, Base::bank_, Base::d_model_, Base::router_, Base::router_bias_,
      Base::router_weight_, Base::shared_;
  using SharedX = typename detail::SharedExpertOr<Shared, Expert>::type;

  stages::Stamp stamp(Index tokens) const {
    return {this, tokens, d_model_, num_experts(), bank_.d_ffn()};
  }

  /// The deepest projection (K) of any job.
  Index projection_depth() const {
    Index k = std::max(d_model_, bank_.d_ffn());
    if constexpr (Shared::has_experts) k = std::max(k, shared_.bank().d_ffn());
    return k;
  }

  void check_input(ConstMatrixView<float> x) const {
    Base::check_input(x, "MoeFfn");
    detail::check(
        router_weight_.size() == static_cast<std::size_t>(num_experts() * d_model_) && d_model_ > 0,
        "MoeFfn: the layer was default-constructed; construct it with sizes first");
  }
  void check_output(ConstMatrixView<float> x, MatrixView<float> y) const {
    Base::check_output(x, y, "MoeFfn");
  }

  BalanceInputs balance_inputs(MoeFfnWorkspace const& ws) const {
    return BalanceInputs{ws.logits_view(), ws.selection, ws.plan,
                         ConstMatrixView<float>(ws.routed.out.data(), ws.plan.num_rows(), d_model_),
                         ws.train.token_mask};
  }

  stages::ExpertRows rows_of(RoutingPlan const& plan) const {
    return {plan.expert_offsets.data(), num_experts()};
  }

  /// The experts and the combine (docs/design.md, "One forward"): in projections with the
  /// activation fused, down projections with the routing weight fused (inference), combine.
  /// Inference reads each routed row of x in place through the plan's row_token (no gather
  /// copy). With `train`, the rows are gathered into ws.routed.x_rows, pre-activations kept, and
  /// expert outputs stay unweighted (the backward and the balance policies need them); the
  /// shared experts likewise. bf16 panels serve inference only. A training forward over a bank
  /// in bf16-compute mode (ExpertBank::set_train_compute) rounds that bank's inputs and hidden
  /// activations to bf16 (the operands of its products; the pre-activations stay fp32).
  void run_experts(ConstMatrixView<float> x, RoutingPlan const& plan, MatrixView<float> y,
                   MoeFfnWorkspace& ws, ThreadPool* pool, bool train,
                   ExpertSchedule const* schedule = nullptr) const {
    Index const T = x.rows, D = d_model_, R = plan.num_rows(), kpD = (D + 1) / 2;
    stages::ExpertMode const routed{train, detail::uses_bf16_pairs(bank_, !train),
                                    detail::uses_q8_rows(bank_, !train)};
    stages::ExpertMode const shared{train, stages::SharedStage::uses_pairs(shared_, train),
                                    stages::SharedStage::uses_q8(shared_, train)};
    stages::ExpertRows const rows = rows_of(plan);
    bool const scaled = routing::detail::scales_input(router_);
    ws.routed.prepare(bank_, R, routed, train || scaled);
    ws.shared.prepare(shared_, T, shared, D);
    bool const x_pairs = routed.pairs || shared.pairs, x_q8 = routed.q8 || shared.q8;
    Index const rbD = kernels::q8_row_bytes(D);
    ws.x_pairs.resize(static_cast<std::size_t>(x_pairs ? T * kpD : 0));
    ws.x_q8.resize(static_cast<std::size_t>(x_q8 ? T * rbD : 0));
    std::uint32_t const* pairs = x_pairs ? ws.x_pairs.data() : nullptr;
    std::byte const* q8 = x_q8 ? ws.x_q8.data() : nullptr;
    // 1. Dispatch (training, and input-scaled routing, gather the rows; the latter scales them by
    // their routing weights), shared-expert gates, x as bf16 pairs / int8 rows.
    if (train || scaled) ws.routed.gather(x, plan.row_token.data(), R, pool);
    if (scaled) ws.routed.scale_inputs(plan.row_weight.data(), R, D, pool);
    ws.routed.round_inputs(bank_, R, routed, pool);
    ConstMatrixView<float> const xs = ws.shared.inputs(shared_, x, shared, pool);
    ws.shared.gates(shared_, x, pool);
    detail::run_pairs_tasks(
        pool, {detail::PairsTask{x.data, x.row_stride, T, D, x_pairs ? ws.x_pairs.data() : nullptr,
                                 x_q8 ? ws.x_q8.data() : nullptr}});
    // 2. In projections with the activation in the epilogue: m = act(x W_gate^T) * (x W_up^T).
    // 3. Down projections, times the routing weight in inference (unless it scaled the inputs).
    // With a schedule, the ready routed experts and the shared ones first, then (after wait) the
    // other routed experts.
    kernels::RowSource const in = train || scaled
                                      ? kernels::RowSource{ws.routed.x_rows.data(), D, nullptr}
                                      : kernels::RowSource{x.data,
                                                           x.row_stride,
                                                           plan.row_token.data(),
                                                           routed.pairs ? pairs : nullptr,
                                                           kpD,
                                                           routed.q8 ? q8 : nullptr,
                                                           rbD};
    for (int phase = 0; phase < (schedule ? 2 : 1); ++phase) {
      stages::ExpertRows part = rows;
      if (schedule) {
        part.only = schedule->ready.data();
        part.want = phase == 0 ? 1 : 0;
        if (phase == 1) schedule->wait();
      }
      bool const shared_too = phase == 0;
      ws.routed.enqueue_in(ws.queue, bank_, part, in, routed);
      if (shared_too) {
        ws.shared.enqueue_in(ws.queue, shared_,
                             {xs.data, xs.row_stride, nullptr, shared.pairs ? pairs : nullptr, kpD,
                              shared.q8 ? q8 : nullptr, rbD},
                             T, shared, T);
      }
      run_queue(ws, pool);
      ws.routed.round_hidden(bank_, R, routed, pool);
      if (shared_too) ws.shared.round_hidden(shared_, shared, pool);
      detail::run_pairs_tasks(
          pool, {ws.routed.act_pairs_task(bank_, R),
                 shared_too ? ws.shared.act_pairs_task(shared_, T) : detail::PairsTask{}});
      ws.routed.enqueue_down(ws.queue, bank_, part,
                             train || scaled ? nullptr : plan.row_weight.data(), routed);
      if (shared_too) ws.shared.enqueue_down(ws.queue, shared_, T, shared, T);
      run_queue(ws, pool);
    }
    // 4. Combine: each token's rows in slot order, then the shared experts.
    stages::combine(combine_source(ws, plan, train && !scaled), y, pool);
  }

  void run_queue(MoeFfnWorkspace& ws, ThreadPool* pool) const {
    ws.queue.run<Expert, SharedX>(pool);
  }

  stages::CombineSource combine_source(MoeFfnWorkspace const& ws, RoutingPlan const& plan,
                                       bool weighted) const {
    stages::CombineSource src;
    src.rows = ws.routed.out.data();
    src.row_weight = weighted ? plan.row_weight.data() : nullptr;  // inference: already applied
    src.plan = &plan;
    ws.shared.add_to(src, shared_);
    return src;
  }

  /// Is expert e among token t's routed rows?
  static bool token_has_expert(RoutingPlan const& plan, Index t, Index e) {
    for (Index j = plan.token_offsets[t]; j < plan.token_offsets[t + 1]; ++j) {
      Index const r = plan.token_rows[j];
      if (r >= plan.expert_offsets[e] && r < plan.expert_offsets[e + 1]) return true;
    }
    return false;
  }

  /// Default MoE, kForward: y_t += sum_{i not in A_t} p_{t,i} d_i, experts in ascending order.
  void add_default_term(MoeFfnWorkspace& ws, MatrixView<float> y, ThreadPool* pool) const {
    Index const T = y.rows, D = d_model_, E = num_experts();
    parallel_for(pool, (T + stages::kTokenTile - 1) / stages::kTokenTile, [&](Index i, int) {
      Index const t0 = i * stages::kTokenTile, t1 = std::min(T, t0 + stages::kTokenTile);
      for (Index t = t0; t < t1; ++t) {
        float const* p = ws.selection.scores.data() + t * E;
        float* yt = y.row(t);
        for (Index e = 0; e < E; ++e) {
          if (p[e] == 0.0f || token_has_expert(ws.plan, t, e)) continue;
          float const* d = ws.train.defaults.data() + e * D;
          for (Index c = 0; c < D; ++c) yt[c] = std::fma(p[e], d[c], yt[c]);
        }
      }
    });
  }

  /// d_e <- decay d_e + (1 - decay) mean of expert e's output rows (experts with rows only).
  void update_defaults(MoeFfnWorkspace& ws, ThreadPool* pool) {
    Index const D = d_model_, E = num_experts();
    float const beta = default_moe_.decay;
    parallel_for(pool, E, [&](Index e, int) {
      Index const r0 = ws.plan.expert_offsets[e], n = ws.plan.expert_rows(e);
      if (n == 0) return;
      float* d = defaults_.data() + e * D;
      for (Index c = 0; c < D; ++c) {
        double sum = 0.0;
        for (Index r = r0; r < r0 + n; ++r) sum += ws.routed.out[r * D + c];
        d[c] = beta * d[c] + (1.0f - beta) * static_cast<float>(sum / static_cast<double>(n));
      }
    });
  }

  /// Default MoE's router signal: dL/dp_{t,i} += <dy_t, d_i> for the experts t did not select.
  void default_score_grads(MoeFfnWorkspace& ws, ConstMatrixView<float> dy, ThreadPool* pool) const {
    Index const T = dy.rows, D = d_model_, E = num_experts();
    parallel_for(pool, (T + stages::kTokenTile - 1) / stages::kTokenTile, [&](Index i, int) {
      Index const t0 = i * stages::kTokenTile, t1 = std::min(T, t0 + stages::kTokenTile);
      for (Index t = t0; t < t1; ++t) {
        for (Index e = 0; e < E; ++e) {
          if (token_has_expert(ws.plan, t, e)) continue;
          float const* d = ws.train.defaults.data() + e * D;
          float dot = 0.0f;
          for (Index c = 0; c < D; ++c) dot = std::fma(dy(t, c), d[c], dot);
          ws.router_grads.dscores[static_cast<std::size_t>(t * E + e)] += dot;
        }
      }
    });
  }

  /// The backward (docs/design.md, "Training"), stage by stage.
  void backward_impl(MoeFfnWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                     Gradients& grads, ThreadPool* pool) const {
    Index const T = dy.rows, D = d_model_, E = num_experts();
    RoutingPlan const& plan = ws.plan;
    Index const R = plan.num_rows();
    ConstMatrixView<float> x(ws.train.x.data(), T, D);
    stages::ExpertRows const rows = rows_of(plan);
    ws.router_grads.reset(T, ws.selection.slots, E);
    ws.routed.d_out.resize(static_cast<std::size_t>(R * D));
    ws.shared.prepare_backward(shared_, T, D);
    // 1. Combine VJP: dY_r = w_r dy[t]; dL/dw of each slot = <dy[t], Y_r>; shared experts.
    stages::CombineGrads cg{ws.routed.d_out.data(), ws.router_grads.dweight.data()};
    ws.shared.add_to(cg);
    bool const scaled = routing::detail::scales_input(router_);
    stages::combine_backward(dy, combine_source(ws, plan, !scaled), ws.selection, cg, pool);
    // 2. Default-MoE score terms; balance gradients.
    if (!ws.train.defaults.empty()) default_score_grads(ws, dy, pool);
    BalanceGradients bg{MatrixView<float>(ws.router_grads.dscores.data(), T, E),
                        MatrixView<float>(ws.router_grads.dlogits_extra.data(), T, E),
                        MatrixView<float>(ws.routed.d_out.data(), R, D)};
    balance_.backward(balance_inputs(ws), bg);
    // 3. Expert VJPs, row phase: m, dh and dx of the routed and the shared experts.
    ws.routed.backward_rows(bank_, rows, pool, ws.scratch);
    ws.shared.backward_rows(shared_, T, pool, ws.scratch);
    // Input-scaled routing: row r's input was w_r x_t, so dL/dw_r = <dX_r, x_t> and
    // dL/dx_t gets w_r dX_r.
    if (scaled)
      ws.routed.scaled_input_grads(x, plan, ws.selection, ws.router_grads.dweight.data(), pool);
    // 4. Router VJP: dweight (+ Default-MoE / balance score terms) -> dlogits.
    ws.router_grads.vjp(router_, ws.logits_view(), ws.selection);
    // 5. Weight gradients, each item one block of one gradient's rows.
    ws.grad_tasks.clear();
    auto const expert_grads = grads.experts.edit();
    stages::SharedGradScope<Shared> const shared_grads(grads.shared);
    ws.routed.add_weight_grads(ws.grad_tasks, bank_, rows, ws.routed.x_rows.data(), expert_grads);
    ws.shared.add_weight_grads(ws.grad_tasks, shared_, x, shared_grads.target());
    ws.router_grads.add_weight_grad(ws.grad_tasks, x, E, grads.router_weight.data());
    if (!router_bias_.empty()) ws.router_grads.add_bias_grad(T, E, grads.router_bias.data());
    ws.grad_tasks.run(pool, ws.scratch);
    // 6. dx = the token's expert-input gradients (slot order) + shared + router + gate terms.
    input_gradient(ws, dx, pool);
  }

  void input_gradient(MoeFfnWorkspace& ws, MatrixView<float> dx, ThreadPool* pool) const {
    stages::CombineSource src;
    src.rows = ws.routed.dx_rows.data();
    src.plan = &ws.plan;
    src.shared = ws.shared.dx.data();
    src.num_shared = shared_.count();
    stages::DxTerm const terms[] = {
        ws.router_grads.dx_term(router_weight_.data(), num_experts(), d_model_),
        ws.shared.gate_dx_term(shared_)};
    stages::combine(src, dx, pool,
                    [&](Index t0, Index n) { stages::add_dx_terms(terms, t0, n, dx); });
  }

  DefaultMoe default_moe_{};
  std::vector<float> defaults_;
  MoeFfnWorkspace own_ws_;
};

// The entry points are defined out of the class, so that a unit which declares an instantiation
// extern (MOE_EXTERN_EXPERT_KERNELS: the presets' layers, layers/presets.hpp) does not compile
// them again. They stay inline: defined out of the class without it, a header-only program with
// one forward took 32 s to compile instead of 24 (g++ -O2, Zen 5), and GCC emits neither way
// for an extern instantiation.
template <RouterPolicy Router_, ExpertPolicy Expert_, SharedExpertPolicy Shared_,
          BalancePolicy Balance_>
inline void MoeFfn<Router_, Expert_, Shared_, Balance_>::route(ConstMatrixView<float> x,
                                                               MoeFfnWorkspace& ws,
                                                               ForwardOptions const& opt) const {
  auto const busy = ws.in_use.enter("MoeFfn::route");
  route_impl(x, ws, opt);
}

template <RouterPolicy Router_, ExpertPolicy Expert_, SharedExpertPolicy Shared_,
          BalancePolicy Balance_>
inline void MoeFfn<Router_, Expert_, Shared_, Balance_>::forward(ConstMatrixView<float> x,
                                                                 MatrixView<float> y,
                                                                 MoeFfnWorkspace& ws,
                                                                 ForwardOptions const& opt) const {
  auto const busy = ws.in_use.enter("MoeFfn::forward");
  check_input(x);
  check_output(x, y);
  route_impl(x, ws, opt);
  run_experts(x, ws.plan, y, ws, opt.pool, false);
  ws.train.stamp = {};
}

template <RouterPolicy Router_, ExpertPolicy Expert_, SharedExpertPolicy Shared_,
          BalancePolicy Balance_>
inline void MoeFfn<Router_, Expert_, Shared_, Balance_>::forward_with_plan(ConstMatrixView<float> x,
                                                                           RoutingPlan const& plan,
                                                                           MatrixView<float> y,
                                                                           MoeFfnWorkspace& ws,
                                                                           ThreadPool* pool) const {
  auto const busy = ws.in_use.enter("MoeFfn::forward_with_plan");
  check_input(x);
  check_output(x, y);
  plan.validate(x.rows, num_experts());
  run_experts(x, plan, y, ws, pool, false);
  ws.train.stamp = {};
}

template <RouterPolicy Router_, ExpertPolicy Expert_, SharedExpertPolicy Shared_,
          BalancePolicy Balance_>
inline void MoeFfn<Router_, Expert_, Shared_, Balance_>::forward_with_plan(
    ConstMatrixView<float> x, RoutingPlan const& plan, MatrixView<float> y, MoeFfnWorkspace& ws,
    ThreadPool* pool, ExpertSchedule const& schedule) const {
  auto const busy = ws.in_use.enter("MoeFfn::forward_with_plan");
  check_input(x);
  check_output(x, y);
  plan.validate(x.rows, num_experts());
  detail::check(static_cast<Index>(schedule.ready.size()) == num_experts() && schedule.wait,
                "MoeFfn::forward_with_plan: the schedule's ready has ", schedule.ready.size(),
                " entries for ", num_experts(), " experts (and needs a wait)");
  run_experts(x, plan, y, ws, pool, false, &schedule);
  ws.train.stamp = {};
}

template <RouterPolicy Router_, ExpertPolicy Expert_, SharedExpertPolicy Shared_,
          BalancePolicy Balance_>
inline void MoeFfn<Router_, Expert_, Shared_, Balance_>::forward_train(ConstMatrixView<float> x,
                                                                       MatrixView<float> y,
                                                                       MoeFfnWorkspace& ws,
                                                                       ForwardOptions const& opt) {
  auto const busy = ws.in_use.enter("MoeFfn::forward_train");
  check_input(x);
  check_output(x, y);
  detail::check(!opt.controls || opt.controls->weight_multiplier.empty(),
                "MoeFfn::forward_train: routing weight multipliers are an inference-time "
                "control; train without them");
  Index const T = x.rows, D = d_model_;
  detail::check(!default_moe_.enabled || (default_moe_.decay >= 0.0f && default_moe_.decay <= 1.0f),
                "MoeFfn: default_moe().decay = ", default_moe_.decay,
                "; the EMA decay must be in [0, 1]");
  ws.train.stamp = {};
  ws.train.x.resize(static_cast<std::size_t>(T * D));
  for (Index t = 0; t < T; ++t) std::copy(x.row(t), x.row(t) + D, ws.train.x.data() + t * D);
  ConstMatrixView<float> xc(ws.train.x.data(), T, D);
  route_impl(xc, ws, opt);
  ws.train.token_mask.assign(opt.token_mask.begin(), opt.token_mask.end());
  run_experts(xc, ws.plan, y, ws, opt.pool, true);
  ws.train.defaults.clear();
  if (default_moe_.enabled) {
    ws.train.defaults = defaults_;
    if (default_moe_.mode == DefaultMoe::Mode::kForward) add_default_term(ws, y, opt.pool);
    update_defaults(ws, opt.pool);
  }
  if constexpr (requires(Balance & b, BalanceInputs const& in) { b.observe(in); }) {
    balance_.observe(balance_inputs(ws));
  }
  ws.train.stamp = stamp(T);
}

template <RouterPolicy Router_, ExpertPolicy Expert_, SharedExpertPolicy Shared_,
          BalancePolicy Balance_>
inline void MoeFfn<Router_, Expert_, Shared_, Balance_>::backward(
    MoeFfnWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx, Gradients& grads,
    ThreadPool* pool) const requires TrainableRouterPolicy<Router_> {
  auto const busy = ws.in_use.enter("MoeFfn::backward");
  detail::check(ws.train.stamp.filled(),
                "MoeFfn::backward: the workspace holds no training forward; call "
                "forward_train first (and backward only once per forward)");
  Index const T = ws.train.stamp.tokens, D = d_model_;
  detail::check(ws.train.stamp == stamp(T),
                "MoeFfn::backward: the workspace was filled by another layer's forward_train; "
                "pass the workspace of this layer's forward_train");
  detail::check(dy.rows == T && dy.cols == D && dx.rows == T && dx.cols == D,
                "MoeFfn::backward: dy and dx must be [", T, ", ", D, "] like the forward's x");
  detail::check_ffn_gradients(grads, router_weight_.size(), router_bias_.size(), bank_, shared_,
                              "MoeFfn");
  ws.train.stamp = {};
  backward_impl(ws, dy, dx, grads, pool);
}

}  // namespace moe
