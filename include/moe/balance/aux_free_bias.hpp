// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// AuxFreeBias: DeepSeek-V3 auxiliary-loss-free balancing through a selection-only bias.
#pragma once

#include <algorithm>
#include <vector>

#include "moe/core/concepts.hpp"
#include "moe/core/error.hpp"

namespace moe::balance {

/// Auxiliary-loss-free load balancing (DeepSeek-V3; Megatron-LM get_updated_expert_bias):
///   c_i = (token, slot) assignments to expert i over the whole step (all forward_train calls
///         since the last end_step; padding tokens excluded when a token mask is given)
///   b_i <- b_i + rate * sign(mean(c) - c_i)          (sign(0) = 0: no change at the average)
/// The bias only changes which experts are selected, never the weights (the router's `bias`, as in
/// routing::GroupLimitedTopK). No loss, no gradient. DeepSeek-V3 used rate 1e-3 (0 for its last
/// 500B tokens). The router must have a `std::vector<float> bias` of E entries (an empty bias is
/// created with zeros on the first update).
struct AuxFreeBias {
  float rate = 1e-3f;
  /// Throws moe::Error unless rate is finite and >= 0 (0 freezes the bias).
  void validate() const {
    ::moe::detail::check(rate >= 0.0f && rate <= 1e6f, "AuxFreeBias: rate = ", rate,
                         "; it must be a number in [0, 1e6] (0 freezes the bias)");
  }
  std::vector<double> counts;  ///< [E] assignments accumulated over the current step

  double aux_loss(BalanceInputs const&) const { return 0.0; }
  void backward(BalanceInputs const&, BalanceGradients&) const {}

  void observe(BalanceInputs const& in) {
    Index const E = in.plan.num_experts;
    if (static_cast<Index>(counts.size()) != E) counts.assign(static_cast<std::size_t>(E), 0.0);
    for (Index e = 0; e < E; ++e) {
      for (Index r = in.plan.expert_offsets[e]; r < in.plan.expert_offsets[e + 1]; ++r) {
        if (in.token_mask.empty() || in.token_mask[in.plan.row_token[r]]) counts[e] += 1.0;
      }
    }
  }

  template <class Router>
  void end_step(Router& router) {
    static_assert(
        requires { router.bias; },
        "moe::balance::AuxFreeBias: the router has no selection bias; use a router with "
        "a `bias` member such as routing::GroupLimitedTopK");
    if (counts.empty()) return;
    Index const E = static_cast<Index>(counts.size());
    if (router.bias.empty()) router.bias.assign(static_cast<std::size_t>(E), 0.0f);
    ::moe::detail::check(static_cast<Index>(router.bias.size()) == E,
                         "AuxFreeBias: router bias has ", router.bias.size(), " entries for ", E,
                         " experts");
    double mean = 0.0;
    for (double c : counts) mean += c;
    mean /= static_cast<double>(E);
    for (Index e = 0; e < E; ++e) {
      double const diff = mean - counts[e];
      router.bias[e] += rate * static_cast<float>((diff > 0.0) - (diff < 0.0));
    }
    std::fill(counts.begin(), counts.end(), 0.0);
  }
};

static_assert(BalancePolicy<AuxFreeBias>);

}  // namespace moe::balance
