// SPDX-License-Identifier: Apache-2.0
// Must not compile: the router has no select(), so it is not a RouterPolicy.
#include <moe/layers/moe_ffn.hpp>

struct BadRouter {
  moe::Index expert_count() const { return 4; }
  moe::Index slots_per_token() const { return 1; }
  void validate() const {}
};
using Layer = moe::MoeFfn<BadRouter, moe::experts::SwiGlu>;
Layer make() { return Layer(8, 8, BadRouter{}); }
