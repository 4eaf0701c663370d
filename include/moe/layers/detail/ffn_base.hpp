// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// What the MoE FFN layers (MoeFfn and ExpertParallelMoeFfn) share besides the pipeline stages:
/// their policies, parameters and accessors, the parameter list and gradient buffers, the
/// argument checks. Not public API: use the layers.
#pragma once

#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/expert_bank.hpp"

namespace moe::detail {

/// An edit scope of `bank` kept alive by `list` (ParameterList::close ends it on a pool).
template <class Bank>
typename Bank::Edit const& open_edit(ParameterList& list, Bank& bank) {
  struct Scope final : EditScope {
    typename Bank::Edit edit;
    explicit Scope(Bank& b) : edit(b) {}
    void close(ThreadPool* pool) override { edit.close(pool); }
  };
  auto scope = std::make_shared<Scope>(bank);
  list.keep(scope);
  return scope->edit;
}

/// "router.weight", "router.bias" (when the layer has one), "experts" (every in_proj block, then
/// every down_proj block) and, with shared experts, "shared_experts" and "shared_experts.gate".
/// The list keeps the banks' edit scopes open (ParameterList::keep) while it lives.
template <class V, class Bank, class Shared>
ParameterList ffn_parameters(V& router_weight, V& router_bias, Bank& bank, Shared& shared) {
  ParameterList list;
  list.push_back({"router.weight", std::span<float>(router_weight)});
  if (!router_bias.empty()) list.push_back({"router.bias", std::span<float>(router_bias)});
  list.push_back({"experts", open_edit(list, bank).parameters()});
  if constexpr (Shared::has_experts) {
    list.push_back({"shared_experts", open_edit(list, shared.bank()).parameters()});
    auto g = shared.gate_weight();
    list.push_back({"shared_experts.gate",
                    std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols))});
  }
  return list;
}

/// Gradients of an MoE FFN layer's parameters, each buffer shaped like its parameter;
/// `groups()` lists them in the order of the layer's parameters().
template <class Bank, class Shared>
struct FfnGradients {
  std::vector<float> router_weight;  ///< [E, D]
  std::vector<float> router_bias;    ///< [E] with a router bias, else empty
  Bank experts;                      ///< same shapes as the layer's (routed, local) experts
  Shared shared;                     ///< same shapes as the layer's shared experts
  void zero() {
    for (auto& p : groups()) std::fill(p.values.begin(), p.values.end(), 0.0f);
  }
  ParameterList groups() { return ffn_parameters(router_weight, router_bias, experts, shared); }
};

/// Zero gradients shaped like (router_weight, router_bias, bank, shared).
template <class Grads, class Bank, class Shared>
Grads make_ffn_gradients(std::size_t router_size, std::size_t bias_size, Bank const& bank,
                         Shared const& shared) {
  Grads g;
  g.router_weight.assign(router_size, 0.0f);
  g.router_bias.assign(bias_size, 0.0f);
  g.experts = Bank(bank.num_experts(), bank.d_model(), bank.d_ffn());
  if (bank.has_biases()) g.experts.enable_biases();
  if constexpr (Shared::has_experts) {
    g.shared = Shared(shared.count(), shared.bank().d_model(), shared.bank().d_ffn());
    if (shared.bank().has_biases()) g.shared.bank().enable_biases();
  }
  return g;
}

/// Throws moe::Error (who: the layer's name) unless `g` is shaped like the layer's parameters.
template <class Grads, class Bank, class Shared>
void check_ffn_gradients(Grads const& g, std::size_t router_size, std::size_t bias_size,
                         Bank const& bank, Shared const& shared, char const* who) {
  bool ok = g.router_weight.size() == router_size && g.router_bias.size() == bias_size &&
            g.experts.num_experts() == bank.num_experts() &&
            g.experts.d_model() == bank.d_model() && g.experts.d_ffn() == bank.d_ffn() &&
            g.experts.has_biases() == bank.has_biases();
  if constexpr (Shared::has_experts) {
    ok = ok && g.shared.count() == shared.count() &&
         g.shared.bank().d_ffn() == shared.bank().d_ffn() &&
         g.shared.bank().d_model() == shared.bank().d_model() &&
         g.shared.bank().has_biases() == shared.bank().has_biases() &&
         g.shared.gate_weight().rows == shared.gate_weight().rows;
  }
  check(ok, who,
        "::backward: the gradients are not shaped like this layer's parameters (another "
        "layer's?); make them with this layer's make_gradients()");
}

/// The policies, parameters and accessors of an MoE FFN layer: the router and its weight
/// [E, D], the routed experts this process holds (all of them, or one rank's), the shared
/// experts and the balance policy.
template <class Router_, class Expert_, class Shared_, class Balance_>
class FfnLayerBase {
 public:
  using Router = Router_;
  using Expert = Expert_;
  using Shared = Shared_;
  using Balance = Balance_;
  using Bank = experts::ExpertBank<Expert>;
  /// Gradients of every parameter, each buffer shaped like its parameter (router_weight [E, D],
  /// experts, shared). `groups()` lists them in the order of parameters().
  using Gradients = FfnGradients<Bank, Shared>;

  Index d_model() const { return d_model_; }
  Index d_ffn() const { return bank_.d_ffn(); }
  Index num_experts() const { return router_.expert_count(); }

  Router& router() { return router_; }
  Router const& router() const { return router_; }
  Shared& shared_experts() { return shared_; }
  Shared const& shared_experts() const { return shared_; }
  Balance& balance() { return balance_; }
  Balance const& balance() const { return balance_; }
  /// [E, D] router projection, logits = x W_r^T (+ b with a router bias).
  MatrixView<float> router_weight() { return {router_weight_.data(), num_experts(), d_model_}; }
  ConstMatrixView<float> router_weight() const {
    return {router_weight_.data(), num_experts(), d_model_};
  }
  /// Gives the router projection a trainable bias b [E] (gpt-oss router.bias), zero to start:
  /// logits = x W_r^T + b, dL/db = sum_t dL/dz_t. A parameter ("router.bias", after
  /// "router.weight"); no effect on a layer that never calls it.
  void enable_router_bias() { router_bias_.assign(static_cast<std::size_t>(num_experts()), 0.0f); }
  bool has_router_bias() const { return !router_bias_.empty(); }
  /// [E] router bias (empty without enable_router_bias()).
  std::span<float> router_bias() { return router_bias_; }
  std::span<float const> router_bias() const { return router_bias_; }

  /// Every trainable parameter as named flat buffers: "router.weight", "router.bias" (with one),
  /// "experts" (all in_proj
  /// blocks then all down_proj blocks, see ExpertBank), and with shared experts
  /// "shared_experts" and "shared_experts.gate". Biases for selection and Default-MoE state are
  /// buffers, not parameters. The list holds the banks' edit scopes open while it lives (writes
  /// through it are seen; a pack is rebuilt when it goes): keep it for one optimizer step.
  ParameterList parameters() {
    return ffn_parameters(router_weight_, router_bias_, bank_, shared_);
  }

  /// Packs the routed and shared experts' weights into the micro-kernel's panel layout once
  /// (ExpertBank::pack): fp32 panels, or bf16 panels for inference (training forwards then use
  /// the fp32 weights). Weights written later through an edit scope (ExpertBank::edit, or a
  /// parameters() list while it lives) are seen: the pack is not used while the edit is open
  /// and is rebuilt when it ends. Throws while such an edit is open. Doubles expert memory.
  /// Experts are packed in parallel on `pool` when given (same result).
  void pack_weights(experts::WeightFormat format = experts::WeightFormat::kF32,
                    ThreadPool* pool = nullptr) {
    bank_.pack(format, pool);
    if constexpr (Shared::has_experts) shared_.bank().pack(format, pool);
  }

  /// pack_weights with one ExpertFormat (in and down projections) for every routed expert and
  /// one for every shared expert (ExpertBank::pack's per-expert form; the same preconditions),
  /// re-packing the stored blocks `routed_stored` / `shared_stored` give as they are
  /// (experts::StoredBlocks; a loader's promise that they encode the weights exactly).
  void pack_weights(experts::ExpertFormat routed, experts::ExpertFormat shared,
                    ThreadPool* pool = nullptr, experts::StoredBlocks const& routed_stored = {},
                    experts::StoredBlocks const& shared_stored = {}) {
    std::vector<experts::ExpertFormat> const r(static_cast<std::size_t>(bank_.num_experts()),
                                               routed);
    bank_.pack(r, pool, routed_stored);
    if constexpr (Shared::has_experts) {
      std::vector<experts::ExpertFormat> const s(
          static_cast<std::size_t>(shared_.bank().num_experts()), shared);
      shared_.bank().pack(s, pool, shared_stored);
    } else {
      (void)shared_stored;
    }
  }

  /// pack_weights(format) where a projection whose depth `format`'s blocks do not divide (the
  /// in projections' d_model, the down projections' d_ffn) gets the first format of its
  /// fallback chain that holds it (experts::resolve_format). Returns one line per projection
  /// class that fell back, e.g. "routed experts' down: q4_k -> q4_0 (depth 2880)"; empty when
  /// none did.
  std::vector<std::string> pack_weights_with_fallback(experts::WeightFormat format,
                                                      ThreadPool* pool = nullptr) {
    std::vector<std::string> fell;
    auto resolve = [&](char const* what, Index depth) {
      experts::WeightFormat const f = experts::resolve_format(format, depth);
      if (f != format) {
        fell.push_back(std::string(what) + ": " + experts::name(format) + " -> " +
                       experts::name(f) + " (depth " + std::to_string(depth) + ")");
      }
      return f;
    };
    experts::ExpertFormat const routed{resolve("routed experts' gate/up", d_model_),
                                       resolve("routed experts' down", bank_.d_ffn())};
    experts::ExpertFormat shared = routed;
    if constexpr (Shared::has_experts) {
      shared = {resolve("shared experts' gate/up", d_model_),
                resolve("shared experts' down", shared_.bank().d_ffn())};
    }
    pack_weights(routed, shared, pool);
    return fell;
  }

  /// The arithmetic of training steps over the routed and shared experts
  /// (ExpertBank::set_train_compute): TrainCompute::kF32 (the default, exact) or kBf16, bf16
  /// operands with fp32 accumulation, fp32 master weights and gradients, on the CPU's bf16 unit
  /// (AMX, AVX512-BF16, or widened to fp32). The router, the shared-expert gates, activations and
  /// balance losses stay fp32; inference forwards are unchanged (MoeFfn and
  /// ExpertParallelMoeFfn, whose from_layer carries the mode over; a MoeAttention over this
  /// layer's bank trains its experts in the same mode). Keeps bf16
  /// copies of the expert weights (half the bytes of the fp32 weights), rebuilt after every
  /// parameters() list or edit scope ends (one optimizer step). Throws while one is open.
  /// Accuracy: docs/design.md, "bf16 compute".
  void set_train_compute(experts::TrainCompute c, ThreadPool* pool = nullptr) {
    bank_.set_train_compute(c, pool);
    if constexpr (Shared::has_experts) shared_.bank().set_train_compute(c, pool);
  }
  experts::TrainCompute train_compute() const { return bank_.train_compute(); }

  /// Frees the routed and shared experts' fp32 weights, keeping their packs
  /// (ExpertBank::discard_master_weights): an inference-only layer, as a decoder keeps it.
  /// Afterwards parameters(), pack_weights(), training forwards and backwards throw moe::Error;
  /// inference forwards give the same results. Precondition (checked): pack_weights() first.
  void discard_master_weights() {
    check(can_discard_master_weights(),
          "MoE layer: discard_master_weights needs every expert bank packed so that inference "
          "reads only the pack (ExpertBank::pack_serves_inference)");
    bank_.discard_master_weights();
    if constexpr (Shared::has_experts) shared_.bank().discard_master_weights();
  }
  /// Would discard_master_weights() succeed (every bank packed in a form inference reads)?
  bool can_discard_master_weights() const {
    bool ok = bank_.pack_serves_inference();
    if constexpr (Shared::has_experts) ok = ok && shared_.bank().pack_serves_inference();
    return ok;
  }

  /// Zero gradients shaped like this layer's parameters.
  Gradients make_gradients() const {
    return make_ffn_gradients<Gradients>(router_weight_.size(), router_bias_.size(), bank_,
                                         shared_);
  }

 protected:
  FfnLayerBase() = default;
  /// The router's and the balance policy's validate(): at construction and on every call, since
  /// router() and balance() hand out mutable references (a parameter changed between calls is
  /// checked before it is used). O(E).
  void check_policies() const {
    router_.validate();
    if constexpr (requires { balance_.validate(); }) balance_.validate();
  }
  /// Validates and takes the policies; `bank_experts` routed experts of D -> F -> D held here
  /// (-1: all of the router's).
  void init(Index d_model, Index d_ffn, Index bank_experts, Router router, Shared shared,
            Balance balance, char const* who) {
    router.validate();
    if constexpr (requires { balance.validate(); }) balance.validate();
    check(d_model >= 1 && d_ffn >= 1, who, ": d_model = ", d_model, ", d_ffn = ", d_ffn,
          "; both must be >= 1");
    if constexpr (Shared::has_experts) {
      check(shared.count() == 0 || shared.bank().d_model() == d_model, who,
            ": shared experts have d_model = ", shared.bank().d_model(), " but the layer has ",
            d_model, "; build them with the layer's d_model");
    }
    router_ = std::move(router);
    shared_ = std::move(shared);
    balance_ = std::move(balance);
    d_model_ = d_model;
    bank_ = Bank(bank_experts < 0 ? router_.expert_count() : bank_experts, d_model, d_ffn);
    router_weight_.assign(static_cast<std::size_t>(router_.expert_count() * d_model), 0.0f);
  }

  void check_input(ConstMatrixView<float> x, char const* who) const {
    check(x.cols == d_model_, who, ": x has ", x.cols, " columns but d_model = ", d_model_,
          "; pass activations of shape [tokens, d_model]");
    check(x.rows >= 0 && x.row_stride >= x.cols && (x.data || x.rows == 0), who,
          ": x is not a valid view (rows = ", x.rows, ", row_stride = ", x.row_stride, ")");
  }
  void check_output(ConstMatrixView<float> x, MatrixView<float> y, char const* who) const {
    check(y.rows == x.rows && y.cols == d_model_, who, ": y is [", y.rows, ", ", y.cols,
          "] but must be [", x.rows, ", ", d_model_, "] like x");
    check(y.row_stride >= y.cols && (y.data || y.rows == 0), who, ": y is not a valid view");
  }

  Router router_{};
  Bank bank_;
  Shared shared_{};
  Balance balance_{};
  Index d_model_ = 0;
  std::vector<float> router_weight_;
  std::vector<float> router_bias_;  ///< [E] or empty (no router bias)
};

}  // namespace moe::detail
