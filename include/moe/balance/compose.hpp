// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Compose: several balance policies in one layer, losses and gradients summed.
#pragma once

#include <tuple>

#include "moe/core/concepts.hpp"

namespace moe::balance {

/// Several balance policies at once: aux_loss = sum of the parts' losses, gradients summed,
/// observe and end_step forwarded to every part that has them (in order).
/// Example: `Compose<HfLoadBalancing, ZLoss>` (Mixtral-style training with a z-loss).
template <BalancePolicy... Parts>
struct Compose {
  std::tuple<Parts...> parts;

  template <std::size_t I>
  auto& get() {
    return std::get<I>(parts);
  }

  /// Validates every part that has a validate().
  void validate() const {
    std::apply(
        [](auto const&... p) {
          (
              [](auto const& q) {
                if constexpr (requires { q.validate(); }) q.validate();
              }(p),
              ...);
        },
        parts);
  }

  double aux_loss(BalanceInputs const& in) const {
    return std::apply(
        [&](auto const&... p) { return (0.0 + ... + static_cast<double>(p.aux_loss(in))); }, parts);
  }
  void backward(BalanceInputs const& in, BalanceGradients& g) const {
    std::apply([&](auto const&... p) { (p.backward(in, g), ...); }, parts);
  }
  void observe(BalanceInputs const& in) {
    std::apply(
        [&](auto&... p) {
          (
              [&](auto& q) {
                if constexpr (requires { q.observe(in); }) q.observe(in);
              }(p),
              ...);
        },
        parts);
  }
  template <class Router>
  void end_step(Router& router) {
    std::apply(
        [&](auto&... p) {
          (
              [&](auto& q) {
                if constexpr (requires { q.end_step(router); }) q.end_step(router);
              }(p),
              ...);
        },
        parts);
  }
};

}  // namespace moe::balance
