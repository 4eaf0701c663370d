// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Pieces shared by the routing policies (not public API).
#pragma once

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
/// w /= (sum_s w + eps); then w *= scale. Empty slots keep weight 0.
inline void weights_from_scores(Selection& sel, Index k, bool normalize, float eps, float scale) {
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
      for (Index s = 0; s < k; ++s) w[s] = w[s] / (sum + eps);
    }
    if (scale != 1.0f) {
      for (Index s = 0; s < k; ++s) w[s] *= scale;
    }
  }
}

inline void check_top_k(char const* who, Index num_experts, Index top_k) {
  check(num_experts >= 1, who, ": num_experts = ", num_experts,
        "; a layer needs at least 1 expert");
  check(top_k >= 1 && top_k <= num_experts, who, ": top_k = ", top_k,
        " with num_experts = ", num_experts, "; top_k must be in [1, num_experts]");
}

}  // namespace detail
}  // namespace moe::routing
