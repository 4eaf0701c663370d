// SPDX-License-Identifier: Apache-2.0
// The learned reuse-distance predictor and its eviction policy (moe/offload/predictor.hpp).
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>

#include "moe/offload/predictor.hpp"
#include "moe/offload/simulator.hpp"
#include "moe/offload/synthetic.hpp"

namespace {

using namespace moe::offload;

SyntheticTraceConfig preset(std::uint64_t seed) {
  SyntheticTraceConfig c = qwen3_30b_a3b_trace_config(1000, seed);
  c.num_layers = 8;
  return c;
}

}  // namespace

namespace {

/// Hit rates at a 25% budget on the calibrated trace (8 layers, 1000 tokens, seed 1, 200 tokens
/// of warm-up), the learned policy trained on seed 2. Computed once for the tests below.
struct CalibratedRates {
  double lru, learned, oracle, belady;
  bool latents_change_nothing;
};

CalibratedRates const& calibrated_rates() {
  static CalibratedRates const rates = [] {
    Trace const train = make_synthetic_trace(preset(2));
    std::vector<float> latent;
    Trace const test = make_synthetic_trace(preset(1), &latent);
    Trace const* traces[] = {&train};
    ReusePredictor const p = ReusePredictor::train(traces);
    auto const g = CacheGeometry::uniform(8, 128, 1, static_cast<std::uint64_t>(0.25 * 8 * 128));
    SimulationOptions o;
    o.warmup_tokens = 200;
    std::vector<moe::Index> const next = next_use_steps(test);
    return CalibratedRates{simulate(test, g, Lru{}, o, next).hit_rate,
                           simulate(test, g, LearnedEviction(p), o, next).hit_rate,
                           simulate(test, g, LatentOracle(latent), o, next).hit_rate,
                           simulate(test, g, Belady{}, o, next).hit_rate,
                           test == make_synthetic_trace(preset(1))};
  }();
  return rates;
}

}  // namespace

TEST_CASE("The learned eviction beats LRU on the calibrated trace at a 25% budget",
          "[offload][predictor]") {
  // Trained on one seed, evaluated on another. docs/offload.md has the 48-layer numbers: the
  // issue's target (LRU + 5 points) is not reached; this checks the margin reached (+2.5).
  CalibratedRates const& r = calibrated_rates();
  CAPTURE(r.lru, r.learned, r.belady);
  CHECK(r.learned >= r.lru + 0.025);
  CHECK(r.learned >= r.belady - 0.10);
}

TEST_CASE("The learned eviction is close to an oracle of the generator's hidden state",
          "[offload][predictor]") {
  // LatentOracle evicts by E[next-token logit] given the generator's latents: no online policy
  // knows more about the next routing. On this trace it reaches about LRU + 4 points, which is
  // why the LRU + 5 is out of reach here (docs/offload.md).
  CalibratedRates const& r = calibrated_rates();
  CAPTURE(r.lru, r.learned, r.oracle, r.belady);
  CHECK(r.latents_change_nothing);  // recording the latents does not change the trace
  CHECK(r.oracle > r.learned);
  CHECK(r.oracle < r.belady);
  CHECK(r.oracle < r.lru + 0.05);
  CHECK(r.learned >= r.oracle - 0.02);
}

TEST_CASE("Training is deterministic and the predictor file round-trips exactly",
          "[offload][predictor]") {
  SyntheticTraceConfig c = preset(3);
  c.num_layers = 2;
  c.num_tokens = 300;
  Trace const t = make_synthetic_trace(c);
  Trace const* traces[] = {&t};
  ReusePredictor const a = ReusePredictor::train(traces);
  ReusePredictor const b = ReusePredictor::train(traces);
  CHECK(a.weights() == b.weights());
  ReusePredictor const back = ReusePredictor::from_text(a.to_text());
  CHECK(back.weights() == a.weights());
  std::filesystem::create_directories(MOE_OFFLOAD_TEST_TMP);
  std::string const path = std::string(MOE_OFFLOAD_TEST_TMP) + "/predictor.txt";
  a.save(path);
  CHECK(ReusePredictor::load(path).weights() == a.weights());
  // Too short to train on.
  c.num_tokens = 10;
  Trace const tiny = make_synthetic_trace(c);
  Trace const* few[] = {&tiny};
  CHECK_THROWS_WITH(ReusePredictor::train(few), Catch::Contains("no training examples"));
}

TEST_CASE("Malformed predictor files are rejected", "[offload][predictor]") {
  std::string const good = ReusePredictor().to_text();
  CHECK_NOTHROW(ReusePredictor::from_text(good));
  CHECK_THROWS_WITH(ReusePredictor::from_text(""), Catch::Contains("not a moe reuse-predictor"));
  CHECK_THROWS_WITH(ReusePredictor::from_text("moe-reuse-predictor 2 19\n"),
                    Catch::Contains("version 2"));
  CHECK_THROWS_WITH(ReusePredictor::from_text("moe-reuse-predictor 1 3\n1\n2\n3\n"),
                    Catch::Contains("3 weights"));
  std::string bad = good;
  bad.replace(bad.find("0x0p+0"), 6, "nan");
  CHECK_THROWS_WITH(ReusePredictor::from_text(bad), Catch::Contains("not a finite number"));
  CHECK_THROWS_WITH(ReusePredictor::from_text(good + "1\n"), Catch::Contains("trailing"));
  std::string cut = good.substr(0, good.size() - 8);
  CHECK_THROWS(ReusePredictor::from_text(cut));
  CHECK_THROWS_WITH(ReusePredictor::load("/no/such/predictor"), Catch::Contains("cannot open"));
}

TEST_CASE("The learned eviction works without begin_step (recency alone)", "[offload][predictor]") {
  ExpertCache<LearnedEviction> cache(CacheGeometry::uniform(2, 8, 1, 3));
  for (moe::Index i = 0; i < 40; ++i) {
    ExpertKey const key{static_cast<std::int32_t>(i % 2), static_cast<std::int32_t>(i % 7)};
    AccessOutcome const o = cache.access(key, {i, i / 2, 0, 1.0f});
    REQUIRE(o != AccessOutcome::kBypass);
    cache.unpin(key);
    REQUIRE(cache.resident_bytes() <= 3);
  }
}
