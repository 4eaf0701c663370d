// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Expert activations (SiLU, exact and tanh GELU, ReLU) and the gated product act(g) * u.
#pragma once

#include <cmath>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/detail/diagnostics_push.hpp"
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

/// The run-time parameters of the clamped GLU of gpt-oss (transformers' GptOssExperts,
/// llama.cpp's swiglu_oai), per hidden unit:
///   g' = min(g, limit),   u' = clamp(u, -limit, limit),   m = g' sigmoid(alpha g') (u' + 1)
/// Backward: dg = dm (u' + 1) s (1 + alpha g' (1 - s)) where g <= limit (0 above),
/// du = dm g' s where |u| <= limit (0 outside), s = sigmoid(alpha g'); the clamps pass their
/// bounds' gradient through as torch.clamp does. NaN stays NaN (the clamps keep it).
/// Preconditions: alpha finite and > 0, limit > 0 (+inf: no clamp).
struct GluClamp {
  float alpha = 1.702f;  ///< transformers hard-codes 1.702 for gpt-oss
  float limit = 7.0f;    ///< config.json swiglu_limit (gpt-oss: 7.0)
  bool operator==(GluClamp const&) const = default;
};

namespace detail {

inline constexpr float kSqrtHalf = 0.70710678118654752440f;
inline constexpr float kSqrtTwoOverPi = 0.79788456080286535588f;
inline constexpr float kGeluCubic = 0.044715f;
inline constexpr float kInvSqrtTwoPi = 0.39894228040143267794f;

/// The clamped GLU product (GluClamp) on one batch: select keeps NaN where min/max would not.
template <class B>
MOE_ALWAYS_INLINE B clamped_glu(B g, B u, B alpha, B limit) {
  g = xsimd::select(g > limit, limit, g);
  u = xsimd::select(u > limit, limit, xsimd::select(u < -limit, -limit, u));
  return g / (B(1.0f) + xsimd::exp(-(alpha * g))) * (u + B(1.0f));
}
inline float clamped_glu_scalar(float g, float u, float alpha, float limit) {
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  return g / (1.0f + std::exp(-(alpha * g))) * (u + 1.0f);
}

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

/// act'(x) on one batch (ALGORITHMS.md section 6).
template <Activation A, class B>
MOE_ALWAYS_INLINE B activate_grad(B const& x) {
  if constexpr (A == Activation::kSilu) {
    B const s = B(1.0f) / (B(1.0f) + xsimd::exp(-x));
    return s * (B(1.0f) + x * (B(1.0f) - s));
  } else if constexpr (A == Activation::kGeluErf) {
    B const cdf = B(0.5f) * (B(1.0f) + xsimd::erf(x * B(kSqrtHalf)));
    B const pdf = B(kInvSqrtTwoPi) * xsimd::exp(B(-0.5f) * x * x);
    return cdf + x * pdf;
  } else if constexpr (A == Activation::kGeluTanh) {
    B const t = xsimd::tanh(B(kSqrtTwoOverPi) * xsimd::fma(B(kGeluCubic) * x * x, x, x));
    B const dinner = B(kSqrtTwoOverPi) * xsimd::fma(B(3.0f * kGeluCubic) * x, x, B(1.0f));
    return B(0.5f) * (B(1.0f) + t) + B(0.5f) * x * (B(1.0f) - t * t) * dinner;
  } else {
    return xsimd::select(x > B(0.0f), B(1.0f), B(0.0f));
  }
}

template <Activation A>
MOE_ALWAYS_INLINE float activate_grad_scalar(float x) {
  if constexpr (A == Activation::kSilu) {
    float const s = 1.0f / (1.0f + std::exp(-x));
    return s * (1.0f + x * (1.0f - s));
  } else if constexpr (A == Activation::kGeluErf) {
    float const cdf = 0.5f * (1.0f + std::erf(x * kSqrtHalf));
    float const pdf = kInvSqrtTwoPi * std::exp(-0.5f * x * x);
    return cdf + x * pdf;
  } else if constexpr (A == Activation::kGeluTanh) {
    float const t = std::tanh(kSqrtTwoOverPi * std::fma(kGeluCubic * x * x, x, x));
    float const dinner = kSqrtTwoOverPi * std::fma(3.0f * kGeluCubic * x, x, 1.0f);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
  } else {
    return x > 0.0f ? 1.0f : 0.0f;
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

/// Backward of activate: a[i] = act(h[i]) and dh[i] = da[i] * act'(h[i]) for i in [0, n).
/// a may be null (not stored). dh may alias da.
template <Activation A, class Arch = simd::DefaultArch>
void activate_backward(float const* h, float const* da, float* a, float* dh, Index n) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index i = 0;
  for (; i + L <= n; i += L) {
    B const x = B::load_unaligned(h + i);
    if (a) detail::activate<A>(x).store_unaligned(a + i);
    (B::load_unaligned(da + i) * detail::activate_grad<A>(x)).store_unaligned(dh + i);
  }
  for (; i < n; ++i) {
    if (a) a[i] = detail::activate_scalar<A>(h[i]);
    dh[i] = da[i] * detail::activate_grad_scalar<A>(h[i]);
  }
}

/// Backward of glu (m = act(g) * u): for i in [0, n)
///   m[i] = act(g[i]) * u[i]   (stored when m is not null)
///   dg[i] = dm[i] * u[i] * act'(g[i]),   du[i] = dm[i] * act(g[i]).
/// dg, du and m must not alias each other or the inputs.
template <Activation A, class Arch = simd::DefaultArch>
void glu_backward(float const* g, float const* u, float const* dm, float* m, float* dg, float* du,
                  Index n) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index i = 0;
  for (; i + L <= n; i += L) {
    B const x = B::load_unaligned(g + i);
    B const up = B::load_unaligned(u + i);
    B const d = B::load_unaligned(dm + i);
    B const act = detail::activate<A>(x);
    if (m) (act * up).store_unaligned(m + i);
    (d * up * detail::activate_grad<A>(x)).store_unaligned(dg + i);
    (d * act).store_unaligned(du + i);
  }
  for (; i < n; ++i) {
    float const act = detail::activate_scalar<A>(g[i]);
    if (m) m[i] = act * u[i];
    dg[i] = dm[i] * u[i] * detail::activate_grad_scalar<A>(g[i]);
    du[i] = dm[i] * act;
  }
}

/// out[i] = the clamped GLU (GluClamp) of gate[i] and up[i] for i in [0, n); out may alias
/// gate or up.
template <class Arch = simd::DefaultArch>
void clamped_glu(float const* gate, float const* up, float* out, Index n, GluClamp c) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B const alpha(c.alpha), limit(c.limit);
  Index i = 0;
  for (; i + L <= n; i += L) {
    detail::clamped_glu(B::load_unaligned(gate + i), B::load_unaligned(up + i), alpha, limit)
        .store_unaligned(out + i);
  }
  for (; i < n; ++i) out[i] = detail::clamped_glu_scalar(gate[i], up[i], c.alpha, c.limit);
}

/// Backward of clamped_glu (formulas at GluClamp): m (when not null; the forward's values, the
/// same batch arithmetic), dg and du from g, u, dm. dg, du and m must not alias each other or
/// the inputs.
template <class Arch = simd::DefaultArch>
void clamped_glu_backward(float const* g, float const* u, float const* dm, float* m, float* dg,
                          float* du, Index n, GluClamp c) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B const alpha(c.alpha), limit(c.limit), one(1.0f), zero(0.0f);
  Index i = 0;
  for (; i + L <= n; i += L) {
    B const x = B::load_unaligned(g + i), y = B::load_unaligned(u + i);
    B const d = B::load_unaligned(dm + i);
    auto const g_in = !(x > limit);
    auto const u_in = (y >= -limit) && (y <= limit);
    B const gc = xsimd::select(g_in, x, limit);
    B const uc = xsimd::select(y > limit, limit, xsimd::select(y < -limit, -limit, y));
    if (m) detail::clamped_glu(x, y, alpha, limit).store_unaligned(m + i);
    B const s = one / (one + xsimd::exp(-(alpha * gc)));
    B const ds = s * (one + alpha * gc * (one - s));
    xsimd::select(g_in, d * (uc + one) * ds, zero).store_unaligned(dg + i);
    xsimd::select(u_in, d * (gc * s), zero).store_unaligned(du + i);
  }
  for (; i < n; ++i) {
    bool const g_in = !(g[i] > c.limit);
    bool const u_in = u[i] >= -c.limit && u[i] <= c.limit;
    float const gc = g_in ? g[i] : c.limit;
    float const uc = u[i] > c.limit ? c.limit : (u[i] < -c.limit ? -c.limit : u[i]);
    if (m) m[i] = detail::clamped_glu_scalar(g[i], u[i], c.alpha, c.limit);
    float const s = 1.0f / (1.0f + std::exp(-(c.alpha * gc)));
    float const ds = s * (1.0f + c.alpha * gc * (1.0f - s));
    dg[i] = g_in ? dm[i] * (uc + 1.0f) * ds : 0.0f;
    du[i] = u_in ? dm[i] * (gc * s) : 0.0f;
  }
}

}  // namespace moe::kernels

#include "moe/kernels/detail/diagnostics_pop.hpp"
