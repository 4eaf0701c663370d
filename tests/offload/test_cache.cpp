// SPDX-License-Identifier: Apache-2.0
// The expert cache's bookkeeping and its eviction policies (moe/offload/cache.hpp), and the
// simulator (moe/offload/simulator.hpp): hand-computed tiny traces, pins, Belady's optimality.
#include <catch2/catch.hpp>
#include <cstdint>
#include <utility>
#include <vector>

#include "moe/offload/cache.hpp"
#include "moe/offload/cache_routing.hpp"
#include "moe/offload/predictor.hpp"
#include "moe/offload/simulator.hpp"
#include "moe/offload/synthetic.hpp"

namespace {

using namespace moe::offload;

/// One layer, top-1: the given sequence of experts, one per token.
Trace sequence(std::vector<std::int32_t> const& experts, moe::Index num_experts) {
  Trace t({1, num_experts, 1, 0});
  float const g[] = {1.0f};
  for (std::int32_t e : experts) t.append(std::span<std::int32_t const>(&e, 1), g);
  return t;
}

SimulationResult run_slots(Trace const& t, auto policy, std::uint64_t slots) {
  SimulationOptions o;
  o.warmup_tokens = 0;
  auto const g = CacheGeometry::uniform(t.shape().num_layers, t.shape().num_experts, 1, slots);
  return simulate(t, g, std::move(policy), o);
}

}  // namespace

TEST_CASE("LRU, decayed LFU and Belady on hand-computed traces", "[offload][cache]") {
  // 0 1 0 2 1 3 0 with two slots: LRU hits only the second 0; LFU likewise (the repeated 0 keeps
  // its count but 1 and 2 push it out by t = 5); Belady keeps {0, 1}, bypasses 2 and 3: 3 hits.
  Trace const a = sequence({0, 1, 0, 2, 1, 3, 0}, 4);
  CHECK(run_slots(a, Lru{}, 2).hits == 1);
  CHECK(run_slots(a, DecayedLfu{}, 2).hits == 1);
  SimulationResult const b = run_slots(a, Belady{}, 2);
  CHECK(b.hits == 3);
  CHECK(b.bypasses == 2);
  CHECK(b.misses == 2);
  // 0 0 0 1 2 0: LRU evicts 0 for 2 (2 hits); LFU keeps the frequent 0 and evicts 1 (3 hits).
  Trace const c = sequence({0, 0, 0, 1, 2, 0}, 4);
  CHECK(run_slots(c, Lru{}, 2).hits == 2);
  CHECK(run_slots(c, DecayedLfu{}, 2).hits == 3);
  CHECK(run_slots(c, Belady{}, 2).hits == 3);
  // Decay: with a half-life of 1 token the three old uses of 0 (count 1.75 at t = 2, 0.44 at
  // t = 4) weigh less than the two recent uses of 1 (1.5 at t = 4), so 2 evicts 0, not 1.
  Trace const d = sequence({0, 0, 0, 1, 1, 2, 1}, 4);
  CHECK(run_slots(d, DecayedLfu(1.0), 2).hits == 4);  // t = 1, 2, 4 and 6
  CHECK(run_slots(sequence({0, 0, 0, 1, 1, 2, 0}, 4), DecayedLfu(1.0), 2).hits == 3);
  // Bytes and the I/O ceiling: 7 accesses, 6 misses of 1 byte over 7 tokens.
  SimulationResult const l = run_slots(a, Lru{}, 2);
  CHECK(l.bytes_per_token == Approx(6.0 / 7.0));
  CHECK(l.misses_per_token == Approx(6.0 / 7.0));
  CHECK(l.io_ceiling_tokens_per_s == Approx(3e9 * 7.0 / 6.0));
}

TEST_CASE("Layer-aware LRU keeps each layer within its share of the budget", "[offload][cache]") {
  AccessContext const ctx{};
  auto fill = [&](auto& cache, std::vector<ExpertKey> const& keys) {
    for (ExpertKey const& k : keys) {
      REQUIRE(cache.access(k, ctx) == AccessOutcome::kMiss);
      cache.unpin(k);
    }
  };
  // Two layers, budget 4 slots: quota 2 each. Layer 1 at its quota evicts its own least recent
  // expert, although layer 0's (0, 0) is the least recent overall (which LRU evicts).
  ExpertCache<LayerAwareLru> aware(CacheGeometry::uniform(2, 8, 1, 4));
  ExpertCache<Lru> lru(CacheGeometry::uniform(2, 8, 1, 4));
  std::vector<ExpertKey> const keys = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {1, 2}};
  fill(aware, keys);
  fill(lru, keys);
  CHECK(aware.resident({0, 0}));
  CHECK_FALSE(aware.resident({1, 0}));
  CHECK_FALSE(lru.resident({0, 0}));
  CHECK(lru.resident({1, 0}));
  // Layer 0 filled the cache alone; layer 1's first miss (under its quota) takes from the layer
  // most over its quota: layer 0's least recent.
  ExpertCache<LayerAwareLru> over(CacheGeometry::uniform(2, 8, 1, 4));
  fill(over, {{0, 0}, {0, 1}, {0, 2}, {0, 3}, {1, 5}});
  CHECK_FALSE(over.resident({0, 0}));
  CHECK(over.resident({0, 1}));
  CHECK(over.resident({1, 5}));
}

TEMPLATE_TEST_CASE("Pinned experts are never evicted, and with every slot pinned a miss bypasses",
                   "[offload][cache]", Lru, DecayedLfu, LayerAwareLru, Belady, LearnedEviction) {
  ExpertCache<TestType> cache(CacheGeometry::uniform(1, 16, 1, 4));
  TraceRng rng(7);
  std::vector<int> pins(16, 0);
  Trace t({1, 16, 1, 0});
  std::int32_t e0 = 0;
  float const g[] = {1.0f};
  t.append(std::span<std::int32_t const>(&e0, 1), g);
  for (moe::Index i = 0; i < 3000; ++i) {
    auto const e = static_cast<std::int32_t>(rng.below(16));
    cache.begin_step({i, t.step(0)});
    AccessContext const ctx{i, i, 0, 1.0f, i + 1 + static_cast<moe::Index>(rng.below(40))};
    AccessOutcome const o = cache.access({0, e}, ctx);
    if (o != AccessOutcome::kBypass) ++pins[static_cast<std::size_t>(e)];
    for (ExpertKey const& v : cache.evicted())
      REQUIRE(pins[static_cast<std::size_t>(v.expert)] == 0);
    for (std::int32_t x = 0; x < 16; ++x)
      if (pins[static_cast<std::size_t>(x)] > 0) REQUIRE(cache.resident({0, x}));
    REQUIRE(cache.resident_bytes() <= 4);
    // Release a random pin now and then (pinned experts pile up to the whole budget at times).
    if (rng.below(3) == 0) {
      auto const x = static_cast<std::int32_t>(rng.below(16));
      if (pins[static_cast<std::size_t>(x)] > 0) {
        cache.unpin({0, x});
        --pins[static_cast<std::size_t>(x)];
      }
    }
  }
  // Pin all four slots: the next miss cannot evict and bypasses.
  ExpertCache<Lru> full(CacheGeometry::uniform(1, 8, 1, 2));
  AccessContext const ctx{0, 0, 0, 1.0f, 5};
  CHECK(full.access({0, 1}, ctx) == AccessOutcome::kMiss);
  CHECK(full.access({0, 2}, ctx) == AccessOutcome::kMiss);
  CHECK(full.access({0, 3}, ctx) == AccessOutcome::kBypass);
  full.unpin({0, 1});
  CHECK(full.access({0, 3}, ctx) == AccessOutcome::kMiss);
  CHECK_FALSE(full.resident({0, 1}));
  CHECK_THROWS_WITH(full.unpin({0, 1}), Catch::Contains("not pinned"));
  CHECK_THROWS_WITH(full.access({1, 0}, ctx), Catch::Contains("outside"));
}

TEST_CASE("No policy beats Belady's MIN (seeds x budgets x localities)", "[offload][cache]") {
  SyntheticTraceConfig const base{
      .num_layers = 3, .num_experts = 16, .top_k = 2, .num_candidates = 6, .num_tokens = 300};
  Trace const train = [&] {
    SyntheticTraceConfig c = base;
    c.persistence = 0.6;
    c.zipf_exponent = 0.5;
    c.seed = 99;
    return make_synthetic_trace(c);
  }();
  Trace const* traces[] = {&train};
  ReusePredictor const predictor = ReusePredictor::train(traces, 16);
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    for (double rho : {0.0, 0.8}) {
      SyntheticTraceConfig c = base;
      c.seed = seed;
      c.persistence = rho;
      c.zipf_exponent = seed % 2 ? 1.0 : 0.0;
      c.topic_period = seed == 3 ? 50 : 0;
      std::vector<float> latent;
      Trace const t = make_synthetic_trace(c, &latent);
      std::vector<moe::Index> const next = next_use_steps(t);
      for (std::uint64_t slots : {2u, 5u, 12u, 24u, 40u}) {
        CAPTURE(seed, rho, slots);
        SimulationOptions o;
        o.warmup_tokens = 0;
        auto const g = CacheGeometry::uniform(3, 16, 1, slots);
        std::int64_t const best = simulate(t, g, Belady{}, o, next).hits;
        CHECK(simulate(t, g, Lru{}, o, next).hits <= best);
        CHECK(simulate(t, g, DecayedLfu{}, o, next).hits <= best);
        CHECK(simulate(t, g, LayerAwareLru{}, o, next).hits <= best);
        CHECK(simulate(t, g, LearnedEviction(predictor), o, next).hits <= best);
        CHECK(simulate(t, g, LatentOracle(latent), o, next).hits <= best);
      }
    }
  }
}

TEST_CASE("A uniform random trace gives hit rates near budget / experts", "[offload][cache]") {
  // i.i.d. uniform top-1 selections: every policy that does not see the future hits B / E in
  // expectation. (With top-k > 1 slightly less: a step's own misses evict experts the step's
  // distinct other choices could have hit, about (B - (K - 1) / 2 * miss rate) / E.)
  SyntheticTraceConfig const c{
      .num_layers = 2, .num_experts = 64, .top_k = 1, .num_tokens = 20000, .seed = 5};
  Trace const t = make_synthetic_trace(c);  // persistence 0, zipf 0: i.i.d. uniform selections
  for (std::uint64_t per_layer : {8u, 16u, 32u}) {
    auto const g = CacheGeometry::uniform(2, 64, 1000, per_layer * 2 * 1000);
    double const expected = static_cast<double>(per_layer) / 64.0;
    CAPTURE(per_layer);
    CHECK(simulate(t, g, Lru{}).hit_rate == Approx(expected).margin(0.015));
    CHECK(simulate(t, g, DecayedLfu{}).hit_rate == Approx(expected).margin(0.015));
    CHECK(simulate(t, g, LayerAwareLru{}).hit_rate == Approx(expected).margin(0.015));
  }
}

TEST_CASE("Cache-aware routing swaps by the guarded rule, hand-computed", "[offload][routing]") {
  // One token, 6 experts, top-3 selected {0, 1, 2} (weights 0.5, 0.3, 0.2); logits
  // 5, 4, 3.9, 3.8, 1, 0 (range 5); experts 0 and 3 resident.
  auto fresh = [] {
    moe::Selection sel;
    sel.reset(1, 3, 6);
    sel.expert = {0, 1, 2};
    sel.weight = {0.5f, 0.3f, 0.2f};
    return sel;
  };
  float const z[] = {5.0f, 4.0f, 3.9f, 3.8f, 1.0f, 0.0f};
  moe::ConstMatrixView<float> const logits(z, 1, 6);
  auto resident = [](moe::ExpertId e) { return e == 0 || e == 3; };
  std::vector<moe::ExpertId> scratch;
  auto run = [&](CacheRoutingOptions o) {
    moe::Selection sel = fresh();
    moe::Index const n = cache_aware_swap(sel, logits, resident, o, scratch);
    CHECK(sel.weight == std::vector<float>{0.5f, 0.3f, 0.2f});  // weights kept as they are
    return std::make_pair(n, sel.expert);
  };
  CacheRoutingOptions o;
  CHECK(run(o).first == 0);  // off: the router's routing
  o.enabled = true;
  // tau 0.05: a gap up to 0.25. Expert 2 (rank 2, not resident) -> 3 (gap 0.1, resident).
  CHECK(run(o) == std::make_pair(moe::Index{1}, std::vector<moe::ExpertId>{0, 1, 3}));
  // Two swaps allowed: expert 1 has no resident substitute within 0.25 (3 is taken, 4 is 3 below).
  o.max_swaps = 2;
  CHECK(run(o) == std::make_pair(moe::Index{1}, std::vector<moe::ExpertId>{0, 1, 3}));
  // tau 1 (gaps up to 5), keep 0: 2 -> 3, then expert 1 finds no resident candidate left (0
  // and 3 are selected).
  o.tau = 1.0f;
  o.keep_top = 0;
  CHECK(run(o) == std::make_pair(moe::Index{1}, std::vector<moe::ExpertId>{0, 1, 3}));
  // Guards: the top 3 kept; tau 0; substitutes only among the top 3 logits (3 is 4th).
  CacheRoutingOptions g = o;
  g.keep_top = 3;
  CHECK(run(g).first == 0);
  g = o;
  g.tau = 0.0f;
  CHECK(run(g).first == 0);
  g = o;
  g.candidates = 3;
  CHECK(run(g).first == 0);
  g = o;
  g.max_swaps = 0;
  CHECK(run(g).first == 0);
}

TEST_CASE("Cache-aware routing options parse and are checked", "[offload][routing]") {
  CacheRoutingOptions const o = parse_cache_routing("tau=0.1,keep=2,swaps=3,candidates=8");
  CHECK(o.enabled);
  CHECK(o.tau == 0.1f);
  CHECK(o.keep_top == 2);
  CHECK(o.max_swaps == 3);
  CHECK(o.candidates == 8);
  CHECK_FALSE(parse_cache_routing("off").enabled);
  CHECK(parse_cache_routing("tau=0.02").keep_top == 1);
  CHECK_THROWS_WITH(parse_cache_routing("tau=2"), Catch::Contains("tau in [0, 1]"));
  CHECK_THROWS_WITH(parse_cache_routing("keep=1.5"), Catch::Contains("'keep=1.5' is not"));
  CHECK_THROWS_WITH(parse_cache_routing("depth=3"), Catch::Contains("'depth=3' is not"));
  CHECK_THROWS_WITH(parse_cache_routing(""), Catch::Contains("'' is not"));
}

TEST_CASE("Cache-aware routing replayed on a trace: tau 0 is exact, a wider rule hits more",
          "[offload][routing]") {
  SyntheticTraceConfig c = qwen3_30b_a3b_trace_config(600, 5);
  c.num_layers = 4;
  Trace const t = make_synthetic_trace(c);
  auto const g = CacheGeometry::uniform(4, c.num_experts, 1, 4 * c.num_experts / 4);
  SimulationOptions o;
  o.warmup_tokens = 100;
  SimulationResult const exact = simulate(t, g, Lru{}, o);
  o.cache_routing = parse_cache_routing("tau=0,keep=1,candidates=16,swaps=2");
  SimulationResult const zero = simulate(t, g, Lru{}, o);
  CHECK(zero.swaps == 0);
  CHECK(zero.hits == exact.hits);
  o.cache_routing = parse_cache_routing("tau=0.1,keep=2,candidates=16,swaps=2");
  SimulationResult const aware = simulate(t, g, Lru{}, o);
  CHECK(aware.swaps > 0);
  CHECK(aware.hit_rate > exact.hit_rate + 0.01);
  CHECK(aware.swapped_weight > 0.0);
  CHECK(aware.swapped_weight < 0.5);
  CHECK_THROWS_WITH(simulate(t, g, Belady{}, o), Catch::Contains("online policy"));
}
