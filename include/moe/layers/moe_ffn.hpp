// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MoeFfn: the sparse Mixture-of-Experts feed-forward layer, composed from policies.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "moe/balance/none.hpp"
#include "moe/core/concepts.hpp"
#include "moe/core/eigen_interop.hpp"
#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/kernels/combine.hpp"
#include "moe/kernels/expert_gemm.hpp"
#include "moe/kernels/gather.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/kernels/softmax.hpp"
#include "moe/layers/detail/expert_jobs.hpp"
#include "moe/layers/detail/row_chunks.hpp"
#include "moe/routing/controls.hpp"

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
/// (ALGORITHMS.md section 1; the defaults follow the precursor code: kGradOnly; decay 0.95 as in
/// the LibMoE reimplementation, since the paper's value was not available.)
struct DefaultMoe {
  enum class Mode { kGradOnly, kForward };
  bool enabled = false;
  float decay = 0.95f;
  Mode mode = Mode::kGradOnly;
};

/// Everything one MoeFfn call writes besides its output: router logits, the Selection, the
/// RoutingPlan, expert inputs, hidden activations and outputs, and per-thread panel scratch.
/// Reused across calls: once it has seen the largest batch (or after `MoeFfn::reserve`), a
/// forward allocates nothing. One workspace per concurrent caller; the layer itself is read-only
/// during forward. A training forward (`forward_train`) also keeps here what `backward` needs.
struct MoeFfnWorkspace {
  std::vector<float> logits;         ///< [T, E] router logits (after routing controls)
  Selection selection;               ///< the router's choices and scores
  RoutingPlan plan;                  ///< rows sorted by expert
  std::vector<float> x_rows;         ///< [R, D] gathered inputs of the routed rows (training)
  std::vector<float> hidden;         ///< [R, P] pre-activations (training)
  std::vector<float> act;            ///< [R, F] activations m
  HugePageVector<float> expert_out;  ///< [R, D] expert outputs E_{e(r)}(x[token(r)]), scaled by
                                     ///< the routing weight of row r in inference forwards
                                     ///< (64-byte aligned: large ones are written with
                                     ///< non-temporal stores)
  std::vector<float> shared_hidden;  ///< [S*T, P_shared] (training)
  std::vector<float> shared_act;     ///< [S*T, F_shared]
  std::vector<float> shared_out;     ///< [S*T, D] shared-expert outputs
  std::vector<float> shared_gate;    ///< [T, S] sigmoid gates of the shared experts
  std::vector<float> panels;         ///< per-thread kernel scratch (kernels::expert_cols)
  /// Inference with bf16 panels and AVX512-BF16 (kernels::bf16_dot_products): the inputs of the
  /// expert projections rounded to bf16 pairs once per forward (kernels::bf16_pairs_rows).
  std::vector<std::uint32_t> x_pairs;           ///< [T, ceil(D / 2)]
  std::vector<std::uint32_t> act_pairs;         ///< [R, ceil(F / 2)]
  std::vector<std::uint32_t> shared_act_pairs;  ///< [S*T, ceil(F_shared / 2)]
  double aux_loss = 0.0;  ///< the balance policy's loss for the last routed call

  using Job = detail::ExpertJob;    ///< one projection with its epilogue
  using Item = detail::ExpertItem;  ///< panels x rows of a job: a unit of parallel work
  std::vector<Job> jobs;
  std::vector<Item> items;

  // Training only (filled by forward_train, read by backward).
  std::vector<float> x;                  ///< [T, D] copy of the input
  std::vector<float> defaults;           ///< [E, D] Default-MoE outputs used by this forward
  std::vector<std::uint8_t> token_mask;  ///< [T] or empty
  std::vector<float> d_rows;             ///< [R, D] dL/d(expert outputs)
  std::vector<float> dx_rows;            ///< [R, D]
  std::vector<float> dhidden;            ///< [R, P]
  std::vector<float> shared_dy;          ///< [S*T, D]
  std::vector<float> shared_dx;          ///< [S*T, D]
  std::vector<float> shared_dhidden;     ///< [S*T, P_shared]
  std::vector<float> dweight;            ///< [T, slots] dL/d(slot weights)
  std::vector<float> dscores;            ///< [T, E]
  std::vector<float> dlogits;            ///< [T, E]
  std::vector<float> dlogits_extra;      ///< [T, E] balance terms on the logits
  std::vector<float> dgate;              ///< [T, S] dL/d(shared gate logits)
  std::vector<float> bwd_scratch;        ///< per-thread backward_rows / gemm_strided scratch
  bool trained = false;                  ///< set by forward_train, cleared by backward

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
/// \tparam Balance_ a BalancePolicy (balance::None, balance::SwitchAux, ...)
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
/// (each output element is computed by one work item in a fixed order). Cost: 2*T*E*D for the
/// router plus 2*R*D*F*(gated ? 3 : 2) for the experts, R = routed rows.
///
/// Training: `forward_train` keeps what `backward(ws, dy, dx, grads)` needs in the workspace;
/// backward returns dx and accumulates into Gradients, laid out like `parameters()`.
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

  /// Rows per gather / activation / combine work item (row-independent work: any value works).
  static constexpr Index kTileRows = 64;
  /// Rows of a weight gradient per backward work item (the product's B is packed once per item).
  static constexpr Index kGradRows = 256;

  /// Gradients of every parameter, each buffer shaped like its parameter. `groups()` lists them
  /// in the order of MoeFfn::parameters().
  struct Gradients {
    std::vector<float> router_weight;  ///< [E, D]
    Bank experts;                      ///< same shapes as the layer's experts
    Shared shared;                     ///< same shapes as the layer's shared experts
    void zero() {
      std::fill(router_weight.begin(), router_weight.end(), 0.0f);
      std::fill(experts.parameters().begin(), experts.parameters().end(), 0.0f);
      if constexpr (Shared::has_experts) {
        auto p = shared.bank().parameters();
        std::fill(p.begin(), p.end(), 0.0f);
        auto g = shared.gate_weight();
        std::fill(g.data, g.data + g.rows * g.cols, 0.0f);
      }
    }
    ParameterList groups() { return list_parameters(router_weight, experts, shared); }
  };

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
    defaults_.assign(static_cast<std::size_t>(E * d_model), 0.0f);
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
  /// Default-MoE configuration (off by default) and its EMA state d [E, D].
  DefaultMoe& default_moe() { return default_moe_; }
  DefaultMoe const& default_moe() const { return default_moe_; }
  MatrixView<float> default_outputs() { return {defaults_.data(), num_experts(), d_model_}; }

  /// Every trainable parameter as named flat buffers: "router.weight", "experts" (all in_proj
  /// blocks then all down_proj blocks, see ExpertBank), and with shared experts
  /// "shared_experts" and "shared_experts.gate". Biases for selection and Default-MoE state are
  /// buffers, not parameters.
  ParameterList parameters() { return list_parameters(router_weight_, bank_, shared_); }

  /// Packs the routed and shared experts' weights into the micro-kernel's panel layout once
  /// (ExpertBank::pack), so forwards stop repacking them per call. Call again after changing
  /// weights; until then the layer notices the change and packs per call. Doubles expert memory.
  void pack_weights(experts::WeightFormat format = experts::WeightFormat::kF32) {
    bank_.pack(format);
    if constexpr (Shared::has_experts) shared_.bank().pack(format);
  }

  /// Zero gradients shaped like this layer's parameters.
  Gradients make_gradients() const {
    Gradients g;
    g.router_weight.assign(router_weight_.size(), 0.0f);
    g.experts = Bank(num_experts(), d_model_, d_ffn());
    if constexpr (Shared::has_experts) {
      g.shared = Shared(shared_.count(), d_model_, shared_.bank().d_ffn());
    }
    return g;
  }

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
    grow(ws.act, R * d_ffn());
    grow(ws.expert_out, R * D);
    if constexpr (Shared::has_experts) {
      grow(ws.shared_act, ns * max_tokens * shared_.bank().d_ffn());
    }
    if (kernels::bf16_dot_products()) {  // used once the bank is packed as bf16
      grow(ws.x_pairs, max_tokens * ((D + 1) / 2));
      grow(ws.act_pairs, R * ((d_ffn() + 1) / 2));
      if constexpr (Shared::has_experts) {
        grow(ws.shared_act_pairs, ns * max_tokens * ((shared_.bank().d_ffn() + 1) / 2));
      }
    }
    grow(ws.shared_out, ns * max_tokens * D);
    grow(ws.shared_gate, ns * max_tokens);
    grow(ws.panels, threads * panel_floats());
    Index const jobs = 2 * (E + ns) + 1;
    grow(ws.jobs, jobs);
    // Items: per job at most one per panel and row chunk; every routed expert's rows are one
    // chunk unless it has more than detail::kItemRows rows.
    Index const np = kernels::panel_width();
    Index const panels = (std::max({bank_.hidden_cols(), D, E}) + np - 1) / np;
    grow(ws.items,
         (jobs + 2 * (R / detail::kItemRows + 1) + 2 * ns * (max_tokens / detail::kItemRows + 1)) *
             (panels + 1));
  }

  /// Routes x: computes ws.logits, ws.selection, ws.plan and ws.aux_loss, without running experts.
  void route(ConstMatrixView<float> x, MoeFfnWorkspace& ws, ForwardOptions const& opt = {}) const {
    check_input(x);
    Index const T = x.rows, E = num_experts();
    ws.logits.resize(static_cast<std::size_t>(T * E));
    MatrixView<float> logits(ws.logits.data(), T, E);
    ws.panels.resize(static_cast<std::size_t>(threads_of(opt.pool) * panel_floats()));
    ws.jobs.clear();
    ws.items.clear();
    MoeFfnWorkspace::Job job;
    job.a = {x.data, x.row_stride, nullptr};
    job.rows = T;
    job.depth = d_model_;
    job.w = detail::expert_weights(router_weight_.data(), E, nullptr, nullptr, d_model_, 0, false,
                                   T < kernels::kPanelMinRows);
    job.c = logits.data;
    job.ldc = E;
    job.cols = E;
    add_job(ws, job);
    run_jobs(ws, opt.pool);
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
    detail::check(opt.token_mask.empty() || static_cast<Index>(opt.token_mask.size()) == T,
                  "MoeFfn: token_mask has ", opt.token_mask.size(), " entries for ", T,
                  " tokens; pass one per token or none");
    ws.aux_loss =
        balance_.aux_loss(BalanceInputs{logits, ws.selection, ws.plan, {}, opt.token_mask});
  }

  /// y = MoE(x): route, run the routed and shared experts, combine. See the class comment.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, MoeFfnWorkspace& ws,
               ForwardOptions const& opt = {}) const {
    check_input(x);
    check_output(x, y);
    route(x, ws, opt);
    run_experts(x, ws.plan, y, ws, opt.pool, false);
    ws.trained = false;
  }

  /// y = MoE(x) with a routing decision made elsewhere (another layer's ws.plan, a plan shared by
  /// several expert banks, or one built by hand). The plan is validated first; ws.selection and
  /// ws.logits are left untouched.
  void forward_with_plan(ConstMatrixView<float> x, RoutingPlan const& plan, MatrixView<float> y,
                         MoeFfnWorkspace& ws, ThreadPool* pool = nullptr) const {
    check_input(x);
    check_output(x, y);
    plan.validate(x.rows, num_experts());
    run_experts(x, plan, y, ws, pool, false);
    ws.trained = false;
  }

  /// Convenience: forward with a workspace owned by the layer (not for concurrent callers).
  void operator()(ConstMatrixView<float> x, MatrixView<float> y, ForwardOptions const& opt = {}) {
    forward(x, y, own_ws_, opt);
  }
  MoeFfnWorkspace const& last_workspace() const { return own_ws_; }

  /// Training forward: forward() that also keeps in `ws` what backward needs, applies Default MoE
  /// (if enabled) and lets stateful balance policies observe the routing. Weight multipliers in
  /// the routing controls are not supported here (they are an inference-time control).
  void forward_train(ConstMatrixView<float> x, MatrixView<float> y, MoeFfnWorkspace& ws,
                     ForwardOptions const& opt = {}) {
    check_input(x);
    check_output(x, y);
    detail::check(!opt.controls || opt.controls->weight_multiplier.empty(),
                  "MoeFfn::forward_train: routing weight multipliers are an inference-time "
                  "control; train without them");
    Index const T = x.rows, D = d_model_, E = num_experts();
    ws.x.resize(static_cast<std::size_t>(T * D));
    for (Index t = 0; t < T; ++t) std::copy(x.row(t), x.row(t) + D, ws.x.data() + t * D);
    ConstMatrixView<float> xc(ws.x.data(), T, D);
    route(xc, ws, opt);
    ws.token_mask.assign(opt.token_mask.begin(), opt.token_mask.end());
    run_experts(xc, ws.plan, y, ws, opt.pool, true);
    if (default_moe_.enabled) {
      ws.defaults = defaults_;
      if (default_moe_.mode == DefaultMoe::Mode::kForward) add_default_term(ws, y, opt.pool);
      update_defaults(ws, opt.pool);
    }
    if constexpr (requires(Balance & b, BalanceInputs const& in) { b.observe(in); }) {
      balance_.observe(balance_inputs(ws));
    }
    (void)E;
    ws.trained = true;
  }

  /// Calls the balance policy's end_step(router) if it has one (auxiliary-loss-free bias
  /// updates, global-batch windows). Call once per optimizer step.
  void end_step() {
    if constexpr (requires(Balance & b, Router & r) { b.end_step(r); }) balance_.end_step(router_);
  }

  /// Backward of the last forward_train on `ws`: dx [T, D] = dL/dx (overwritten), and every
  /// parameter gradient accumulated (+=) into `grads`. dL/dy = dy [T, D]. The loss includes the
  /// balance policy's aux_loss (with its coefficient). Bitwise identical for any pool size.
  void backward(MoeFfnWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                Gradients& grads,
                ThreadPool* pool = nullptr) const requires TrainableRouterPolicy<Router> {
    detail::check(ws.trained,
                  "MoeFfn::backward: the workspace holds no training forward; call "
                  "forward_train first (and backward only once per forward)");
    Index const T = ws.selection.num_tokens, D = d_model_, E = num_experts();
    detail::check(dy.rows == T && dy.cols == D && dx.rows == T && dx.cols == D,
                  "MoeFfn::backward: dy and dx must be [", T, ", ", D, "] like the forward's x");
    detail::check(grads.router_weight.size() == router_weight_.size() &&
                      grads.experts.parameters().size() == bank_.parameters().size(),
                  "MoeFfn::backward: gradients do not match this layer; use make_gradients()");
    ws.trained = false;
    backward_impl(ws, dy, dx, grads, pool);
    (void)E;
  }

 private:
  template <class V, class SharedT>
  static ParameterList list_parameters(V& router_weight, Bank& bank, SharedT& shared) {
    ParameterList list;
    list.push_back({"router.weight", std::span<float>(router_weight)});
    list.push_back({"experts", bank.parameters()});
    if constexpr (SharedT::has_experts) {
      list.push_back({"shared_experts", shared.bank().parameters()});
      auto g = shared.gate_weight();
      list.push_back({"shared_experts.gate",
                      std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols))});
    }
    return list;
  }

  static int threads_of(ThreadPool* pool) { return pool ? pool->size() : 1; }

  /// The largest projection depth (K) of any job.
  Index panel_depth() const {
    Index k = std::max(d_model_, d_ffn());
    if constexpr (Shared::has_experts) k = std::max(k, shared_.bank().d_ffn());
    return k;
  }
  Index panel_floats() const {
    Index const n = kernels::expert_scratch_floats(panel_depth());
    return (n + 15) / 16 * 16;
  }

  static void add_job(MoeFfnWorkspace& ws, MoeFfnWorkspace::Job const& job) {
    detail::add_expert_job(ws.jobs, ws.items, job);
  }
  static kernels::WeightPanels weights_of(float const* raw, Index rows, float const* packed,
                                          std::uint32_t const* packed_bf16, Index depth, Index half,
                                          bool use_bf16, Index job_rows) {
    return detail::expert_weights(raw, rows, packed, packed_bf16, depth, half, use_bf16,
                                  job_rows < kernels::kPanelMinRows);
  }
  void run_jobs(MoeFfnWorkspace& ws, ThreadPool* pool) const {
    using SharedX = typename detail::SharedExpertOr<Shared, Expert>::type;
    detail::run_expert_jobs<Expert, SharedX>(ws.jobs, ws.items, pool, ws.panels.data(),
                                             panel_floats());
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

  BalanceInputs balance_inputs(MoeFfnWorkspace const& ws) const {
    return BalanceInputs{ws.logits_view(), ws.selection, ws.plan,
                         ConstMatrixView<float>(ws.expert_out.data(), ws.plan.num_rows(), d_model_),
                         ws.token_mask};
  }

  /// In projection with the activation fused (m into ws.act), down projection with the routing
  /// weight fused (inference), combine. Inference reads each routed row of x in place through
  /// the plan's row_token (no gather copy). With `train`, the rows are gathered into ws.x_rows,
  /// pre-activations kept in ws.hidden, and expert outputs stay unweighted (the backward and the
  /// balance policies need them); the shared experts likewise.
  void run_experts(ConstMatrixView<float> x, RoutingPlan const& plan, MatrixView<float> y,
                   MoeFfnWorkspace& ws, ThreadPool* pool, bool train) const {
    using Job = MoeFfnWorkspace::Job;
    Index const T = x.rows, D = d_model_, E = num_experts(), F = d_ffn();
    Index const P = bank_.hidden_cols();
    Index const R = plan.num_rows();
    Index const ns = shared_.count();
    ws.x_rows.resize(static_cast<std::size_t>(train ? R * D : 0));
    ws.hidden.resize(static_cast<std::size_t>(train ? R * P : 0));
    ws.act.resize(static_cast<std::size_t>(R * F));
    ws.expert_out.resize(static_cast<std::size_t>(R * D));
    ws.shared_out.resize(static_cast<std::size_t>(ns * T * D));
    ws.shared_gate.resize(static_cast<std::size_t>(Shared::gated ? ns * T : 0));
    ws.panels.resize(static_cast<std::size_t>(threads_of(pool) * panel_floats()));
    Index Ps = 0, Fs = 0;
    if constexpr (Shared::has_experts) {
      Ps = shared_.bank().hidden_cols();
      Fs = shared_.bank().d_ffn();
    }
    ws.shared_hidden.resize(static_cast<std::size_t>(train ? ns * T * Ps : 0));
    ws.shared_act.resize(static_cast<std::size_t>(ns * T * Fs));
    // bf16 panels serve inference only; training multiplies the exact fp32 weights. With
    // AVX512-BF16 the projections' inputs are rounded to bf16 pairs once here, not per item.
    bool const use_bf16 = !train;
    bool const routed_pairs = detail::uses_bf16_pairs(bank_, use_bf16);
    bool shared_pairs = false;
    if constexpr (Shared::has_experts) {
      shared_pairs = detail::uses_bf16_pairs(shared_.bank(), use_bf16);
    }
    Index const kpD = (D + 1) / 2, kpF = (F + 1) / 2, kpFs = (Fs + 1) / 2;  // pairs per row
    bool const x_pairs = routed_pairs || shared_pairs;
    ws.x_pairs.resize(static_cast<std::size_t>(x_pairs ? T * kpD : 0));
    ws.act_pairs.resize(static_cast<std::size_t>(routed_pairs ? R * kpF : 0));
    ws.shared_act_pairs.resize(static_cast<std::size_t>(shared_pairs ? ns * T * kpFs : 0));

    // 1. Training: gather (dispatch) the routed rows. Shared-expert gates.
    Index const row_tiles = train ? (R + kTileRows - 1) / kTileRows : 0;
    Index const token_tiles = (T + kTileRows - 1) / kTileRows;
    parallel_for(pool, row_tiles + (Shared::gated ? token_tiles : 0), [&](Index i, int) {
      if (i < row_tiles) {
        Index const r0 = i * kTileRows, n = std::min(kTileRows, R - r0);
        kernels::gather_rows(x.data, x.row_stride, plan.row_token.data() + r0, n, D,
                             ws.x_rows.data() + r0 * D, D);
      } else if constexpr (Shared::gated) {
        Index const t0 = (i - row_tiles) * kTileRows, t1 = std::min(T, t0 + kTileRows);
        for (Index t = t0; t < t1; ++t) {
          for (Index s = 0; s < ns; ++s) {
            float const* g = shared_.gate_weight().row(s);
            float const* xt = x.row(t);
            float z = 0.0f;
            for (Index d = 0; d < D; ++d) z = std::fma(g[d], xt[d], z);
            ws.shared_gate[t * ns + s] = 1.0f / (1.0f + std::exp(-z));
          }
        }
      }
    });
    // bf16 pairs of x for the in projections.
    detail::run_pairs_tasks(pool, {detail::PairsTask{x.data, x.row_stride, T, D,
                                                     x_pairs ? ws.x_pairs.data() : nullptr}});
    // 2. In projections with the activation in the epilogue: m = act(x W_gate^T) * (x W_up^T).
    Index const half = Expert::gated ? F : 0;
    for (Index e = 0; e < E; ++e) {
      Index const r0 = plan.expert_offsets[e], n = plan.expert_rows(e);
      Job job;
      job.kind = Job::Kind::kRoutedHidden;
      job.a = train ? kernels::RowSource{ws.x_rows.data() + r0 * D, D, nullptr}
                    : kernels::RowSource{x.data, x.row_stride, plan.row_token.data() + r0,
                                         routed_pairs ? ws.x_pairs.data() : nullptr, kpD};
      job.rows = n;
      job.depth = D;
      job.w = weights_of(bank_.in_proj(e).data, P, bank_.packed_in(e), bank_.packed_in_bf16(e), D,
                         half, use_bf16, n);
      job.c = ws.act.data() + r0 * F;
      job.ldc = F;
      job.cols = F;
      job.h = train ? ws.hidden.data() + r0 * P : nullptr;
      job.ldh = P;
      add_job(ws, job);
    }
    if constexpr (Shared::has_experts) {
      using SX = typename Shared::Expert;
      for (Index s = 0; s < ns; ++s) {
        auto const& sb = shared_.bank();
        Job job;
        job.kind = Job::Kind::kSharedHidden;
        job.a = {x.data, x.row_stride, nullptr, shared_pairs ? ws.x_pairs.data() : nullptr, kpD};
        job.rows = T;
        job.depth = D;
        job.w = weights_of(sb.in_proj(s).data, Ps, sb.packed_in(s), sb.packed_in_bf16(s), D,
                           SX::gated ? Fs : 0, use_bf16, T);
        job.c = ws.shared_act.data() + s * T * Fs;
        job.ldc = Fs;
        job.cols = Fs;
        job.h = train ? ws.shared_hidden.data() + s * T * Ps : nullptr;
        job.ldh = Ps;
        add_job(ws, job);
      }
    }
    run_jobs(ws, pool);
    // bf16 pairs of m for the down projections.
    detail::run_pairs_tasks(
        pool,
        {detail::PairsTask{ws.act.data(), F, R, F, routed_pairs ? ws.act_pairs.data() : nullptr},
         detail::PairsTask{ws.shared_act.data(), Fs, ns * T, Fs,
                           shared_pairs ? ws.shared_act_pairs.data() : nullptr}});
    // 3. Down projections y_rows = m W_down^T, times the routing weight in inference; a large
    //    output goes to memory with non-temporal stores (see detail::kStreamOutputBytes).
    bool const stream_out = R * D * static_cast<Index>(sizeof(float)) >= detail::kStreamOutputBytes;
    for (Index e = 0; e < E; ++e) {
      Index const r0 = plan.expert_offsets[e], n = plan.expert_rows(e);
      Job job;
      job.a = {ws.act.data() + r0 * F, F, nullptr,
               routed_pairs ? ws.act_pairs.data() + r0 * kpF : nullptr, kpF};
      job.rows = n;
      job.depth = F;
      job.w = weights_of(bank_.down_proj(e).data, D, bank_.packed_down(e),
                         bank_.packed_down_bf16(e), F, 0, use_bf16, n);
      job.c = ws.expert_out.data() + r0 * D;
      job.ldc = D;
      job.cols = D;
      job.scale = train ? nullptr : plan.row_weight.data() + r0;
      job.stream = stream_out;
      add_job(ws, job);
    }
    if constexpr (Shared::has_experts) {
      for (Index s = 0; s < ns; ++s) {
        auto const& sb = shared_.bank();
        Job job;
        job.a = {ws.shared_act.data() + s * T * Fs, Fs, nullptr,
                 shared_pairs ? ws.shared_act_pairs.data() + s * T * kpFs : nullptr, kpFs};
        job.rows = T;
        job.depth = Fs;
        job.w = weights_of(sb.down_proj(s).data, D, sb.packed_down(s), sb.packed_down_bf16(s), Fs,
                           0, use_bf16, T);
        job.c = ws.shared_out.data() + s * T * D;
        job.ldc = D;
        job.cols = D;
        add_job(ws, job);
      }
    }
    run_jobs(ws, pool);
    // 4. Combine: each token's rows in slot order, then the shared experts.
    parallel_for(pool, token_tiles, [&](Index i, int) {
      kernels::CombineParams p;
      p.expert_out = ws.expert_out.data();
      p.ld_expert_out = D;
      p.row_weight = train ? plan.row_weight.data() : nullptr;  // inference: already applied
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
    parallel_for(pool, (T + kTileRows - 1) / kTileRows, [&](Index i, int) {
      Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
      for (Index t = t0; t < t1; ++t) {
        float const* p = ws.selection.scores.data() + t * E;
        float* yt = y.row(t);
        for (Index e = 0; e < E; ++e) {
          if (p[e] == 0.0f || token_has_expert(ws.plan, t, e)) continue;
          float const* d = ws.defaults.data() + e * D;
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
        for (Index r = r0; r < r0 + n; ++r) sum += ws.expert_out[r * D + c];
        d[c] = beta * d[c] + (1.0f - beta) * static_cast<float>(sum / static_cast<double>(n));
      }
    });
  }

  void backward_impl(MoeFfnWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                     Gradients& grads, ThreadPool* pool) const {
    Index const T = ws.selection.num_tokens, D = d_model_, E = num_experts(), F = d_ffn();
    Index const P = bank_.hidden_cols(), S = ws.selection.slots;
    RoutingPlan const& plan = ws.plan;
    Index const R = plan.num_rows(), ns = shared_.count();
    Index Ps = 0, Fs = 0;
    if constexpr (Shared::has_experts) {
      Ps = shared_.bank().hidden_cols();
      Fs = shared_.bank().d_ffn();
    }
    ConstMatrixView<float> x(ws.x.data(), T, D);
    Index const token_tiles = (T + kTileRows - 1) / kTileRows;
    ws.d_rows.resize(static_cast<std::size_t>(R * D));
    ws.dx_rows.resize(static_cast<std::size_t>(R * D));
    ws.dhidden.resize(static_cast<std::size_t>(R * P));
    ws.shared_dy.resize(static_cast<std::size_t>(ns * T * D));
    ws.shared_dx.resize(static_cast<std::size_t>(ns * T * D));
    ws.shared_dhidden.resize(static_cast<std::size_t>(ns * T * Ps));
    ws.dweight.assign(static_cast<std::size_t>(T * S), 0.0f);
    ws.dscores.assign(static_cast<std::size_t>(T * E), 0.0f);
    ws.dlogits.assign(static_cast<std::size_t>(T * E), 0.0f);
    ws.dlogits_extra.assign(static_cast<std::size_t>(T * E), 0.0f);
    ws.dgate.assign(static_cast<std::size_t>(ns * T), 0.0f);
    // backward_rows scratch per thread; it also holds the weight gradients' gemm_strided scratch.
    Index scratch_per = bank_.backward_scratch_floats(detail::kBackwardRows);
    if constexpr (Shared::has_experts) {
      scratch_per = std::max(scratch_per, shared_.bank().backward_scratch_floats(kTileRows));
    }
    ws.bwd_scratch.resize(static_cast<std::size_t>(threads_of(pool) * scratch_per));

    // 1. Combine VJP: dY_r = w_r dy[t]; dL/dw of each slot = <dy[t], Y_r>; shared experts.
    parallel_for(pool, token_tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
      for (Index t = t0; t < t1; ++t) {
        float const* g = dy.row(t);
        Index j = plan.token_offsets[t];
        for (Index s = 0; s < S; ++s) {
          if (ws.selection.expert[t * S + s] < 0) continue;
          Index const r = plan.token_rows[j++];
          ws.dweight[t * S + s] = kernels::scale_dot(
              g, ws.expert_out.data() + r * D, plan.row_weight[r], ws.d_rows.data() + r * D, D);
        }
        for (Index s = 0; s < ns; ++s) {
          float const gate = Shared::gated ? ws.shared_gate[t * ns + s] : 1.0f;
          float const dot = kernels::scale_dot(g, ws.shared_out.data() + (s * T + t) * D, gate,
                                               ws.shared_dy.data() + (s * T + t) * D, D);
          if (Shared::gated) ws.dgate[t * ns + s] = dot * gate * (1.0f - gate);
        }
      }
    });
    // 2. Default MoE: dL/dp_{t,i} += <dy_t, d_i> for unselected experts; balance gradients.
    if (!ws.defaults.empty()) {
      parallel_for(pool, token_tiles, [&](Index i, int) {
        Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
        for (Index t = t0; t < t1; ++t) {
          for (Index e = 0; e < E; ++e) {
            if (token_has_expert(plan, t, e)) continue;
            float const* d = ws.defaults.data() + e * D;
            float dot = 0.0f;
            for (Index c = 0; c < D; ++c) dot = std::fma(dy(t, c), d[c], dot);
            ws.dscores[t * E + e] += dot;
          }
        }
      });
    }
    BalanceGradients bg{MatrixView<float>(ws.dscores.data(), T, E),
                        MatrixView<float>(ws.dlogits_extra.data(), T, E),
                        MatrixView<float>(ws.d_rows.data(), R, D)};
    balance_.backward(balance_inputs(ws), bg);
    // 3. Expert VJPs, row phase: m, dh and dx per expert (in chunks of up to kBackwardRows
    //    rows; each streams the expert's weights once) and per token tile (shared).
    std::vector<detail::RowChunk> chunks;
    for (Index e = 0; e < E; ++e) {
      detail::add_row_chunks(chunks, e, plan.expert_offsets[e], plan.expert_rows(e));
    }
    Index const routed_items = static_cast<Index>(chunks.size());
    Index const shared_tiles = ns * token_tiles;
    parallel_for(pool, routed_items + shared_tiles, [&](Index i, int thread) {
      float* scratch = ws.bwd_scratch.data() + thread * scratch_per;
      if (i < routed_items) {
        detail::backward_chunk(bank_, chunks[static_cast<std::size_t>(i)], ws.hidden.data(),
                               ws.d_rows.data(), ws.act.data(), ws.dhidden.data(),
                               ws.dx_rows.data(), scratch);
      } else if constexpr (Shared::has_experts) {
        Index const s = (i - routed_items) / token_tiles;
        Index const t0 = ((i - routed_items) % token_tiles) * kTileRows,
                    n = std::min(kTileRows, T - t0);
        Index const off = s * T + t0;
        shared_.bank().backward_rows(
            s, ConstMatrixView<float>(ws.shared_hidden.data() + off * Ps, n, Ps),
            ConstMatrixView<float>(ws.shared_dy.data() + off * D, n, D),
            MatrixView<float>(ws.shared_act.data() + off * Fs, n, Fs),
            MatrixView<float>(ws.shared_dhidden.data() + off * Ps, n, Ps),
            MatrixView<float>(ws.shared_dx.data() + off * D, n, D), scratch);
      }
    });
    // 4. Router VJP: dweight (+ Default-MoE / balance score terms) -> dlogits.
    MatrixView<float> dlogits(ws.dlogits.data(), T, E);
    router_.backward(ws.logits_view(), ws.selection, ws.dweight.data(),
                     MatrixView<float>(ws.dscores.data(), T, E), dlogits);
    for (Index i = 0; i < T * E; ++i) ws.dlogits[i] += ws.dlogits_extra[i];
    // 5. Weight gradients: one item per (bank, expert, kGradRows-row block of the gradient).
    struct GradItem {
      int kind;  // 0 expert in, 1 expert down, 2 shared in, 3 shared down, 4 router, 5 gate
      Index e, r0, r1;
    };
    std::vector<GradItem> gitems;
    for (Index e = 0; e < E; ++e) {
      if (plan.expert_rows(e) == 0) continue;
      for (Index r = 0; r < P; r += kGradRows)
        gitems.push_back({0, e, r, std::min(P, r + kGradRows)});
      for (Index r = 0; r < D; r += kGradRows)
        gitems.push_back({1, e, r, std::min(D, r + kGradRows)});
    }
    for (Index s = 0; s < ns && T > 0; ++s) {
      for (Index r = 0; r < Ps; r += kGradRows)
        gitems.push_back({2, s, r, std::min(Ps, r + kGradRows)});
      for (Index r = 0; r < D; r += kGradRows)
        gitems.push_back({3, s, r, std::min(D, r + kGradRows)});
    }
    for (Index r = 0; r < E; r += kTileRows)
      gitems.push_back({4, 0, r, std::min(E, r + kTileRows)});
    if (Shared::gated && ns > 0) gitems.push_back({5, 0, 0, ns});
    parallel_for(pool, static_cast<Index>(gitems.size()), [&](Index i, int thread) {
      GradItem const& it = gitems[i];
      float* const scratch = ws.bwd_scratch.data() + thread * scratch_per;
      if (it.kind == 0 || it.kind == 1) {
        Index const r0 = plan.expert_offsets[it.e], n = plan.expert_rows(it.e);
        if (it.kind == 0) {
          Bank::accumulate_in_grad(ConstMatrixView<float>(ws.x_rows.data() + r0 * D, n, D),
                                   ConstMatrixView<float>(ws.dhidden.data() + r0 * P, n, P), it.r0,
                                   it.r1, grads.experts.in_proj(it.e), scratch);
        } else {
          Bank::accumulate_down_grad(ConstMatrixView<float>(ws.act.data() + r0 * F, n, F),
                                     ConstMatrixView<float>(ws.d_rows.data() + r0 * D, n, D), it.r0,
                                     it.r1, grads.experts.down_proj(it.e), scratch);
        }
      } else if (it.kind == 4) {
        // router_weight[r0:r1] += dlogits[:, r0:r1]^T x
        kernels::gemm_strided(it.r1 - it.r0, D, T, ws.dlogits.data() + it.r0, 1, E, x.data,
                              x.row_stride, grads.router_weight.data() + it.r0 * D, D, true,
                              scratch);
      } else if constexpr (Shared::has_experts) {
        using SBank = std::remove_cvref_t<decltype(shared_.bank())>;
        Index const off = it.e * T;
        if (it.kind == 2) {
          SBank::accumulate_in_grad(
              x, ConstMatrixView<float>(ws.shared_dhidden.data() + off * Ps, T, Ps), it.r0, it.r1,
              grads.shared.bank().in_proj(it.e), scratch);
        } else if (it.kind == 3) {
          SBank::accumulate_down_grad(
              ConstMatrixView<float>(ws.shared_act.data() + off * Fs, T, Fs),
              ConstMatrixView<float>(ws.shared_dy.data() + off * D, T, D), it.r0, it.r1,
              grads.shared.bank().down_proj(it.e), scratch);
        } else if constexpr (Shared::gated) {
          auto g = grads.shared.gate_weight();  // += dgate^T x
          kernels::gemm_strided(ns, D, T, ws.dgate.data(), 1, ns, x.data, x.row_stride, g.data,
                                g.row_stride, true, scratch);
        }
      }
    });
    // 6. dx = sum of the token's expert-input gradients (fixed order) + shared + router + gates.
    parallel_for(pool, token_tiles, [&](Index i, int) {
      kernels::CombineParams p;
      p.expert_out = ws.dx_rows.data();
      p.ld_expert_out = D;
      p.row_weight = nullptr;
      p.token_offsets = plan.token_offsets.data();
      p.token_rows = plan.token_rows.data();
      p.shared_out = ns > 0 ? ws.shared_dx.data() : nullptr;
      p.ld_shared = D;
      p.shared_plane = T * D;
      p.num_shared = ns;
      p.shared_gate = nullptr;
      p.token_begin = i * kTileRows;
      p.token_end = std::min(T, p.token_begin + kTileRows);
      p.cols = D;
      p.out = dx.data;
      p.ld_out = dx.row_stride;
      kernels::combine_rows(p);
      Index const n = p.token_end - p.token_begin;
      // dx rows += dlogits W_r (+ dgate W_g)
      float* dxt = dx.row(p.token_begin);
      kernels::gemm_strided(n, D, E, ws.dlogits.data() + p.token_begin * E, E, 1,
                            router_weight_.data(), D, dxt, dx.row_stride, true);
      if constexpr (Shared::gated) {
        if (ns > 0) {
          auto const g = std::as_const(shared_).gate_weight();
          kernels::gemm_strided(n, D, ns, ws.dgate.data() + p.token_begin * ns, ns, 1, g.data,
                                g.row_stride, dxt, dx.row_stride, true);
        }
      }
    });
  }

  Router router_{};
  Bank bank_;
  Shared shared_{};
  Balance balance_{};
  Index d_model_ = 0;
  std::vector<float> router_weight_;
  DefaultMoe default_moe_{};
  std::vector<float> defaults_;
  MoeFfnWorkspace own_ws_;
};

}  // namespace moe
