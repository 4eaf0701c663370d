// SPDX-License-Identifier: Apache-2.0
// Sanity pair of the compile-fail tests: this file must compile (it proves the harness builds
// a well-formed layer, so a failure of the other files comes from their one misuse).
#include <moe/layers/moe_ffn.hpp>
#include <moe/routing/softmax_top_k.hpp>

using Layer = moe::MoeFfn<moe::routing::SoftmaxTopK, moe::experts::SwiGlu>;
Layer make() { return Layer(8, 8, moe::routing::SoftmaxTopK{}); }
