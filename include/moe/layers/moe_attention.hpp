// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MoeAttention: UMoE pre-mixing attention experts ("UMoE: Unifying Attention and FFN with Shared
/// Experts", NeurIPS 2025), whose experts are drawn from an ExpertBank that an MoE FFN layer uses
/// too. Forward and backward.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "moe/core/concepts.hpp"
#include "moe/core/error.hpp"
#include "moe/core/in_use.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/gating/sdpa_gate.hpp"
#include "moe/kernels/combine.hpp"
#include "moe/kernels/gather.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/kernels/rope.hpp"
#include "moe/kernels/sdpa.hpp"
#include "moe/layers/attention_options.hpp"
#include "moe/layers/detail/expert_jobs.hpp"
#include "moe/layers/detail/ffn_base.hpp"
#include "moe/layers/kv_cache.hpp"
#include "moe/layers/stages/combine.hpp"
#include "moe/layers/stages/routed_experts.hpp"
#include "moe/layers/stages/router.hpp"
#include "moe/layers/stages/shared_experts.hpp"
#include "moe/layers/stages/work.hpp"

namespace moe {

/// Sizes and options of a MoeAttention layer (run-time values). The number of experts and k
/// come from the router.
struct MoeAttentionConfig {
  Index d_model = 0;            ///< D (also the value dimension: values are the hidden states)
  Index qk_dim = 0;             ///< d_qk of the queries and the shared key (UMoE 1B: 512)
  Index q_rank = 0;             ///< per-expert query rank r (UMoE q_lora_rank 36); 0 = full rank
  bool residual_query = false;  ///< UMoE res_query_lora: a shared q_res(x) added to every query
  bool rope = false;            ///< rotate-half RoPE on queries and the key
  float rope_theta = 10000.0f;  ///< RoPE base: finite, >= 1
  Index rotary_dim = 0;         ///< even, <= qk_dim; 0 = qk_dim
  float scale = 0.0f;           ///< 0 = 1 / sqrt(qk_dim)
  bool causal = true;
  /// Sliding-window attention (causal only): a query sees the last `sliding_window` positions of
  /// its sequence, itself included. 0: the whole causal prefix.
  Index sliding_window = 0;
  /// A learned sink logit per expert "head" (the E routed experts, then the shared ones), added
  /// to the softmax denominator of that expert's queries as gpt-oss's per-head sinks (parameter
  /// "sinks" [E + S], initialised to 0).
  bool sinks = false;
};

namespace detail {
/// One SDPA call's query rows in MoeAttention: routed rows of sequence b (token-major [r0, r1)
/// of that sequence's rows), or shared expert s's rows of sequence b (s < 0: routed).
struct AttentionSdpaItem {
  Index b, s, r0, r1;
};
}  // namespace detail

/// What a MoeAttention call writes besides its output, and what forward_train keeps (see
/// MoeAttention). "Expert-major" rows follow the RoutingPlan (sorted by expert); "token-major"
/// rows follow plan.token_rows (sorted by token), so each sequence's queries are contiguous.
struct MoeAttentionWorkspace {
  InUse in_use;  ///< a call holds it: a second, overlapping call on this workspace throws
  std::vector<float> logits;  ///< [T, E] router logits
  Selection selection;
  RoutingPlan plan;
  std::vector<Index> tok_index;  ///< [R] token-major index of each expert-major row
  std::vector<Index> tok_pos;    ///< [R] causal position of each token-major row
  std::vector<float> tok_sink;   ///< [R] sink logit of each token-major row (config sinks)
  std::vector<float> x_rows;     ///< [R, D] expert-major gathered inputs
  std::vector<float> q_low;      ///< [R, r] low-rank query codes (q_rank > 0)
  std::vector<float> q_rows;     ///< [R, d_qk] expert-major routed queries (before RoPE)
  std::vector<float> q_res;      ///< [T, d_qk] residual query (residual_query)
  std::vector<float> q_tok;      ///< [R, d_qk] token-major queries after residual and RoPE
  std::vector<float> q_sh;       ///< [n_shared, T, d_qk] shared-expert queries after RoPE
  std::vector<float> k;          ///< [T, d_qk] shared key after RoPE
  std::vector<float> mixed_tok;  ///< [R, D] SDPA outputs (token-major, before the gate)
  std::vector<float> mixed_sh;   ///< [n_shared, T, D]
  std::vector<float> lse_tok;    ///< [R] SDPA row logsumexp (training)
  std::vector<float> lse_sh;     ///< [n_shared, T]
  std::vector<float> gate;       ///< [R + n_shared T, w] gate logits, then sigmoid gates
  std::vector<float> xin_sh;     ///< [n_shared, T, D] shared-expert inputs (gated mixed)
  /// The routed experts (the shared bank) through the routed-experts engine: x_rows [R, D] are
  /// the expert inputs (gated mixed vectors, expert-major), then pre-activations (training),
  /// activations, outputs [R, D], bf16 pairs; backward rows.
  stages::RoutedExperts routed;
  std::vector<std::uint32_t> xin_pairs;     ///< [R, ceil(D / 2)] bf16 pairs of the expert inputs
  std::vector<std::uint32_t> xin_sh_pairs;  ///< [n_shared, T, ceil(D / 2)]
  stages::SharedStage shared;  ///< the layer's own shared experts: gates, activations, outputs
  std::vector<float> rope_cos, rope_sin;  ///< [T, rotary_dim / 2]
  std::vector<float> scratch;             ///< per-thread SDPA / panel scratch
  stages::ProjectionQueue queue;          ///< query, key and gate projections (fp32, in place)
  stages::ProjectionQueue expert_queue;   ///< the experts' projections (and the router's)
  std::vector<detail::AttentionSdpaItem> sdpa_items;  ///< work items, reused across calls
  stages::GradTasks grad_tasks;                       ///< weight-gradient items of a backward
  std::vector<stages::DxTerm> dx_terms;               ///< dx's projection terms, in order
  stages::ThreadScratch grad_scratch;                 ///< per-thread backward scratch

  // Training only.
  std::vector<float> x;
  std::vector<std::uint8_t> key_mask;
  Index batch = 1;
  stages::RouterGrads router_grads;  ///< dL/d(slot weights), d(scores), d(logits)
  std::vector<float> dgate;
  std::vector<float> dmixed_tok, dmixed_sh, delta_tok, delta_sh;
  std::vector<float> dq_tok, dq_sh, dq_rows, dq_low, dq_res, dk, dv, dx_rows;
  stages::Stamp stamp;  ///< the layer and shapes of the training forward (or none)

  // forward_cached only.
  std::vector<Index> cache_pos;   ///< [T] position of each new token in its sequence
  std::vector<Index> cache_seq;   ///< [T] its sequence
  std::vector<Index> cache_row0;  ///< [sequences + 1] first new token of each sequence
};

/// UMoE pre-mixing attention experts (ALGORITHMS.md section 3): attention is token mixing
/// followed by an FFN-like expert, so every routed expert is one attention "head" whose value and
/// output projections are an FFN expert shared with the MoE FFN layer:
///
///   (A_t, w_t) = Router(W_r x_t)                              router on the token's own state
///   q_{t,i} = W_qb^i W_qa^i x_t  (+ W_qres x_t)    for i in A_t   (W_q^i x_t when q_rank = 0)
///   k_s = W_k x_s;   q, k <- RoPE(q), RoPE(k) (optional)          one shared key
///   m_{t,i} = sum_s softmax_s(scale q_{t,i} . k_s + mask) x_s      values = hidden states
///             (mask: causal, padding, and with sliding_window W the keys before pos - W + 1;
///             with sinks the denominator also sums exp(z_i), z_i expert i's sink logit)
///   m_{t,i} <- m_{t,i} * sigmoid(W_g^i x_t)                       optional output gate (Gate_)
///   y_t = sum_{i in A_t} w_{t,i} E_i(m_{t,i})  +  sum_s g_s(x_t) E^sh_s(m^sh_{t,s})
///
/// Shared expert s has its own query W_qs^s x_t (and gate row W_g^{E+s} with an output gate);
/// g_s = sigmoid(<w_sg^s, x_t>) for gated shared experts, 1 otherwise.
///
/// \tparam Router_ a TrainableRouterPolicy for backward (UMoE: SoftmaxTopK, no renormalisation)
/// \tparam Expert_ the ExpertPolicy of the shared bank (UMoE 1B: SiluMlp, down(silu(gate x)))
/// \tparam Shared_ the attention layer's own shared experts (UMoE: separate from the FFN's)
/// \tparam Gate_   an SdpaGatePolicy on the mixed vectors (headwise: one scalar per expert)
///
/// The routed experts are *not* owned: the layer points at an ExpertBank owned elsewhere (the
/// MoE FFN layer's `experts()`), which must outlive it and keep its address (re-point with
/// bind_experts after moving the owner). Its gradients go to a bank passed to backward, so the
/// attention and FFN uses accumulate into one gradient (e.g. the FFN's `Gradients::experts`).
/// When the bank holds a current fp32 pack (ExpertBank::pack, MoeFfn::pack_weights), the expert
/// projections read its panels instead of packing per call.
///
/// | parameter               | shape             |                                        |
/// |-------------------------|-------------------|----------------------------------------|
/// | router_weight()         | [E, D]            | separate from the FFN layer's router    |
/// | q_a_proj(), q_b_proj()  | [E, r, D], [E, d_qk, r] | q_rank > 0                        |
/// | q_proj()                | [E, d_qk, D]      | q_rank = 0                              |
/// | q_res_proj()            | [d_qk, D]         | residual_query                          |
/// | k_proj()                | [d_qk, D]         |                                        |
/// | shared_q_proj()         | [S, d_qk, D]      | S shared experts                        |
/// | gate_proj()             | [(E + S) w, D]    | output gate, w = Gate::width(D)         |
/// | shared_experts()        | bank + gate       | the attention layer's own               |
/// | sinks()                 | [E + S]           | config sinks                            |
///
/// x, y [T, D] hold `opt.batch` sequences (AttentionOptions: padding mask, positions); y must
/// not alias x. The SDPA runs once per sequence over all routed rows of its tokens (queries in
/// token order, per-row causal positions) and once per shared expert, never materialising a
/// T x T matrix. Threads: all work is split into items fixed by the shapes, so results are bitwise
/// identical for any pool size. Training keeps the routing, the gathered inputs, the queries,
/// the key, the SDPA outputs and row logsumexp, the gates, the expert inputs, pre-activations,
/// activations and outputs; backward recomputes the attention probabilities blockwise.
template <RouterPolicy Router_, ExpertPolicy Expert_,
          SharedExpertPolicy Shared_ = experts::NoSharedExperts,
          gating::SdpaGatePolicy Gate_ = gating::NoGate>
class MoeAttention {
 public:
  using Router = Router_;
  using Expert = Expert_;
  using Shared = Shared_;
  using Gate = Gate_;
  using Bank = experts::ExpertBank<Expert>;
  static constexpr bool gated = Gate::kind != gating::GateKind::kNone;
  static constexpr Index kTileRows = 64;

  /// Gradients of the parameters the layer owns (the routed experts' go to a separate bank).
  struct Gradients {
    std::vector<float> router_weight, q_a, q_b, q_res, k_proj, shared_q, gate_proj, sinks;
    Shared shared;
    ParameterList groups() { return list(*this); }
    void zero() {
      for (auto& p : groups()) std::fill(p.values.begin(), p.values.end(), 0.0f);
    }
  };

  MoeAttention() = default;
  /// A layer with zero weights over `experts` (owned elsewhere). Throws moe::Error on bad sizes.
  MoeAttention(MoeAttentionConfig const& config, Router router, Bank const& experts,
               Shared shared = {})
      : c_(config), router_(std::move(router)), shared_(std::move(shared)), bank_(&experts) {
    router_.validate();
    Index const D = c_.d_model, E = router_.expert_count();
    detail::check(D >= 1 && c_.qk_dim >= 1 && c_.q_rank >= 0, "MoeAttention: d_model = ", D,
                  ", qk_dim = ", c_.qk_dim, ", q_rank = ", c_.q_rank,
                  "; d_model and qk_dim must be >= 1, q_rank >= 0 (0 = full-rank queries)");
    if (c_.rotary_dim == 0) c_.rotary_dim = c_.qk_dim;
    detail::check(
        !c_.rope || (c_.rotary_dim % 2 == 0 && c_.rotary_dim > 0 && c_.rotary_dim <= c_.qk_dim &&
                     c_.rope_theta >= 1.0f && std::isfinite(c_.rope_theta)),
        "MoeAttention: rotary_dim = ", c_.rotary_dim, ", rope_theta = ", c_.rope_theta,
        "; RoPE needs an even rotary_dim in [2, qk_dim = ", c_.qk_dim,
        "] and a finite rope_theta >= 1 (a tiny theta overflows the frequencies)");
    detail::check(c_.sliding_window >= 0 && (c_.sliding_window == 0 || c_.causal),
                  "MoeAttention: sliding_window = ", c_.sliding_window,
                  "; it must be >= 0 (0: none), and a window needs causal attention");
    if (c_.scale == 0.0f) c_.scale = 1.0f / std::sqrt(static_cast<float>(c_.qk_dim));
    detail::check(std::isfinite(c_.scale) && c_.scale > 0.0f, "MoeAttention: scale = ", c_.scale,
                  "; pass a finite positive scale or 0 for 1/sqrt(qk_dim)");
    check_bank(experts);
    if constexpr (Shared::has_experts) {
      detail::check(shared_.count() == 0 || shared_.bank().d_model() == D,
                    "MoeAttention: shared experts have d_model = ", shared_.bank().d_model(),
                    " but the layer has ", D, "; build them with the layer's d_model");
    }
    Index const dk = c_.qk_dim, r = c_.q_rank, ns = shared_.count();
    auto sized = [](Index n) { return std::vector<float>(static_cast<std::size_t>(n), 0.0f); };
    router_weight_ = sized(E * D);
    q_a_ = sized(r > 0 ? E * r * D : E * dk * D);
    q_b_ = sized(r > 0 ? E * dk * r : 0);
    q_res_ = sized(c_.residual_query ? dk * D : 0);
    k_proj_ = sized(dk * D);
    shared_q_ = sized(ns * dk * D);
    gate_proj_ = sized((E + ns) * Gate::width(D) * D);
    sinks_ = sized(c_.sinks ? E + ns : 0);
  }

  /// Points the layer at another bank (same sizes), e.g. after the owning FFN layer moved.
  void bind_experts(Bank const& experts) {
    check_bank(experts);
    bank_ = &experts;
  }
  Bank const& experts() const { return *bank_; }

  MoeAttentionConfig const& config() const { return c_; }
  Index d_model() const { return c_.d_model; }
  Index num_experts() const { return router_.expert_count(); }
  Router& router() { return router_; }
  Router const& router() const { return router_; }
  Shared& shared_experts() { return shared_; }
  Shared const& shared_experts() const { return shared_; }

  MatrixView<float> router_weight() { return {router_weight_.data(), num_experts(), c_.d_model}; }
  ConstMatrixView<float> router_weight() const {
    return {router_weight_.data(), num_experts(), c_.d_model};
  }
  /// Expert e's first query factor [r, D] (q_rank > 0).
  MatrixView<float> q_a_proj(Index e) {
    return {q_a_.data() + e * c_.q_rank * c_.d_model, c_.q_rank, c_.d_model};
  }
  /// Expert e's second query factor [d_qk, r] (q_rank > 0).
  MatrixView<float> q_b_proj(Index e) {
    return {q_b_.data() + e * c_.qk_dim * c_.q_rank, c_.qk_dim, c_.q_rank};
  }
  /// Expert e's full-rank query [d_qk, D] (q_rank = 0).
  MatrixView<float> q_proj(Index e) {
    return {q_a_.data() + e * c_.qk_dim * c_.d_model, c_.qk_dim, c_.d_model};
  }
  MatrixView<float> q_res_proj() {
    return {q_res_.data(), c_.residual_query ? c_.qk_dim : 0, c_.d_model};
  }
  MatrixView<float> k_proj() { return {k_proj_.data(), c_.qk_dim, c_.d_model}; }
  MatrixView<float> shared_q_proj(Index s) {
    return {shared_q_.data() + s * c_.qk_dim * c_.d_model, c_.qk_dim, c_.d_model};
  }
  /// Output-gate rows: routed expert e at rows [e w, (e + 1) w), shared s at (E + s) w.
  MatrixView<float> gate_proj() {
    return {gate_proj_.data(), (num_experts() + shared_.count()) * Gate::width(c_.d_model),
            c_.d_model};
  }

  /// [E + S] sink logits: routed expert e at e, shared expert s at E + s (config().sinks; empty
  /// otherwise).
  std::span<float> sinks() { return sinks_; }
  std::span<float const> sinks() const { return sinks_; }

  /// The layer's own parameters, named: "router.weight", "q_a_proj.weight" and
  /// "q_b_proj.weight" (or "q_proj.weight"), "q_res_proj.weight", "k_proj.weight",
  /// "shared_q_proj.weight", "gate_proj.weight", "sinks", "shared_experts", "shared_experts.gate"
  /// (each only when present). The routed experts belong to the bank's owner.
  ParameterList parameters() { return list_own(); }
  Gradients make_gradients() const {
    Gradients g;
    g.router_weight.assign(router_weight_.size(), 0.0f);
    g.q_a.assign(q_a_.size(), 0.0f);
    g.q_b.assign(q_b_.size(), 0.0f);
    g.q_res.assign(q_res_.size(), 0.0f);
    g.k_proj.assign(k_proj_.size(), 0.0f);
    g.shared_q.assign(shared_q_.size(), 0.0f);
    g.gate_proj.assign(gate_proj_.size(), 0.0f);
    g.sinks.assign(sinks_.size(), 0.0f);
    if constexpr (Shared::has_experts) {
      g.shared = Shared(shared_.count(), c_.d_model, shared_.bank().d_ffn());
    }
    return g;
  }

  /// y = MoeAttention(x). See the class comment.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, MoeAttentionWorkspace& ws,
               AttentionOptions const& opt = {}) const {
    auto const busy = ws.in_use.enter("MoeAttention::forward");
    check_call(x, y, opt);
    ws.stamp = {};
    run_forward(x, y, ws, opt, false);
  }

  /// Decoding with a KvCache made by KvCache::with_widths(sequences, qk_dim, d_model) (keys after
  /// RoPE, values = the hidden states): x [T, D] holds new_tokens[s] new tokens of each
  /// sequence s in order (sum = T), at positions length(s) onwards. Every routed and shared
  /// expert query of a new token attends causally to its sequence's cached keys and the new
  /// ones up to itself; the shared key and hidden state of each new token are appended. The
  /// routing, experts and combine are those of forward(). Equals the last rows of forward()
  /// over each whole sequence up to float rounding of the projections (few-row vs panel paths,
  /// as GatedAttention::forward_cached; tested within 1e-5). Inference only; needs causal
  /// attention. Throws moe::Error for a cache of other widths, counts that do not match.
  void forward_cached(ConstMatrixView<float> x, MatrixView<float> y, KvCache& cache,
                      std::span<Index const> new_tokens, MoeAttentionWorkspace& ws,
                      ThreadPool* pool = nullptr) const {
    auto const busy = ws.in_use.enter("MoeAttention::forward_cached");
    AttentionOptions o;
    o.pool = pool;
    check_call(x, y, o);
    detail::check(c_.causal,
                  "MoeAttention::forward_cached: the layer is not causal; a KV cache "
                  "serves causal decoding only");
    detail::check(cache.window() == 0, "MoeAttention::forward_cached: the cache keeps a window of ",
                  cache.window(),
                  " tokens; MoeAttention reads whole-prefix caches (KvCache::with_widths)");
    detail::check(cache.key_dim() == c_.qk_dim && cache.value_dim() == c_.d_model,
                  "MoeAttention::forward_cached: the cache holds keys of ", cache.key_dim(),
                  " and values of ", cache.value_dim(),
                  " floats but the layer needs qk_dim = ", c_.qk_dim, " and d_model = ", c_.d_model,
                  "; make it with KvCache::with_widths(sequences, qk_dim, d_model)");
    detail::check_new_tokens(cache, new_tokens, x.rows, "MoeAttention");
    Index const B = cache.sequences();
    ws.cache_pos.resize(static_cast<std::size_t>(x.rows));
    ws.cache_seq.resize(static_cast<std::size_t>(x.rows));
    ws.cache_row0.assign(static_cast<std::size_t>(B + 1), 0);
    for (Index s = 0, t = 0; s < B; ++s) {
      Index const n = new_tokens[static_cast<std::size_t>(s)];
      cache.make_room(s, n);
      ws.cache_row0[static_cast<std::size_t>(s + 1)] =
          ws.cache_row0[static_cast<std::size_t>(s)] + n;
      for (Index i = 0; i < n; ++i, ++t) {
        ws.cache_pos[static_cast<std::size_t>(t)] = cache.length(s) + i;
        ws.cache_seq[static_cast<std::size_t>(t)] = s;
      }
    }
    o.positions = ws.cache_pos;
    ws.stamp = {};
    run_forward(x, y, ws, o, false, &cache, new_tokens);
  }

  /// forward() keeping in `ws` what backward needs.
  void forward_train(ConstMatrixView<float> x, MatrixView<float> y, MoeAttentionWorkspace& ws,
                     AttentionOptions const& opt = {}) const {
    auto const busy = ws.in_use.enter("MoeAttention::forward_train");
    check_call(x, y, opt);
    Index const T = x.rows, D = c_.d_model;
    ws.stamp = {};
    AttentionOptions const o = detail::keep_training_input(x, opt, ws.x, ws.key_mask);
    ws.batch = opt.batch;
    run_forward(ConstMatrixView<float>(ws.x.data(), T, D), y, ws, o, true);
    ws.stamp = stamp(T);
  }

  /// Backward of the last forward_train on `ws`: dx [T, D] (overwritten), the layer's parameter
  /// gradients accumulated into `grads`, and the routed experts' gradients accumulated into
  /// `expert_grads` (a bank shaped like experts(), typically the FFN layer's gradient bank).
  void backward(MoeAttentionWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                Gradients& grads, Bank& expert_grads,
                ThreadPool* pool = nullptr) const requires TrainableRouterPolicy<Router> {
    auto const busy = ws.in_use.enter("MoeAttention::backward");
    detail::check(ws.stamp.filled(),
                  "MoeAttention::backward: the workspace holds no training forward; call "
                  "forward_train first (and backward only once per forward)");
    Index const D = c_.d_model, T = ws.stamp.tokens;
    detail::check(ws.stamp == stamp(T),
                  "MoeAttention::backward: the workspace was filled by another layer's "
                  "forward_train; pass the workspace of this layer's forward_train");
    detail::check(dy.rows == T && dy.cols == D && dx.rows == T && dx.cols == D,
                  "MoeAttention::backward: dy and dx must be [", T, ", ", D,
                  "] like the forward's x");
    detail::check(
        grads.router_weight.size() == router_weight_.size() && grads.q_a.size() == q_a_.size() &&
            grads.q_b.size() == q_b_.size() && grads.q_res.size() == q_res_.size() &&
            grads.k_proj.size() == k_proj_.size() && grads.shared_q.size() == shared_q_.size() &&
            grads.gate_proj.size() == gate_proj_.size() && grads.sinks.size() == sinks_.size() &&
            shared_grads_match(grads.shared),
        "MoeAttention::backward: gradients do not match this layer; use "
        "make_gradients()");
    detail::check(expert_grads.parameters().size() == bank_->parameters().size() &&
                      expert_grads.num_experts() == bank_->num_experts(),
                  "MoeAttention::backward: expert_grads is not shaped like the expert bank; pass "
                  "the FFN layer's Gradients::experts (or a bank built with the same sizes)");
    ws.stamp = {};
    run_backward(ws, dy, dx, grads, expert_grads, pool);
  }

 private:
  using SharedX = typename detail::SharedExpertOr<Shared, Expert>::type;

  stages::Stamp stamp(Index tokens) const {
    return {this, tokens, c_.d_model, num_experts(), bank_->d_ffn()};
  }
  bool shared_grads_match(Shared const& g) const {
    if constexpr (Shared::has_experts) {
      return g.count() == shared_.count() && g.bank().d_ffn() == shared_.bank().d_ffn() &&
             g.bank().d_model() == shared_.bank().d_model();
    }
    (void)g;
    return true;
  }

  template <class G>
  static ParameterList list(G& g) {
    ParameterList l;
    auto add = [&](char const* name, std::vector<float>& v) {
      if (!v.empty()) l.push_back({name, std::span<float>(v)});
    };
    add("router.weight", g.router_weight);
    add(g.q_b.empty() ? "q_proj.weight" : "q_a_proj.weight", g.q_a);
    add("q_b_proj.weight", g.q_b);
    add("q_res_proj.weight", g.q_res);
    add("k_proj.weight", g.k_proj);
    add("shared_q_proj.weight", g.shared_q);
    add("gate_proj.weight", g.gate_proj);
    add("sinks", g.sinks);
    if constexpr (Shared::has_experts) {
      if (g.shared.count() > 0) {
        l.push_back({"shared_experts", detail::open_edit(l, g.shared.bank()).parameters()});
        auto gw = g.shared.gate_weight();
        if (gw.rows > 0) {
          l.push_back({"shared_experts.gate",
                       std::span<float>(gw.data, static_cast<std::size_t>(gw.rows * gw.cols))});
        }
      }
    }
    return l;
  }
  ParameterList list_own() {
    struct Ref {
      std::vector<float>&router_weight, &q_a, &q_b, &q_res, &k_proj, &shared_q, &gate_proj, &sinks;
      Shared& shared;
    } r{router_weight_, q_a_, q_b_, q_res_, k_proj_, shared_q_, gate_proj_, sinks_, shared_};
    return list(r);
  }

  void check_bank(Bank const& b) const {
    detail::check(b.num_experts() == router_.expert_count() && b.d_model() == c_.d_model,
                  "MoeAttention: the expert bank has ", b.num_experts(), " experts of d_model ",
                  b.d_model(), " but the router has ", router_.expert_count(),
                  " experts and the layer d_model = ", c_.d_model,
                  "; share the bank of an MoE FFN layer of the same width and expert count");
  }

  static int threads_of(ThreadPool* pool) { return pool ? pool->size() : 1; }
  Index half_rot() const { return c_.rope ? c_.rotary_dim / 2 : 0; }
  Index gate_width() const { return Gate::width(c_.d_model); }
  Index shared_ffn() const {
    if constexpr (Shared::has_experts) return shared_.bank().d_ffn();
    return 0;
  }
  Index scratch_floats() const {
    Index const D = c_.d_model;
    Index n = kernels::sdpa_scratch_size(c_.qk_dim, D);
    Index depth = std::max({D, c_.qk_dim, std::max<Index>(1, c_.q_rank), bank_->d_ffn()});
    depth = std::max(depth, shared_ffn());
    n = std::max(n, kernels::panel_scratch_size(depth));
    return (n + 15) / 16 * 16;
  }

  void check_call(ConstMatrixView<float> x, MatrixView<float> y,
                  AttentionOptions const& opt) const {
    detail::check(bank_ != nullptr,
                  "MoeAttention: the layer was default-constructed; construct "
                  "it with a config, a router and an expert bank first");
    check_bank(*bank_);
    detail::check_attention_call(x, y, c_.d_model, opt, "MoeAttention");
    detail::check(y.rows == 0 || y.data != x.data,
                  "MoeAttention: y aliases x; the values of every token are read after outputs "
                  "are written, so pass a separate output buffer");
  }

  using SdpaItem = detail::AttentionSdpaItem;

  kernels::SdpaParams sdpa_params(MoeAttentionWorkspace const& ws, ConstMatrixView<float> x,
                                  Index S, Index b, Index s, std::uint8_t const* mask) const {
    Index const dk = c_.qk_dim, T = x.rows;
    kernels::SdpaParams p;
    if (s < 0) {
      Index const j0 = ws.plan.token_offsets[b * S], j1 = ws.plan.token_offsets[(b + 1) * S];
      p.q = ws.q_tok.data() + j0 * dk;
      p.q_rows = j1 - j0;
      p.q_pos = ws.tok_pos.data() + j0;
      if (!sinks_.empty()) p.row_sink = ws.tok_sink.data() + j0;
    } else {
      p.q = ws.q_sh.data() + (s * T + b * S) * dk;
      p.q_rows = S;
      if (!sinks_.empty()) p.sink = sinks_[static_cast<std::size_t>(num_experts() + s)];
    }
    p.ldq = dk;
    p.k = ws.k.data() + b * S * dk;
    p.ldk = dk;
    p.v = x.data + b * S * x.row_stride;
    p.ldv = x.row_stride;
    p.kv_rows = S;
    p.head_dim = dk;
    p.value_dim = c_.d_model;
    p.scale = c_.scale;
    p.causal = c_.causal;
    p.window = c_.sliding_window;
    p.key_mask = mask ? mask + b * S : nullptr;
    return p;
  }

  /// Query-row chunks of every SDPA call (routed rows per sequence, then shared experts).
  void sdpa_items(MoeAttentionWorkspace const& ws, Index B, Index S,
                  std::vector<SdpaItem>& it) const {
    it.clear();
    for (Index b = 0; b < B; ++b) {
      Index const n = ws.plan.token_offsets[(b + 1) * S] - ws.plan.token_offsets[b * S];
      for (Index r = 0; r < n; r += kTileRows) it.push_back({b, -1, r, std::min(n, r + kTileRows)});
      for (Index s = 0; s < shared_.count(); ++s) {
        for (Index r = 0; r < S; r += kTileRows)
          it.push_back({b, s, r, std::min(S, r + kTileRows)});
      }
    }
  }

  /// The row offset of SDPA item rows in the token-major (routed) or shared row space.
  Index item_row0(MoeAttentionWorkspace const& ws, Index T, Index S, SdpaItem const& it) const {
    return it.s < 0 ? ws.plan.token_offsets[it.b * S] : it.s * T + it.b * S;
  }

  void run_forward(ConstMatrixView<float> x, MatrixView<float> y, MoeAttentionWorkspace& ws,
                   AttentionOptions const& opt, bool train, KvCache* cache = nullptr,
                   std::span<Index const> new_tokens = {}) const;
  void run_backward(MoeAttentionWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                    Gradients& grads, Bank& expert_grads, ThreadPool* pool) const;

  MoeAttentionConfig c_{};
  Router router_{};
  Shared shared_{};
  Bank const* bank_ = nullptr;
  std::vector<float> router_weight_, q_a_, q_b_, q_res_, k_proj_, shared_q_, gate_proj_, sinks_;
};

template <RouterPolicy Rt, ExpertPolicy Xp, SharedExpertPolicy Sh, gating::SdpaGatePolicy Gt>
void MoeAttention<Rt, Xp, Sh, Gt>::run_forward(ConstMatrixView<float> x, MatrixView<float> y,
                                               MoeAttentionWorkspace& ws,
                                               AttentionOptions const& opt, bool train,
                                               KvCache* cache,
                                               std::span<Index const> new_tokens) const {
  Index const T = x.rows, D = c_.d_model, E = num_experts(), dk = c_.qk_dim, rk = c_.q_rank;
  Index const ns = shared_.count(), w = gate_width(), B = opt.batch, hr = half_rot();
  ThreadPool* pool = opt.pool;
  Index const per = scratch_floats();
  auto grow = [](auto& v, Index n) { v.resize(static_cast<std::size_t>(n)); };
  grow(ws.scratch, threads_of(pool) * per);
  if (T == 0) {
    ws.plan = RoutingPlan{};
    return;
  }
  Index const S = T / B;
  Bank const& bank = *bank_;

  // 1. Route on each token's own hidden state (router() is mutable: validated per call).
  router_.validate();
  stages::router_logits<Expert, SharedX>(x, router_weight_.data(), E, ws.logits, ws.expert_queue,
                                         pool);
  MatrixView<float> logits(ws.logits.data(), T, E);
  stages::check_finite_logits(logits, {"MoeAttention"});
  stages::select_and_plan(router_, logits, nullptr, ws.selection, ws.plan, "MoeAttention");
  RoutingPlan const& plan = ws.plan;
  Index const R = plan.num_rows();
  grow(ws.tok_index, R);
  grow(ws.tok_pos, R);
  for (Index j = 0; j < R; ++j) {
    Index const r = plan.token_rows[j];
    ws.tok_index[r] = j;
    Index const t = plan.row_token[r];
    ws.tok_pos[j] = cache ? ws.cache_pos[static_cast<std::size_t>(t)] : t % S;
  }
  grow(ws.tok_sink, sinks_.empty() ? 0 : R);
  if (!sinks_.empty()) {
    for (Index e = 0; e < E; ++e) {
      for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r)
        ws.tok_sink[static_cast<std::size_t>(ws.tok_index[r])] =
            sinks_[static_cast<std::size_t>(e)];
    }
  }
  Index const row_tiles = (R + kTileRows - 1) / kTileRows;
  Index const token_tiles = (T + kTileRows - 1) / kTileRows;
  grow(ws.x_rows, R * D);
  parallel_for(pool, row_tiles, [&](Index i, int) {
    Index const r0 = i * kTileRows, n = std::min(kTileRows, R - r0);
    kernels::gather_rows(x.data, x.row_stride, plan.row_token.data() + r0, n, D,
                         ws.x_rows.data() + r0 * D, D);
  });

  // 2. Queries (per expert, low-rank or full), residual query, shared key, shared-expert
  //    queries, output-gate logits.
  grow(ws.q_low, rk > 0 ? R * rk : 0);
  grow(ws.q_rows, R * dk);
  grow(ws.q_res, c_.residual_query ? T * dk : 0);
  grow(ws.k, T * dk);
  grow(ws.q_sh, ns * T * dk);
  grow(ws.gate, (R + ns * T) * w);
  for (Index e = 0; e < E; ++e) {
    Index const r0 = plan.expert_offsets[e], n = plan.expert_rows(e);
    float const* xr = ws.x_rows.data() + r0 * D;
    if (rk > 0) {
      ws.queue.add(stages::raw_job(xr, D, n, q_a_.data() + e * rk * D, D, ws.q_low.data() + r0 * rk,
                                   rk, rk));
    } else {
      ws.queue.add(stages::raw_job(xr, D, n, q_a_.data() + e * dk * D, D,
                                   ws.q_rows.data() + r0 * dk, dk, dk));
    }
    if (gated) {
      ws.queue.add(stages::raw_job(xr, D, n, gate_proj_.data() + e * w * D, D,
                                   ws.gate.data() + r0 * w, w, w));
    }
  }
  if (c_.residual_query) {
    ws.queue.add(
        stages::raw_job(x.data, x.row_stride, T, q_res_.data(), D, ws.q_res.data(), dk, dk));
  }
  ws.queue.add(stages::raw_job(x.data, x.row_stride, T, k_proj_.data(), D, ws.k.data(), dk, dk));
  for (Index s = 0; s < ns; ++s) {
    ws.queue.add(stages::raw_job(x.data, x.row_stride, T, shared_q_.data() + s * dk * D, D,
                                 ws.q_sh.data() + s * T * dk, dk, dk));
    if (gated) {
      ws.queue.add(stages::raw_job(x.data, x.row_stride, T, gate_proj_.data() + (E + s) * w * D, D,
                                   ws.gate.data() + (R + s * T) * w, w, w));
    }
  }
  ws.queue.run<Expert, SharedX>(pool);
  if (rk > 0) {
    for (Index e = 0; e < E; ++e) {
      Index const r0 = plan.expert_offsets[e], n = plan.expert_rows(e);
      ws.queue.add(stages::raw_job(ws.q_low.data() + r0 * rk, rk, n, q_b_.data() + e * dk * rk, rk,
                                   ws.q_rows.data() + r0 * dk, dk, dk));
    }
    ws.queue.run<Expert, SharedX>(pool);
  }

  // 3. RoPE; routed queries to token-major order (+ residual query).
  grow(ws.rope_cos, T * hr);
  grow(ws.rope_sin, T * hr);
  parallel_for(pool, token_tiles, [&](Index i, int) {
    Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
    for (Index t = t0; t < t1; ++t) {
      if (!c_.rope) continue;
      float* cs = ws.rope_cos.data() + t * hr;
      float* sn = ws.rope_sin.data() + t * hr;
      Index const pos = opt.positions.empty() ? t % S : opt.positions[t];
      kernels::rope_angles(pos, c_.rope_theta, c_.rotary_dim, cs, sn);
      kernels::rope_apply(ws.k.data() + t * dk, cs, sn, c_.rotary_dim);
      for (Index s = 0; s < ns; ++s) {
        kernels::rope_apply(ws.q_sh.data() + (s * T + t) * dk, cs, sn, c_.rotary_dim);
      }
    }
  });
  grow(ws.q_tok, R * dk);
  parallel_for(pool, row_tiles, [&](Index i, int) {
    Index const j0 = i * kTileRows, j1 = std::min(R, j0 + kTileRows);
    for (Index j = j0; j < j1; ++j) {
      Index const r = plan.token_rows[j], t = plan.row_token[r];
      float* q = ws.q_tok.data() + j * dk;
      float const* src = ws.q_rows.data() + r * dk;
      if (c_.residual_query) {
        float const* res = ws.q_res.data() + t * dk;
        for (Index c = 0; c < dk; ++c) q[c] = src[c] + res[c];
      } else {
        std::copy(src, src + dk, q);
      }
      if (c_.rope) {
        kernels::rope_apply(q, ws.rope_cos.data() + t * hr, ws.rope_sin.data() + t * hr,
                            c_.rotary_dim);
      }
    }
  });

  // 4. Token mixing: SDPA per sequence, values = the hidden states themselves.
  grow(ws.mixed_tok, R * D);
  grow(ws.mixed_sh, ns * T * D);
  grow(ws.lse_tok, train ? R : 0);
  grow(ws.lse_sh, train ? ns * T : 0);
  std::uint8_t const* mask = opt.key_mask.empty() ? nullptr : opt.key_mask.data();
  auto& items = ws.sdpa_items;
  if (cache) {
    // Decoding: append the new tokens' keys and hidden states, then attend over the cache.
    parallel_for(pool, token_tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        Index const sq = ws.cache_seq[static_cast<std::size_t>(t)];
        Index const pos = ws.cache_pos[static_cast<std::size_t>(t)];
        cache->store_key(sq, pos, ws.k.data() + t * dk);  // rounded in a bf16 cache
        cache->store_value(sq, pos, x.row(t));
      }
    });
    Index const Bc = cache->sequences();
    items.clear();
    for (Index b = 0; b < Bc; ++b) {
      Index const t0 = ws.cache_row0[static_cast<std::size_t>(b)];
      Index const n = new_tokens[static_cast<std::size_t>(b)];
      Index const rows = plan.token_offsets[t0 + n] - plan.token_offsets[t0];
      for (Index r = 0; r < rows; r += kTileRows) {
        items.push_back({b, -1, r, std::min(rows, r + kTileRows)});
      }
      for (Index s = 0; s < ns; ++s) {
        for (Index r = 0; r < n; r += kTileRows)
          items.push_back({b, s, r, std::min(n, r + kTileRows)});
      }
    }
    parallel_for(pool, static_cast<Index>(items.size()), [&](Index i, int thread) {
      SdpaItem const& it = items[i];
      Index const t0 = ws.cache_row0[static_cast<std::size_t>(it.b)];
      Index const n = new_tokens[static_cast<std::size_t>(it.b)];
      Index const len = cache->length(it.b);  // before this call's tokens
      kernels::SdpaParams p;
      Index row0 = 0;
      if (it.s < 0) {
        row0 = plan.token_offsets[t0];
        p.q = ws.q_tok.data() + row0 * dk;
        p.q_rows = plan.token_offsets[t0 + n] - row0;
        p.q_pos = ws.tok_pos.data() + row0;
        if (!sinks_.empty()) p.row_sink = ws.tok_sink.data() + row0;
      } else {
        row0 = it.s * T + t0;
        p.q = ws.q_sh.data() + row0 * dk;
        p.q_rows = n;
        p.causal_offset = len;
        if (!sinks_.empty()) p.sink = sinks_[static_cast<std::size_t>(E + it.s)];
      }
      p.ldq = dk;
      detail::bind_cached_kv(p, *cache, it.b, 0, 0);
      p.ldk = dk;
      p.ldv = D;
      p.kv_rows = len + n;
      p.head_dim = dk;
      p.value_dim = D;
      p.scale = c_.scale;
      p.causal = true;
      p.window = c_.sliding_window;
      float* o = (it.s < 0 ? ws.mixed_tok.data() : ws.mixed_sh.data()) + row0 * D;
      kernels::sdpa_forward(p, o, D, nullptr, it.r0, it.r1, ws.scratch.data() + thread * per);
    });
    for (Index b = 0; b < Bc; ++b) cache->advance(b, new_tokens[static_cast<std::size_t>(b)]);
  } else {
    sdpa_items(ws, B, S, items);
    parallel_for(pool, static_cast<Index>(items.size()), [&](Index i, int thread) {
      SdpaItem const& it = items[i];
      Index const row0 = item_row0(ws, T, S, it);
      float* o = (it.s < 0 ? ws.mixed_tok.data() : ws.mixed_sh.data()) + row0 * D;
      float* lse = train ? (it.s < 0 ? ws.lse_tok.data() : ws.lse_sh.data()) + row0 : nullptr;
      kernels::sdpa_forward(sdpa_params(ws, x, S, it.b, it.s, mask), o, D, lse, it.r0, it.r1,
                            ws.scratch.data() + thread * per);
    });
  }

  // 5. Output gate; expert inputs back in expert-major order.
  grow(ws.routed.x_rows, R * D);
  grow(ws.xin_sh, ns * T * D);
  parallel_for(pool, row_tiles + ns * token_tiles, [&](Index i, int) {
    if (i < row_tiles) {
      Index const r0 = i * kTileRows, r1 = std::min(R, r0 + kTileRows);
      for (Index r = r0; r < r1; ++r) {
        float* g = ws.gate.data() + r * w;
        Gate::forward(ws.mixed_tok.data() + ws.tok_index[r] * D, g, g,
                      ws.routed.x_rows.data() + r * D, 1, D);
      }
    } else {
      Index const s = (i - row_tiles) / token_tiles;
      Index const t0 = ((i - row_tiles) % token_tiles) * kTileRows,
                  t1 = std::min(T, t0 + kTileRows);
      for (Index t = t0; t < t1; ++t) {
        Index const k = s * T + t;
        float* g = ws.gate.data() + (R + k) * w;
        Gate::forward(ws.mixed_sh.data() + k * D, g, g, ws.xin_sh.data() + k * D, 1, D);
      }
    }
  });

  // 6. Experts: the shared bank on the routed rows, the layer's shared experts on theirs, both
  //    through the routed-experts engine (fused activation, packed fp32 / bf16 panels).
  stages::ExpertMode const routed{train, detail::uses_bf16_pairs(bank, !train)};
  stages::ExpertMode const shared{train, stages::SharedStage::uses_pairs(shared_, train)};
  stages::ExpertRows const rows{plan.expert_offsets.data(), E};
  Index const kpD = (D + 1) / 2;
  ws.routed.prepare(bank, R, routed, false);
  ws.shared.prepare(shared_, T, shared, D);
  ws.shared.gates(shared_, x, pool);
  ws.xin_pairs.resize(static_cast<std::size_t>(routed.pairs ? R * kpD : 0));
  ws.xin_sh_pairs.resize(static_cast<std::size_t>(shared.pairs ? ns * T * kpD : 0));
  std::uint32_t* const pairs = routed.pairs ? ws.xin_pairs.data() : nullptr;
  std::uint32_t* const sh_pairs = shared.pairs ? ws.xin_sh_pairs.data() : nullptr;
  // bf16-compute training: the experts' inputs rounded to bf16 in place (the gate's backward
  // reads the mixed values and the gates, not these).
  ws.routed.round_inputs(bank, R, routed, pool);
  if (train && stages::SharedStage::trains_bf16(shared_)) {
    stages::round_bf16(ws.xin_sh.data(), ns * T * D, pool);
  }
  detail::run_pairs_tasks(pool, {detail::PairsTask{ws.routed.x_rows.data(), D, R, D, pairs},
                                 detail::PairsTask{ws.xin_sh.data(), D, ns * T, D, sh_pairs}});
  ws.routed.enqueue_in(ws.expert_queue, bank, rows,
                       {ws.routed.x_rows.data(), D, nullptr, pairs, kpD}, routed);
  ws.shared.enqueue_in(ws.expert_queue, shared_, {ws.xin_sh.data(), D, nullptr, sh_pairs, kpD}, T,
                       shared, T, T);
  ws.expert_queue.run<Expert, SharedX>(pool);
  ws.routed.round_hidden(bank, R, routed, pool);
  ws.shared.round_hidden(shared_, shared, pool);
  detail::run_pairs_tasks(
      pool, {ws.routed.act_pairs_task(bank, R), ws.shared.act_pairs_task(shared_, T)});
  ws.routed.enqueue_down(ws.expert_queue, bank, rows, nullptr, routed);
  ws.shared.enqueue_down(ws.expert_queue, shared_, T, shared, T);
  ws.expert_queue.run<Expert, SharedX>(pool);

  // 7. The combine: y_t = sum_j w_j E(m_j) + sum_s g_s E_s(m_s).
  stages::CombineSource src;
  src.rows = ws.routed.out.data();
  src.row_weight = plan.row_weight.data();
  src.plan = &plan;
  ws.shared.add_to(src, shared_);
  stages::combine(src, y, pool);
}

template <RouterPolicy Rt, ExpertPolicy Xp, SharedExpertPolicy Sh, gating::SdpaGatePolicy Gt>
void MoeAttention<Rt, Xp, Sh, Gt>::run_backward(MoeAttentionWorkspace& ws,
                                                ConstMatrixView<float> dy, MatrixView<float> dx,
                                                Gradients& grads, Bank& expert_grads,
                                                ThreadPool* pool) const {
  Index const D = c_.d_model, T = static_cast<Index>(ws.x.size()) / D, E = num_experts();
  Index const dk = c_.qk_dim, rk = c_.q_rank, ns = shared_.count(), w = gate_width();
  Index const B = ws.batch, hr = half_rot();
  Index const per = scratch_floats();
  auto sized = [](std::vector<float>& v, Index n) { v.resize(static_cast<std::size_t>(n)); };
  auto zeroed = [](std::vector<float>& v, Index n) { v.assign(static_cast<std::size_t>(n), 0.0f); };
  sized(ws.scratch, threads_of(pool) * per);
  if (T == 0) return;
  Index const S = T / B;
  Bank const& bank = *bank_;
  RoutingPlan const& plan = ws.plan;
  Selection const& sel = ws.selection;
  Index const R = plan.num_rows(), Sl = sel.slots;
  ConstMatrixView<float> x(ws.x.data(), T, D);
  Index const row_tiles = (R + kTileRows - 1) / kTileRows;
  Index const token_tiles = (T + kTileRows - 1) / kTileRows;
  ws.router_grads.reset(T, Sl, E);
  sized(ws.routed.d_out, R * D);
  sized(ws.dgate, (R + ns * T) * w);
  sized(ws.dmixed_tok, R * D);
  sized(ws.dmixed_sh, ns * T * D);
  sized(ws.delta_tok, R);
  sized(ws.delta_sh, ns * T);
  zeroed(ws.dq_tok, R * dk);
  zeroed(ws.dq_sh, ns * T * dk);
  zeroed(ws.dk, T * dk);
  zeroed(ws.dv, T * D);
  sized(ws.dq_rows, R * dk);
  sized(ws.dq_low, R * rk);
  sized(ws.dq_res, c_.residual_query ? T * dk : 0);
  sized(ws.dx_rows, R * D);
  ws.shared.prepare_backward(shared_, T, D);

  // 1. Combine VJP: dE_r = w_r dy_t, dL/dw = <dy_t, E_r>; shared experts and their gates.
  {
    stages::CombineSource src;
    src.rows = ws.routed.out.data();
    src.row_weight = plan.row_weight.data();
    src.plan = &plan;
    ws.shared.add_to(src, shared_);
    stages::CombineGrads cg{ws.routed.d_out.data(), ws.router_grads.dweight.data()};
    ws.shared.add_to(cg);
    stages::combine_backward(dy, src, sel, cg, pool);
  }

  // 2. Expert VJPs (each expert's rows in chunks of up to kBackwardRows; shared experts by
  //    token tiles).
  stages::ExpertRows const rows{plan.expert_offsets.data(), E};
  ws.routed.backward_rows(bank, rows, pool, ws.grad_scratch);
  ws.shared.backward_rows(shared_, T, pool, ws.grad_scratch);

  // 3. Output-gate VJP; dL/d(mixed) back to token-major order.
  parallel_for(pool, row_tiles + ns * token_tiles, [&](Index i, int) {
    if (i < row_tiles) {
      Index const r0 = i * kTileRows, r1 = std::min(R, r0 + kTileRows);
      for (Index r = r0; r < r1; ++r) {
        Index const j = ws.tok_index[r];
        Gate::backward(ws.mixed_tok.data() + j * D, ws.gate.data() + r * w,
                       ws.routed.dx_rows.data() + r * D, ws.dmixed_tok.data() + j * D,
                       ws.dgate.data() + r * w, 1, D);
      }
    } else {
      Index const s = (i - row_tiles) / token_tiles;
      Index const t0 = ((i - row_tiles) % token_tiles) * kTileRows,
                  t1 = std::min(T, t0 + kTileRows);
      for (Index t = t0; t < t1; ++t) {
        Index const k = s * T + t;
        Gate::backward(ws.mixed_sh.data() + k * D, ws.gate.data() + (R + k) * w,
                       ws.shared.dx.data() + k * D, ws.dmixed_sh.data() + k * D,
                       ws.dgate.data() + (R + k) * w, 1, D);
      }
    }
  });

  // 4. SDPA backward: delta per query row, then dq by query chunks and dk, dv by key blocks
  //    (each key block sums its sequence's routed rows, then each shared expert, in order).
  std::uint8_t const* mask = ws.key_mask.empty() ? nullptr : ws.key_mask.data();
  auto& items = ws.sdpa_items;
  sdpa_items(ws, B, S, items);
  auto grads_for = [&](Index b, Index s) {
    Index const row0 = s < 0 ? plan.token_offsets[b * S] : s * T + b * S;
    kernels::SdpaGrads g;
    g.o = (s < 0 ? ws.mixed_tok.data() : ws.mixed_sh.data()) + row0 * D;
    g.ldo = D;
    g.dout = (s < 0 ? ws.dmixed_tok.data() : ws.dmixed_sh.data()) + row0 * D;
    g.lddo = D;
    g.lse = (s < 0 ? ws.lse_tok.data() : ws.lse_sh.data()) + row0;
    g.delta = (s < 0 ? ws.delta_tok.data() : ws.delta_sh.data()) + row0;
    g.dq = (s < 0 ? ws.dq_tok.data() : ws.dq_sh.data()) + row0 * dk;
    g.lddq = dk;
    g.dk = ws.dk.data() + b * S * dk;
    g.lddk = dk;
    g.dv = ws.dv.data() + b * S * D;
    g.lddv = D;
    return g;
  };
  Index const nit = static_cast<Index>(items.size());
  parallel_for(pool, nit, [&](Index i, int) {
    SdpaItem const& it = items[i];
    float* delta = (it.s < 0 ? ws.delta_tok.data() : ws.delta_sh.data()) + item_row0(ws, T, S, it);
    kernels::sdpa_backward_delta(grads_for(it.b, it.s), D, it.r0, it.r1, delta);
  });
  if (!sinks_.empty()) {  // dL/dz per expert, its rows in ascending (expert-major) order
    float const ninf = -std::numeric_limits<float>::infinity();
    for (Index e = 0; e < E; ++e) {
      float const z = sinks_[static_cast<std::size_t>(e)];
      float acc = 0.0f;
      for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r) {
        Index const j = ws.tok_index[r];
        if (ws.lse_tok[j] != ninf) acc -= std::exp(z - ws.lse_tok[j]) * ws.delta_tok[j];
      }
      grads.sinks[static_cast<std::size_t>(e)] += acc;
    }
    for (Index s = 0; s < ns; ++s) {
      grads.sinks[static_cast<std::size_t>(E + s)] +=
          kernels::sdpa_sink_grad(sinks_[static_cast<std::size_t>(E + s)], ws.lse_sh.data() + s * T,
                                  ws.delta_sh.data() + s * T, T);
    }
  }
  Index const kblocks = (S + kernels::kSdpaKeyBlock - 1) / kernels::kSdpaKeyBlock;
  parallel_for(pool, nit + B * kblocks, [&](Index i, int thread) {
    float* scratch = ws.scratch.data() + thread * per;
    if (i < nit) {
      SdpaItem const& it = items[i];
      kernels::sdpa_backward_dq(sdpa_params(ws, x, S, it.b, it.s, mask), grads_for(it.b, it.s),
                                it.r0, it.r1, scratch);
    } else {
      Index const b = (i - nit) / kblocks, kb = (i - nit) % kblocks;
      for (Index s = -1; s < ns; ++s) {
        kernels::sdpa_backward_dkv(sdpa_params(ws, x, S, b, s, mask), grads_for(b, s), kb, kb + 1,
                                   scratch);
      }
    }
  });

  // 5. RoPE VJPs; routed query gradients to expert-major order; residual query gradient.
  parallel_for(pool, token_tiles, [&](Index i, int) {
    if (!c_.rope) return;
    Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
    for (Index t = t0; t < t1; ++t) {
      float const* cs = ws.rope_cos.data() + t * hr;
      float const* sn = ws.rope_sin.data() + t * hr;
      kernels::rope_backward(ws.dk.data() + t * dk, cs, sn, c_.rotary_dim);
      for (Index s = 0; s < ns; ++s) {
        kernels::rope_backward(ws.dq_sh.data() + (s * T + t) * dk, cs, sn, c_.rotary_dim);
      }
    }
  });
  parallel_for(pool, row_tiles, [&](Index i, int) {
    Index const j0 = i * kTileRows, j1 = std::min(R, j0 + kTileRows);
    for (Index j = j0; j < j1; ++j) {
      Index const r = plan.token_rows[j], t = plan.row_token[r];
      float* dq = ws.dq_tok.data() + j * dk;
      if (c_.rope) {
        kernels::rope_backward(dq, ws.rope_cos.data() + t * hr, ws.rope_sin.data() + t * hr,
                               c_.rotary_dim);
      }
      std::copy(dq, dq + dk, ws.dq_rows.data() + r * dk);
    }
  });
  if (c_.residual_query) {
    parallel_for(pool, token_tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
      for (Index t = t0; t < t1; ++t) {
        float* d = ws.dq_res.data() + t * dk;
        std::fill(d, d + dk, 0.0f);
        for (Index j = plan.token_offsets[t]; j < plan.token_offsets[t + 1]; ++j) {
          float const* src = ws.dq_tok.data() + j * dk;
          for (Index c = 0; c < dk; ++c) d[c] += src[c];
        }
      }
    });
  }

  // 6. Router VJP.
  ws.router_grads.vjp(router_, ConstMatrixView<float>(ws.logits.data(), T, E), sel, false);

  // 7. Query and gate projections, input side: dx_rows = dq W_q (through the low rank) + dgamma
  //    W_g, per row tile split at expert boundaries.
  parallel_for(pool, row_tiles, [&](Index i, int) {
    Index const r0 = i * kTileRows, r1 = std::min(R, r0 + kTileRows);
    Index r = r0;
    while (r < r1) {
      Index e = 0;
      while (plan.expert_offsets[e + 1] <= r) ++e;
      Index const end = std::min(r1, plan.expert_offsets[e + 1]), n = end - r;
      float* const dxr = ws.dx_rows.data() + r * D;
      float const* const dq = ws.dq_rows.data() + r * dk;
      if (rk > 0) {
        float* const dql = ws.dq_low.data() + r * rk;
        kernels::gemm_strided(n, rk, dk, dq, dk, 1, q_b_.data() + e * dk * rk, rk, dql, rk, false);
        kernels::gemm_strided(n, D, rk, dql, rk, 1, q_a_.data() + e * rk * D, D, dxr, D, false);
      } else {
        kernels::gemm_strided(n, D, dk, dq, dk, 1, q_a_.data() + e * dk * D, D, dxr, D, false);
      }
      if (gated) {
        kernels::gemm_strided(n, D, w, ws.dgate.data() + r * w, w, 1, gate_proj_.data() + e * w * D,
                              D, dxr, D, true);
      }
      r = end;
    }
  });

  // 8. Weight gradients, each item one block of one gradient's rows.
  auto& gt = ws.grad_tasks;
  gt.clear();
  ws.router_grads.add_weight_grad(gt, x, E, grads.router_weight.data());
  for (Index e = 0; e < E; ++e) {
    Index const r0 = plan.expert_offsets[e], n = plan.expert_rows(e);
    if (n == 0) continue;
    ConstMatrixView<float> xr(ws.x_rows.data() + r0 * D, n, D);
    ConstMatrixView<float> dq(ws.dq_rows.data() + r0 * dk, n, dk);
    if (rk > 0) {
      gt.add(ConstMatrixView<float>(ws.q_low.data() + r0 * rk, n, rk), dq,
             MatrixView<float>(grads.q_b.data() + e * dk * rk, dk, rk));
      gt.add(xr, ConstMatrixView<float>(ws.dq_low.data() + r0 * rk, n, rk),
             MatrixView<float>(grads.q_a.data() + e * rk * D, rk, D));
    } else {
      gt.add(xr, dq, MatrixView<float>(grads.q_a.data() + e * dk * D, dk, D));
    }
    if (gated) {
      gt.add(xr, ConstMatrixView<float>(ws.dgate.data() + r0 * w, n, w),
             MatrixView<float>(grads.gate_proj.data() + e * w * D, w, D));
    }
  }
  auto const expert_edit = expert_grads.edit();
  ws.routed.add_weight_grads(gt, bank, rows, ws.routed.x_rows.data(), expert_edit);
  if (c_.residual_query) {
    gt.add(x, ConstMatrixView<float>(ws.dq_res.data(), T, dk),
           MatrixView<float>(grads.q_res.data(), dk, D));
  }
  gt.add(x, ConstMatrixView<float>(ws.dk.data(), T, dk),
         MatrixView<float>(grads.k_proj.data(), dk, D));
  for (Index s = 0; s < ns; ++s) {
    gt.add(x, ConstMatrixView<float>(ws.dq_sh.data() + s * T * dk, T, dk),
           MatrixView<float>(grads.shared_q.data() + s * dk * D, dk, D));
    if (gated) {
      gt.add(x, ConstMatrixView<float>(ws.dgate.data() + (R + s * T) * w, T, w),
             MatrixView<float>(grads.gate_proj.data() + (E + s) * w * D, w, D));
    }
  }
  stages::SharedGradScope<Shared> const shared_grads(grads.shared);
  ws.shared.add_weight_grads(gt, shared_, x, shared_grads.target(), ws.xin_sh.data());
  gt.run(pool, ws.grad_scratch);

  // 9. dx: the token's routed rows (slot order), the values, then every projection of x_t (one
  //    accumulating product each, in this order).
  auto& terms = ws.dx_terms;
  terms.clear();
  terms.push_back(ws.router_grads.dx_term(router_weight_.data(), E, D));
  terms.push_back({ws.dk.data(), dk, dk, k_proj_.data(), D});
  if (c_.residual_query) terms.push_back({ws.dq_res.data(), dk, dk, q_res_.data(), D});
  for (Index s = 0; s < ns; ++s) {
    terms.push_back({ws.dq_sh.data() + s * T * dk, dk, dk, shared_q_.data() + s * dk * D, D});
    if (gated) {
      terms.push_back(
          {ws.dgate.data() + (R + s * T) * w, w, w, gate_proj_.data() + (E + s) * w * D, D});
    }
  }
  terms.push_back(ws.shared.gate_dx_term(shared_));
  stages::CombineSource src;
  src.rows = ws.dx_rows.data();
  src.plan = &plan;
  stages::combine(src, dx, pool, [&](Index t0, Index n) {
    for (Index t = t0; t < t0 + n; ++t) {
      float const* const dvt = ws.dv.data() + t * D;
      float* const out = dx.row(t);
      for (Index c = 0; c < D; ++c) out[c] += dvt[c];
    }
    stages::add_dx_terms(terms, t0, n, dx);
  });
}

}  // namespace moe
