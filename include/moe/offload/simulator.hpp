// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Trace-driven simulation of the expert cache: moe::offload::simulate replays a Trace through an
/// ExpertCache with a given EvictionPolicy and budget and reports hit rate, bytes and misses per
/// token and the I/O ceiling in tokens/s at a read bandwidth.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/offload/cache.hpp"
#include "moe/offload/cache_routing.hpp"
#include "moe/offload/trace.hpp"

namespace moe::offload {

/// For every access of `trace` (index step * K + rank), the step of the next access of the same
/// (layer, expert), or kNeverUsedAgain. What Belady's MIN needs; O(steps K) time and memory.
inline std::vector<Index> next_use_steps(Trace const& trace) {
  TraceShape const& s = trace.shape();
  auto const k = static_cast<std::size_t>(s.top_k);
  std::vector<Index> next(trace.expert_ids().size(), kNeverUsedAgain);
  std::vector<Index> upcoming(static_cast<std::size_t>(s.num_layers * s.num_experts),
                              kNeverUsedAgain);
  for (Index i = trace.num_steps() - 1; i >= 0; --i) {
    TraceRecord const r = trace.step(i);
    for (std::size_t j = 0; j < k; ++j) {
      auto const slot = static_cast<std::size_t>(r.layer * s.num_experts + r.experts[j]);
      next[static_cast<std::size_t>(i) * k + j] = upcoming[slot];
      upcoming[slot] = i;
    }
  }
  return next;
}

/// How simulate replays a trace.
struct SimulationOptions {
  /// Tokens replayed before counting (the cache fills during them); must be < the trace's tokens.
  Index warmup_tokens = 100;
  /// Read bandwidth for the I/O ceiling, bytes/s (3e9: a PCIe 3 NVMe drive).
  double bandwidth_bytes_per_s = 3e9;
  /// Cache-aware routing replayed on the trace (off: the trace's routing). Each step's experts
  /// are rewritten by the rule before its accesses, with the trace's candidates as the
  /// substitutes and log(score) as the logits (the range: over the M candidates only). The
  /// later steps stay as traced (a trace cannot say how the swap changes the model's next
  /// routing). Needs candidates in the trace; not with Belady (its future is the trace's).
  CacheRoutingOptions cache_routing;
};

/// What simulate measured over the tokens after the warm-up.
struct SimulationResult {
  std::string policy;              ///< the policy's name()
  std::uint64_t budget_bytes = 0;  ///< the cache's budget
  Index measured_tokens = 0;       ///< tokens counted (trace tokens - warm-up)
  std::int64_t accesses = 0;       ///< expert accesses counted (measured_tokens * L * K)
  std::int64_t hits = 0;           ///< of which resident
  std::int64_t misses = 0;         ///< read and cached
  std::int64_t bypasses = 0;       ///< read, not cached
  std::uint64_t bytes_read = 0;    ///< bytes of the misses and bypasses
  double hit_rate = 0;             ///< hits / accesses
  double misses_per_token = 0;     ///< (misses + bypasses) / measured_tokens
  double bytes_per_token = 0;      ///< bytes_read / measured_tokens
  /// bandwidth / bytes_per_token: the decode rate the reads alone allow (infinity if no reads).
  double io_ceiling_tokens_per_s = 0;
  std::int64_t swaps = 0;  ///< cache-aware routing's swaps (counted steps)
  /// The share of the counted steps' gate weight that went to substitutes (a first-order measure
  /// of how far cache-aware routing moves the layer outputs).
  double swapped_weight = 0;
};

/// Replays `trace` through an ExpertCache<Policy>(geometry, policy): per step, begin_step, then
/// one access per selected expert in rank order, all pinned until the step ends (a kernel reads
/// the step's experts together). Counts after `options.warmup_tokens`. `next_uses` (from
/// next_use_steps(trace), computed here when empty) feeds AccessContext::next_use_step, so every
/// policy may see the future but only Belady uses it. Deterministic.
/// Preconditions: geometry is L x E of the trace; warmup_tokens < trace tokens.
template <EvictionPolicy Policy>
SimulationResult simulate(Trace const& trace, CacheGeometry const& geometry, Policy policy,
                          SimulationOptions const& options = {},
                          std::vector<Index> const& next_uses = {}) {
  TraceShape const& s = trace.shape();
  char const* where = "moe::offload::simulate";
  moe::detail::check(geometry.num_layers == s.num_layers && geometry.num_experts == s.num_experts,
                     where, ": the cache is ", geometry.num_layers, " x ", geometry.num_experts,
                     " but the trace has ", s.num_layers, " layers of ", s.num_experts, " experts");
  moe::detail::check(options.warmup_tokens >= 0 && options.warmup_tokens < trace.num_tokens(),
                     where, ": warmup_tokens ", options.warmup_tokens,
                     " must be in [0, tokens of the trace = ", trace.num_tokens(), ")");
  moe::detail::check(options.bandwidth_bytes_per_s > 0, where, ": bandwidth must be > 0");
  std::vector<Index> computed;
  if (next_uses.empty()) computed = next_use_steps(trace);
  std::vector<Index> const& next = next_uses.empty() ? computed : next_uses;
  moe::detail::check(next.size() == trace.expert_ids().size(), where,
                     ": next_uses does not match the trace");

  CacheRoutingOptions const& cr = options.cache_routing;
  cr.check();
  moe::detail::check(!cr.enabled || (s.num_candidates > 0 && Policy::name() != "belady"), where,
                     ": cache-aware routing needs a trace with candidates and an online policy "
                     "(Belady's future is the trace's routing)");
  ExpertCache<Policy> cache(geometry, std::move(policy));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(s.top_k));
  std::vector<std::int32_t> subs;
  double weight = 0.0, moved = 0.0;
  SimulationResult out;
  out.policy = std::string(Policy::name());
  out.budget_bytes = geometry.budget_bytes;
  auto const k = static_cast<std::size_t>(s.top_k);
  Index const first = options.warmup_tokens * s.num_layers;
  for (Index i = 0; i < trace.num_steps(); ++i) {
    TraceRecord r = trace.step(i);
    bool const counted = i >= first;
    if (cr.enabled) {
      std::copy(r.experts.begin(), r.experts.end(), ids.begin());
      auto logit = [&](std::int32_t e) {
        for (std::size_t m = 0; m < r.candidates.size(); ++m) {
          if (r.candidates[m] == e) return std::log(std::max(r.candidate_scores[m], 1e-30f));
        }
        return -std::numeric_limits<float>::infinity();  // outside the top-M: never close
      };
      // The substitutes best first (a trace records its candidates in rank order; sorted here
      // anyway, ties to the lower expert).
      subs.assign(r.candidates.begin(), r.candidates.end());
      std::stable_sort(subs.begin(), subs.end(),
                       [&](std::int32_t a, std::int32_t b) { return logit(a) > logit(b); });
      if (static_cast<Index>(subs.size()) > cr.candidates)
        subs.resize(static_cast<std::size_t>(cr.candidates));
      float lo = logit(subs.front());
      for (std::int32_t const c : r.candidates) lo = std::min(lo, logit(c));
      Index const n = swap_token(
          std::span<std::int32_t>(ids), logit, std::span<std::int32_t const>(subs),
          logit(subs.front()) - lo,
          [&](std::int32_t e) {
            return cache.resident({static_cast<std::int32_t>(r.layer), e});
          },
          cr);
      if (counted) {
        out.swaps += n;
        for (std::size_t j = 0; j < k; ++j) {
          weight += r.gates[j];
          if (ids[j] != r.experts[j]) moved += r.gates[j];
        }
      }
      r.experts = ids;
    }
    cache.begin_step({i, r});
    for (std::size_t j = 0; j < k; ++j) {
      ExpertKey const key{static_cast<std::int32_t>(r.layer), r.experts[j]};
      AccessContext const ctx{i, r.token, static_cast<Index>(j), r.gates[j],
                              next[static_cast<std::size_t>(i) * k + j]};
      AccessOutcome const o = cache.access(key, ctx);
      if (!counted) continue;
      ++out.accesses;
      if (o == AccessOutcome::kHit) {
        ++out.hits;
      } else {
        (o == AccessOutcome::kMiss ? out.misses : out.bypasses) += 1;
        out.bytes_read += geometry.bytes(geometry.slot(key));
      }
    }
    for (std::size_t j = 0; j < k; ++j) {
      ExpertKey const key{static_cast<std::int32_t>(r.layer), r.experts[j]};
      if (cache.pinned(key)) cache.unpin(key);
    }
  }
  out.swapped_weight = weight > 0.0 ? moved / weight : 0.0;
  out.measured_tokens = trace.num_tokens() - options.warmup_tokens;
  double const tokens = static_cast<double>(out.measured_tokens);
  out.hit_rate =
      out.accesses ? static_cast<double>(out.hits) / static_cast<double>(out.accesses) : 0.0;
  out.misses_per_token = static_cast<double>(out.misses + out.bypasses) / tokens;
  out.bytes_per_token = static_cast<double>(out.bytes_read) / tokens;
  out.io_ceiling_tokens_per_s = out.bytes_per_token > 0
                                    ? options.bandwidth_bytes_per_s / out.bytes_per_token
                                    : std::numeric_limits<double>::infinity();
  return out;
}

}  // namespace moe::offload
