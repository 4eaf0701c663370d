// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ExpertStreamer: routed experts read on demand from an ExpertStore into a bounded cache (a
/// byte budget; ExpertCache's bookkeeping and eviction policies), by a pool of reader threads.
/// A decoder whose expert banks stream their records (ExpertBank::stream_records over
/// records(layer)) calls acquire(layer, experts) once the router has chosen and release(layer)
/// when the experts have run. POSIX only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/offload/cache.hpp"
#include "moe/offload/cache_routing.hpp"
#include "moe/offload/predictor.hpp"
#include "moe/offload/store.hpp"

namespace moe::offload {

/// What an ExpertStreamer did: accesses (one per expert of a layer's step), hits, misses (read
/// into the cache), bypasses (read for one step only: the cache could not take them), bytes
/// read (prefetches included), the seconds acquire() waited for reads; prefetches (experts read
/// ahead by prefetch()) and prefetch hits (accesses that found an expert a prefetch brought in).
struct StreamStats {
  std::uint64_t accesses = 0, hits = 0, misses = 0, bypasses = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t prefetches = 0, prefetch_hits = 0;
  std::uint64_t swaps = 0;  ///< experts cache-aware routing replaced by resident ones
  double wait_seconds = 0.0;
  Index tokens = 0;  ///< tokens seen (begin_forward's counts)
  double hit_rate() const {
    return accesses == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(accesses);
  }
  /// Of the experts read ahead, the share an access then used.
  double prefetch_precision() const {
    return prefetches == 0 ? 0.0
                           : static_cast<double>(prefetch_hits) / static_cast<double>(prefetches);
  }
  /// Of the accesses that would have missed without prefetching, the share a prefetch covered.
  double prefetch_recall() const {
    std::uint64_t const would_miss = prefetch_hits + misses + bypasses;
    return would_miss == 0 ? 0.0
                           : static_cast<double>(prefetch_hits) / static_cast<double>(would_miss);
  }
  double bytes_per_token() const {
    return tokens == 0 ? 0.0 : static_cast<double>(bytes_read) / static_cast<double>(tokens);
  }
};

/// The options of an ExpertStreamer.
struct StreamerOptions {
  /// The most bytes of records resident at once (each record counted at its read size,
  /// StoreRecord::read_bytes). Experts a step needs beyond it are read for that step only.
  std::uint64_t budget_bytes = std::uint64_t{1} << 30;
  /// The eviction policy: "lru", "lfu" (DecayedLfu), "layer-lru" (LayerAwareLru) or "learned"
  /// (LearnedEviction with `predictor`). Belady needs the future and runs only in the simulator.
  std::string policy = "lru";
  double lfu_half_life_tokens = 16.0;
  std::optional<ReusePredictor> predictor;  ///< "learned": required
  /// Reader threads (0: reads in the calling thread, and no prefetching). More threads keep
  /// more reads in flight.
  int reader_threads = 4;
  /// What a decoder reads ahead for the next MoE layer while a layer runs: "none"; "router"
  /// (that layer's router applied to the current hidden state); "previous" (the experts that
  /// layer ran for the previous token); "both".
  std::string prefetch = "router";
  bool prefetch_router() const { return prefetch == "router" || prefetch == "both"; }
  bool prefetch_previous() const { return prefetch == "previous" || prefetch == "both"; }
  /// Cache-aware routing (off by default: routing exactly the router's). A decoder applies it
  /// between routing a layer and requesting its experts.
  CacheRoutingOptions cache_routing;
};

/// The names StreamerOptions::policy takes.
inline constexpr std::string_view kStreamPolicies[] = {"lru", "lfu", "layer-lru", "learned"};

/// Streams routed experts from a RecordSource (an ExpertStore file, or a model's own file)
/// through a bounded cache. Results do not depend on the policy, the budget or the threads: a
/// forward reads the same bytes, only from elsewhere. One forward at a time (acquire, release)
/// per streamer; not thread-safe otherwise.
class ExpertStreamer {
 public:
  ExpertStreamer(std::shared_ptr<RecordSource const> store, StreamerOptions options)
      : store_(std::move(store)), options_(std::move(options)) {
    char const* w = "moe::offload::ExpertStreamer";
    moe::detail::check(store_ != nullptr, w, ": no store");
    moe::detail::check(options_.reader_threads >= 0 && options_.reader_threads <= 256, w,
                       ": reader_threads = ", options_.reader_threads, "; give 0 to 256");
    options_.cache_routing.check();
    moe::detail::check(
        options_.prefetch == "none" || options_.prefetch_router() || options_.prefetch_previous(),
        w, ": prefetch '", options_.prefetch, "'; use none, router, previous or both");
    StoreShape const& s = store_->shape();
    L_ = s.num_layers;
    E_ = s.num_experts;
    CacheGeometry g;
    g.num_layers = L_;
    g.num_experts = E_;
    g.budget_bytes = options_.budget_bytes;
    for (Index l = 0; l < L_; ++l) {
      for (Index e = 0; e < E_; ++e) g.slot_bytes.push_back(store_->buffer_bytes(l, e));
    }
    cache_ = make_cache(std::move(g));
    table_.assign(static_cast<std::size_t>(L_ * E_), nullptr);
    buffers_.resize(table_.size());
    loading_.assign(table_.size(), 0);
    prefetched_.assign(table_.size(), 0);
    held_.resize(static_cast<std::size_t>(L_));
    last_.resize(static_cast<std::size_t>(L_));
    for (int i = 0; i < options_.reader_threads; ++i) {
      readers_.emplace_back([this] { read_loop(); });
    }
  }
  ExpertStreamer(ExpertStreamer const&) = delete;
  ExpertStreamer& operator=(ExpertStreamer const&) = delete;
  ~ExpertStreamer() {
    {
      std::lock_guard<std::mutex> const lock(mutex_);
      stop_ = true;
    }
    work_.notify_all();
    for (std::thread& t : readers_) t.join();
  }

  /// Where the records come from.
  RecordSource const& store() const { return *store_; }
  StreamerOptions const& options() const { return options_; }
  /// The record table of MoE layer `layer` (E entries; null where not resident): what
  /// ExpertBank::stream_records reads. Stable for the streamer's life.
  std::byte const* const* records(Index layer) const {
    moe::detail::check(layer >= 0 && layer < L_, "moe::offload::ExpertStreamer: MoE layer ", layer,
                       " is outside the store's ", L_);
    return table_.data() + layer * E_;
  }

  /// A forward of `tokens` new tokens begins (the policies' clock counts tokens).
  void begin_forward(Index tokens) {
    token_ = stats_.tokens;
    stats_.tokens += tokens;
  }

  /// Makes `experts` of MoE layer `layer` resident (distinct ids; gates[i] the i-th expert's
  /// routing weight, or empty), pinned until release(layer); returns once every record is
  /// there: request() then wait(). Throws moe::Error for bad ids, a layer still held, or a
  /// failed read.
  void acquire(Index layer, std::span<std::int32_t const> experts, std::span<float const> gates) {
    request(layer, experts, gates);
    wait(layer);
  }

  /// acquire() without the wait: pins the hits and starts reading the others (with no reader
  /// threads, reads them). ready(layer) then says which are readable already, wait(layer)
  /// returns when all are: a caller runs the ready experts in between.
  void request(Index layer, std::span<std::int32_t const> experts, std::span<float const> gates) {
    char const* w = "moe::offload::ExpertStreamer::request";
    moe::detail::check(layer >= 0 && layer < L_, w, ": MoE layer ", layer, " is outside the ", L_,
                       " of the store");
    moe::detail::check(gates.empty() || gates.size() == experts.size(), w, ": ", gates.size(),
                       " gates for ", experts.size(), " experts");
    Held& held = held_[static_cast<std::size_t>(layer)];
    moe::detail::check(held.cached.empty() && held.transient.empty(), w, ": MoE layer ", layer,
                       " is still acquired; release it first");
    moe::detail::check(!broken_, w, ": a read failed earlier (", broken_why_,
                       "); the cache may hold a partial record, so make a new streamer");
    seen_.assign(static_cast<std::size_t>(E_), 0);
    for (std::int32_t const e : experts) {
      moe::detail::check(e >= 0 && e < E_, w, ": expert ", e, " is outside [0, ", E_, ")");
      moe::detail::check(seen_[static_cast<std::size_t>(e)]++ == 0, w, ": expert ", e,
                         " is listed twice");
    }
    Index const step = token_ * L_ + layer;
    gates_.assign(gates.begin(), gates.end());
    gates_.resize(experts.size(), 0.0f);
    collect_prefetches();
    cache_->begin_step({step, TraceRecord{token_, layer, experts, gates_, {}, {}}});
    pending_reads_.clear();
    for (std::size_t i = 0; i < experts.size(); ++i) {
      std::int32_t const e = experts[i];
      ExpertKey const key{static_cast<std::int32_t>(layer), e};
      AccessContext const ctx{step, token_, static_cast<Index>(i), gates_[i]};
      ++stats_.accesses;
      std::size_t const s = slot(layer, e);
      std::uint64_t const bytes = store_->buffer_bytes(layer, e);
      switch (cache_->access(key, ctx)) {
        case AccessOutcome::kHit:
          ++stats_.hits;
          if (prefetched_[s] != 0) {
            prefetched_[s] = 0;
            ++stats_.prefetch_hits;
          }
          held.cached.push_back(e);
          break;
        case AccessOutcome::kMiss:
          held.cached.push_back(e);
          place_miss(layer, e, false);
          ++stats_.misses;
          break;
        case AccessOutcome::kBypass:
          held.transient.emplace_back(e, RecordBuffer(bytes));
          table_[s] = held.transient.back().second.data();
          pending_reads_.push_back({layer, e, held.transient.back().second.data(), s, false});
          ++stats_.bypasses;
          stats_.bytes_read += bytes;
          break;
      }
    }
    spare_.clear();  // evicted buffers no miss of this step reused: give their memory back
    std::vector<std::int32_t>& last = last_[static_cast<std::size_t>(layer)];
    last.assign(experts.begin(), experts.end());
    guarded([&] { issue_reads(); });
  }

  /// [E] per expert of MoE layer `layer`: 1 if the last request() holds it and its record is
  /// readable now, else 0. Valid until the next call on the streamer.
  std::span<unsigned char const> ready(Index layer) {
    ready_.assign(static_cast<std::size_t>(E_), 0);
    Held const& held = held_.at(static_cast<std::size_t>(layer));
    std::lock_guard<std::mutex> const lock(mutex_);
    for (std::int32_t const e : held.cached)
      ready_[static_cast<std::size_t>(e)] = loading_[slot(layer, e)] == 0;
    for (auto const& [e, buf] : held.transient) {
      ready_[static_cast<std::size_t>(e)] = loading_[slot(layer, e)] == 0;
    }
    return ready_;
  }

  /// Returns when every expert the last request() of MoE layer `layer` holds is readable.
  void wait(Index layer) {
    guarded([&] { wait_reads(layer); });
  }

  /// Reads `experts` of MoE layer `layer` ahead, in the background, into the cache (those not
  /// resident and for which the cache makes room without evicting a pinned expert); acquire()
  /// of that layer then finds them resident, or waits for the reads in flight. Demand reads go
  /// first. A no-op without reader threads. Ids are checked as acquire checks them.
  void prefetch(Index layer, std::span<std::int32_t const> experts) {
    char const* w = "moe::offload::ExpertStreamer::prefetch";
    moe::detail::check(layer >= 0 && layer < L_, w, ": MoE layer ", layer, " is outside the ", L_,
                       " of the store");
    if (readers_.empty() || broken_) return;
    collect_prefetches();
    Index const step = token_ * L_ + layer;
    std::size_t const first = pending_reads_.size();
    // The listed experts already resident are pinned for the while (and count as used now), so
    // that reading the others does not evict them.
    touched_.clear();
    for (std::int32_t const e : experts) {
      moe::detail::check(e >= 0 && e < E_, w, ": expert ", e, " is outside [0, ", E_, ")");
      ExpertKey const key{static_cast<std::int32_t>(layer), e};
      if (cache_->resident(key)) {
        (void)cache_->access(key, AccessContext{step, token_, E_, 0.0f});
        touched_.push_back(key);
      }
    }
    for (std::int32_t const e : experts) {
      ExpertKey const key{static_cast<std::int32_t>(layer), e};
      if (cache_->resident(key)) continue;
      if (cache_->access(key, AccessContext{step, token_, E_, 0.0f}) != AccessOutcome::kMiss) {
        continue;  // a bypass: no room, nothing read
      }
      place_miss(layer, e, true);
      prefetched_[slot(layer, e)] = 1;
      ++stats_.prefetches;
    }
    spare_.clear();
    for (ExpertKey const& k : touched_) cache_->unpin(k);
    if (pending_reads_.size() == first) return;
    {
      std::lock_guard<std::mutex> const lock(mutex_);
      for (std::size_t i = first; i < pending_reads_.size(); ++i) {
        loading_[pending_reads_[i].slot] = 1;
        prefetch_q_.push_back(pending_reads_[i]);
      }
    }
    pending_reads_.resize(first);
    work_.notify_all();
  }
  /// The experts the last acquire() of MoE layer `layer` made resident (empty before one).
  std::span<std::int32_t const> last_experts(Index layer) const {
    return last_.at(static_cast<std::size_t>(layer));
  }

  /// Unpins MoE layer `layer`'s experts of the last acquire and drops its bypassed records.
  void release(Index layer) {
    moe::detail::check(layer >= 0 && layer < L_,
                       "moe::offload::ExpertStreamer::release: MoE layer ", layer,
                       " is outside the ", L_, " of the store");
    Held& held = held_[static_cast<std::size_t>(layer)];
    // A request released without its wait (an exception between them): its reads finish before
    // their buffers may be evicted or freed. A read's error stays for the next wait.
    if (!readers_.empty()) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [&] { return !held_loading(layer); });
    }
    for (std::int32_t const e : held.cached) cache_->unpin({static_cast<std::int32_t>(layer), e});
    for (auto const& [e, buf] : held.transient) table_[slot(layer, e)] = nullptr;
    held.cached.clear();
    held.transient.clear();
  }

  StreamStats const& stats() const { return stats_; }
  void reset_stats() {
    Index const tokens = stats_.tokens;
    stats_ = {};
    stats_.tokens = tokens;
    tokens_at_reset_ = tokens;
  }
  /// Counts experts cache-aware routing swapped (StreamStats::swaps).
  void count_swaps(Index n) { stats_.swaps += static_cast<std::uint64_t>(n); }
  /// Tokens counted since the last reset_stats (stats().tokens counts from the start).
  Index tokens_since_reset() const { return stats_.tokens - tokens_at_reset_; }
  std::uint64_t resident_bytes() const { return cache_->resident_bytes(); }
  bool resident(Index layer, Index expert) const {
    return cache_->resident({static_cast<std::int32_t>(layer), static_cast<std::int32_t>(expert)});
  }

 private:
  struct Held {
    std::vector<std::int32_t> cached;
    std::vector<std::pair<std::int32_t, RecordBuffer>> transient;
  };
  struct Read {
    Index layer;
    Index expert;
    std::byte* dst;
    std::size_t slot;
    bool prefetch;
  };
  /// The cache, whatever its policy.
  struct Cache {
    virtual ~Cache() = default;
    virtual void begin_step(StepContext const& c) = 0;
    virtual AccessOutcome access(ExpertKey k, AccessContext const& c) = 0;
    virtual std::span<ExpertKey const> evicted() const = 0;
    virtual void unpin(ExpertKey k) = 0;
    virtual bool resident(ExpertKey k) const = 0;
    virtual std::uint64_t resident_bytes() const = 0;
  };
  template <class Policy>
  struct CacheOf final : Cache {
    CacheOf(CacheGeometry g, Policy p) : cache(std::move(g), std::move(p)) {}
    void begin_step(StepContext const& c) override { cache.begin_step(c); }
    AccessOutcome access(ExpertKey k, AccessContext const& c) override {
      return cache.access(k, c);
    }
    std::span<ExpertKey const> evicted() const override { return cache.evicted(); }
    void unpin(ExpertKey k) override { cache.unpin(k); }
    bool resident(ExpertKey k) const override { return cache.resident(k); }
    std::uint64_t resident_bytes() const override { return cache.resident_bytes(); }
    ExpertCache<Policy> cache;
  };
  std::unique_ptr<Cache> make_cache(CacheGeometry g) const {
    std::string_view const p = options_.policy;
    if (p == "lru") return std::make_unique<CacheOf<Lru>>(std::move(g), Lru{});
    if (p == "lfu") {
      return std::make_unique<CacheOf<DecayedLfu>>(std::move(g),
                                                   DecayedLfu(options_.lfu_half_life_tokens));
    }
    if (p == "layer-lru") {
      return std::make_unique<CacheOf<LayerAwareLru>>(std::move(g), LayerAwareLru{});
    }
    if (p == "learned") {
      moe::detail::check(options_.predictor.has_value(),
                         "moe::offload::ExpertStreamer: the learned policy needs a predictor "
                         "(ReusePredictor::load of one moe_cache_sim --train-predictor wrote)");
      return std::make_unique<CacheOf<LearnedEviction>>(std::move(g),
                                                        LearnedEviction(*options_.predictor));
    }
    moe::detail::fail("moe::offload::ExpertStreamer: unknown cache policy '", p,
                      "'; use lru, lfu, layer-lru or learned (belady needs the future: "
                      "moe_cache_sim replays it on a trace)");
  }
  std::size_t slot(Index layer, Index e) const { return static_cast<std::size_t>(layer * E_ + e); }
  /// A miss the cache just admitted: the evicted experts' buffers to spare_, a buffer for
  /// (layer, e), and its read queued in pending_reads_.
  void place_miss(Index layer, std::int32_t e, bool prefetch) {
    for (ExpertKey const& v : cache_->evicted()) {
      std::size_t const vs = slot(v.layer, v.expert);
      table_[vs] = nullptr;
      prefetched_[vs] = 0;
      spare_.push_back(std::move(buffers_[vs]));
    }
    std::size_t const s = slot(layer, e);
    std::uint64_t const bytes = store_->buffer_bytes(layer, e);
    buffers_[s] = take_buffer(bytes);
    table_[s] = buffers_[s].data();
    pending_reads_.push_back({layer, e, buffers_[s].data(), s, prefetch});
    stats_.bytes_read += bytes;
  }
  /// Is any expert MoE layer `layer`'s request holds still being read? (Under mutex_.)
  bool held_loading(Index layer) const {
    Held const& held = held_[static_cast<std::size_t>(layer)];
    for (std::int32_t const e : held.cached) {
      if (loading_[slot(layer, e)] != 0) return true;
    }
    for (auto const& [e, buf] : held.transient) {
      if (loading_[slot(layer, e)] != 0) return true;
    }
    return false;
  }
  /// A buffer of `bytes` (read size): an evicted one of that size, or a new one.
  RecordBuffer take_buffer(std::uint64_t bytes) {
    for (RecordBuffer& b : spare_) {
      if (b && b.size() == bytes) return std::move(b);
    }
    return RecordBuffer(bytes);
  }
  /// Runs f; a failed read marks the streamer broken (the cache may hold a partial record).
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (std::exception const& e) {
      broken_ = true;
      broken_why_ = e.what();
      throw;
    }
  }
  /// Starts pending_reads_ (demand reads) on the reader threads, or runs them here without any.
  void issue_reads() {
    if (readers_.empty()) {
      auto const t0 = std::chrono::steady_clock::now();
      for (Read const& r : pending_reads_) store_->read(r.layer, r.expert, r.dst);
      stats_.wait_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } else if (!pending_reads_.empty()) {
      {
        std::lock_guard<std::mutex> const lock(mutex_);
        for (Read const& r : pending_reads_) {
          loading_[r.slot] = 1;
          demand_q_.push_back(r);
        }
      }
      work_.notify_all();
    }
    pending_reads_.clear();
  }
  /// Waits until no expert of MoE layer `layer` that its request holds is being read (demand
  /// reads and prefetches), and rethrows a failed read.
  void wait_reads(Index layer) {
    if (readers_.empty()) return;
    auto const t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return error_ || !held_loading(layer); });
    if (error_) {
      std::exception_ptr const e = std::exchange(error_, nullptr);
      lock.unlock();
      std::rethrow_exception(e);
    }
    stats_.wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  /// Unpins the prefetches whose reads are done (the readers cannot touch the cache).
  void collect_prefetches() {
    std::vector<std::size_t>& done = prefetch_collected_;  // swapped, so neither reallocates
    done.clear();
    {
      std::lock_guard<std::mutex> const lock(mutex_);
      done.swap(prefetch_done_);
    }
    for (std::size_t const s : done) {
      cache_->unpin({static_cast<std::int32_t>(static_cast<Index>(s) / E_),
                     static_cast<std::int32_t>(static_cast<Index>(s) % E_)});
    }
  }
  void read_loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !demand_q_.empty() || !prefetch_q_.empty(); });
      if (stop_) return;
      std::deque<Read>& q = demand_q_.empty() ? prefetch_q_ : demand_q_;
      Read const r = q.front();
      q.pop_front();
      lock.unlock();
      std::exception_ptr err;
      try {
        store_->read(r.layer, r.expert, r.dst);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      if (err && !error_) error_ = err;
      loading_[r.slot] = 0;
      if (r.prefetch) prefetch_done_.push_back(r.slot);
      done_.notify_all();
    }
  }

  std::shared_ptr<RecordSource const> store_;
  StreamerOptions options_;
  Index L_ = 0, E_ = 0;
  std::unique_ptr<Cache> cache_;
  std::vector<std::byte const*> table_;          // [L * E] the resident (or bypassed) records
  std::vector<RecordBuffer> buffers_;            // [L * E] the cached records' memory
  std::vector<RecordBuffer> spare_;              // evicted this step, for this step's misses
  std::vector<Held> held_;                       // [L] what the last acquire of each layer holds
  std::vector<std::vector<std::int32_t>> last_;  // [L] the experts of each layer's last acquire
  std::vector<unsigned char> prefetched_;        // [L * E] brought in by a prefetch, not used yet
  std::vector<float> gates_;
  std::vector<unsigned char> seen_, ready_;
  std::vector<ExpertKey> touched_;
  bool broken_ = false;
  std::string broken_why_;
  std::vector<Read> pending_reads_;
  Index token_ = 0, tokens_at_reset_ = 0;
  StreamStats stats_;
  // Reader threads.
  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<Read> demand_q_, prefetch_q_;
  std::vector<unsigned char> loading_;  // [L * E] a read into the slot is in flight
  std::vector<std::size_t> prefetch_done_;
  std::vector<std::size_t> prefetch_collected_;  // collect_prefetches' side of the swap  //
                                                 // prefetched slots read, still pinned
  std::exception_ptr error_;
  bool stop_ = false;
  std::vector<std::thread> readers_;
};

}  // namespace moe::offload
