// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Expert activations (SiLU, exact and tanh GELU, ReLU) and the gated product act(g) * u.
#pragma once

#include <cmath>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

/// Expert activation functions, with the Hugging Face definitions (transformers/activations.py):
/// | value      | HF name                         | definition                                   |
/// |------------|---------------------------------|----------------------------------------------|
/// | kSilu      | silu, swish                     | x * sigmoid(x)                               |
/// | kGeluErf   | gelu                            | 0.5 x (1 + erf(x / sqrt 2))                  |
/// | kGeluTanh  | gelu_pytorch_tanh, gelu_new     | 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
/// | | kRelu      | relu                            | max(0, x) |
enum class Activation { kSilu, kGeluErf, kGeluTanh, kRelu };

/// The Hugging Face name of an activation (the config.json `hidden_act` value).
constexpr char const* to_string(Activation a) {
  switch (a) {
    case Activation::kSilu:
      return "silu";
    case Activation::kGeluErf:
      return "gelu";
    case Activation::kGeluTanh:
      return "gelu_pytorch_tanh";
    case Activation::kRelu:
      return "relu";
  }
  return "?";
}

namespace detail {

inline constexpr float kSqrtHalf = 0.70710678118654752440f;
inline constexpr float kSqrtTwoOverPi = 0.79788456080286535588f;
inline constexpr float kGeluCubic = 0.044715f;

/// act(x) on one batch. SiLU is x / (1 + exp(-x)): overflow-safe (exp(-x) = inf gives -0).
template <Activation A, class B>
MOE_ALWAYS_INLINE B activate(B const& x) {
  if constexpr (A == Activation::kSilu) {
    return x / (B(1.0f) + xsimd::exp(-x));
  } else if constexpr (A == Activation::kGeluErf) {
    return B(0.5f) * x * (B(1.0f) + xsimd::erf(x * B(kSqrtHalf)));
  } else if constexpr (A == Activation::kGeluTanh) {
    B const inner = B(kSqrtTwoOverPi) * xsimd::fma(B(kGeluCubic) * x * x, x, x);
    return B(0.5f) * x * (B(1.0f) + xsimd::tanh(inner));
  } else {
    return xsimd::max(x, B(0.0f));
  }
}

/// The scalar twin of activate, used for tails.
template <Activation A>
MOE_ALWAYS_INLINE float activate_scalar(float x) {
  if constexpr (A == Activation::kSilu) {
    return x / (1.0f + std::exp(-x));
  } else if constexpr (A == Activation::kGeluErf) {
    return 0.5f * x * (1.0f + std::erf(x * kSqrtHalf));
  } else if constexpr (A == Activation::kGeluTanh) {
    float const inner = kSqrtTwoOverPi * std::fma(kGeluCubic * x * x, x, x);
    return 0.5f * x * (1.0f + std::tanh(inner));
  } else {
    return x > 0.0f ? x : 0.0f;
  }
}

}  // namespace detail

/// out[i] = act(in[i]) for i in [0, n). out may alias in.
template <Activation A, class Arch = simd::DefaultArch>
void activate(float const* in, float* out, Index n) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index i = 0;
  for (; i + L <= n; i += L)
    detail::activate<A>(B::load_unaligned(in + i)).store_unaligned(out + i);
  for (; i < n; ++i) out[i] = detail::activate_scalar<A>(in[i]);
}

/// The gated linear unit product: out[i] = act(gate[i]) * up[i] for i in [0, n)
/// (SwiGLU for kSilu, GeGLU for the GELUs). out may alias gate or up.
template <Activation A, class Arch = simd::DefaultArch>
void glu(float const* gate, float const* up, float* out, Index n) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index i = 0;
  for (; i + L <= n; i += L) {
    (detail::activate<A>(B::load_unaligned(gate + i)) * B::load_unaligned(up + i))
        .store_unaligned(out + i);
  }
  for (; i < n; ++i) out[i] = detail::activate_scalar<A>(gate[i]) * up[i];
}

}  // namespace moe::kernels
