// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GroupLimitedTopK: scores with a selection-only bias and group-limited top-k (DeepSeek-V3).
#pragma once

#include <cmath>
#include <vector>

#include "moe/core/selection.hpp"
#include "moe/kernels/top_k.hpp"
#include "moe/routing/detail/common.hpp"

namespace moe::routing {

/// How a group of experts is scored for group-limited routing.
enum class GroupScore {
  kTopTwoSum,  ///< sum of the group's two best selection scores (DeepSeek-V3 with bias; HF)
  kMax,        ///< the group's best selection score (DeepSeek-V3 official code without bias, V2)
};

/// DeepSeek-V3 routing (official inference/model.py::Gate; HF DeepseekV3TopkRouter):
///   s   = sigmoid(z_t)            (or softmax(z_t) with scoring = kSoftmax)
///   sb  = s + b                   (b = e_score_correction_bias: used for SELECTION only)
///   group score g_j = sum of the top-2 sb in group j (or max), j < n_group
///   keep the topk_group best groups; every expert of another group is masked with -inf
///   A_t = top-k(masked sb);  w_i = s_i (unbiased);
///   if normalize: w_i /= max(sum_A s + norm_epsilon, norm_min)   (DeepSeek: + 1e-20)
///   w_i *= scale              (routed_scaling_factor, 2.5 for DeepSeek-V3)
/// The same type routes GLM-4.5 (as DeepSeek-V3), DeepSeek-V2 (softmax, no bias, group max, no
/// renormalisation), MiniMax-M2 (sigmoid, bias, one group, norm_epsilon 0) and ERNIE 4.5
/// (softmax, bias added to the probabilities, norm_epsilon 0, norm_min = moe_norm_min).
/// Masked groups get -inf as in the official code (HF uses 0.0, which can beat a negative s + b;
/// on inputs where every s + b > 0 the two agree). With n_group = topk_group = 1 this is plain
/// sigmoid top-k. Ties (groups and experts) go to the lower index. Experts with logit -inf are
/// unavailable; a group score sums its best two *available* experts (one if only one is left),
/// which equals the official rule whenever no expert is masked.
///
/// Shapes: logits [T, E], bias [E] or empty; slots = top_k.
/// Preconditions: n_group divides num_experts, 1 <= topk_group <= n_group,
/// 1 <= top_k <= topk_group * (num_experts / n_group), bias finite, 0 < scale <= 1e6,
/// norm_epsilon and norm_min in [0, 1].
struct GroupLimitedTopK {
  Index num_experts = 256;
  Index top_k = 8;
  Index n_group = 1;
  Index topk_group = 1;
  bool normalize = true;  ///< norm_topk_prob (always on for sigmoid in the official code)
  float scale = 1.0f;     ///< routed_scaling_factor
  ScoreFunction scoring = ScoreFunction::kSigmoid;
  GroupScore group_score = GroupScore::kTopTwoSum;
  std::vector<float> bias = {};  ///< [E] selection-only bias (e_score_correction_bias), or empty
  float norm_epsilon = 1e-20f;   ///< added to the sum before renormalising (DeepSeek's 1e-20)
  float norm_min = 0.0f;         ///< the sum is clamped to at least this (ERNIE's moe_norm_min)

  Index expert_count() const { return num_experts; }
  Index slots_per_token() const { return top_k; }

  void validate() const {
    using detail::check;
    detail::check_top_k("GroupLimitedTopK", num_experts, top_k);
    check(n_group >= 1 && num_experts % n_group == 0, "GroupLimitedTopK: n_group = ", n_group,
          " does not divide num_experts = ", num_experts, "; pick n_group among its divisors");
    check(topk_group >= 1 && topk_group <= n_group, "GroupLimitedTopK: topk_group = ", topk_group,
          " with n_group = ", n_group, "; topk_group must be in [1, n_group]");
    check(top_k <= topk_group * (num_experts / n_group), "GroupLimitedTopK: top_k = ", top_k,
          " exceeds the ", topk_group * (num_experts / n_group),
          " experts in the kept groups; raise topk_group or lower top_k");
    check(bias.empty() || bias.size() == static_cast<std::size_t>(num_experts),
          "GroupLimitedTopK: bias has ", bias.size(), " entries; give one per expert (",
          num_experts, ") or none");
    for (float b : bias) check(std::isfinite(b), "GroupLimitedTopK: bias holds a non-finite value");
    detail::check_scale("GroupLimitedTopK", scale);
    check(norm_epsilon >= 0.0f && norm_epsilon <= 1.0f,
          "GroupLimitedTopK: norm_epsilon = ", norm_epsilon,
          "; it must be in [0, 1] (DeepSeek uses 1e-20)");
    check(norm_min >= 0.0f && norm_min <= 1.0f, "GroupLimitedTopK: norm_min = ", norm_min,
          "; it must be in [0, 1] (ERNIE 4.5 uses 1e-12)");
  }

  /// Backward (see TrainableRouterPolicy): dweight [T, S] = dL/dw per slot; dscores [T, E] holds
  /// extra dL/dscores on entry and is accumulated into; dlogits [T, E] is overwritten.
  void backward(ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
                MatrixView<float> dscores, MatrixView<float> dlogits) const {
    (void)logits;
    detail::weights_from_scores_backward(sel, top_k, normalize, norm_epsilon, scale, dweight,
                                         dscores, norm_min);
    detail::score_backward(scoring, sel, dscores, dlogits);  // the bias gets no gradient
  }
  void select(ConstMatrixView<float> logits, Selection& sel) const {
    Index const T = logits.rows;
    Index const E = num_experts;
    sel.reset(T, top_k, E);
    detail::compute_scores(scoring, logits, sel);
    // Selection key [T, E] = s + b, with -inf for unavailable experts; then [T, k] values.
    sel.scratch.resize(static_cast<std::size_t>(T * E + T * top_k + n_group + topk_group));
    float* key = sel.scratch.data();
    float* vals = key + T * E;
    float* gscore = vals + T * top_k;
    float* gval = gscore + n_group;
    sel.scratch_ids.resize(static_cast<std::size_t>(topk_group));
    ExpertId* gids = sel.scratch_ids.data();
    Index const group_size = E / n_group;
    for (Index t = 0; t < T; ++t) {
      float const* z = logits.row(t);
      float const* s = sel.scores.data() + t * E;
      float* kt = key + t * E;
      for (Index e = 0; e < E; ++e) {
        kt[e] = z[e] == -INFINITY ? -INFINITY : (bias.empty() ? s[e] : s[e] + bias[e]);
      }
      if (n_group == 1) continue;
      for (Index g = 0; g < n_group; ++g) {
        float best1 = -INFINITY, best2 = -INFINITY;
        for (Index e = g * group_size; e < (g + 1) * group_size; ++e) {
          if (kt[e] > best1) {
            best2 = best1;
            best1 = kt[e];
          } else if (kt[e] > best2) {
            best2 = kt[e];
          }
        }
        bool const two = group_score == GroupScore::kTopTwoSum && best2 != -INFINITY;
        gscore[g] = two ? best1 + best2 : best1;
      }
      kernels::top_k_rows(gscore, n_group, 1, n_group, topk_group, gids, gval);
      // Mask every group that was not kept.
      for (Index g = 0; g < n_group; ++g) {
        bool kept = false;
        for (Index j = 0; j < topk_group; ++j) kept = kept || gids[j] == g;
        if (!kept) {
          for (Index e = g * group_size; e < (g + 1) * group_size; ++e) kt[e] = -INFINITY;
        }
      }
    }
    kernels::top_k_rows(key, E, T, E, top_k, sel.expert.data(), vals);
    detail::weights_from_scores(sel, top_k, normalize, norm_epsilon, scale, norm_min);
  }
};

static_assert(RouterPolicy<GroupLimitedTopK>);

}  // namespace moe::routing
