// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Expert policies: what one expert computes (gated GLU or plain MLP, and its activation).
#pragma once

#include "moe/kernels/activations.hpp"

namespace moe::experts {

using kernels::Activation;

/// Gated-linear-unit expert, no biases (Hugging Face *MLP of Mixtral, Qwen, DeepSeek, OLMoE):
///   E(x) = W_down ( act(W_gate x) * (W_up x) )
/// Shapes: x [D], W_gate and W_up [F, D], W_down [D, F]. Mixtral names them w1 (gate), w3 (up),
/// w2 (down). `Glu<kSilu>` is SwiGLU; `Glu<kGeluTanh>` / `Glu<kGeluErf>` are GeGLU.
template <Activation Act>
struct Glu {
  using Element = float;
  static constexpr bool gated = true;
  static constexpr Activation activation = Act;
};

/// Plain two-layer expert, no biases: E(x) = W_down act(W_up x).
/// Shapes: W_up [F, D], W_down [D, F] (Switch Transformers' wi / wo with ReLU).
template <Activation Act>
struct Mlp {
  using Element = float;
  static constexpr bool gated = false;
  static constexpr Activation activation = Act;
};

using SwiGlu = Glu<Activation::kSilu>;           ///< silu(W_gate x) * W_up x
using GeGlu = Glu<Activation::kGeluTanh>;        ///< gelu_pytorch_tanh(W_gate x) * W_up x
using GeGluErf = Glu<Activation::kGeluErf>;      ///< gelu(W_gate x) * W_up x (exact erf GELU)
using ReluMlp = Mlp<Activation::kRelu>;          ///< W_down relu(W_up x)
using GeluMlp = Mlp<Activation::kGeluErf>;       ///< W_down gelu(W_up x)
using GeluTanhMlp = Mlp<Activation::kGeluTanh>;  ///< W_down gelu_tanh(W_up x)
using SiluMlp = Mlp<Activation::kSilu>;          ///< W_down silu(W_up x)

}  // namespace moe::experts
