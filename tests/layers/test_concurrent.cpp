// SPDX-License-Identifier: Apache-2.0
// One const layer called from several std::threads at once, each with its own workspace and its
// own ThreadPool: every forward is bitwise equal to the one computed beforehand on the main
// thread (MoeFfn unpacked, packed fp32 / bf16 / q8_0, shared experts, GatedAttention,
// MoeAttention); two threads sharing one ThreadPool (parallel_for calls are serialised). Small
// sizes: the tsan preset runs this file under ThreadSanitizer, which is 5-15x slower.
#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <exception>
#include <filesystem>
#include <latch>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/moe_attention.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/layers/presets.hpp"
#include "moe/offload/store.hpp"
#include "moe/offload/streamer.hpp"
#include "moe/routing/softmax_top_k.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace routing = moe::routing;
namespace experts = moe::experts;
namespace gating = moe::gating;

namespace {

constexpr int kThreads = 3;     // callers, each with a ThreadPool(2) of its own
constexpr int kIterations = 3;  // forwards per caller and input

std::vector<float> random_vector(Index n, std::uint64_t seed) {
  std::vector<float> v(static_cast<std::size_t>(n));
  moe::fill_uniform(v, -1.0f, 1.0f, seed);
  return v;
}

bool bitwise_equal(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Starts `threads` threads that call body(thread) at the same moment (a latch), joins them, and
/// rethrows the first exception one of them threw. Catch2 v2's assertions are not thread-safe,
/// so bodies only record what they find; the caller checks it after the join.
template <class Body>
void run_threads(int threads, Body body) {
  std::latch start(threads);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      try {
        start.arrive_and_wait();
        body(t);
      } catch (...) {
        errors[static_cast<std::size_t>(t)] = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  for (auto const& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

/// forward(x, y, ws, pool) of one const layer from kThreads threads at once, each with its own
/// Workspace and ThreadPool(2) and two inputs of its own (different T), kIterations times each;
/// every output must be bitwise equal to the one computed on this thread with no pool first.
template <class Workspace, class Forward>
void check_concurrent(Index D, Forward forward) {
  struct Input {
    Index T;
    std::vector<float> x, want;
  };
  std::vector<std::vector<Input>> inputs(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int j = 0; j < 2; ++j) {
      Index const T = 9 + 7 * t + 11 * j;
      Input in{T, random_vector(T * D, 1000 + 10 * t + j), {}};
      in.want.assign(in.x.size(), 0.0f);
      Workspace ws;
      forward(ConstMatrixView<float>(in.x.data(), T, D), MatrixView<float>(in.want.data(), T, D),
              ws, nullptr);
      inputs[static_cast<std::size_t>(t)].push_back(std::move(in));
    }
  }
  std::vector<int> mismatches(kThreads, 0);
  run_threads(kThreads, [&](int t) {
    Workspace ws;
    moe::ThreadPool pool(2);
    for (int it = 0; it < kIterations; ++it) {
      for (Input const& in : inputs[static_cast<std::size_t>(t)]) {
        std::vector<float> y(in.x.size(), -1.0f);
        forward(ConstMatrixView<float>(in.x.data(), in.T, D), MatrixView<float>(y.data(), in.T, D),
                ws, &pool);
        if (!bitwise_equal(y, in.want)) ++mismatches[static_cast<std::size_t>(t)];
      }
    }
  });
  for (int t = 0; t < kThreads; ++t) {
    INFO("thread " << t);
    CHECK(mismatches[static_cast<std::size_t>(t)] == 0);
  }
}

template <class Layer>
void randomize_ffn(Layer& layer, std::uint64_t seed) {
  moe::fill_uniform(layer.experts().edit().parameters(), -0.2f, 0.2f, seed);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                    0.5f, seed + 1);
  if constexpr (Layer::Shared::has_experts) {
    moe::fill_uniform(layer.shared_experts().bank().edit().parameters(), -0.2f, 0.2f, seed + 2);
    if constexpr (requires { layer.shared_experts().gate_weight(); }) {
      auto g = layer.shared_experts().gate_weight();
      moe::fill_uniform(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)), -0.5f,
                        0.5f, seed + 3);
    }
  }
}

template <class Layer>
void check_ffn(Layer const& layer) {
  check_concurrent<moe::MoeFfnWorkspace>(
      layer.d_model(), [&](auto x, auto y, moe::MoeFfnWorkspace& ws, moe::ThreadPool* pool) {
        layer.forward(x, y, ws, {nullptr, pool});
      });
}

template <class Layer>
void randomize_params(Layer& layer, std::uint64_t seed) {
  auto params = layer.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    moe::fill_uniform(params[i].values, -0.5f, 0.5f, seed + i);
  }
}

}  // namespace

TEST_CASE("MoeFfn called from several threads at once is bitwise equal to one thread",
          "[concurrent][moe_ffn]") {
  // D and F multiples of 32 (q8_0 blocks).
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>;
  Layer layer(64, 64, {8, 2, true, 1.0f});
  randomize_ffn(layer, 1);
  SECTION("unpacked weights") { check_ffn(layer); }
  SECTION("packed fp32") {
    layer.pack_weights(experts::WeightFormat::kF32);
    check_ffn(layer);
  }
  SECTION("packed bf16") {
    layer.pack_weights(experts::WeightFormat::kBf16);
    check_ffn(layer);
  }
  SECTION("packed q8_0") {
    layer.pack_weights(experts::WeightFormat::kQ8_0);
    check_ffn(layer);
  }
}

TEST_CASE("MoeFfn with shared experts called from several threads at once",
          "[concurrent][shared]") {
  SECTION("Qwen2-MoE preset: gated shared expert, packed bf16") {
    auto layer = moe::presets::make_qwen2_moe({64, 32, 64, 8, 2, false});
    randomize_ffn(layer, 11);
    check_ffn(layer);
    layer.pack_weights(experts::WeightFormat::kBf16);
    check_ffn(layer);
  }
  SECTION("DeepSeek-V3 preset: group-limited routing, ungated shared expert, packed fp32") {
    moe::presets::DeepseekV3Config c;
    c.hidden_size = 64;
    c.moe_intermediate_size = 32;
    c.n_routed_experts = 8;
    c.num_experts_per_tok = 2;
    c.n_group = 4;
    c.topk_group = 2;
    auto layer = moe::presets::make_deepseek_v3(c);
    randomize_ffn(layer, 21);
    layer.router().bias = random_vector(8, 22);
    check_ffn(layer);
    layer.pack_weights(experts::WeightFormat::kF32);
    check_ffn(layer);
  }
}

TEST_CASE("GatedAttention called from several threads at once is bitwise equal to one thread",
          "[concurrent][attention]") {
  moe::GatedAttentionConfig c;
  c.d_model = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.gate_layout = moe::GateLayout::kPackedPerHead;
  c.qk_norm = moe::QkNorm::kRmsNormOnePlus;
  c.rope = true;
  moe::GatedAttention<gating::ElementwiseGate> layer(c);
  randomize_params(layer, 31);
  moe::GatedAttention<gating::ElementwiseGate> const& cl = layer;
  check_concurrent<moe::GatedAttentionWorkspace>(
      c.d_model, [&](auto x, auto y, moe::GatedAttentionWorkspace& ws, moe::ThreadPool* pool) {
        moe::AttentionOptions opt;
        opt.pool = pool;
        cl.forward(x, y, ws, opt);
      });
}

TEST_CASE("MoeAttention called from several threads at once is bitwise equal to one thread",
          "[concurrent][attention]") {
  Index const D = 32;
  experts::ExpertBank<experts::SwiGlu> bank(6, D, 32);
  moe::fill_uniform(bank.edit().parameters(), -0.3f, 0.3f, 41);
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 8;
  c.q_rank = 4;
  c.residual_query = true;
  c.rope = true;
  using Layer = moe::MoeAttention<routing::SoftmaxTopK, experts::SwiGlu, Sh, gating::HeadwiseGate>;
  Layer layer(c, {6, 2, false, 1.0f}, bank, Sh(1, D, 16));
  randomize_params(layer, 42);
  Layer const& cl = layer;
  auto check = [&] {
    check_concurrent<moe::MoeAttentionWorkspace>(
        D, [&](auto x, auto y, moe::MoeAttentionWorkspace& ws, moe::ThreadPool* pool) {
          moe::AttentionOptions opt;
          opt.pool = pool;
          cl.forward(x, y, ws, opt);
        });
  };
  SECTION("unpacked bank") { check(); }
  SECTION("packed fp32 bank") {
    bank.pack(experts::WeightFormat::kF32);
    check();
  }
}

TEST_CASE("Two threads sharing one ThreadPool: concurrent parallel_for calls are serialised",
          "[concurrent][thread_pool]") {
  moe::ThreadPool pool(3);
  SECTION("parallel_for") {
    Index const n = 257;
    std::vector<std::vector<Index>> out(2, std::vector<Index>(static_cast<std::size_t>(n)));
    std::vector<int> bad(2, 0);
    std::atomic<int> bad_thread{0};  // written by the pool's workers
    run_threads(2, [&](int t) {
      auto& o = out[static_cast<std::size_t>(t)];
      for (int it = 0; it < 50; ++it) {
        std::fill(o.begin(), o.end(), Index{-1});
        pool.parallel_for(n, [&](Index i, int thread) {
          if (thread < 0 || thread >= pool.size()) ++bad_thread;
          o[static_cast<std::size_t>(i)] = i * (t + 2) + it;
        });
        for (Index i = 0; i < n; ++i) {
          if (o[static_cast<std::size_t>(i)] != i * (t + 2) + it) {
            ++bad[static_cast<std::size_t>(t)];
          }
        }
      }
    });
    CHECK(bad[0] == 0);
    CHECK(bad[1] == 0);
    CHECK(bad_thread == 0);
  }
  SECTION("MoeFfn forwards with their own workspaces") {
    auto layer = moe::presets::make_qwen2_moe({32, 32, 32, 4, 2, true});
    randomize_ffn(layer, 51);
    Index const D = 32, T = 23;
    std::vector<std::vector<float>> x, want;
    for (int t = 0; t < 2; ++t) {
      x.push_back(random_vector(T * D, 52 + t));
      want.emplace_back(x.back().size());
      moe::MoeFfnWorkspace ws;
      layer.forward({x.back().data(), T, D}, {want.back().data(), T, D}, ws);
    }
    std::vector<int> mismatches(2, 0);
    run_threads(2, [&](int t) {
      auto const& xt = x[static_cast<std::size_t>(t)];
      moe::MoeFfnWorkspace ws;
      for (int it = 0; it < kIterations; ++it) {
        std::vector<float> y(xt.size(), -1.0f);
        layer.forward({xt.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
        if (!bitwise_equal(y, want[static_cast<std::size_t>(t)])) {
          ++mismatches[static_cast<std::size_t>(t)];
        }
      }
    });
    CHECK(mismatches[0] == 0);
    CHECK(mismatches[1] == 0);
  }
  SECTION("an exception in one caller's item reaches that caller only") {
    std::vector<int> caught(2, 0);
    run_threads(2, [&](int t) {
      for (int it = 0; it < 20; ++it) {
        try {
          pool.parallel_for(8, [&](Index i, int) {
            if (t == 0 && i == 5) throw std::runtime_error("item 5");
          });
        } catch (std::runtime_error const&) {
          ++caught[static_cast<std::size_t>(t)];
        }
      }
    });
    CHECK(caught[0] == 20);
    CHECK(caught[1] == 0);
  }
}

TEST_CASE("A workspace used by two calls at once is refused, not shared", "[concurrent][in_use]") {
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>;
  Layer layer(32, 32, {4, 2, true, 1.0f});
  randomize_ffn(layer, 51);
  auto const x = random_vector(4 * 32, 52);
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  {
    // Another call holds the workspace (as a second thread's forward would): refused at once.
    auto const held = ws.in_use.enter("test");
    REQUIRE_THROWS_WITH(
        layer.forward({x.data(), 4, 32}, {y.data(), 4, 32}, ws),
        Catch::Contains("MoeFfn::forward: the workspace is in use by another call"));
    REQUIRE_THROWS_WITH(layer.route({x.data(), 4, 32}, ws), Catch::Contains("MoeFfn::route"));
    REQUIRE_THROWS_WITH(layer.forward_train({x.data(), 4, 32}, {y.data(), 4, 32}, ws),
                        Catch::Contains("MoeFfn::forward_train"));
  }
  layer.forward({x.data(), 4, 32}, {y.data(), 4, 32}, ws);  // released: fine again
  moe::MoeFfnWorkspace copy = ws;                           // a copy is a free workspace
  layer.forward({x.data(), 4, 32}, {y.data(), 4, 32}, copy);
  // An exception inside a call releases the workspace too.
  std::vector<float> bad(x);
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS(layer.forward({bad.data(), 4, 32}, {y.data(), 4, 32}, ws));
  layer.forward({x.data(), 4, 32}, {y.data(), 4, 32}, ws);

  moe::GatedAttentionConfig c;
  c.d_model = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  moe::GatedAttention<gating::NoGate> attn(c);
  randomize_params(attn, 53);
  moe::GatedAttentionWorkspace aws;
  moe::KvCache cache(1, 16);
  std::vector<Index> const counts = {4};
  auto const held = aws.in_use.enter("test");
  REQUIRE_THROWS_WITH(attn.forward({x.data(), 4, 32}, {y.data(), 4, 32}, aws),
                      Catch::Contains("GatedAttention::forward: the workspace is in use"));
  REQUIRE_THROWS_WITH(attn.forward_cached({x.data(), 4, 32}, {y.data(), 4, 32}, cache, counts, aws),
                      Catch::Contains("GatedAttention::forward_cached"));
}

TEST_CASE("Two threads on one workspace: every overlapping call is refused, none corrupts",
          "[concurrent][in_use]") {
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>;
  Layer layer(64, 64, {8, 2, true, 1.0f});
  randomize_ffn(layer, 61);
  Index const T = 64;
  auto const x = random_vector(T * 64, 62);
  std::vector<float> want(x.size());
  {
    moe::MoeFfnWorkspace own;
    layer.forward({x.data(), T, 64}, {want.data(), T, 64}, own);
  }
  moe::MoeFfnWorkspace shared;
  std::atomic<int> refused{0}, ran{0};
  std::atomic<bool> wrong{false};
  std::latch start(2);
  auto caller = [&] {
    std::vector<float> y(x.size());
    start.arrive_and_wait();
    for (int i = 0; i < 50; ++i) {
      try {
        layer.forward({x.data(), T, 64}, {y.data(), T, 64}, shared);
        ++ran;
        if (y != want) wrong = true;
      } catch (moe::Error const&) {
        ++refused;
      }
    }
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  REQUIRE(ran + refused == 100);
  REQUIRE(ran > 0);  // a call is refused only while the other thread's call runs
  REQUIRE_FALSE(wrong);
}

TEST_CASE(
    "Experts streamed by reader threads, with prefetch and a two-step forward, give the "
    "resident outputs",
    "[concurrent][offload]") {
  // The streamer's reader threads write records while the caller computes on the ready ones and
  // queues prefetches: under ThreadSanitizer (the tsan preset) this is its race check.
  Index const E = 8, D = 64, F = 64, T = 3;
  auto layer = moe::presets::make_qwen3_moe({D, F, E, 2, true});
  moe::fill_uniform(layer.experts().edit().parameters(), -0.1f, 0.1f, 41);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                    0.5f, 42);
  layer.pack_weights(experts::WeightFormat::kQ8_0);
  std::string const path = std::string(MOE_CONCURRENT_TEST_TMP) + "/concurrent.moex";
  std::filesystem::create_directories(MOE_CONCURRENT_TEST_TMP);
  {
    moe::offload::ExpertStoreWriter w(path, {1, E, D, F, true});
    w.add_layer(layer.experts());
    w.finish();
  }
  auto const store = std::make_shared<moe::offload::ExpertStore const>(path);
  moe::offload::StreamerOptions o;
  o.budget_bytes = 3 * store->record(0, 0).read_bytes();
  o.reader_threads = 3;
  moe::offload::ExpertStreamer streamer(store, o);
  auto streamed = layer;
  streamed.experts().stream_records(store->layer_formats(0), streamer.records(0));
  moe::ThreadPool pool(2);
  moe::MoeFfnWorkspace ws_a, ws_b;
  std::vector<float> ya(static_cast<std::size_t>(T * D)), yb(ya.size());
  std::vector<std::int32_t> ids, ahead;
  for (Index step = 0; step < 12; ++step) {
    std::vector<float> const x = random_vector(T * D, 100 + static_cast<std::uint64_t>(step));
    ConstMatrixView<float> xs(x.data(), T, D);
    layer.forward(xs, MatrixView<float>(ya.data(), T, D), ws_a, {nullptr, &pool});
    streamer.begin_forward(T);
    streamed.route(xs, ws_b, {nullptr, &pool});
    ids.clear();
    for (Index e = 0; e < E; ++e) {
      if (ws_b.plan.expert_rows(e) > 0) ids.push_back(static_cast<std::int32_t>(e));
    }
    streamer.request(0, ids, {});
    ahead = {static_cast<std::int32_t>(step % E), static_cast<std::int32_t>((step + 3) % E)};
    streamer.prefetch(0, ahead);
    std::span<unsigned char const> const ready = streamer.ready(0);
    streamed.forward_with_plan(xs, ws_b.plan, MatrixView<float>(yb.data(), T, D), ws_b, &pool,
                               moe::ExpertSchedule{ready, [&] { streamer.wait(0); }});
    streamer.release(0);
    REQUIRE(std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0);
  }
}
