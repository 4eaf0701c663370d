// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// RoutingPlan: routed rows sorted by expert, the value every MoE layer runs its experts from.
#pragma once

#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"

namespace moe {

/// The routing decision of one layer call, in the layout the expert kernels read.
///
/// A *row* is one (token, expert) pair. Rows are sorted by expert; within an expert, by token,
/// then by slot (a stable counting sort of the Selection), so the order is deterministic.
///
/// | member          | shape  | meaning                                                      |
/// |-----------------|--------|--------------------------------------------------------------|
/// | expert_offsets  | [E+1]  | rows of expert e are [expert_offsets[e], expert_offsets[e+1]) |
/// | row_token       | [R]    | token each row came from                                     |
/// | row_weight      | [R]    | combine weight of each row                                   |
/// | token_offsets   | [T+1]  | rows of token t are token_rows[token_offsets[t] .. [t+1])    |
/// | token_rows      | [R]    | row ids of each token, in the token's slot order             |
///
/// Combine reads a token's rows in `token_rows` order: y[t] = sum_j row_weight[r_j] Y[r_j].
/// A plan can be built by a layer (`MoeFfn::route`), by `kernels::build_plan`, or by hand; a
/// layer given an external plan checks it with `validate` first.
struct RoutingPlan {
  Index num_tokens = 0;
  Index num_experts = 0;
  std::vector<Index> expert_offsets;  // [E+1]
  std::vector<Index> row_token;       // [R]
  std::vector<float> row_weight;      // [R]
  std::vector<Index> token_offsets;   // [T+1]
  std::vector<Index> token_rows;      // [R]

  Index num_rows() const { return expert_offsets.empty() ? 0 : expert_offsets.back(); }
  Index expert_rows(Index e) const { return expert_offsets[e + 1] - expert_offsets[e]; }
  Index token_count(Index t) const { return token_offsets[t + 1] - token_offsets[t]; }

  /// Throws moe::Error unless the plan is internally consistent and fits T tokens and E
  /// experts: offsets start at 0 and never decrease, every row's token is in [0, T), every row
  /// appears exactly once in token_rows under its own token, and all weights are finite. O(T+R).
  void validate(Index expected_tokens, Index expected_experts) const;
};

inline void RoutingPlan::validate(Index expected_tokens, Index expected_experts) const {
  using detail::check;
  constexpr char const* kWhere = "RoutingPlan::validate: ";
  check(num_tokens == expected_tokens, kWhere, "plan has num_tokens = ", num_tokens,
        " but the input has ", expected_tokens,
        " tokens; route the same input the plan was made for");
  check(num_experts == expected_experts, kWhere, "plan has num_experts = ", num_experts,
        " but the layer has ", expected_experts,
        " experts; build the plan for this layer's experts");
  check(expert_offsets.size() == static_cast<std::size_t>(num_experts + 1), kWhere,
        "expert_offsets has ", expert_offsets.size(),
        " entries, expected num_experts + 1 = ", num_experts + 1);
  check(token_offsets.size() == static_cast<std::size_t>(num_tokens + 1), kWhere,
        "token_offsets has ", token_offsets.size(),
        " entries, expected num_tokens + 1 = ", num_tokens + 1);
  check(expert_offsets.front() == 0 && token_offsets.front() == 0, kWhere,
        "expert_offsets and token_offsets must start at 0");
  for (Index e = 0; e < num_experts; ++e) {
    check(expert_offsets[e + 1] >= expert_offsets[e], kWhere, "expert_offsets decreases at expert ",
          e, "; offsets must be a prefix sum of per-expert row counts");
  }
  for (Index t = 0; t < num_tokens; ++t) {
    check(token_offsets[t + 1] >= token_offsets[t], kWhere, "token_offsets decreases at token ", t);
  }
  Index const rows = num_rows();
  check(token_offsets.back() == rows, kWhere, "token_offsets ends at ", token_offsets.back(),
        " but the plan has ", rows, " rows; every row must belong to exactly one token");
  check(row_token.size() == static_cast<std::size_t>(rows) &&
            row_weight.size() == static_cast<std::size_t>(rows) &&
            token_rows.size() == static_cast<std::size_t>(rows),
        kWhere, "row_token, row_weight and token_rows must each hold num_rows() = ", rows,
        " entries");
  std::vector<char> seen(static_cast<std::size_t>(rows), 0);
  for (Index t = 0; t < num_tokens; ++t) {
    for (Index j = token_offsets[t]; j < token_offsets[t + 1]; ++j) {
      Index const r = token_rows[j];
      check(r >= 0 && r < rows, kWhere, "token ", t, " lists row ", r, ", outside [0, ", rows, ")");
      check(!seen[r], kWhere, "row ", r, " is listed twice in token_rows");
      seen[r] = 1;
      check(row_token[r] == t, kWhere, "row ", r, " is listed under token ", t,
            " but row_token says ", row_token[r]);
    }
  }
  for (Index r = 0; r < rows; ++r) {
    float const w = row_weight[r];
    check(w - w == 0.0f, kWhere, "row ", r, " has a non-finite weight ", w);
  }
}

}  // namespace moe
