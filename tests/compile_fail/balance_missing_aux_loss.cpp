// SPDX-License-Identifier: Apache-2.0
// Must not compile: the balance policy has no aux_loss(), so it is not a BalancePolicy.
#include <moe/layers/moe_ffn.hpp>
#include <moe/routing/softmax_top_k.hpp>

struct BadBalance {
  double loss() const { return 0.0; }
};
using Layer = moe::MoeFfn<moe::routing::SoftmaxTopK, moe::experts::SwiGlu,
                          moe::experts::NoSharedExperts, BadBalance>;
Layer make() { return Layer(8, 8, moe::routing::SoftmaxTopK{}); }
