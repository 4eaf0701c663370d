// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Pieces shared by the routing policies (not public API).
#pragma once

#include <algorithm>
#include <cmath>

#include "moe/core/concepts.hpp"
#include "moe/core/error.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/views.hpp"
#include "moe/kernels/softmax.hpp"

namespace moe::routing {

/// How router logits become scores.
enum class ScoreFunction {
  kSoftmax,  ///< p = softmax(z) over all experts (Mixtral, Qwen, OLMoE)
  kSigmoid,  ///< s = sigmoid(z) per expert (DeepSeek-V3)
};

namespace detail {

using moe::detail::check;

/// sel.scores = score_function(logits).
inline void compute_scores(ScoreFunction f, ConstMatrixView<float> logits, Selection& sel) {
  float* out = sel.scores.data();
  if (f == ScoreFunction::kSoftmax) {
    kernels::softmax_rows(logits.data, logits.row_stride, out, sel.num_experts, logits.rows,
                          logits.cols);
  } else {
    kernels::sigmoid_rows(logits.data, logits.row_stride, out, sel.num_experts, logits.rows,
                          logits.cols);
  }
}

/// weight[t, s] = scores[t, expert[t, s]] for the first `k` slots; then, if normalize,
/// w /= max(sum_s w + eps, norm_min); then w *= scale. Empty slots keep weight 0. (eps: the
/// 1e-20 of DeepSeek's gates; norm_min: ERNIE 4.5's clamp(sum, min=moe_norm_min).)
inline void weights_from_scores(Selection& sel, Index k, bool normalize, float eps, float scale,
                                float norm_min = 0.0f) {
  for (Index t = 0; t < sel.num_tokens; ++t) {
    ExpertId const* ids = sel.expert_row(t);
    float* w = sel.weight_row(t);
    float const* p = sel.scores.data() + t * sel.num_experts;
    float sum = 0.0f;
    for (Index s = 0; s < k; ++s) {
      w[s] = ids[s] >= 0 ? p[ids[s]] : 0.0f;
      sum += w[s];
    }
    if (normalize) {
      float const denom = std::max(sum + eps, norm_min);
      for (Index s = 0; s < k; ++s) w[s] = w[s] / denom;
    }
    if (scale != 1.0f) {
      for (Index s = 0; s < k; ++s) w[s] *= scale;
    }
  }
}

/// Backward of weights_from_scores: with u = dweight [T, S] (dL/dw per slot) and
/// w_j = c s_j / d, d = max(S + eps, norm_min) (normalize), or w_j = c s_j, adds dL/ds to
/// dscores [T, E]:
///   normalize, d = S + eps: ds_j += c (u_j - sum_i u_i s_i / d) / d;
///   normalize, d = norm_min (the clamp is active: d does not depend on s): ds_j += c u_j / d;
///   else ds_j += c u_j.
/// Slots dropped by a capacity limit still count in S (with u = 0), as they did in the forward.
inline void weights_from_scores_backward(Selection const& sel, Index k, bool normalize, float eps,
                                         float scale, float const* dweight,
                                         MatrixView<float> dscores, float norm_min = 0.0f) {
  Index const S = sel.slots, E = sel.num_experts;
  for (Index t = 0; t < sel.num_tokens; ++t) {
    float const* p = sel.scores.data() + t * E;
    float const* u = dweight + t * S;
    float* ds = dscores.row(t);
    if (!normalize) {
      for (Index s = 0; s < k; ++s) {
        ExpertId const e = sel.chosen_expert(t * S + s);
        if (e >= 0) ds[e] += scale * u[s];
      }
      continue;
    }
    float sum = 0.0f, dot = 0.0f;
    for (Index s = 0; s < k; ++s) {
      ExpertId const e = sel.chosen_expert(t * S + s);
      if (e < 0) continue;
      sum += p[e];
      dot += u[s] * p[e];
    }
    bool const clamped = sum + eps < norm_min;
    float const denom = clamped ? norm_min : sum + eps;
    float const mean = clamped ? 0.0f : dot / denom;
    for (Index s = 0; s < k; ++s) {
      ExpertId const e = sel.chosen_expert(t * S + s);
      if (e >= 0) ds[e] += scale * (u[s] - mean) / denom;
    }
  }
}

/// dlogits = VJP of the score function at the forward's scores:
///   softmax: dz = p * (ds - <p, ds>);  sigmoid: dz = ds * s (1 - s).
inline void score_backward(ScoreFunction f, Selection const& sel, ConstMatrixView<float> dscores,
                           MatrixView<float> dlogits) {
  Index const E = sel.num_experts;
  for (Index t = 0; t < sel.num_tokens; ++t) {
    float const* p = sel.scores.data() + t * E;
    float const* ds = dscores.row(t);
    float* dz = dlogits.row(t);
    if (f == ScoreFunction::kSoftmax) {
      float dot = 0.0f;
      for (Index e = 0; e < E; ++e) dot += p[e] * ds[e];
      for (Index e = 0; e < E; ++e) dz[e] = p[e] * (ds[e] - dot);
    } else {
      for (Index e = 0; e < E; ++e) dz[e] = ds[e] * p[e] * (1.0f - p[e]);
    }
  }
}

/// Closed form for softmax scores with renormalised top-k weights, w_i = c q_i, q_i = p_i / S:
///   dz_k += c q_k (u_k - sum_i q_i u_i) for selected k, and exactly 0 for every other expert
/// (the softmax normaliser cancels in q). Exact where the chained form leaves rounding residue.
inline void renormalized_softmax_backward(Selection const& sel, Index k, float scale,
                                          float const* dweight, MatrixView<float> dlogits) {
  Index const S = sel.slots, E = sel.num_experts;
  for (Index t = 0; t < sel.num_tokens; ++t) {
    float const* p = sel.scores.data() + t * E;
    float const* u = dweight + t * S;
    float* dz = dlogits.row(t);
    float sum = 0.0f, dot = 0.0f;
    for (Index s = 0; s < k; ++s) {
      ExpertId const e = sel.chosen_expert(t * S + s);
      if (e >= 0) sum += p[e];
    }
    for (Index s = 0; s < k; ++s) {
      ExpertId const e = sel.chosen_expert(t * S + s);
      if (e >= 0) dot += p[e] / sum * u[s];
    }
    for (Index s = 0; s < k; ++s) {
      ExpertId const e = sel.chosen_expert(t * S + s);
      if (e >= 0) dz[e] += scale * (p[e] / sum) * (u[s] - dot);
    }
  }
}

/// max(round_half_even(factor * T / E), min_capacity), the product taken in double and clamped
/// to [0, T] before the integer conversion (a huge or infinite factor means no limit, never an
/// out-of-range cast). factor > 0 and not NaN (validated by the policies).
inline Index capacity_of(float factor, Index num_tokens, Index num_experts, Index min_capacity) {
  double const c = static_cast<double>(factor) * static_cast<double>(num_tokens) /
                   static_cast<double>(num_experts);
  double r = std::nearbyint(c);
  if (!(r > 0.0)) r = 0.0;  // NaN too
  if (r > static_cast<double>(num_tokens)) r = static_cast<double>(num_tokens);
  return std::max(static_cast<Index>(r), min_capacity);
}

/// Throws unless the routed scaling factor is in (0, 1e6]: NaN, +-inf, 0 and negative values are
/// rejected (a weight of 0 or below is not a routing weight), and the bound keeps
/// scale * weight far from float overflow. Denormal scales are accepted.
inline void check_scale(char const* who, float scale) {
  check(scale > 0.0f && scale <= 1e6f, who, ": scale = ", scale,
        "; the routed scaling factor must be in (0, 1e6] (1 = unscaled)");
}

inline void check_top_k(char const* who, Index num_experts, Index top_k) {
  check(num_experts >= 1, who, ": num_experts = ", num_experts,
        "; a layer needs at least 1 expert");
  check(top_k >= 1 && top_k <= num_experts, who, ": top_k = ", top_k,
        " with num_experts = ", num_experts, "; top_k must be in [1, num_experts]");
}

}  // namespace detail
}  // namespace moe::routing
