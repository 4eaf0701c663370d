// SPDX-License-Identifier: Apache-2.0
// Must not compile: claims to have shared experts but provides no bank().
#include <moe/layers/moe_ffn.hpp>
#include <moe/routing/softmax_top_k.hpp>

struct BadShared {
  static constexpr bool has_experts = true;
  static constexpr bool gated = false;
  moe::Index count() const { return 1; }
};
using Layer = moe::MoeFfn<moe::routing::SoftmaxTopK, moe::experts::SwiGlu, BadShared>;
Layer make() { return Layer(8, 8, moe::routing::SoftmaxTopK{}); }
