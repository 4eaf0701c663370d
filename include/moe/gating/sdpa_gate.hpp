// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The head-specific sigmoid gate on the SDPA output ("Gated Attention for LLMs", Qiu et al.
/// 2025, position G1; Qwen3-Next): policy tags NoGate, HeadwiseGate and ElementwiseGate.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>

#include "moe/core/types.hpp"
#include "moe/kernels/softmax.hpp"

namespace moe::gating {

/// How many gate logits each head gets.
enum class GateKind {
  kNone,         ///< no gate: O = SDPA(Q, K, V)
  kHeadwise,     ///< one logit per head:     O_h = A_h * sigmoid(gamma_h)
  kElementwise,  ///< head_dim logits per head: O_hd = A_hd * sigmoid(gamma_hd)
};

/// A SDPA output gate policy (compile-time choice of a GatedAttention or MoeAttention layer).
/// Requirements: `G::kind` (GateKind), `G::width(head_dim)` (gate logits per head: 0, 1 or
/// head_dim), and on one token's row of `heads` heads:
///   `G::forward(a, gamma, s, out, heads, head_dim)`:   s = sigmoid(gamma) [heads * width],
///        out = a * s (broadcast over head_dim when headwise); a, out [heads * head_dim]
///   `G::backward(a, s, dout, da, dgamma, heads, head_dim)`:
///        da = dout * s,  dgamma = sum_{d in gate} dout * a * s (1 - s)
/// out may alias a, s may alias gamma, da may alias dout.
template <class G>
concept SdpaGatePolicy = requires(float const* c, float* m, Index n) {
  { G::kind } -> std::convertible_to<GateKind>;
  { G::width(n) } -> std::convertible_to<Index>;
  G::forward(c, c, m, m, n, n);
  G::backward(c, c, c, m, m, n, n);
};

/// No gate: O = SDPA(Q, K, V) (the ungated baseline; Qwen3, Llama).
struct NoGate {
  static constexpr GateKind kind = GateKind::kNone;
  static constexpr char const* name = "none";
  static constexpr Index width(Index) { return 0; }
  static void forward(float const* a, float const*, float*, float* out, Index heads,
                      Index head_dim) {
    if (out != a) std::copy(a, a + heads * head_dim, out);
  }
  static void backward(float const*, float const*, float const* dout, float* da, float*,
                       Index heads, Index head_dim) {
    if (da != dout) std::copy(dout, dout + heads * head_dim, da);
  }
};

/// Headwise sigmoid gate, one scalar per head: O_h = A_h * sigmoid(gamma_h), gamma = x W_g,
/// W_g [heads, D] (qiuzh20/gated_attention `headwise_attn_output_gate`).
///   dA_h = dO_h s_h;  dgamma_h = s_h (1 - s_h) sum_d dO_hd A_hd
struct HeadwiseGate {
  static constexpr GateKind kind = GateKind::kHeadwise;
  static constexpr char const* name = "headwise";
  static constexpr Index width(Index) { return 1; }
  static void forward(float const* a, float const* gamma, float* s, float* out, Index heads,
                      Index head_dim) {
    kernels::sigmoid_rows(gamma, heads, s, heads, 1, heads);
    for (Index h = 0; h < heads; ++h) {
      for (Index d = 0; d < head_dim; ++d) out[h * head_dim + d] = a[h * head_dim + d] * s[h];
    }
  }
  static void backward(float const* a, float const* s, float const* dout, float* da, float* dgamma,
                       Index heads, Index head_dim) {
    for (Index h = 0; h < heads; ++h) {
      float dot = 0.0f;
      for (Index d = 0; d < head_dim; ++d) {
        Index const i = h * head_dim + d;
        dot = std::fma(dout[i], a[i], dot);
        da[i] = dout[i] * s[h];
      }
      dgamma[h] = dot * s[h] * (1.0f - s[h]);
    }
  }
};

/// Elementwise sigmoid gate, one scalar per output element: O = A * sigmoid(gamma), gamma = x W_g,
/// W_g [heads * head_dim, D] (qiuzh20 `elementwise_attn_output_gate`; HF Qwen3-Next).
///   dA = dO s;  dgamma = dO A s (1 - s)
struct ElementwiseGate {
  static constexpr GateKind kind = GateKind::kElementwise;
  static constexpr char const* name = "elementwise";
  static constexpr Index width(Index head_dim) { return head_dim; }
  static void forward(float const* a, float const* gamma, float* s, float* out, Index heads,
                      Index head_dim) {
    Index const n = heads * head_dim;
    kernels::sigmoid_rows(gamma, n, s, n, 1, n);
    for (Index i = 0; i < n; ++i) out[i] = a[i] * s[i];
  }
  static void backward(float const* a, float const* s, float const* dout, float* da, float* dgamma,
                       Index heads, Index head_dim) {
    Index const n = heads * head_dim;
    for (Index i = 0; i < n; ++i) {
      float const g = dout[i];
      dgamma[i] = g * a[i] * s[i] * (1.0f - s[i]);
      da[i] = g * s[i];
    }
  }
};

static_assert(SdpaGatePolicy<NoGate>);
static_assert(SdpaGatePolicy<HeadwiseGate>);
static_assert(SdpaGatePolicy<ElementwiseGate>);

}  // namespace moe::gating
