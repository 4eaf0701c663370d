// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Shared experts: experts every token goes through, ungated (DeepSeek) or sigmoid-gated
/// (Qwen2-MoE).
#pragma once

#include <span>
#include <vector>

#include "moe/core/concepts.hpp"
#include "moe/experts/expert_bank.hpp"

namespace moe::experts {

/// No shared experts (Mixtral, Qwen3-MoE, OLMoE).
struct NoSharedExperts {
  static constexpr bool has_experts = false;
  static constexpr bool gated = false;
  Index count() const { return 0; }
};

/// `count` shared experts that every token goes through, added to the routed output:
///   ungated (DeepSeek-V2/V3):  y_t += sum_s S_s(x_t)
///   gated (Qwen2-MoE, Qwen3-Next): y_t += sum_s sigmoid(<g_s, x_t>) * S_s(x_t)
/// Shapes: bank with `count` experts of width D -> F_shared -> D; gate_weight [count, D] (gated
/// only; Qwen2-MoE's shared_expert_gate is Linear(D, 1, bias=False), i.e. count = 1).
/// DeepSeek-V3's n_shared_experts = n is one expert of width n * moe_intermediate_size.
template <ExpertPolicy Expert_, bool Gated>
class SharedExperts {
 public:
  using Expert = Expert_;
  static constexpr bool has_experts = true;
  static constexpr bool gated = Gated;

  SharedExperts() = default;
  SharedExperts(Index count, Index d_model, Index d_ffn)
      : bank_(count, d_model, d_ffn),
        gate_(Gated ? static_cast<std::size_t>(count * d_model) : 0, 0.0f) {}

  Index count() const { return bank_.num_experts(); }
  ExpertBank<Expert>& bank() { return bank_; }
  ExpertBank<Expert> const& bank() const { return bank_; }
  /// [count, D] gate projection (empty view when ungated).
  MatrixView<float> gate_weight() { return {gate_.data(), Gated ? count() : 0, bank_.d_model()}; }
  ConstMatrixView<float> gate_weight() const {
    return {gate_.data(), Gated ? count() : 0, bank_.d_model()};
  }

 private:
  ExpertBank<Expert> bank_;
  std::vector<float> gate_;
};

template <ExpertPolicy Expert>
using UngatedSharedExperts = SharedExperts<Expert, false>;
template <ExpertPolicy Expert>
using GatedSharedExperts = SharedExperts<Expert, true>;

}  // namespace moe::experts
