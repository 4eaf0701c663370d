// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// RoutingControls: inference-time steering and masking that compose with any routing policy.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

#include "moe/core/error.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/views.hpp"

namespace moe::routing {

/// Inference-time routing controls, applied by the layer around any routing policy without
/// touching the weights. Every field is optional (empty span = off); each non-empty one has E
/// entries.
///
/// - `logit_offset[e]` is added to every token's router logit of expert e before scoring
///   (steering: a positive offset makes e more likely, as in RICE's expert reinforcement).
/// - `expert_mask[e] == 0` makes expert e unavailable: its logit becomes -inf before scoring, so
///   it is never selected and softmax renormalises over the remaining experts (expert pruning).
/// - `weight_multiplier[e]` multiplies the final combine weight of expert e wherever it was
///   selected, after the policy's own normalisation and scaling.
///
/// Preconditions (checked by `validate`): sizes E, finite offsets and multipliers, and at least
/// one available expert (the layer also requires at least top_k of them for token choice).
struct RoutingControls {
  std::span<float const> logit_offset = {};
  std::span<float const> weight_multiplier = {};
  std::span<std::uint8_t const> expert_mask = {};

  bool empty() const {
    return logit_offset.empty() && weight_multiplier.empty() && expert_mask.empty();
  }

  /// Experts left available by the mask.
  Index available_experts(Index num_experts) const {
    if (expert_mask.empty()) return num_experts;
    Index n = 0;
    for (auto m : expert_mask) n += m != 0;
    return n;
  }

  void validate(Index num_experts) const {
    auto check_size = [&](std::size_t size, char const* name) {
      detail::check(size == 0 || size == static_cast<std::size_t>(num_experts),
                    "RoutingControls: ", name, " has ", size, " entries but the layer has ",
                    num_experts, " experts; pass one entry per expert or leave it empty");
    };
    check_size(logit_offset.size(), "logit_offset");
    check_size(weight_multiplier.size(), "weight_multiplier");
    check_size(expert_mask.size(), "expert_mask");
    for (std::size_t e = 0; e < logit_offset.size(); ++e) {
      detail::check(std::isfinite(logit_offset[e]), "RoutingControls: logit_offset[", e,
                    "] is not finite; use expert_mask to remove an expert");
    }
    for (std::size_t e = 0; e < weight_multiplier.size(); ++e) {
      detail::check(std::isfinite(weight_multiplier[e]), "RoutingControls: weight_multiplier[", e,
                    "] is not finite");
    }
    detail::check(available_experts(num_experts) > 0,
                  "RoutingControls: expert_mask removes every expert; keep at least one");
  }

  /// logits[t, e] += logit_offset[e]; logits[t, e] = -inf where expert_mask[e] == 0.
  void apply_to_logits(MatrixView<float> logits) const {
    for (Index t = 0; t < logits.rows; ++t) {
      float* z = logits.row(t);
      for (std::size_t e = 0; e < logit_offset.size(); ++e) z[e] += logit_offset[e];
      for (std::size_t e = 0; e < expert_mask.size(); ++e) {
        if (!expert_mask[e]) z[e] = -INFINITY;
      }
    }
  }

  /// weight[t, s] *= weight_multiplier[expert[t, s]] for every non-empty slot.
  void apply_to_weights(Selection& sel) const {
    if (weight_multiplier.empty()) return;
    for (std::size_t i = 0; i < sel.expert.size(); ++i) {
      if (sel.expert[i] >= 0) sel.weight[i] *= weight_multiplier[sel.expert[i]];
    }
  }
};

}  // namespace moe::routing
