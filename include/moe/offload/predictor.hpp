// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// CECAR-style reuse-distance prediction: moe::offload::ReuseTracker (per-expert features from
/// the routing seen so far), ReusePredictor (ridge regression of log next-use distance on those
/// features, trained from traces, saved to / loaded from a small text file) and LearnedEviction
/// (the EvictionPolicy that evicts the expert with the largest predicted next-use distance).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/offload/cache.hpp"
#include "moe/offload/trace.hpp"

namespace moe::offload {

/// Number of features of ReuseTracker::features.
inline constexpr std::size_t kReuseFeatures = 19;
/// Next-use distances (tokens) are capped here (and "never again" counts as the cap).
inline constexpr double kReuseDistanceCap = 256.0;

/// Per-expert routing history, updated step by step, and the predictor's features of it.
/// For expert (l, e) as of token t (after observing step (t, l)):
///   d        tokens since its last selection at layer l (kReuseDistanceCap if never): recency
///   c4, c64  decayed selection counts, half-lives 4 and 64 tokens: frequency
///   g, r     gate score (times E) and rank / K at its last selection
///   sel      1 if selected at this step
///   in_c     1 if among step (t, l)'s router candidates (the top-M); s_c its score there, r_c
///            its candidate rank / M. In a live system this is the "lookahead score": the
///            router's view of the current token, known before the experts run
///   z2, z8, z32  moving averages (half-lives 2, 8, 32 tokens) over every step of layer l of
///            ln(score / the step's best score); outside the visible set (the candidates, or the
///            selection when the trace records none) as the smallest visible minus 1
///   a8, a32  decayed counts of candidate appearances weighted by 1 - r_c (half-lives 8, 32)
/// features = [1, ln(1+d), ln(1+c4), ln(1+c64), g, r, sel, in_c, in_c ln(s_c E), in_c (1 - r_c),
///             sel ln(1+c64), in_c ln(1+d), [d >= cap], ln(1+d)^2, z2, z8, z32, ln(1+a8),
///             ln(1+a32)]
/// Memory O(L E); observe is O(E + K + M) per step, features O(1).
class ReuseTracker {
 public:
  void reset(Index num_layers, Index num_experts, Index top_k, Index num_candidates) {
    L_ = num_layers;
    E_ = num_experts;
    K_ = top_k;
    M_ = num_candidates;
    auto const n = static_cast<std::size_t>(L_ * E_);
    history_.assign(n, SlotHistory{});
    for (auto& z : zhat_) z.assign(n, 0.0);
    zhat_steps_.assign(static_cast<std::size_t>(L_), 0);
    visible_.assign(static_cast<std::size_t>(E_), 0.0);
  }
  /// Records step (token, layer): its selections and candidates.
  void observe(TraceRecord const& r) {
    for (std::size_t j = 0; j < r.experts.size(); ++j) {
      SlotHistory& h = history_[slot(r.layer, r.experts[j])];
      h.count4 = decayed(h.count4, r.token - h.count_token, 4.0) + 1.0;
      h.count64 = decayed(h.count64, r.token - h.count_token, 64.0) + 1.0;
      h.count_token = r.token;
      h.last_use = r.token;
      h.gate = r.gates[j];
      h.rank = static_cast<std::int32_t>(j);
    }
    for (std::size_t j = 0; j < r.candidates.size(); ++j) {
      SlotHistory& h = history_[slot(r.layer, r.candidates[j])];
      h.cand_token = r.token;
      h.cand_score = r.candidate_scores[j];
      h.cand_rank = static_cast<std::int32_t>(j);
      double const evidence =
          1.0 - static_cast<double>(j) / static_cast<double>(r.candidates.size());
      h.appear8 = decayed(h.appear8, r.token - h.appear_token, 8.0) + evidence;
      h.appear32 = decayed(h.appear32, r.token - h.appear_token, 32.0) + evidence;
      h.appear_token = r.token;
    }
    update_score_averages(r);
  }
  /// The token at which expert (layer, expert) was last selected (-1: never).
  Index last_use(Index layer, Index expert) const { return history_[slot(layer, expert)].last_use; }
  /// The features of expert (layer, expert) as of token `token` (see the class comment).
  std::array<double, kReuseFeatures> features(Index layer, Index expert, Index token) const {
    std::size_t const s = slot(layer, expert);
    SlotHistory const& h = history_[s];
    bool const used = h.last_use >= 0;
    double const d = used ? std::min(kReuseDistanceCap, static_cast<double>(token - h.last_use))
                          : kReuseDistanceCap;
    double const ld = std::log1p(d);
    double const c64 = decayed(h.count64, token - h.count_token, 64.0);
    double const sel = used && h.last_use == token ? 1.0 : 0.0;
    bool const in_c = h.cand_token == token;
    double const e = static_cast<double>(E_);
    double const sc = in_c ? std::log(std::max(1e-6, static_cast<double>(h.cand_score) * e)) : 0.0;
    double const rc =
        in_c && M_ > 0 ? 1.0 - static_cast<double>(h.cand_rank) / static_cast<double>(M_) : 0.0;
    double const ic = in_c ? 1.0 : 0.0;
    return {1.0,
            ld,
            std::log1p(decayed(h.count4, token - h.count_token, 4.0)),
            std::log1p(c64),
            used ? static_cast<double>(h.gate) * e : 0.0,
            used ? static_cast<double>(h.rank) / static_cast<double>(K_) : 1.0,
            sel,
            ic,
            sc,
            rc,
            sel * std::log1p(c64),
            ic * ld,
            d >= kReuseDistanceCap ? 1.0 : 0.0,
            ld * ld,
            zhat_[0][s],
            zhat_[1][s],
            zhat_[2][s],
            std::log1p(decayed(h.appear8, token - h.appear_token, 8.0)),
            std::log1p(decayed(h.appear32, token - h.appear_token, 32.0))};
  }

 private:
  /// What the tracker remembers of one (layer, expert); counts decay lazily from their token.
  struct SlotHistory {
    Index last_use = -1;    // token of the last selection
    Index count_token = 0;  // token count4 / count64 were last updated
    double count4 = 0, count64 = 0;
    float gate = 0.0f;        // at the last selection
    std::int32_t rank = 0;    // at the last selection
    Index cand_token = -1;    // token of the last candidate appearance
    float cand_score = 0.0f;  // there
    std::int32_t cand_rank = 0;
    Index appear_token = 0;  // token appear8 / appear32 were last updated
    double appear8 = 0, appear32 = 0;
  };
  static double decayed(double c, Index dt, double half_life) {
    return c * std::exp2(-static_cast<double>(dt) / half_life);
  }
  std::size_t slot(Index layer, Index expert) const {
    return static_cast<std::size_t>(layer * E_ + expert);
  }
  /// zhat_[i][slot]: exponential moving averages (half-lives kZhatHalfLives tokens) of the
  /// expert's visible log-score relative to the step's best, ln(score / top score), over every
  /// step of its layer; an expert outside the visible set (the candidates, or the selection when
  /// the trace has no candidates) counts as the smallest visible one minus 1 (it is below it).
  void update_score_averages(TraceRecord const& r) {
    bool const cand = !r.candidates.empty();
    std::span<std::int32_t const> ids = cand ? r.candidates : r.experts;
    std::span<float const> scores = cand ? r.candidate_scores : r.gates;
    double top = -1e30, low = 1e30;
    for (float const v : scores) {
      double const lv = std::log(std::max(1e-30, static_cast<double>(v)));
      top = std::max(top, lv);
      low = std::min(low, lv);
    }
    std::fill(visible_.begin(), visible_.end(), low - top - 1.0);
    for (std::size_t j = 0; j < ids.size(); ++j)
      visible_[static_cast<std::size_t>(ids[j])] =
          std::log(std::max(1e-30, static_cast<double>(scores[j]))) - top;
    Index& steps = zhat_steps_[static_cast<std::size_t>(r.layer)];
    ++steps;
    for (std::size_t i = 0; i < zhat_.size(); ++i) {
      // The first steps average what there is (no bias towards the initial 0).
      double const a =
          std::max(1.0 - std::exp2(-1.0 / kZhatHalfLives[i]), 1.0 / static_cast<double>(steps));
      double* z = zhat_[i].data() + r.layer * E_;
      for (Index e = 0; e < E_; ++e) z[e] += a * (visible_[static_cast<std::size_t>(e)] - z[e]);
    }
  }
  static constexpr double kZhatHalfLives[3] = {2.0, 8.0, 32.0};
  std::array<std::vector<double>, 3> zhat_;
  std::vector<Index> zhat_steps_;
  std::vector<double> visible_;
  std::vector<SlotHistory> history_;
  Index L_ = 0, E_ = 0, K_ = 1, M_ = 0;
};

/// The learned reuse-distance model: predicted ln(1 + next-use distance in tokens) =
/// w . features (ReuseTracker), fitted by ridge regression (closed form, Cholesky; deterministic)
/// on traces. Distances are capped at kReuseDistanceCap.
class ReusePredictor {
 public:
  ReusePredictor() { weights_.fill(0.0); }
  explicit ReusePredictor(std::array<double, kReuseFeatures> const& w) : weights_(w) {}

  /// Predicted ln(1 + distance) for a feature vector.
  double predict(std::array<double, kReuseFeatures> const& f) const {
    double y = 0;
    for (std::size_t i = 0; i < kReuseFeatures; ++i) y += weights_[i] * f[i];
    return y;
  }
  std::array<double, kReuseFeatures> const& weights() const { return weights_; }

  /// Fits on `traces`: at every step (t, l) with t >= `warmup_tokens`, one example per expert of
  /// layer l selected within the last `horizon_tokens` tokens or among the step's candidates
  /// (the experts a cache would be choosing among), labelled by its true next-use distance.
  /// `ridge` is the L2 penalty on the non-bias weights, relative to the example count.
  /// Deterministic (fixed summation order). moe::Error if there are no examples.
  static ReusePredictor train(std::span<Trace const* const> traces, Index warmup_tokens = 32,
                              Index horizon_tokens = 64, double ridge = 1e-4) {
    constexpr std::size_t n = kReuseFeatures;
    std::array<double, n * n> xtx{};
    std::array<double, n> xty{};
    std::int64_t examples = 0;
    for (Trace const* trace : traces) {
      TraceShape const& s = trace->shape();
      ReuseTracker tracker;
      tracker.reset(s.num_layers, s.num_experts, s.top_k, s.num_candidates);
      // uses[slot]: the tokens selecting (l, e), ascending; ptr[slot]: the first one > now.
      auto const slots = static_cast<std::size_t>(s.num_layers * s.num_experts);
      std::vector<std::vector<Index>> uses(slots);
      for (Index i = 0; i < trace->num_steps(); ++i) {
        TraceRecord const r = trace->step(i);
        for (std::int32_t const e : r.experts)
          uses[static_cast<std::size_t>(r.layer * s.num_experts + e)].push_back(r.token);
      }
      std::vector<std::size_t> ptr(slots, 0);
      std::vector<Index> candidate_at(slots, -1);  // step at which (l, e) was last a candidate
      for (Index i = 0; i < trace->num_steps(); ++i) {
        TraceRecord const r = trace->step(i);
        tracker.observe(r);
        if (r.token < warmup_tokens) continue;
        for (std::int32_t const e : r.candidates)
          candidate_at[static_cast<std::size_t>(r.layer * s.num_experts + e)] = i;
        for (Index e = 0; e < s.num_experts; ++e) {
          auto const slot = static_cast<std::size_t>(r.layer * s.num_experts + e);
          Index const last = tracker.last_use(r.layer, e);
          bool const recent = last >= 0 && r.token - last <= horizon_tokens;
          if (!recent && candidate_at[slot] != i) continue;
          std::vector<Index> const& u = uses[slot];
          std::size_t& p = ptr[slot];
          while (p < u.size() && u[p] <= r.token) ++p;
          double const dist = p < u.size()
                                  ? std::min(kReuseDistanceCap, static_cast<double>(u[p] - r.token))
                                  : kReuseDistanceCap;
          double const y = std::log1p(dist);
          auto const f = tracker.features(r.layer, e, r.token);
          for (std::size_t a = 0; a < n; ++a) {
            xty[a] += f[a] * y;
            for (std::size_t b = 0; b < n; ++b) xtx[a * n + b] += f[a] * f[b];
          }
          ++examples;
        }
      }
    }
    moe::detail::check(examples > 0,
                       "moe::offload::ReusePredictor::train: no training examples (traces too "
                       "short for warmup_tokens?)");
    for (std::size_t a = 1; a < n; ++a) xtx[a * n + a] += ridge * static_cast<double>(examples);
    return ReusePredictor(solve(xtx, xty));
  }

  /// The text form: "moe-reuse-predictor 1 <n>" then the n weights as hexadecimal floats (exact
  /// round trip), one per line.
  std::string to_text() const {
    std::string out = "moe-reuse-predictor 1 " + std::to_string(kReuseFeatures) + "\n";
    char buf[64];
    for (double const w : weights_) {
      std::snprintf(buf, sizeof buf, "%a\n", w);
      out += buf;
    }
    return out;
  }
  /// Parses to_text()'s form; moe::Error naming `name` on anything else (wrong header, count,
  /// a non-finite or unparsable weight, trailing text).
  static ReusePredictor from_text(std::string_view text, std::string_view name = "predictor") {
    std::string const where(name);
    std::istringstream in{std::string(text)};
    std::string magic;
    int version = 0;
    std::size_t count = 0;
    in >> magic >> version >> count;
    moe::detail::check(in && magic == "moe-reuse-predictor", where,
                       ": not a moe reuse-predictor file (expected \"moe-reuse-predictor 1 ",
                       kReuseFeatures, "\" first)");
    moe::detail::check(version == 1, where, ": predictor format version ", version,
                       " is not supported (1 is)");
    moe::detail::check(count == kReuseFeatures, where, ": ", count, " weights, this build has ",
                       kReuseFeatures, " features");
    std::array<double, kReuseFeatures> w{};
    for (std::size_t i = 0; i < count; ++i) {
      std::string token;
      in >> token;
      char* end = nullptr;
      w[i] = std::strtod(token.c_str(), &end);
      moe::detail::check(
          !token.empty() && end == token.c_str() + token.size() && std::isfinite(w[i]), where,
          ": weight ", i, " '", token, "' is not a finite number");
    }
    std::string rest;
    in >> rest;
    moe::detail::check(rest.empty(), where, ": trailing text after the weights");
    return ReusePredictor(w);
  }
  void save(std::string const& path) const {
    std::ofstream out(path, std::ios::trunc);
    moe::detail::check(static_cast<bool>(out), path, ": cannot open for writing");
    out << to_text();
    out.flush();
    moe::detail::check(static_cast<bool>(out), path, ": write failed");
  }
  static ReusePredictor load(std::string const& path) {
    std::ifstream in(path);
    moe::detail::check(static_cast<bool>(in), path, ": cannot open the predictor file");
    std::stringstream ss;
    ss << in.rdbuf();
    return from_text(ss.str(), path);
  }

 private:
  /// Solves (A) w = b for symmetric positive definite A by Cholesky.
  static std::array<double, kReuseFeatures> solve(
      std::array<double, kReuseFeatures * kReuseFeatures> a, std::array<double, kReuseFeatures> b) {
    constexpr std::size_t n = kReuseFeatures;
    for (std::size_t j = 0; j < n; ++j) {
      double d = a[j * n + j];
      for (std::size_t p = 0; p < j; ++p) d -= a[j * n + p] * a[j * n + p];
      if (d <= 1e-12) d = 1e-12;  // a feature constant on the data: its weight stays ~0
      double const l = std::sqrt(d);
      a[j * n + j] = l;
      for (std::size_t i = j + 1; i < n; ++i) {
        double v = a[i * n + j];
        for (std::size_t p = 0; p < j; ++p) v -= a[i * n + p] * a[j * n + p];
        a[i * n + j] = v / l;
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t p = 0; p < i; ++p) b[i] -= a[i * n + p] * b[p];
      b[i] /= a[i * n + i];
    }
    for (std::size_t i = n; i-- > 0;) {
      for (std::size_t p = i + 1; p < n; ++p) b[i] -= a[p * n + i] * b[p];
      b[i] /= a[i * n + i];
    }
    return b;
  }
  std::array<double, kReuseFeatures> weights_;
};

/// The learned eviction policy (CECAR-style): evicts the resident unpinned expert with the
/// largest predicted next-use distance. Each resident expert's prediction is refreshed whenever
/// its layer runs a step (so it is at most one token old) and on every access; the victim is the
/// largest predicted next-use token (token of the prediction + e^y - 1). Uses the step's
/// candidates when the trace has them (the router's top-M: the lookahead signal). O(resident
/// experts of the layer) per step, O(log n) per access.
class LearnedEviction {
 public:
  explicit LearnedEviction(ReusePredictor predictor = {}) : predictor_(std::move(predictor)) {}
  static constexpr std::string_view name() { return "learned"; }
  void reset(CacheGeometry const& g) {
    L_ = g.num_layers;
    E_ = g.num_experts;
    initialized_ = false;
    residents_.reset(g.num_layers, g.num_experts);
    // Sized now so that a cache whose owner never calls begin_step still works (on recency
    // alone); the first step re-sizes it to the routing's top-k and candidates.
    tracker_.reset(L_, E_, 1, 0);
  }
  void on_step(StepContext const& ctx) {
    TraceRecord const& r = ctx.record;
    if (!initialized_) {
      tracker_.reset(L_, E_, static_cast<Index>(r.experts.size()),
                     static_cast<Index>(r.candidates.size()));
      initialized_ = true;
    }
    tracker_.observe(r);
    token_ = r.token;
    for (Index const s : residents_.layer(r.layer)) residents_.rekey(s, predicted_next(s));
  }
  void on_hit(Index s, AccessContext const&) { residents_.rekey(s, predicted_next(s)); }
  bool admit(Index, AccessContext const&) { return true; }
  void on_insert(Index s, AccessContext const&) { residents_.insert(s, predicted_next(s)); }
  void on_evict(Index s) { residents_.erase(s); }
  Index victim(Index, std::span<std::uint32_t const> pins) const {
    return residents_.largest_unpinned(pins);
  }
  ReusePredictor const& predictor() const { return predictor_; }

 private:
  /// The predicted token of the next use: now + e^y - 1 (y clamped to [0, 10]).
  double predicted_next(Index s) const {
    double const y = predictor_.predict(tracker_.features(s / E_, s % E_, token_));
    return static_cast<double>(token_) + std::expm1(std::clamp(y, 0.0, 10.0));
  }
  ReusePredictor predictor_;
  ReuseTracker tracker_;
  bool initialized_ = false;
  Index L_ = 0, E_ = 1, token_ = 0;
  detail::KeyedSlots residents_;
};

static_assert(EvictionPolicy<LearnedEviction>);

}  // namespace moe::offload
