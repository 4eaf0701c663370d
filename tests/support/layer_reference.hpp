// SPDX-License-Identifier: Apache-2.0
// Reference forward of a whole MoeFfn layer in double, from a routing and the layer's weights.
#pragma once

#include <vector>

#include "support/reference.hpp"

namespace ref {

/// One expert e of a bank, in double.
template <class Bank>
std::vector<double> bank_expert(Bank const& bank, Index e, float const* x, Bf16Rounding bf16 = {}) {
  moe::ConstMatrixView<float> gate;
  if constexpr (Bank::Expert::gated) gate = bank.gate_proj(e);
  return expert(gate, bank.up_proj(e), bank.down_proj(e), Bank::Expert::activation, x, bf16);
}

/// y[t] = sum over the token's (expert, weight) pairs of w E_e(x_t) + shared experts, in double
/// (experts' operands rounded as `bf16` says; shared gates and routing stay exact).
template <class Layer>
std::vector<double> layer_forward(Layer const& layer, moe::ConstMatrixView<float> x,
                                  Routing const& routing, Bf16Rounding bf16 = {}) {
  Index const T = x.rows, D = x.cols;
  std::vector<double> y(static_cast<std::size_t>(T * D), 0.0);
  for (Index t = 0; t < T; ++t) {
    for (auto [e, w] : routing[t]) {
      auto o = bank_expert(layer.experts(), e, x.row(t), bf16);
      for (Index d = 0; d < D; ++d) y[t * D + d] += w * o[d];
    }
    if constexpr (Layer::Shared::has_experts) {
      auto const& sh = layer.shared_experts();
      for (Index s = 0; s < sh.count(); ++s) {
        auto o = bank_expert(sh.bank(), s, x.row(t), bf16);
        double g = 1.0;
        if constexpr (Layer::Shared::gated) {
          double z = 0.0;
          for (Index d = 0; d < D; ++d) z += static_cast<double>(sh.gate_weight()(s, d)) * x(t, d);
          g = sigmoid(z);
        }
        for (Index d = 0; d < D; ++d) y[t * D + d] += g * o[d];
      }
    }
  }
  return y;
}

}  // namespace ref
