// SPDX-License-Identifier: Apache-2.0
// The expert store file (moe/offload/store.hpp) and the streamer (moe/offload/streamer.hpp):
// records round-trip bit for bit, bad files are refused with what is wrong, and an MoE layer
// whose experts stream through the cache gives the resident layer's outputs bit for bit, for
// every policy, budget (down to nothing cached) and reader-thread count.
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "moe/core/random.hpp"
#include "moe/layers/presets.hpp"
#include "moe/offload/store.hpp"
#include "moe/offload/streamer.hpp"

namespace {

using moe::Index;
using moe::experts::ExpertFormat;
using moe::experts::WeightFormat;
using namespace moe::offload;

std::string tmp(std::string const& name) {
  std::filesystem::create_directories(MOE_OFFLOAD_TEST_TMP);
  return std::string(MOE_OFFLOAD_TEST_TMP) + "/" + name;
}

/// A Qwen3-MoE-like layer (GLU experts, softmax top-k) with random weights; D and F multiples of
/// 256 and of the panel width, so that every format holds them.
moe::presets::Qwen3Moe make_layer(std::uint64_t seed, Index E = 6, Index D = 256, Index F = 256) {
  moe::presets::Qwen3Moe m = moe::presets::make_qwen3_moe({D, F, E, 2, true});
  moe::fill_uniform(m.experts().edit().parameters(), -0.1f, 0.1f, seed);
  auto wr = m.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                    0.5f, seed + 1000);
  return m;
}

std::vector<ExpertFormat> mixed_formats(Index E) {
  WeightFormat const f[] = {WeightFormat::kF32,  WeightFormat::kBf16, WeightFormat::kQ8_0,
                            WeightFormat::kQ4_K, WeightFormat::kQ6_K, WeightFormat::kIQ4_XS};
  std::vector<ExpertFormat> out;
  for (Index e = 0; e < E; ++e) out.push_back({f[e % 6], f[(e + 2) % 6]});
  return out;
}

/// A store of one MoE layer: `bank`'s records.
template <class Bank>
void write_layer(std::string const& path, Bank const& bank) {
  ExpertStoreWriter w(path, {1, bank.num_experts(), bank.d_model(), bank.d_ffn(), true});
  w.add_layer(bank);
  w.finish();
}

std::vector<char> file_bytes(std::string const& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(std::string const& path, std::vector<char> const& b) {
  std::ofstream(path, std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
}

}  // namespace

TEST_CASE("An expert store holds every record bit for bit, 4 KiB-aligned", "[offload][store]") {
  auto a = make_layer(1), b = make_layer(2);
  a.experts().pack(mixed_formats(6));
  b.experts().pack(WeightFormat::kQ4_K);
  std::string const path = tmp("two_layers.moex");
  {
    ExpertStoreWriter w(path, {2, 6, 256, 256, true});
    w.add_layer(a.experts());
    w.add_layer(b.experts());
    w.finish();
  }
  for (bool const direct : {false, true}) {
    ExpertStore const s(path, {direct, 0.0, 0.0});
    CHECK(s.shape() == StoreShape{2, 6, 256, 256, true});
    CHECK(s.panel_width() == moe::kernels::panel_width());
    s.check_layer(0, a.experts());
    s.check_layer(1, b.experts());
    for (Index l = 0; l < 2; ++l) {
      auto const& bank = (l == 0 ? a : b).experts();
      for (Index e = 0; e < 6; ++e) {
        StoreRecord const& r = s.record(l, e);
        CHECK(r.offset % kStoreAlign == 0);
        CHECK(r.format == bank.packed_formats()[static_cast<std::size_t>(e)]);
        REQUIRE(r.bytes == bank.packed_record(e).size());
        RecordBuffer buf(r.bytes);
        s.read(l, e, buf.data());
        CHECK(std::memcmp(buf.data(), bank.packed_record(e).data(), r.bytes) == 0);
      }
    }
  }
  // A writer that does not finish leaves no file.
  std::string const partial = tmp("partial.moex");
  {
    ExpertStoreWriter w(partial, {2, 6, 256, 256, true});
    w.add_layer(a.experts());
    CHECK_THROWS_WITH(w.finish(), Catch::Contains("1 of 2 layers written"));
  }
  CHECK_FALSE(std::filesystem::exists(partial));
  // Shapes that are not the store's.
  ExpertStoreWriter w(tmp("wrong.moex"), {1, 5, 256, 256, true});
  CHECK_THROWS_WITH(w.add_layer(a.experts()), Catch::Contains("the store holds 5"));
  auto unpacked = make_layer(3);
  ExpertStoreWriter w2(tmp("unpacked.moex"), {1, 6, 256, 256, true});
  CHECK_THROWS_WITH(w2.add_layer(unpacked.experts()), Catch::Contains("not packed"));
}

TEST_CASE("A damaged expert store is refused with what is wrong", "[offload][store]") {
  auto a = make_layer(4);
  a.experts().pack(WeightFormat::kQ8_0);
  std::string const path = tmp("good.moex");
  write_layer(path, a.experts());
  std::vector<char> const good = file_bytes(path);
  auto refused = [&](auto edit, char const* what) {
    std::vector<char> b = good;
    edit(b);
    std::string const bad = tmp("bad.moex");
    write_bytes(bad, b);
    CHECK_THROWS_WITH(ExpertStore(bad), Catch::Contains(what));
  };
  auto put32 = [](std::vector<char>& b, std::size_t at, std::uint32_t v) {
    std::memcpy(b.data() + at, &v, 4);
  };
  auto put64 = [](std::vector<char>& b, std::size_t at, std::uint64_t v) {
    std::memcpy(b.data() + at, &v, 8);
  };
  refused([](std::vector<char>& b) { b[0] = 'X'; }, "no MOEXPERT magic");
  refused([&](std::vector<char>& b) { put32(b, 8, 2); }, "version 2");
  refused([&](std::vector<char>& b) { put32(b, 28, 0); }, "0 experts");
  refused([&](std::vector<char>& b) { put32(b, 24, 70000); }, "70000 layers");
  refused([&](std::vector<char>& b) { put64(b, 48, 100); }, "data offset 100");
  refused([&](std::vector<char>& b) { put64(b, 56, 1); }, "reserved");
  refused([&](std::vector<char>& b) { put32(b, 64, 999); }, "format id 999");
  // Expert 1's record moved onto expert 0's: out of order.
  refused([&](std::vector<char>& b) { put64(b, 64 + 32 + 8, 4096); }, "expert (0, 1)");
  refused([&](std::vector<char>& b) { put64(b, 64 + 16, 100); }, "a multiple of 64");
  refused([&](std::vector<char>& b) { b.resize(b.size() - 4096); }, "inside the file");
  refused([&](std::vector<char>& b) { b.resize(40); }, "fewer than a header's 64");
  CHECK_THROWS_WITH(ExpertStore(tmp("no_such.moex")), Catch::Contains("cannot open"));

  // Another machine's panel width: quantized records are the same everywhere, fp32 / bf16 ones
  // are not.
  std::vector<char> b = good;
  put32(b, 12, static_cast<std::uint32_t>(moe::kernels::panel_width() / 2));
  write_bytes(tmp("narrow.moex"), b);
  ExpertStore const narrow(tmp("narrow.moex"));
  narrow.check_layer(0, a.experts());
  auto dense = make_layer(4);
  dense.experts().pack(mixed_formats(6));
  write_layer(tmp("dense.moex"), dense.experts());
  std::vector<char> d = file_bytes(tmp("dense.moex"));
  put32(d, 12, static_cast<std::uint32_t>(moe::kernels::panel_width() / 2));
  write_bytes(tmp("dense_narrow.moex"), d);
  ExpertStore const dense_narrow(tmp("dense_narrow.moex"));
  CHECK_THROWS_WITH(dense_narrow.check_layer(0, dense.experts()),
                    Catch::Contains("write the store again on this machine"));
  ExpertStore const s(path);
  auto other = make_layer(5, 6, 256, 512);
  other.experts().pack(WeightFormat::kQ8_0);
  CHECK_THROWS_WITH(s.check_layer(0, other.experts()), Catch::Contains("another model"));
}

TEST_CASE("A throttled store reads no faster than its bandwidth and latency", "[offload][store]") {
  auto a = make_layer(6);
  a.experts().pack(WeightFormat::kF32);  // 6 records of ~790 KB
  std::string const path = tmp("throttle.moex");
  write_layer(path, a.experts());
  double const bw = 200e6, latency = 0.002;
  ExpertStore const s(path, {false, bw, latency});
  std::uint64_t bytes = 0;
  auto const t0 = std::chrono::steady_clock::now();
  for (Index e = 0; e < 6; ++e) {
    RecordBuffer buf(s.record(0, e).bytes);
    s.read(0, e, buf.data());
    bytes += s.record(0, e).read_bytes();
  }
  double const took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Serial reads: each waits for its transfer and its latency (a lower bound only: the machine
  // may be slower, never faster).
  CHECK(took >= static_cast<double>(bytes) / bw + 6 * latency - 1e-3);
  CHECK_THROWS_WITH(ExpertStore(path, {false, -1.0, 0.0}), Catch::Contains("bandwidth"));
}

TEST_CASE("An MoE layer streaming its experts gives the resident outputs bit for bit",
          "[offload][store]") {
  Index const E = 6, D = 256, T = 5;
  auto resident = make_layer(7, E, D);
  resident.experts().pack(mixed_formats(E));
  std::string const path = tmp("layer.moex");
  write_layer(path, resident.experts());
  auto const store = std::make_shared<ExpertStore const>(path);
  std::vector<float> x(static_cast<std::size_t>(4 * T * D));
  moe::fill_uniform(x, -1.0f, 1.0f, 8);
  std::uint64_t const record = store->record(0, 0).read_bytes();

  std::string const policy = GENERATE(as<std::string>{}, "lru", "lfu", "layer-lru", "learned");
  // Budgets: nothing, less than one token's two experts, three records, all.
  std::uint64_t const budget = GENERATE_COPY(std::uint64_t{0}, record, 3 * record, 100 * record);
  int const threads = GENERATE(0, 3);
  INFO(policy << ", budget " << budget << ", " << threads << " reader threads");
  StreamerOptions o;
  o.policy = policy;
  o.budget_bytes = budget;
  o.reader_threads = threads;
  if (policy == "learned") o.predictor = ReusePredictor{};
  ExpertStreamer streamer(store, o);
  auto streamed = resident;
  streamed.experts().stream_records(store->layer_formats(0), streamer.records(0));
  CHECK(streamed.experts().records_streamed());
  CHECK_FALSE(streamed.experts().has_master_weights());

  moe::MoeFfnWorkspace ws_a, ws_b;
  std::vector<float> ya(static_cast<std::size_t>(T * D)), yb(ya.size());
  std::vector<std::int32_t> ids;
  for (Index step = 0; step < 4; ++step) {
    moe::ConstMatrixView<float> xs(x.data() + step * T * D, T, D);
    resident.forward(xs, moe::MatrixView<float>(ya.data(), T, D), ws_a);
    streamer.begin_forward(T);
    streamed.route(xs, ws_b);
    ids.clear();
    for (Index e = 0; e < E; ++e) {
      if (ws_b.plan.expert_rows(e) > 0) ids.push_back(static_cast<std::int32_t>(e));
    }
    // Before acquire the experts are not readable (unless cached from an earlier step).
    streamer.acquire(0, ids, {});
    streamed.forward_with_plan(xs, ws_b.plan, moe::MatrixView<float>(yb.data(), T, D), ws_b);
    streamer.release(0);
    REQUIRE(std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0);
    CHECK(streamer.resident_bytes() <= budget);
  }
  StreamStats const& st = streamer.stats();
  CHECK(st.accesses == st.hits + st.misses + st.bypasses);
  CHECK(st.tokens == 4 * T);
  if (budget == 0) CHECK(st.bypasses == st.accesses);
  if (budget >= 100 * record) CHECK(st.misses <= static_cast<std::uint64_t>(E));
  std::uint64_t lo = record, hi = 0;
  for (StoreRecord const& r : store->layer_records(0)) {
    lo = std::min(lo, r.read_bytes());
    hi = std::max(hi, r.read_bytes());
  }
  CHECK(st.bytes_read >= (st.misses + st.bypasses) * lo);
  CHECK(st.bytes_read <= (st.misses + st.bypasses) * hi);
}

TEST_CASE("Prefetched experts are hits, counted as such; the outputs do not change",
          "[offload][store]") {
  Index const E = 6, D = 256, T = 1;
  auto resident = make_layer(11, E, D);
  resident.experts().pack(WeightFormat::kQ4_K);
  std::string const path = tmp("prefetch.moex");
  write_layer(path, resident.experts());
  auto const store = std::make_shared<ExpertStore const>(path);
  std::uint64_t const record = store->record(0, 0).read_bytes();
  StreamerOptions o;
  o.budget_bytes = 4 * record;
  o.reader_threads = 2;
  ExpertStreamer streamer(store, o);
  auto streamed = resident;
  streamed.experts().stream_records(store->layer_formats(0), streamer.records(0));
  std::vector<float> x(static_cast<std::size_t>(8 * D));
  moe::fill_uniform(x, -1.0f, 1.0f, 12);
  moe::MoeFfnWorkspace ws_a, ws_b;
  std::vector<float> ya(static_cast<std::size_t>(D)), yb(ya.size());
  std::vector<std::int32_t> ids;
  std::uint64_t used = 0;
  for (Index step = 0; step < 8; ++step) {
    moe::ConstMatrixView<float> xs(x.data() + step * D, T, D);
    resident.forward(xs, moe::MatrixView<float>(ya.data(), T, D), ws_a);
    streamer.begin_forward(T);
    streamed.route(xs, ws_b);
    ids.clear();
    for (Index e = 0; e < E; ++e) {
      if (ws_b.plan.expert_rows(e) > 0) ids.push_back(static_cast<std::int32_t>(e));
    }
    // Read this step's experts ahead (as the decoder does one layer early), then acquire: every
    // one is a hit, a prefetch hit unless it was resident already.
    std::uint64_t const hits = streamer.stats().hits, before = streamer.stats().prefetch_hits;
    std::uint64_t fresh = 0;
    for (std::int32_t const e : ids) fresh += streamer.resident(0, e) ? 0 : 1;
    streamer.prefetch(0, ids);
    streamer.acquire(0, ids, {});
    CHECK(streamer.stats().hits - hits == ids.size());
    CHECK(streamer.stats().prefetch_hits - before == fresh);
    used += fresh;
    streamed.forward_with_plan(xs, ws_b.plan, moe::MatrixView<float>(yb.data(), T, D), ws_b);
    streamer.release(0);
    REQUIRE(std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0);
  }
  StreamStats const& st = streamer.stats();
  CHECK(st.misses == 0);
  CHECK(st.prefetches == used);
  CHECK(st.prefetch_precision() == 1.0);
  CHECK(st.prefetch_recall() == 1.0);
  // An unknown prefetch mode is refused.
  o.prefetch = "later";
  CHECK_THROWS_WITH(ExpertStreamer(store, o),
                    Catch::Contains("use none, router, previous or both"));
}

TEST_CASE("A forward in two steps (ready experts first) gives the one-step outputs bit for bit",
          "[offload][store]") {
  // Qwen2-MoE-like (a gated shared expert runs in the first step), bf16 and q8_0 experts (the
  // bf16-pair and int8-row inputs of the down projections are made in both steps).
  Index const E = 8, D = 256, F = 256, T = 6;
  WeightFormat const f = GENERATE(WeightFormat::kBf16, WeightFormat::kQ8_0, WeightFormat::kF32);
  auto layer = moe::presets::make_qwen2_moe({D, F, 512, E, 3, true});
  moe::fill_uniform(layer.experts().edit().parameters(), -0.1f, 0.1f, 21);
  moe::fill_uniform(layer.shared_experts().bank().edit().parameters(), -0.1f, 0.1f, 22);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                    0.5f, 23);
  layer.pack_weights({f, f}, {f, f});
  std::vector<float> x(static_cast<std::size_t>(T * D)), ya(x.size()), yb(x.size());
  moe::fill_uniform(x, -1.0f, 1.0f, 24);
  moe::ConstMatrixView<float> xs(x.data(), T, D);
  moe::MoeFfnWorkspace ws;
  layer.forward(xs, moe::MatrixView<float>(ya.data(), T, D), ws);
  for (std::uint64_t seed = 0; seed < 6; ++seed) {
    std::vector<unsigned char> ready(static_cast<std::size_t>(E));
    for (Index e = 0; e < E; ++e) ready[static_cast<std::size_t>(e)] = ((seed * 7 + e * 3) % 5) < 2;
    if (seed == 4) std::fill(ready.begin(), ready.end(), 0);  // nothing ready
    if (seed == 5) std::fill(ready.begin(), ready.end(), 1);  // everything
    int waits = 0;
    std::fill(yb.begin(), yb.end(), -7.0f);
    layer.forward_with_plan(xs, ws.plan, moe::MatrixView<float>(yb.data(), T, D), ws, nullptr,
                            moe::ExpertSchedule{ready, [&] { ++waits; }});
    CHECK(waits == 1);
    REQUIRE(std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0);
  }
  std::vector<unsigned char> const short_ready(3, 1);
  CHECK_THROWS_WITH(layer.forward_with_plan(xs, ws.plan, moe::MatrixView<float>(yb.data(), T, D),
                                            ws, nullptr, moe::ExpertSchedule{short_ready, [] {}}),
                    Catch::Contains("3 entries for 8 experts"));
}

TEST_CASE("request, ready and wait: reads run while the ready experts could compute",
          "[offload][store]") {
  auto a = make_layer(31);
  a.experts().pack(WeightFormat::kQ8_0);
  std::string const path = tmp("request.moex");
  write_layer(path, a.experts());
  // A slow drive (20 MB/s: a record of ~0.4 MB takes ~20 ms), so the reads are still running
  // when request returns.
  auto const store = std::make_shared<ExpertStore const>(path, StoreReadOptions{false, 20e6, 0.0});
  StreamerOptions o;
  o.reader_threads = 2;
  ExpertStreamer s(store, o);
  std::int32_t const first[] = {1, 4};
  s.acquire(0, first, {});
  s.release(0);
  std::int32_t const next[] = {4, 2, 5};
  s.request(0, next, {});
  std::span<unsigned char const> const r = s.ready(0);
  CHECK(r[4] == 1);        // a hit: readable at once
  CHECK(r[0] == 0);        // not requested
  CHECK(r[2] + r[5] < 2);  // at least one of the misses is still being read
  s.wait(0);
  std::span<unsigned char const> const after = s.ready(0);
  CHECK((after[2] == 1 && after[4] == 1 && after[5] == 1));
  for (std::int32_t const e : next) {
    CHECK(std::memcmp(s.records(0)[e], a.experts().packed_record(e).data(),
                      a.experts().packed_record(e).size()) == 0);
  }
  s.release(0);
}

TEST_CASE("The streamer refuses bad calls and unknown policies", "[offload][store]") {
  auto a = make_layer(9);
  a.experts().pack(WeightFormat::kQ8_0);
  std::string const path = tmp("calls.moex");
  write_layer(path, a.experts());
  auto const store = std::make_shared<ExpertStore const>(path);
  StreamerOptions o;
  o.policy = "belady";
  CHECK_THROWS_WITH(ExpertStreamer(store, o), Catch::Contains("belady needs the future"));
  o.policy = "learned";
  CHECK_THROWS_WITH(ExpertStreamer(store, o), Catch::Contains("needs a predictor"));
  o.policy = "lru";
  ExpertStreamer s(store, o);
  std::int32_t const twice[] = {1, 1};
  CHECK_THROWS_WITH(s.acquire(0, twice, {}), Catch::Contains("listed twice"));
  std::int32_t const outside[] = {6};
  CHECK_THROWS_WITH(s.acquire(0, outside, {}), Catch::Contains("outside [0, 6)"));
  CHECK_THROWS_WITH(s.acquire(1, {}, {}), Catch::Contains("outside the 1"));
  std::int32_t const one[] = {2};
  s.acquire(0, one, {});
  CHECK_THROWS_WITH(s.acquire(0, one, {}), Catch::Contains("release it first"));
  s.release(0);
  // A streamed bank reading an expert that is not resident: an error, not a wild read.
  auto b = a;
  b.experts().stream_records(store->layer_formats(0), s.records(0));
  CHECK_THROWS_WITH(b.experts().packed_in_quant(5), Catch::Contains("not resident"));
}
