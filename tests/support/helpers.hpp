// SPDX-License-Identifier: Apache-2.0
// Test helpers: seeded data, comparisons against the reference, a reference MoE layer forward.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "moe/core/random.hpp"
#include "moe/core/selection.hpp"
#include "support/reference.hpp"

namespace test {

/// An MoE FFN layer's weights uniform: experts and shared experts in [-0.5, 0.5), router and
/// shared-expert gate in [-1, 1), from `seed` on.
template <class Layer>
void randomize_ffn(Layer& layer, std::uint64_t seed) {
  moe::fill_uniform(layer.experts().edit().parameters(), -0.5f, 0.5f, seed);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -1.0f,
                    1.0f, seed + 1);
  if constexpr (Layer::Shared::has_experts) {
    moe::fill_uniform(layer.shared_experts().bank().edit().parameters(), -0.5f, 0.5f, seed + 2);
    auto g = layer.shared_experts().gate_weight();
    moe::fill_uniform(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)), -1.0f,
                      1.0f, seed + 3);
  }
}

using moe::Index;

/// The tail sizes of STYLE.md section 6.9 for lane count L, deduplicated and sorted.
inline std::vector<Index> tail_sizes(Index L) {
  std::vector<Index> n = {0,  1,  2,  L - 1, L,  L + 1, 2 * L + 3, 15,
                          16, 17, 63, 64,    65, 127,   128,       129};
  std::sort(n.begin(), n.end());
  n.erase(std::unique(n.begin(), n.end()), n.end());
  n.erase(std::remove_if(n.begin(), n.end(), [](Index v) { return v < 0; }), n.end());
  return n;
}

inline std::vector<float> random_vector(Index n, std::uint64_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  moe::fill_uniform(v, lo, hi, seed);
  return v;
}

/// The non-empty slots of each token of a Selection, as (expert, weight) pairs in slot order.
inline ref::Routing routing_of(moe::Selection const& sel) {
  ref::Routing r(static_cast<std::size_t>(sel.num_tokens));
  for (Index t = 0; t < sel.num_tokens; ++t) {
    for (Index s = 0; s < sel.slots; ++s) {
      if (sel.expert_row(t)[s] >= 0) r[t].emplace_back(sel.expert_row(t)[s], sel.weight_row(t)[s]);
    }
  }
  return r;
}

/// Same experts in the same order, weights within rel/abs tolerance.
inline void require_same_routing(ref::Routing const& got, ref::Routing const& want,
                                 double tol = 1e-5) {
  REQUIRE(got.size() == want.size());
  for (std::size_t t = 0; t < got.size(); ++t) {
    INFO("token " << t);
    REQUIRE(got[t].size() == want[t].size());
    for (std::size_t s = 0; s < got[t].size(); ++s) {
      INFO("slot " << s);
      REQUIRE(got[t][s].first == want[t][s].first);
      REQUIRE(got[t][s].second == Approx(want[t][s].second).epsilon(tol).margin(tol * 1e-2));
    }
  }
}

/// max |a - b| / max(1, max |b|).
inline double max_rel_diff(float const* a, std::vector<double> const& b) {
  double scale = 1.0, diff = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) scale = std::max(scale, std::fabs(b[i]));
  for (std::size_t i = 0; i < b.size(); ++i) diff = std::max(diff, std::fabs(a[i] - b[i]));
  return diff / scale;
}

}  // namespace test
