// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Synthetic routing traces with controllable locality (make_synthetic_trace), a preset
/// calibrated to Qwen3-30B-A3B's measured locality (qwen3_30b_a3b_trace_config), and the
/// locality statistics of any trace (measure_locality).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/offload/trace.hpp"

namespace moe::offload {

/// A small, seeded, platform-independent random stream (SplitMix64 seeding xoshiro256**), with
/// uniform and standard normal (Box-Muller) draws. Same seed, same numbers everywhere.
class TraceRng {
 public:
  explicit TraceRng(std::uint64_t seed) {
    for (auto& s : s_) {
      seed += 0x9e3779b97f4a7c15ull;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      s = z ^ (z >> 31);
    }
  }
  std::uint64_t next() {
    std::uint64_t const result = rotl(s_[1] * 5, 7) * 9;
    std::uint64_t const t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  /// Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Uniform integer in [0, n) (n >= 1; the modulo bias is below 2^-40 for n < 2^24).
  std::uint64_t below(std::uint64_t n) { return next() % n; }
  /// Standard normal.
  double normal() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    double const u1 = 1.0 - uniform();  // (0, 1]
    double const u2 = uniform();
    double const r = std::sqrt(-2.0 * std::log(u1));
    double const a = 6.283185307179586 * u2;
    spare_ = r * std::sin(a);
    have_spare_ = true;
    return r * std::cos(a);
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4]{};
  double spare_ = 0;
  bool have_spare_ = false;
};

/// How make_synthetic_trace draws routing. Each layer l has latent router logits
///
///   z[t, e] = -zipf_exponent * ln(1 + rank_l(e)) + sqrt(1 - w) * f[t, e] + sqrt(w) * s[t, e]
///
/// where rank_l is a random permutation of the experts (popularity rank: a Zipf-shaped prior,
/// exactly Zipf(zipf_exponent) for the top-1 choice if the noise were Gumbel), re-drawn every
/// `topic_period` tokens (topic switches); f and s are AR(1) processes with unit variance,
/// f[t] = rho f[t-1] + sqrt(1 - rho^2) N(0, 1) with rho = `persistence` (fast, token-to-token
/// locality) and s likewise with `slow_persistence` (slow drift), w = `slow_fraction`.
/// The K largest z are selected (rank 0 first; ties to the lower id); gate scores are
/// softmax(z) over all experts; the M largest z and their softmax scores are the candidates.
///
/// `reuse_probability` in [0, 1] (instead of a negative value) sets `persistence` by bisection
/// so that the expected fraction of selections that repeat at the next token is that value
/// (measured on a pilot run of one layer; clamped to what rho in [0, 1) can give).
struct SyntheticTraceConfig {
  Index num_layers = 4;             ///< L
  Index num_experts = 64;           ///< E
  Index top_k = 4;                  ///< K
  Index num_candidates = 0;         ///< M (0 = none recorded, else K <= M <= E)
  Index num_tokens = 1000;          ///< T
  double reuse_probability = -1.0;  ///< target next-token repeat fraction; < 0: use persistence
  double persistence = 0.0;         ///< rho of the fast AR(1) latent, in [0, 1)
  double zipf_exponent = 0.0;       ///< alpha >= 0 (0: uniform popularity)
  double slow_fraction = 0.0;       ///< w in [0, 1]: variance share of the slow latent
  double slow_persistence = 0.99;   ///< rho of the slow latent, in [0, 1)
  Index topic_period = 0;           ///< re-permute popularity every N tokens (0: never)
  std::uint64_t seed = 1;           ///< same seed, same trace

  void check() const {
    char const* w = "moe::offload::SyntheticTraceConfig";
    TraceShape{num_layers, num_experts, top_k, num_candidates}.check(w);
    moe::detail::check(num_tokens >= 0, w, ": num_tokens ", num_tokens, " is negative");
    moe::detail::check(reuse_probability <= 1.0, w, ": reuse_probability ", reuse_probability,
                       " is above 1");
    moe::detail::check(persistence >= 0.0 && persistence < 1.0, w, ": persistence ", persistence,
                       " is not in [0, 1)");
    moe::detail::check(slow_persistence >= 0.0 && slow_persistence < 1.0, w,
                       ": slow_persistence is not in [0, 1)");
    moe::detail::check(slow_fraction >= 0.0 && slow_fraction <= 1.0, w,
                       ": slow_fraction is not in [0, 1]");
    moe::detail::check(zipf_exponent >= 0.0 && zipf_exponent <= 100.0, w,
                       ": zipf_exponent is not in [0, 100]");
    moe::detail::check(topic_period >= 0, w, ": topic_period is negative");
  }
};

namespace detail {

/// One layer's latent router state (see SyntheticTraceConfig).
class SyntheticLayer {
 public:
  SyntheticLayer(SyntheticTraceConfig const& c, double rho, TraceRng& rng)
      : c_(c),
        rho_(rho),
        bias_(static_cast<std::size_t>(c.num_experts)),
        fast_(bias_.size()),
        slow_(bias_.size()),
        z_(bias_.size()),
        order_(bias_.size()) {
    permute(rng);
    for (auto& v : fast_) v = rng.normal();
    for (auto& v : slow_) v = rng.normal();
  }
  /// New popularity ranks (a topic switch).
  void permute(TraceRng& rng) {
    std::iota(order_.begin(), order_.end(), 0);
    for (std::size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[rng.below(i)]);
    for (std::size_t r = 0; r < order_.size(); ++r)
      bias_[static_cast<std::size_t>(order_[r])] =
          -c_.zipf_exponent * std::log(1.0 + static_cast<double>(r));
  }
  /// Advances the latents one token and ranks the experts by z (order_[0] the largest).
  void advance(TraceRng& rng, bool first) {
    double const a = std::sqrt(1.0 - rho_ * rho_);
    double const as = std::sqrt(1.0 - c_.slow_persistence * c_.slow_persistence);
    double const wf = std::sqrt(1.0 - c_.slow_fraction), ws = std::sqrt(c_.slow_fraction);
    for (std::size_t e = 0; e < z_.size(); ++e) {
      if (!first) {
        fast_[e] = rho_ * fast_[e] + a * rng.normal();
        slow_[e] = c_.slow_persistence * slow_[e] + as * rng.normal();
      }
      z_[e] = bias_[e] + wf * fast_[e] + ws * slow_[e];
    }
    std::iota(order_.begin(), order_.end(), 0);
    auto const n = static_cast<std::size_t>(std::max(c_.top_k, c_.num_candidates));
    std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(n), order_.end(),
                      [this](std::int32_t x, std::int32_t y) {
                        double const zx = z_[static_cast<std::size_t>(x)];
                        double const zy = z_[static_cast<std::size_t>(y)];
                        return zx > zy || (zx == zy && x < y);
                      });
    double const zmax = z_[static_cast<std::size_t>(order_[0])];
    double sum = 0;
    for (double const v : z_) sum += std::exp(v - zmax);
    inv_sum_ = 1.0 / sum;
    zmax_ = zmax;
  }
  std::int32_t ranked(std::size_t r) const { return order_[r]; }
  /// E[z[t + 1, e] | the latents now] (popularity as of now: a topic switch is not foreseen).
  double expected_next(std::size_t e) const {
    return bias_[e] + std::sqrt(1.0 - c_.slow_fraction) * rho_ * fast_[e] +
           std::sqrt(c_.slow_fraction) * c_.slow_persistence * slow_[e];
  }
  float score(std::int32_t e) const {
    return static_cast<float>(std::exp(z_[static_cast<std::size_t>(e)] - zmax_) * inv_sum_);
  }

 private:
  SyntheticTraceConfig const& c_;
  double rho_;
  std::vector<double> bias_, fast_, slow_, z_;
  std::vector<std::int32_t> order_;
  double inv_sum_ = 1, zmax_ = 0;
};

/// Fraction of selections of one synthetic layer that repeat at the next token, at `rho`.
inline double pilot_reuse(SyntheticTraceConfig const& c, double rho, Index tokens) {
  TraceRng rng(c.seed ^ 0x5eedf00dull);
  SyntheticLayer layer(c, rho, rng);
  auto const k = static_cast<std::size_t>(c.top_k);
  std::vector<unsigned char> prev(static_cast<std::size_t>(c.num_experts), 0), cur(prev);
  std::int64_t repeats = 0, total = 0;
  for (Index t = 0; t < tokens; ++t) {
    if (c.topic_period > 0 && t > 0 && t % c.topic_period == 0) layer.permute(rng);
    layer.advance(rng, t == 0);
    std::fill(cur.begin(), cur.end(), 0);
    for (std::size_t r = 0; r < k; ++r) {
      auto const e = static_cast<std::size_t>(layer.ranked(r));
      cur[e] = 1;
      if (t > 0) repeats += prev[e];
    }
    if (t > 0) total += static_cast<std::int64_t>(k);
    std::swap(prev, cur);
  }
  return total == 0 ? 0.0 : static_cast<double>(repeats) / static_cast<double>(total);
}

}  // namespace detail

/// The fast-latent persistence rho that make_synthetic_trace uses for `config`: its
/// `persistence` when reuse_probability < 0, else the bisection's result (deterministic).
inline double synthetic_persistence(SyntheticTraceConfig const& config) {
  config.check();
  if (config.reuse_probability < 0.0) return config.persistence;
  constexpr Index kPilotTokens = 2000;
  double lo = 0.0, hi = 0.999;
  for (int i = 0; i < 16; ++i) {
    double const mid = 0.5 * (lo + hi);
    (detail::pilot_reuse(config, mid, kPilotTokens) < config.reuse_probability ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

/// A synthetic trace drawn as SyntheticTraceConfig describes: T tokens of L layers, each
/// selecting K of E experts, with M candidates when num_candidates > 0. Deterministic: the same
/// config (seed included) gives the same trace. Cost O(T L E) time, O(T L (K + M)) memory.
/// With `expected_next_logits`, also what an oracle of the generator's hidden state knows: for
/// every step (t, l) and expert e, E[z[t + 1, e]] given the latents at t, [T, L, E] (the input
/// of LatentOracle, an offline reference for online policies; O(T L E) memory).
inline Trace make_synthetic_trace(SyntheticTraceConfig const& config,
                                  std::vector<float>* expected_next_logits = nullptr) {
  config.check();
  double const rho = synthetic_persistence(config);
  TraceRng rng(config.seed);
  std::vector<detail::SyntheticLayer> layers;
  layers.reserve(static_cast<std::size_t>(config.num_layers));
  for (Index l = 0; l < config.num_layers; ++l) layers.emplace_back(config, rho, rng);
  Trace trace({config.num_layers, config.num_experts, config.top_k, config.num_candidates});
  trace.reserve_tokens(config.num_tokens);
  auto const k = static_cast<std::size_t>(config.top_k);
  auto const m = static_cast<std::size_t>(config.num_candidates);
  std::vector<std::int32_t> ids(k), cids(m);
  std::vector<float> gates(k), scores(m);
  if (expected_next_logits != nullptr)
    expected_next_logits->assign(
        static_cast<std::size_t>(config.num_tokens * config.num_layers * config.num_experts), 0.0f);
  float* oracle = expected_next_logits != nullptr ? expected_next_logits->data() : nullptr;
  for (Index t = 0; t < config.num_tokens; ++t) {
    bool const topic = config.topic_period > 0 && t > 0 && t % config.topic_period == 0;
    for (auto& layer : layers) {
      if (topic) layer.permute(rng);
      layer.advance(rng, t == 0);
      for (std::size_t r = 0; r < k; ++r) {
        ids[r] = layer.ranked(r);
        gates[r] = layer.score(ids[r]);
      }
      for (std::size_t r = 0; r < m; ++r) {
        cids[r] = layer.ranked(r);
        scores[r] = layer.score(cids[r]);
      }
      trace.append(ids, gates, cids, scores);
      if (oracle != nullptr) {
        for (std::size_t e = 0; e < static_cast<std::size_t>(config.num_experts); ++e)
          *oracle++ = static_cast<float>(layer.expected_next(e));
      }
    }
  }
  return trace;
}

/// The preset calibrated to the routing locality measured on Qwen3-30B-A3B (issue 44): 48
/// layers, 128 experts, top-8, 32 candidates recorded; next-token repeat fraction 0.45, Zipf
/// prior and slow drift chosen so that ~80% of selections repeat within 8 tokens and the median
/// reuse distance is 2 tokens, and a global LRU holding 40% of the experts hits 90-95% after
/// warm-up (tests/offload check these within tolerances; docs/offload.md has the numbers).
inline SyntheticTraceConfig qwen3_30b_a3b_trace_config(Index num_tokens = 2000,
                                                       std::uint64_t seed = 1) {
  return {.num_layers = 48,
          .num_experts = 128,
          .top_k = 8,
          .num_candidates = 32,
          .num_tokens = num_tokens,
          .reuse_probability = 0.45,
          .zipf_exponent = 0.6,
          .slow_fraction = 0.5,
          .slow_persistence = 0.99,
          .seed = seed};
}

/// Locality of a trace, pooled over its layers (reuse distance = tokens since the same expert
/// was last selected at the same layer).
struct LocalityStats {
  double next_token_repeat = 0;  ///< fraction of selections at t >= 1 also selected at t - 1
  double within_8_repeat = 0;    ///< fraction of selections at t >= 8 selected in [t - 8, t - 1]
  double median_reuse_distance = 0;  ///< median over selections with an earlier use
  double distinct_per_layer = 0;     ///< mean experts of a layer ever selected
};

/// The locality statistics of `trace` (definitions in LocalityStats). O(steps K).
inline LocalityStats measure_locality(Trace const& trace) {
  TraceShape const& s = trace.shape();
  auto const e = static_cast<std::size_t>(s.num_experts);
  std::vector<Index> last(static_cast<std::size_t>(s.num_layers) * e, -1);
  std::vector<std::int64_t> hist(65, 0);  // distances 1..64, 64 = ">= 64"
  std::int64_t n1 = 0, r1 = 0, n8 = 0, r8 = 0, with_prev = 0;
  for (Index i = 0; i < trace.num_steps(); ++i) {
    TraceRecord const r = trace.step(i);
    for (std::int32_t const x : r.experts) {
      Index& l = last[static_cast<std::size_t>(r.layer) * e + static_cast<std::size_t>(x)];
      Index const d = l < 0 ? -1 : r.token - l;
      if (r.token >= 1) {
        ++n1;
        r1 += d == 1;
      }
      if (r.token >= 8) {
        ++n8;
        r8 += d >= 1 && d <= 8;
      }
      if (d >= 1) {
        ++with_prev;
        ++hist[static_cast<std::size_t>(std::min<Index>(d, 64))];
      }
      l = r.token;
    }
  }
  LocalityStats out;
  out.next_token_repeat = n1 ? static_cast<double>(r1) / static_cast<double>(n1) : 0.0;
  out.within_8_repeat = n8 ? static_cast<double>(r8) / static_cast<double>(n8) : 0.0;
  std::int64_t acc = 0;
  for (std::size_t d = 1; d < hist.size(); ++d) {
    acc += hist[d];
    if (2 * acc >= with_prev && with_prev > 0) {
      out.median_reuse_distance = static_cast<double>(d);
      break;
    }
  }
  std::int64_t distinct = 0;
  for (Index const l : last) distinct += l >= 0;
  out.distinct_per_layer = static_cast<double>(distinct) / static_cast<double>(s.num_layers);
  return out;
}

}  // namespace moe::offload
