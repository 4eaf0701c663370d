// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The parameter list and gradient buffers of the MoE FFN layers (MoeFfn and
/// ExpertParallelMoeFfn). Not public API: use the layers' Gradients and parameters().
#pragma once

#include <algorithm>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/parameters.hpp"

namespace moe::detail {

/// "router.weight", "experts" (every in_proj block, then every down_proj block) and, with
/// shared experts, "shared_experts" and "shared_experts.gate".
template <class V, class Bank, class Shared>
ParameterList ffn_parameters(V& router_weight, Bank& bank, Shared& shared) {
  ParameterList list;
  list.push_back({"router.weight", std::span<float>(router_weight)});
  list.push_back({"experts", bank.parameters()});
  if constexpr (Shared::has_experts) {
    list.push_back({"shared_experts", shared.bank().parameters()});
    auto g = shared.gate_weight();
    list.push_back({"shared_experts.gate",
                    std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols))});
  }
  return list;
}

/// Gradients of an MoE FFN layer's parameters, each buffer shaped like its parameter;
/// `groups()` lists them in the order of the layer's parameters().
template <class Bank, class Shared>
struct FfnGradients {
  std::vector<float> router_weight;  ///< [E, D]
  Bank experts;                      ///< same shapes as the layer's (routed, local) experts
  Shared shared;                     ///< same shapes as the layer's shared experts
  void zero() {
    for (auto& p : groups()) std::fill(p.values.begin(), p.values.end(), 0.0f);
  }
  ParameterList groups() { return ffn_parameters(router_weight, experts, shared); }
};

/// Zero gradients shaped like (router_weight, bank, shared).
template <class Grads, class Bank, class Shared>
Grads make_ffn_gradients(std::size_t router_size, Bank const& bank, Shared const& shared) {
  Grads g;
  g.router_weight.assign(router_size, 0.0f);
  g.experts = Bank(bank.num_experts(), bank.d_model(), bank.d_ffn());
  if constexpr (Shared::has_experts) {
    g.shared = Shared(shared.count(), shared.bank().d_model(), shared.bank().d_ffn());
  }
  return g;
}

/// Throws moe::Error (who: the layer's name) unless `g` is shaped like the layer's parameters.
template <class Grads, class Bank, class Shared>
void check_ffn_gradients(Grads const& g, std::size_t router_size, Bank const& bank,
                         Shared const& shared, char const* who) {
  bool ok = g.router_weight.size() == router_size &&
            g.experts.num_experts() == bank.num_experts() &&
            g.experts.d_model() == bank.d_model() && g.experts.d_ffn() == bank.d_ffn();
  if constexpr (Shared::has_experts) {
    ok = ok && g.shared.count() == shared.count() &&
         g.shared.bank().d_ffn() == shared.bank().d_ffn() &&
         g.shared.bank().d_model() == shared.bank().d_model() &&
         g.shared.gate_weight().rows == shared.gate_weight().rows;
  }
  check(ok, who,
        "::backward: the gradients are not shaped like this layer's parameters (another "
        "layer's?); make them with this layer's make_gradients()");
}

}  // namespace moe::detail
