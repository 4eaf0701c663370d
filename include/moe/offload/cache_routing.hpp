// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Cache-aware routing (CECAR-style, guarded): a token's low-ranked experts that are not in the
/// expert cache may be swapped for cached ones the router scored almost as high. Off by
/// default; a decoder with streamed experts applies it between routing and reading
/// (models::Decoder, offload::StreamerOptions::cache_routing).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"

namespace moe::offload {

/// The guarded rule of cache-aware routing. For each token, in its selection's slot order:
/// - the top `keep_top` (J) experts are never replaced;
/// - a substitute comes only from the router's `candidates` (M) highest logits, is not selected
///   already, and is resident (in the cache, or being read into it);
/// - a swap of selected expert a for substitute b needs logit(a) - logit(b) <= tau * (the
///   token's largest logit - its smallest);
/// - the substitute takes a's routing weight as it is (no renormalisation: substituting and
///   renormalising is what degrades quality most in published measurements);
/// - at most `max_swaps` swaps a token, the lowest-ranked non-resident experts first, each for
///   the highest-logit resident substitute.
/// Disabled (the default), routing is exactly the router's.
struct CacheRoutingOptions {
  bool enabled = false;
  Index keep_top = 1;     ///< J >= 0
  Index candidates = 16;  ///< M >= 1 (clamped to the experts)
  float tau = 0.05f;      ///< in [0, 1]
  Index max_swaps = 1;    ///< >= 0
  void check() const {
    moe::detail::check(
        keep_top >= 0 && candidates >= 1 && max_swaps >= 0 && tau >= 0.0f && tau <= 1.0f,
        "moe::offload::CacheRoutingOptions: keep_top ", keep_top, ", candidates ", candidates,
        ", tau ", tau, ", max_swaps ", max_swaps,
        "; need keep_top >= 0, candidates >= 1, tau in [0, 1], max_swaps >= 0");
  }
};

/// Parses "tau=0.05,keep=1,candidates=16,swaps=1" (any subset, any order) into enabled
/// options; "off" disables. Throws moe::Error naming the bad item.
inline CacheRoutingOptions parse_cache_routing(std::string const& text) {
  CacheRoutingOptions o;
  if (text == "off") return o;
  o.enabled = true;
  std::size_t p = 0;
  while (p <= text.size()) {
    std::size_t const q = std::min(text.find(',', p), text.size());
    std::string const item = text.substr(p, q - p);
    std::size_t const eq = item.find('=');
    std::string const key = item.substr(0, eq == std::string::npos ? item.size() : eq);
    std::string const value = eq == std::string::npos ? std::string() : item.substr(eq + 1);
    char* end = nullptr;
    double const v = std::strtod(value.c_str(), &end);
    bool const number = !value.empty() && end == value.c_str() + value.size() && std::isfinite(v);
    bool const whole = number && v == std::floor(v) && v >= 0 && v <= 1e6;
    if (key == "tau" && number) {
      o.tau = static_cast<float>(v);
    } else if (key == "keep" && whole) {
      o.keep_top = static_cast<Index>(v);
    } else if (key == "candidates" && whole) {
      o.candidates = static_cast<Index>(v);
    } else if (key == "swaps" && whole) {
      o.max_swaps = static_cast<Index>(v);
    } else {
      moe::detail::fail("cache-aware routing: '", item,
                        "' is not tau=X, keep=N, candidates=N or swaps=N (e.g. "
                        "\"tau=0.05,keep=1,candidates=16,swaps=1\", or \"off\")");
    }
    p = q + 1;
  }
  o.check();
  return o;
}

/// The rule for one token: `ids` its experts in rank order (-1: an empty slot, left alone),
/// `logit(e)` the router's logit of expert e, `substitutes` the router's top-M experts best
/// first, `range` the token's largest logit minus its smallest, `resident(e)` whether e is
/// cached. Swaps in place; returns how many.
template <class Logit, class Resident>
Index swap_token(std::span<ExpertId> ids, Logit const& logit, std::span<ExpertId const> substitutes,
                 float range, Resident const& resident, CacheRoutingOptions const& o) {
  if (!o.enabled) return 0;
  auto const S = static_cast<Index>(ids.size());
  Index done = 0;
  for (Index s = S - 1; s >= o.keep_top && done < o.max_swaps; --s) {
    ExpertId const a = ids[static_cast<std::size_t>(s)];
    if (a < 0 || resident(a)) continue;
    for (ExpertId const b : substitutes) {
      if (logit(a) - logit(b) > o.tau * range) break;  // the candidates only fall from here
      if (!resident(b) || std::find(ids.begin(), ids.end(), b) != ids.end()) continue;
      ids[static_cast<std::size_t>(s)] = b;
      ++done;
      break;
    }
  }
  return done;
}

/// Applies the rule to `sel` (token-choice routing: each token's slots in rank order) given the
/// router's `logits` [T, E] and `resident(e)`; returns the number of swaps. The weights, the
/// scores and the empty slots stay as they are; rebuild the routing plan after a swap
/// (kernels::build_plan).
template <class Resident>
Index cache_aware_swap(Selection& sel, ConstMatrixView<float> logits, Resident const& resident,
                       CacheRoutingOptions const& o, std::vector<ExpertId>& scratch) {
  if (!o.enabled || o.max_swaps == 0) return 0;
  Index const T = sel.num_tokens, S = sel.slots, E = sel.num_experts;
  moe::detail::check(logits.rows == T && logits.cols == E, "cache_aware_swap: logits are [",
                     logits.rows, ", ", logits.cols, "] for a selection of ", T, " tokens over ", E,
                     " experts");
  Index const M = std::min(o.candidates, E);
  Index swaps = 0;
  for (Index t = 0; t < T; ++t) {
    float const* z = logits.row(t);
    float const range = *std::max_element(z, z + E) - *std::min_element(z, z + E);
    // The M highest logits (ties to the lower expert): the substitutes, best first.
    scratch.resize(static_cast<std::size_t>(E));
    for (Index e = 0; e < E; ++e) scratch[static_cast<std::size_t>(e)] = static_cast<ExpertId>(e);
    std::partial_sort(
        scratch.begin(), scratch.begin() + M, scratch.end(),
        [&](ExpertId a, ExpertId b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
    swaps += swap_token(
        std::span<ExpertId>(sel.expert.data() + t * S, static_cast<std::size_t>(S)),
        [&](ExpertId e) { return z[e]; },
        std::span<ExpertId const>(scratch.data(), static_cast<std::size_t>(M)), range, resident, o);
  }
  return swaps;
}

}  // namespace moe::offload
