// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Selection: what a routing policy decided, token by token, before it becomes a RoutingPlan.
#pragma once

#include <vector>

#include "moe/core/types.hpp"
#include "moe/core/views.hpp"

namespace moe {

/// The output of a routing policy: for each token, up to `slots` (expert, weight) pairs, plus
/// the dense per-expert scores the weights were taken from.
///
/// | member   | shape  | meaning                                                            |
/// |----------|--------|--------------------------------------------------------------------|
/// | expert   | [T, S] | chosen expert id, or -1 for an empty or dropped slot               |
/// | weight   | [T, S] | combine weight of that slot (0 for an empty slot)                  |
/// | scores   | [T, E] | softmax probabilities or sigmoid scores the weights come from      |
///
/// Token-choice policies fill the first K slots of each token in descending score order (ties:
/// lower expert index first); capacity dropping empties slots in place (expert = -1) and counts
/// them in `dropped`. Expert choice and top-p use S = E, fill slots in ascending expert order
/// (expert choice) or descending score order (top-p), and leave the rest empty.
struct Selection {
  Index num_tokens = 0;
  Index slots = 0;
  Index num_experts = 0;
  std::vector<ExpertId> expert;          // [T, S]
  std::vector<float> weight;             // [T, S]
  std::vector<float> scores;             // [T, E]
  Index dropped = 0;                     // token-slots removed by a capacity limit
  std::vector<ExpertId> dropped_expert;  // [T, S] expert a dropped slot had, else -1 (or empty)
  std::vector<float> scratch;            // router-private work space (no meaning between calls)
  std::vector<ExpertId> scratch_ids;     // router-private work space

  /// Sets the shape, marks every slot empty and clears `dropped`. Reuses capacity: no
  /// allocation once the largest shape has been seen.
  void reset(Index num_tokens_, Index slots_, Index num_experts_) {
    num_tokens = num_tokens_;
    slots = slots_;
    num_experts = num_experts_;
    expert.assign(static_cast<std::size_t>(num_tokens * slots), ExpertId{-1});
    weight.assign(static_cast<std::size_t>(num_tokens * slots), 0.0f);
    scores.resize(static_cast<std::size_t>(num_tokens * num_experts));
    dropped = 0;
    dropped_expert.clear();
  }
  /// The expert slot i was routed to before any capacity drop (-1 for an empty slot): what the
  /// routing weights were computed from, and so what a backward pass differentiates.
  ExpertId chosen_expert(Index i) const {
    return expert[i] >= 0 || dropped_expert.empty() ? expert[i] : dropped_expert[i];
  }
  ExpertId* expert_row(Index t) { return expert.data() + t * slots; }
  float* weight_row(Index t) { return weight.data() + t * slots; }
  ExpertId const* expert_row(Index t) const { return expert.data() + t * slots; }
  float const* weight_row(Index t) const { return weight.data() + t * slots; }
  MatrixView<float> score_view() { return {scores.data(), num_tokens, num_experts}; }
  ConstMatrixView<float> score_view() const { return {scores.data(), num_tokens, num_experts}; }
};

}  // namespace moe
