// SPDX-License-Identifier: Apache-2.0
// Must not compile: the expert policy names no activation, so it is not an ExpertPolicy.
#include <moe/layers/moe_ffn.hpp>
#include <moe/routing/softmax_top_k.hpp>

struct BadExpert {
  using Element = float;
  static constexpr bool gated = true;
};
using Layer = moe::MoeFfn<moe::routing::SoftmaxTopK, BadExpert>;
Layer make() { return Layer(8, 8, moe::routing::SoftmaxTopK{}); }
