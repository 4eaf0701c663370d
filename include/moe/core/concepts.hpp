// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The policy concepts: what a router, an expert, a shared-expert set and a balance policy must
/// provide to compose into a layer. A type missing a requirement fails at the layer's template
/// argument list with the name of the concept and of the requirement.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"

namespace moe {

/// A routing policy turns router logits into a Selection.
/// Requirements (r const):
/// - `r.expert_count()`: E, the number of routed experts;
/// - `r.slots_per_token()`: S, the most experts one token can get (K, or E for expert choice);
/// - `r.validate()`: throws moe::Error if the configuration is unusable;
/// - `r.select(logits, sel)`: logits [T, E] (finite, or -inf for unavailable experts) -> sel,
///   which it resets to [T, S]; it must be deterministic and never select a -inf expert.
template <class R>
concept RouterPolicy = requires(R const& r, ConstMatrixView<float> logits, Selection& sel) {
  { r.expert_count() } -> std::convertible_to<Index>;
  { r.slots_per_token() } -> std::convertible_to<Index>;
  { r.validate() } -> std::same_as<void>;
  { r.select(logits, sel) } -> std::same_as<void>;
};

/// A routing policy that can be trained: it also provides the vector-Jacobian product
///   r.backward(logits, sel, dweight, dscores, dlogits)
/// with dweight [T, S] = dL/d(weight of each slot), dscores [T, E] = extra dL/dscores on entry
/// (Default MoE, balance losses; the policy adds its own terms), dlogits [T, E] = dL/dlogits out.
/// Selection itself (which experts) is not differentiable; only the weights are.
template <class R>
concept TrainableRouterPolicy = RouterPolicy<R> &&
    requires(R const& r, ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
             MatrixView<float> m) {
  { r.backward(logits, sel, dweight, m, m) } -> std::same_as<void>;
};

/// An expert policy says what one expert computes.
/// Requirements: `X::Element` (float), `X::gated` (bool: GLU with gate and up projections, or a
/// plain MLP), `X::activation` (a moe::kernels::Activation).
template <class X>
concept ExpertPolicy = requires {
  typename X::Element;
  { X::gated } -> std::convertible_to<bool>;
  X::activation;
}
&&std::same_as<typename X::Element, float>;

/// A shared-expert policy: experts every token goes through.
/// Requirements: `S::has_experts`, `S::gated` (bools), `s.count()`; when has_experts, also
/// `s.bank()` (an ExpertBank) and `s.gate_weight()` ([count, D] view, empty when ungated).
template <class S>
concept SharedExpertPolicy = requires(S const& s) {
  { S::has_experts } -> std::convertible_to<bool>;
  { S::gated } -> std::convertible_to<bool>;
  { s.count() } -> std::convertible_to<Index>;
}
&&(!S::has_experts || requires(S const& s) {
  s.bank();
  { s.gate_weight() } -> std::convertible_to<ConstMatrixView<float>>;
});

/// What a balance policy sees after routing (read-only): logits [T, E] (after routing controls),
/// the Selection (scores [T, E] and choices), the RoutingPlan, and, in training, the expert
/// outputs [R, D] (row r = E_{e(r)}(x_token(r)), unweighted) and an optional token mask [T]
/// (1 = real token, 0 = padding; empty = all real).
struct BalanceInputs {
  ConstMatrixView<float> logits;
  Selection const& selection;
  RoutingPlan const& plan;
  ConstMatrixView<float> expert_out = {};
  std::span<std::uint8_t const> token_mask = {};
};

/// Where a balance policy adds the gradient of its loss: dL/dscores [T, E] (through the router's
/// score function), dL/dlogits [T, E] (directly on the logits, e.g. the z-loss) and
/// dL/d(expert outputs) [R, D] (e.g. the orthogonality loss). All are accumulated into.
struct BalanceGradients {
  MatrixView<float> dscores;
  MatrixView<float> dlogits;
  MatrixView<float> dexpert_out;
};

/// A load-balancing policy:
/// - `b.aux_loss(inputs)`: the value of its loss for this forward (0 for balance::None), with its
///   coefficient applied;
/// - `b.backward(inputs, grads)`: adds the gradient of that value (see BalanceGradients).
/// Optional, detected by the layer: `b.observe(inputs)` after every training forward (stateful
/// policies: counts over a step), `b.end_step(router)` when the trainer calls
/// MoeFfn::end_step (bias updates, window resets).
template <class B>
concept BalancePolicy = requires(B const& b, BalanceInputs const& in, BalanceGradients& g) {
  { b.aux_loss(in) } -> std::convertible_to<double>;
  { b.backward(in, g) } -> std::same_as<void>;
};

}  // namespace moe
