// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The bounded expert cache's bookkeeping (no I/O): moe::offload::ExpertCache, a byte budget
/// over (layer, expert) slots with pin counts, and its pluggable eviction policies behind the
/// EvictionPolicy concept: Lru, DecayedLfu, LayerAwareLru and Belady's MIN (offline). The learned
/// policy is in offload/predictor.hpp; the trace-driven simulator in offload/simulator.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <set>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/offload/trace.hpp"

namespace moe::offload {

/// One routed expert: MoE layer `layer` (0-based among the MoE layers), expert `expert`.
struct ExpertKey {
  std::int32_t layer = 0;
  std::int32_t expert = 0;
  friend bool operator==(ExpertKey const&, ExpertKey const&) = default;
};

/// Sizes of the cache: L x E slots, slot (l, e) holding `slot_bytes[l * E + e]` bytes, and the
/// byte budget the resident slots may not exceed. Slots are identified by their flat index
/// l * E + e.
struct CacheGeometry {
  Index num_layers = 0;                   ///< L
  Index num_experts = 0;                  ///< E
  std::vector<std::uint64_t> slot_bytes;  ///< [L * E] bytes of each expert (>= 1)
  std::uint64_t budget_bytes = 0;         ///< the most bytes resident at once

  /// Every expert `bytes_per_expert` bytes.
  static CacheGeometry uniform(Index num_layers, Index num_experts, std::uint64_t bytes_per_expert,
                               std::uint64_t budget_bytes) {
    CacheGeometry g;
    g.num_layers = num_layers;
    g.num_experts = num_experts;
    g.slot_bytes.assign(static_cast<std::size_t>(num_layers * num_experts), bytes_per_expert);
    g.budget_bytes = budget_bytes;
    g.check();
    return g;
  }
  Index num_slots() const { return num_layers * num_experts; }
  Index slot(ExpertKey k) const { return k.layer * num_experts + k.expert; }
  ExpertKey key(Index slot) const {
    return {static_cast<std::int32_t>(slot / num_experts),
            static_cast<std::int32_t>(slot % num_experts)};
  }
  std::uint64_t bytes(Index slot) const { return slot_bytes[static_cast<std::size_t>(slot)]; }
  std::uint64_t total_bytes() const {
    std::uint64_t s = 0;
    for (auto const b : slot_bytes) s += b;
    return s;
  }
  void check() const {
    char const* w = "moe::offload::CacheGeometry";
    moe::detail::check(num_layers >= 1 && num_experts >= 1, w, ": num_layers ", num_layers,
                       " and num_experts ", num_experts, " must be >= 1");
    moe::detail::check(static_cast<Index>(slot_bytes.size()) == num_slots(), w, ": slot_bytes has ",
                       slot_bytes.size(), " entries, expected L * E = ", num_slots());
    for (auto const b : slot_bytes) moe::detail::check(b >= 1, w, ": a slot of 0 bytes");
  }
};

/// "No next use" / "not known": AccessContext::next_use_step values.
inline constexpr Index kNeverUsedAgain = std::numeric_limits<Index>::max();
inline constexpr Index kNextUseUnknown = -1;

/// What the policies are told about one access. `step` = token * L + layer (the decoding-order
/// clock); `rank` / `gate` the expert's rank and gate score in this step; `next_use_step` the
/// step of the same expert's next access (only offline replays know it: kNextUseUnknown
/// otherwise; Belady requires it).
struct AccessContext {
  Index step = 0;
  Index token = 0;
  Index rank = 0;
  float gate = 0.0f;
  Index next_use_step = kNextUseUnknown;
};

/// What the policies are told when a step starts, before its accesses: the step's clock and its
/// routing (the experts it will access and, when traced, the router's top-M candidates).
struct StepContext {
  Index step = 0;
  TraceRecord record;
};

/// An eviction policy: the cache calls reset once, on_step when a step begins, then per access
/// on_hit, or (on a miss that needs room) admit and victim until enough bytes are free, on_evict
/// per victim and on_insert. victim(incoming, pin_counts) names a resident, unpinned slot
/// (pin_counts[slot] == 0) the policy would evict to make room for `incoming`, or -1 if it has
/// none. admit(incoming, ctx) may refuse to cache a missed expert (it is then read for this
/// access only: "bypass"); only Belady refuses.
template <class P>
concept EvictionPolicy = requires(P& p, CacheGeometry const& g, StepContext const& s, Index slot,
                                  AccessContext const& a, std::span<std::uint32_t const> pins) {
  { P::name() } -> std::convertible_to<std::string_view>;
  p.reset(g);
  p.on_step(s);
  p.on_hit(slot, a);
  { p.admit(slot, a) } -> std::same_as<bool>;
  p.on_insert(slot, a);
  p.on_evict(slot);
  { p.victim(slot, pins) } -> std::same_as<Index>;
};

namespace detail {

/// An intrusive doubly linked list over slot indices (most recent at the head).
class SlotList {
 public:
  void reset(Index n) {
    prev_.assign(static_cast<std::size_t>(n), -1);
    next_.assign(static_cast<std::size_t>(n), -1);
    head_ = tail_ = -1;
  }
  void push_front(Index s) {
    prev_[u(s)] = -1;
    next_[u(s)] = head_;
    if (head_ >= 0) prev_[u(head_)] = s;
    head_ = s;
    if (tail_ < 0) tail_ = s;
  }
  void unlink(Index s) {
    Index const p = prev_[u(s)], n = next_[u(s)];
    (p >= 0 ? next_[u(p)] : head_) = n;
    (n >= 0 ? prev_[u(n)] : tail_) = p;
    prev_[u(s)] = next_[u(s)] = -1;
  }
  /// The least recent slot with no pins, or -1.
  Index oldest_unpinned(std::span<std::uint32_t const> pins) const {
    for (Index s = tail_; s >= 0; s = prev_[u(s)])
      if (pins[u(s)] == 0) return s;
    return -1;
  }

 private:
  static std::size_t u(Index s) { return static_cast<std::size_t>(s); }
  std::vector<Index> prev_, next_;
  Index head_ = -1, tail_ = -1;
};

/// Resident slots ordered by a key (ties to the lower slot), with each layer's residents listed:
/// the bookkeeping of the policies that evict the smallest or the largest key. O(log n) per
/// change, O(1) per layer listing.
class KeyedSlots {
 public:
  void reset(Index num_layers, Index num_experts) {
    E_ = num_experts;
    key_.assign(static_cast<std::size_t>(num_layers * num_experts), 0.0);
    position_.assign(key_.size(), 0);
    layers_.assign(static_cast<std::size_t>(num_layers), {});
    order_.clear();
  }
  void insert(Index s, double key) {
    auto& list = layers_[static_cast<std::size_t>(s / E_)];
    position_[u(s)] = list.size();
    list.push_back(s);
    key_[u(s)] = key;
    order_.insert({key, s});
  }
  void erase(Index s) {
    order_.erase({key_[u(s)], s});
    auto& list = layers_[static_cast<std::size_t>(s / E_)];
    std::size_t const p = position_[u(s)];
    list[p] = list.back();
    position_[u(list[p])] = p;
    list.pop_back();
  }
  void rekey(Index s, double key) {
    order_.erase({key_[u(s)], s});
    key_[u(s)] = key;
    order_.insert({key, s});
  }
  /// The residents of layer `layer` (in no particular order).
  std::span<Index const> layer(Index layer) const {
    return layers_[static_cast<std::size_t>(layer)];
  }
  Index smallest_unpinned(std::span<std::uint32_t const> pins) const {
    for (auto const& [key, s] : order_)
      if (pins[u(s)] == 0) return s;
    return -1;
  }
  Index largest_unpinned(std::span<std::uint32_t const> pins) const {
    for (auto it = order_.rbegin(); it != order_.rend(); ++it)
      if (pins[u(it->second)] == 0) return it->second;
    return -1;
  }

 private:
  static std::size_t u(Index s) { return static_cast<std::size_t>(s); }
  Index E_ = 1;
  std::vector<double> key_;
  std::vector<std::size_t> position_;
  std::vector<std::vector<Index>> layers_;
  std::set<std::pair<double, Index>> order_;
};

}  // namespace detail

/// Least recently used: evicts the resident unpinned expert accessed longest ago (any layer).
/// O(1) per access, O(pinned) per victim.
class Lru {
 public:
  static constexpr std::string_view name() { return "lru"; }
  void reset(CacheGeometry const& g) { list_.reset(g.num_slots()); }
  void on_step(StepContext const&) {}
  void on_hit(Index s, AccessContext const&) {
    list_.unlink(s);
    list_.push_front(s);
  }
  bool admit(Index, AccessContext const&) { return true; }
  void on_insert(Index s, AccessContext const&) { list_.push_front(s); }
  void on_evict(Index s) { list_.unlink(s); }
  Index victim(Index, std::span<std::uint32_t const> pins) const {
    return list_.oldest_unpinned(pins);
  }

 private:
  detail::SlotList list_;
};

/// Decayed least frequently used: each expert's use count decays with a half-life of
/// `half_life_tokens` tokens, c <- c * 2^(-dt / half_life) + 1 at each access (counts are kept
/// for evicted experts too, so a popular expert returns with its history); evicts the resident
/// unpinned expert with the smallest decayed count now. The comparison uses the time-invariant
/// key ln c + lambda * t_last (lambda = ln 2 / half-life), so a std::set orders the residents:
/// O(log n) per access.
class DecayedLfu {
 public:
  explicit DecayedLfu(double half_life_tokens = 16.0) : half_life_(half_life_tokens) {
    moe::detail::check(half_life_tokens > 0.0, "moe::offload::DecayedLfu: half_life_tokens ",
                       half_life_tokens, " must be > 0");
  }
  static constexpr std::string_view name() { return "lfu"; }
  void reset(CacheGeometry const& g) {
    lambda_ = std::log(2.0) / (half_life_ * static_cast<double>(g.num_layers));  // per step
    count_.assign(static_cast<std::size_t>(g.num_slots()), 0.0);
    last_.assign(count_.size(), 0);
    residents_.reset(g.num_layers, g.num_experts);
  }
  void on_step(StepContext const&) {}
  void on_hit(Index s, AccessContext const& a) { residents_.rekey(s, bump(s, a.step)); }
  bool admit(Index, AccessContext const&) { return true; }
  void on_insert(Index s, AccessContext const& a) { residents_.insert(s, bump(s, a.step)); }
  void on_evict(Index s) { residents_.erase(s); }
  Index victim(Index, std::span<std::uint32_t const> pins) const {
    return residents_.smallest_unpinned(pins);
  }

 private:
  static std::size_t u(Index s) { return static_cast<std::size_t>(s); }
  /// Counts a use at `step`; returns the expert's new key.
  double bump(Index s, Index step) {
    double& c = count_[u(s)];
    c = c * std::exp(-lambda_ * static_cast<double>(step - last_[u(s)])) + 1.0;
    last_[u(s)] = step;
    return std::log(c) + lambda_ * static_cast<double>(step);
  }
  double half_life_;
  double lambda_ = 0;
  std::vector<double> count_;
  std::vector<Index> last_;
  detail::KeyedSlots residents_;
};

/// Layer-aware LRU: each layer has a quota, budget * (layer's bytes / all experts' bytes); a
/// miss at layer l evicts layer l's least recently used expert when l is at or over its quota,
/// else the least recently used expert of the layer most over its quota (so one layer's burst
/// of misses cannot empty the others). Falls back to any layer with an unpinned resident.
/// reset(g) keeps a pointer to `g` (ExpertCache passes its own geometry, which outlives it).
class LayerAwareLru {
 public:
  static constexpr std::string_view name() { return "layer-lru"; }
  void reset(CacheGeometry const& g) {
    geometry_ = &g;
    auto const L = static_cast<std::size_t>(g.num_layers);
    lists_.assign(L, {});
    for (auto& l : lists_) l.reset(g.num_slots());
    resident_.assign(L, 0);
    quota_.assign(L, 0.0);
    double const total = static_cast<double>(g.total_bytes());
    for (Index s = 0; s < g.num_slots(); ++s)
      quota_[static_cast<std::size_t>(s / g.num_experts)] +=
          static_cast<double>(g.budget_bytes) * static_cast<double>(g.bytes(s)) / total;
  }
  void on_step(StepContext const&) {}
  void on_hit(Index s, AccessContext const&) {
    lists_[layer(s)].unlink(s);
    lists_[layer(s)].push_front(s);
  }
  bool admit(Index, AccessContext const&) { return true; }
  void on_insert(Index s, AccessContext const&) {
    lists_[layer(s)].push_front(s);
    resident_[layer(s)] += geometry_->bytes(s);
  }
  void on_evict(Index s) {
    lists_[layer(s)].unlink(s);
    resident_[layer(s)] -= geometry_->bytes(s);
  }
  Index victim(Index incoming, std::span<std::uint32_t const> pins) const {
    std::size_t const own = layer(incoming);
    if (static_cast<double>(resident_[own] + geometry_->bytes(incoming)) > quota_[own]) {
      Index const v = lists_[own].oldest_unpinned(pins);
      if (v >= 0) return v;
    }
    // The layer most over its quota (relative), with an unpinned resident.
    Index best = -1;
    double best_excess = -std::numeric_limits<double>::infinity();
    for (std::size_t l = 0; l < lists_.size(); ++l) {
      double const excess = static_cast<double>(resident_[l]) - quota_[l];
      if (excess <= best_excess) continue;
      Index const v = lists_[l].oldest_unpinned(pins);
      if (v < 0) continue;
      best = v;
      best_excess = excess;
    }
    return best;
  }

 private:
  std::size_t layer(Index s) const { return static_cast<std::size_t>(s / geometry_->num_experts); }
  CacheGeometry const* geometry_ = nullptr;
  std::vector<detail::SlotList> lists_;
  std::vector<std::uint64_t> resident_;
  std::vector<double> quota_;
};

/// Belady's MIN (offline): evicts the resident unpinned expert whose next use is furthest in the
/// future, and does not cache a missed expert whose own next use is later than that victim's
/// (bypass). Optimal for equal slot sizes (the tests' property: no policy beats it); with unequal
/// sizes it is the classic furthest-next-use heuristic. Needs AccessContext::next_use_step
/// (moe::Error without it). O(log n) per access.
class Belady {
 public:
  static constexpr std::string_view name() { return "belady"; }
  void reset(CacheGeometry const& g) {
    next_.assign(static_cast<std::size_t>(g.num_slots()), kNeverUsedAgain);
    order_.clear();
  }
  void on_step(StepContext const&) {}
  void on_hit(Index s, AccessContext const& a) {
    order_.erase({next_[u(s)], s});
    next_[u(s)] = next_use(a);
    order_.insert({next_[u(s)], s});
  }
  bool admit(Index, AccessContext const& a) {
    Index const mine = next_use(a);
    for (auto it = order_.rbegin(); it != order_.rend(); ++it)
      if (pins_ == nullptr || (*pins_)[u(it->second)] == 0) return mine < it->first;
    return false;
  }
  void on_insert(Index s, AccessContext const& a) {
    next_[u(s)] = next_use(a);
    order_.insert({next_[u(s)], s});
  }
  void on_evict(Index s) { order_.erase({next_[u(s)], s}); }
  Index victim(Index, std::span<std::uint32_t const> pins) const {
    for (auto it = order_.rbegin(); it != order_.rend(); ++it)
      if (pins[u(it->second)] == 0) return it->second;
    return -1;
  }
  /// The cache's pin counts, for admit (set by ExpertCache).
  void watch_pins(std::vector<std::uint32_t> const* pins) { pins_ = pins; }

 private:
  static std::size_t u(Index s) { return static_cast<std::size_t>(s); }
  static Index next_use(AccessContext const& a) {
    moe::detail::check(a.next_use_step != kNextUseUnknown,
                       "moe::offload::Belady: the access has no next_use_step; Belady's MIN "
                       "needs the future of the trace (simulate() provides it)");
    return a.next_use_step;
  }
  std::vector<Index> next_;
  std::set<std::pair<Index, Index>> order_;
  std::vector<std::uint32_t> const* pins_ = nullptr;
};

/// An offline reference, not a deployable policy: given a score for every step and expert,
/// score[(t L + l) E + e] with higher meaning "needed sooner" (make_synthetic_trace's expected
/// next-token logits: what an oracle of the generator's hidden state knows), evicts the resident
/// unpinned expert with the lowest score as of its layer's latest step. It shows how much of the
/// gap between an online policy and Belady any predictor of the next routing could close. The
/// scores must cover every step replayed and outlive the policy. O(resident of the layer) per
/// step, O(log n) per access.
class LatentOracle {
 public:
  explicit LatentOracle(std::span<float const> scores = {}) : scores_(scores) {}
  static constexpr std::string_view name() { return "oracle"; }
  void reset(CacheGeometry const& g) {
    E_ = g.num_experts;
    step_.assign(static_cast<std::size_t>(g.num_layers), -1);
    residents_.reset(g.num_layers, g.num_experts);
  }
  void on_step(StepContext const& ctx) {
    moe::detail::check(static_cast<std::size_t>((ctx.step + 1) * E_) <= scores_.size(),
                       "moe::offload::LatentOracle: no scores for step ", ctx.step);
    step_[static_cast<std::size_t>(ctx.record.layer)] = ctx.step;
    for (Index const s : residents_.layer(ctx.record.layer)) residents_.rekey(s, score(s));
  }
  void on_hit(Index s, AccessContext const&) { residents_.rekey(s, score(s)); }
  bool admit(Index, AccessContext const&) { return true; }
  void on_insert(Index s, AccessContext const&) { residents_.insert(s, score(s)); }
  void on_evict(Index s) { residents_.erase(s); }
  Index victim(Index, std::span<std::uint32_t const> pins) const {
    return residents_.smallest_unpinned(pins);
  }

 private:
  double score(Index s) const {
    Index const step = step_[static_cast<std::size_t>(s / E_)];
    return step < 0 ? -std::numeric_limits<double>::infinity()
                    : static_cast<double>(scores_[static_cast<std::size_t>(step * E_ + s % E_)]);
  }
  std::span<float const> scores_;
  Index E_ = 1;
  std::vector<Index> step_;
  detail::KeyedSlots residents_;
};

/// The result of ExpertCache::access.
enum class AccessOutcome {
  kHit,     ///< resident: no read; now pinned
  kMiss,    ///< not resident: read, cached (victims evicted as needed); now pinned
  kBypass,  ///< not resident and not cached (no room among unpinned slots, or not admitted):
            ///< read into a transient buffer for this access only; not pinned
};

/// The bookkeeping of a bounded expert cache: which (layer, expert) slots are resident, how many
/// bytes they hold (never more than the budget), which are pinned (a kernel reads them: never
/// evicted), and which to evict (the policy). It does no I/O: the expert store reads the slot on
/// kMiss / kBypass and frees the victims' memory (evicted() lists them after each access).
///
/// Protocol per step: begin_step(ctx) once, then access(key, ctx) per expert (pins it unless
/// bypassed), and unpin(key) when the kernel is done with it. Not thread-safe: one owner.
/// \tparam Policy an EvictionPolicy.
template <EvictionPolicy Policy>
class ExpertCache {
 public:
  explicit ExpertCache(CacheGeometry geometry, Policy policy = Policy{})
      : geometry_(std::move(geometry)), policy_(std::move(policy)) {
    geometry_.check();
    auto const n = static_cast<std::size_t>(geometry_.num_slots());
    resident_.assign(n, 0);
    pins_.assign(n, 0);
    policy_.reset(geometry_);
    if constexpr (requires(Policy & p) { p.watch_pins(&pins_); }) policy_.watch_pins(&pins_);
  }
  ExpertCache(ExpertCache const&) = delete;
  ExpertCache& operator=(ExpertCache const&) = delete;

  /// Tells the policy a step begins (its routing, for policies that watch it).
  void begin_step(StepContext const& ctx) { policy_.on_step(ctx); }

  /// One access of `key` (see AccessOutcome). The slots evicted to make room are in evicted().
  AccessOutcome access(ExpertKey key, AccessContext const& ctx) {
    Index const s = checked_slot(key);
    evicted_.clear();
    if (resident_[u(s)] != 0) {
      ++pins_[u(s)];
      policy_.on_hit(s, ctx);
      return AccessOutcome::kHit;
    }
    std::uint64_t const need = geometry_.bytes(s);
    if (need > geometry_.budget_bytes) return AccessOutcome::kBypass;
    if (used_ + need > geometry_.budget_bytes) {
      if (!policy_.admit(s, ctx)) return AccessOutcome::kBypass;
      while (used_ + need > geometry_.budget_bytes) {
        Index const v = policy_.victim(s, pins_);
        if (v < 0) return AccessOutcome::kBypass;
        moe::detail::check(resident_[u(v)] != 0 && pins_[u(v)] == 0,
                           "moe::offload::ExpertCache: policy ", Policy::name(),
                           " named a victim that is not resident or is pinned (a policy bug)");
        policy_.on_evict(v);
        resident_[u(v)] = 0;
        used_ -= geometry_.bytes(v);
        evicted_.push_back(geometry_.key(v));
      }
    }
    resident_[u(s)] = 1;
    used_ += need;
    ++pins_[u(s)];
    policy_.on_insert(s, ctx);
    return AccessOutcome::kMiss;
  }

  /// Pins a resident expert once more (moe::Error if it is not resident).
  void pin(ExpertKey key) {
    Index const s = checked_slot(key);
    moe::detail::check(resident_[u(s)] != 0, "moe::offload::ExpertCache::pin: expert (", key.layer,
                       ", ", key.expert, ") is not resident");
    ++pins_[u(s)];
  }
  /// Releases one pin (moe::Error if the expert has none).
  void unpin(ExpertKey key) {
    Index const s = checked_slot(key);
    moe::detail::check(pins_[u(s)] > 0, "moe::offload::ExpertCache::unpin: expert (", key.layer,
                       ", ", key.expert, ") is not pinned");
    --pins_[u(s)];
  }

  bool resident(ExpertKey key) const { return resident_[u(checked_slot(key))] != 0; }
  bool pinned(ExpertKey key) const { return pins_[u(checked_slot(key))] != 0; }
  /// Experts evicted by the last access (in eviction order).
  std::span<ExpertKey const> evicted() const { return evicted_; }
  std::uint64_t resident_bytes() const { return used_; }
  CacheGeometry const& geometry() const { return geometry_; }
  Policy& policy() { return policy_; }

 private:
  static std::size_t u(Index s) { return static_cast<std::size_t>(s); }
  Index checked_slot(ExpertKey key) const {
    moe::detail::check(key.layer >= 0 && key.layer < geometry_.num_layers && key.expert >= 0 &&
                           key.expert < geometry_.num_experts,
                       "moe::offload::ExpertCache: expert (", key.layer, ", ", key.expert,
                       ") is outside the ", geometry_.num_layers, " x ", geometry_.num_experts,
                       " cache");
    return geometry_.slot(key);
  }
  CacheGeometry geometry_;
  Policy policy_;
  std::vector<unsigned char> resident_;
  std::vector<std::uint32_t> pins_;
  std::vector<ExpertKey> evicted_;
  std::uint64_t used_ = 0;
};

static_assert(EvictionPolicy<Lru>);
static_assert(EvictionPolicy<DecayedLfu>);
static_assert(EvictionPolicy<LayerAwareLru>);
static_assert(EvictionPolicy<Belady>);
static_assert(EvictionPolicy<LatentOracle>);

}  // namespace moe::offload
