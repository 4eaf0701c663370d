// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Token generation over a loaded Decoder (or an AnyDecoder): Sampler (greedy, or temperature and
/// top-p sampling from a seeded stream) and generate() (a KV-cached prefill, then one step a
/// token, with a callback per token that may stop it): the loop moe_generate runs.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <numeric>
#include <span>
#include <variant>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"
#include "moe/layers/kv_cache.hpp"
#include "moe/models/decoder.hpp"

namespace moe::models {

/// How each next token is picked from the logits z [V].
struct SamplingOptions {
  /// 0: greedy (the first maximum of z). T > 0: a sample of p_i = softmax(z / T)_i restricted
  /// to the smallest set of most likely tokens (ties in id order) whose probability reaches
  /// top_p, renormalised.
  double temperature = 0.0;
  double top_p = 1.0;      ///< in (0, 1]
  std::uint64_t seed = 0;  ///< of the SplitMix64 stream the samples are drawn from
};

/// Picks tokens as SamplingOptions says: the same logits, seed and call order give the same
/// ids on every machine (the uniform draws are SplitMix64, the arithmetic double).
class Sampler {
 public:
  /// Throws moe::Error for a temperature that is negative or not finite, or a top_p outside
  /// (0, 1].
  explicit Sampler(SamplingOptions const& o = {}) : o_(o), state_(o.seed) {
    moe::detail::check(std::isfinite(o.temperature) && o.temperature >= 0.0,
                       "Sampler: temperature = ", o.temperature,
                       " must be finite and >= 0 (0: greedy)");
    moe::detail::check(o.top_p > 0.0 && o.top_p <= 1.0, "Sampler: top_p = ", o.top_p,
                       " must be in (0, 1]");
  }

  /// The next token for logits z [V] (V >= 1; NaN logits are never picked unless all are).
  std::int64_t pick(std::span<float const> z) {
    moe::detail::check(!z.empty(), "Sampler::pick: no logits");
    auto const n = static_cast<std::int64_t>(z.size());
    auto greater = [&](std::int64_t x, std::int64_t y) {
      float const a = z[static_cast<std::size_t>(x)], b = z[static_cast<std::size_t>(y)];
      return a > b || (!std::isnan(a) && std::isnan(b));
    };
    if (o_.temperature == 0.0) {
      std::int64_t best = 0;
      for (std::int64_t i = 1; i < n; ++i) best = greater(i, best) ? i : best;
      return best;
    }
    order_.resize(static_cast<std::size_t>(n));
    std::iota(order_.begin(), order_.end(), std::int64_t{0});
    std::stable_sort(order_.begin(), order_.end(), greater);
    p_.resize(static_cast<std::size_t>(n));
    double const mx = z[static_cast<std::size_t>(order_[0])];
    double sum = 0.0;
    for (std::size_t i = 0; i < p_.size(); ++i) {
      double const zi = z[static_cast<std::size_t>(order_[i])];
      sum += (p_[i] = std::isnan(zi) ? 0.0 : std::exp((zi - mx) / o_.temperature));
    }
    std::size_t keep = 0;
    double mass = 0.0;
    while (keep < p_.size() && mass < o_.top_p * sum) mass += p_[keep++];
    keep = std::max<std::size_t>(keep, 1);
    double u = uniform() * mass;
    for (std::size_t i = 0; i < keep; ++i) {
      if ((u -= p_[i]) < 0.0) return order_[i];
    }
    return order_[keep - 1];
  }

 private:
  /// Uniform in [0, 1) from the SplitMix64 stream.
  double uniform() {
    state_ += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
  }

  SamplingOptions o_;
  std::uint64_t state_;
  std::vector<std::int64_t> order_;
  std::vector<double> p_;
};

/// What generate() does.
struct GenerateOptions {
  Index max_new_tokens = 16;  ///< >= 0
  SamplingOptions sampling;
  /// false: no KV cache, every step recomputes the whole sequence (the same ids; the logits
  /// equal within float rounding: docs/decoding.md).
  bool cache = true;
  KvFormat kv = KvFormat::kF32;  ///< how the cache holds keys and values
  ThreadPool* pool = nullptr;
  /// Called with each new token and the logits it was picked from (before temperature);
  /// returning true stops generation after that token (an end-of-text id, a budget).
  std::function<bool(std::int64_t id, std::span<float const> logits)> on_token;
  /// When set, every token's routing is appended to it (DecoderState::trace: the prompt's
  /// tokens, then each new one but the last, which is not run). Needs the KV cache.
  offload::Trace* trace = nullptr;
};

/// What generate() produced.
struct GenerateResult {
  std::vector<std::int64_t> ids;  ///< the new tokens (the stopping one included)
  double prefill_seconds = 0.0;   ///< the prompt's forward
  double decode_seconds = 0.0;    ///< every later step
  Index steps = 0;                ///< forwards after the prefill (ids.size() - 1, or 0)
  std::size_t kv_bytes_per_token = 0;
  /// Bytes of the Gated DeltaNet layers' recurrent states (the same at any length; 0: none).
  std::size_t recurrent_bytes = 0;
};

/// Generates up to opt.max_new_tokens tokens after `prompt` (at least one id; no BOS is added:
/// the ids are the model's input as they are): one forward over the prompt, then one a token,
/// each next token picked by a Sampler(opt.sampling) from the last logits. Throws moe::Error
/// for an empty prompt, a negative max_new_tokens, bad sampling options, and as
/// Decoder::forward (ids outside the vocabulary).
template <class Moe>
GenerateResult generate(Decoder<Moe> const& dec, std::span<std::int64_t const> prompt,
                        GenerateOptions const& opt = {}) {
  moe::detail::check(!prompt.empty(), "generate: the prompt is empty; give at least one token id");
  moe::detail::check(opt.max_new_tokens >= 0, "generate: max_new_tokens = ", opt.max_new_tokens,
                     " must be >= 0");
  using Clock = std::chrono::steady_clock;
  Sampler sampler(opt.sampling);
  Index const V = dec.vocab();
  auto const P = static_cast<Index>(prompt.size());
  std::vector<std::int64_t> seq(prompt.begin(), prompt.end());
  std::vector<float> logits(static_cast<std::size_t>(V));
  GenerateResult r;
  moe::detail::check(opt.trace == nullptr || opt.cache,
                     "generate: a routing trace needs the KV cache (without it every step "
                     "recomputes, and would record, the whole sequence again)");
  DecoderState st = dec.make_state(1, P + opt.max_new_tokens, opt.kv);
  st.trace = opt.trace;
  auto run = [&](std::span<std::int64_t const> tokens) {
    if (!opt.cache) st = dec.make_state(1, static_cast<Index>(tokens.size()), opt.kv);
    Index const n[] = {static_cast<Index>(tokens.size())};
    dec.forward(tokens, n, st, {logits.data(), 1, V}, opt.pool);
  };
  auto const t0 = Clock::now();
  if (opt.max_new_tokens > 0) run(prompt);
  auto const t1 = Clock::now();
  for (Index i = 0; i < opt.max_new_tokens; ++i) {
    std::int64_t const next = sampler.pick(logits);
    r.ids.push_back(next);
    seq.push_back(next);
    bool const stop = opt.on_token && opt.on_token(next, logits);
    if (stop || i + 1 == opt.max_new_tokens) break;
    if (opt.cache) {
      run(std::span<std::int64_t const>(&seq.back(), 1));
    } else {
      run(seq);
    }
    ++r.steps;
  }
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  r.kv_bytes_per_token = st.kv_bytes_per_token();
  r.recurrent_bytes = st.recurrent_bytes();
  return r;
}

/// generate() over whichever decoder `dec` holds.
inline GenerateResult generate(AnyDecoder const& dec, std::span<std::int64_t const> prompt,
                               GenerateOptions const& opt = {}) {
  return std::visit([&](auto const& d) { return generate(d, prompt, opt); }, dec);
}

}  // namespace moe::models
