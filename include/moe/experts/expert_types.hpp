// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Expert policies: what one expert computes (gated GLU or plain MLP, and its activation).
#pragma once

#include <string>

#include "moe/kernels/activations.hpp"

namespace moe::experts {

using kernels::Activation;
using kernels::GluClamp;

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

/// gpt-oss's expert (transformers GptOssExperts; llama.cpp's swiglu_oai), a GLU whose gate and
/// up are clamped and whose up is offset by one:
///   g = W_gate x + b_gate,  u = W_up x + b_up,  g' = min(g, limit),  u' = clamp(u, -limit, limit)
///   E(x) = W_down ( g' sigmoid(alpha g') (u' + 1) ) + b_down
/// alpha and limit are run-time values of the bank (ExpertBank::glu_clamp(), default 1.702 and
/// 7 as gpt-oss's swiglu_limit); the biases are the bank's (ExpertBank::enable_biases(), which
/// any expert policy may use). Shapes as Glu.
struct ClampedSwiGlu {
  using Element = float;
  static constexpr bool gated = true;
  static constexpr Activation activation = Activation::kSilu;  ///< sigmoid-weighted, as SiLU
  static constexpr bool clamped = true;
};

/// Does expert policy X compute the clamped GLU (ClampedSwiGlu)?
template <class X>
inline constexpr bool is_clamped_glu = requires {
  requires X::clamped;
};

/// "glu/silu", "mlp/relu", "clamped_glu" ...: what an expert policy computes, for messages.
template <class X>
std::string expert_kind_name() {
  if constexpr (is_clamped_glu<X>) return "clamped_glu";
  return std::string(X::gated ? "glu/" : "mlp/") + kernels::to_string(X::activation);
}

using SwiGlu = Glu<Activation::kSilu>;           ///< silu(W_gate x) * W_up x
using GeGlu = Glu<Activation::kGeluTanh>;        ///< gelu_pytorch_tanh(W_gate x) * W_up x
using GeGluErf = Glu<Activation::kGeluErf>;      ///< gelu(W_gate x) * W_up x (exact erf GELU)
using ReluMlp = Mlp<Activation::kRelu>;          ///< W_down relu(W_up x)
using GeluMlp = Mlp<Activation::kGeluErf>;       ///< W_down gelu(W_up x)
using GeluTanhMlp = Mlp<Activation::kGeluTanh>;  ///< W_down gelu_tanh(W_up x)
using SiluMlp = Mlp<Activation::kSilu>;          ///< W_down silu(W_up x)

}  // namespace moe::experts
