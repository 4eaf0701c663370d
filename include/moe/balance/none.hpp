// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// balance::None: no load-balancing objective.
#pragma once

#include "moe/core/concepts.hpp"

namespace moe::balance {

/// No auxiliary loss: aux_loss = 0, no gradient.
struct None {
  double aux_loss(BalanceInputs const&) const { return 0.0; }
  void backward(BalanceInputs const&, BalanceGradients&) const {}
};

static_assert(BalancePolicy<None>);

}  // namespace moe::balance
