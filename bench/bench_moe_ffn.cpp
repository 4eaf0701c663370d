// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// Benchmarks of MoeFfn::forward (level: layer) and of the kernels it is built from (level:
// kernel). See bench/README.md for how to build, run and read them.
//
// Shapes (T tokens, D d_model, F d_ffn, E experts, K top_k, R = routed rows = T * K here):
//   BM_Layer_MoeFfn_Qwen3    Qwen3-30B-A3B expert layer: D 2048, F 768,  E 128, K 8 (SwiGLU)
//   BM_Layer_MoeFfn_Mixtral  Mixtral-like:              D 1024, F 3584, E 8,   K 2 (SwiGLU)
//   both at T in {1, 8, 32, 128, 512} and a moe::ThreadPool of 1 or 2 threads ("pool").
//   BM_Kernel_{Route,BuildPlan,GatherRows,CombineRows}: the Qwen3 shape at T 512, one thread.
//
// FLOP count of one layer forward (multiply-add = 2 FLOP; elementwise SiLU, the GLU product, the
// softmax, top-k and combine are not counted, they are O(T*E + R*F + R*D), < 0.2% at these shapes):
//   router   2 * T * E * D                 logits = x W_r^T
//   experts  R * 2 * D * F * 3             per routed row: gate [F, D], up [F, D], down [D, F]
//
// Bytes of one layer forward ("weight_B/s", active-weight bandwidth):
//   A * 3 * D * F * 4  +  E * D * 4        A = experts that received at least one row (fp32
//                                          gate + up + down), plus the fp32 router weight W_r.
//   Activations (x, y, expert outputs) are not counted. At T = 1 the layer is a pure stream of the
//   K active experts' weights, so weight_B/s is the figure to compare with the memory bandwidth.
//
// benchmark::DoNotOptimize is given non-const lvalues (its const& overload is deprecated in 1.8).
// Counters are per-iteration values turned into rates with kIsIterationInvariantRate. The layer
// benchmarks use real (wall-clock) time, since the pool's worker is invisible to the CPU-time
// clock; the single-threaded kernel benchmarks use CPU time.
// Routing is deterministic for a fixed input, so R and A are read once from ws.plan after a
// warm-up call and are the same in every timed iteration.

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "bench_main.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/random.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"
#include "moe/kernels/combine.hpp"
#include "moe/kernels/dispatch.hpp"
#include "moe/kernels/gather.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/layers/presets.hpp"

namespace {

using moe::Index;

constexpr std::uint64_t kWeightSeed = 0x5EED0001;
constexpr std::uint64_t kInputSeed = 0x5EED1000;
constexpr Index kKernelTokens = 512;

/// Router and expert weights uniform in [-1/sqrt(D), 1/sqrt(D)), input x uniform in [-1, 1).
template <class Layer>
void fill_weights(Layer& layer, std::uint64_t seed) {
  float const bound = 1.0f / std::sqrt(static_cast<float>(layer.d_model()));
  moe::MatrixView<float> const w_r = layer.router_weight();  // [E, D]
  moe::fill_uniform(std::span<float>(w_r.data, static_cast<std::size_t>(w_r.rows * w_r.cols)),
                    -bound, bound, seed);
  moe::fill_uniform(layer.experts().edit().parameters(), -bound, bound, seed + 1);
  layer.pack_weights();  // weights in the micro-kernel's panel layout, once (inference mode)
}

// One layer per shape, built on first use (the filtered smoke run builds only what it runs) and
// shared by every benchmark of that shape. The weights are NOT rotated through several copies,
// see the "weights" context entry below.
moe::presets::Qwen3Moe const& qwen3_layer() {
  static moe::presets::Qwen3Moe const layer = [] {
    moe::presets::Qwen3Moe l = moe::presets::make_qwen3_moe();  // D 2048, F 768, E 128, K 8
    fill_weights(l, kWeightSeed);
    return l;
  }();
  return layer;
}

moe::presets::MixtralMoe const& mixtral_layer() {
  static moe::presets::MixtralMoe const layer = [] {
    moe::presets::MixtralConfig c;
    c.hidden_size = 1024;
    c.intermediate_size = 3584;
    c.num_local_experts = 8;
    c.num_experts_per_tok = 2;
    moe::presets::MixtralMoe l = moe::presets::make_mixtral(c);
    fill_weights(l, kWeightSeed + 2);
    return l;
  }();
  return layer;
}

std::vector<float> random_input(Index rows, Index cols, std::uint64_t seed) {
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  moe::fill_uniform(v, -1.0f, 1.0f, seed);
  return v;
}

template <class Layer>
void run_layer(benchmark::State& state, Layer const& layer) {
  Index const T = state.range(0);
  int const threads = static_cast<int>(state.range(1));
  Index const D = layer.d_model(), F = layer.d_ffn(), E = layer.num_experts();

  std::vector<float> x = random_input(T, D, kInputSeed + static_cast<std::uint64_t>(T));  // [T, D]
  std::vector<float> y(x.size());                                                         // [T, D]
  moe::ConstMatrixView<float> const xv(x.data(), T, D);
  moe::MatrixView<float> const yv(y.data(), T, D);
  moe::ThreadPool pool(threads);
  moe::MoeFfnWorkspace ws;
  layer.reserve(ws, T, threads);
  moe::ForwardOptions opt;
  opt.pool = &pool;

  layer.forward(xv, yv, ws, opt);  // warm-up: sizes the workspace, and gives R and A
  Index const R = ws.plan.num_rows();
  Index active = 0;
  for (Index e = 0; e < E; ++e) active += ws.plan.expert_rows(e) > 0 ? 1 : 0;

  for (auto _ : state) {
    layer.forward(xv, yv, ws, opt);
    float* out = y.data();
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
  }

  double const flops = 2.0 * static_cast<double>(T * E * D) +
                       static_cast<double>(R) * 2.0 * static_cast<double>(D * F) * 3.0;
  double const weight_bytes = static_cast<double>(active) * 3.0 * static_cast<double>(D * F) * 4.0 +
                              static_cast<double>(E * D) * 4.0;
  using benchmark::Counter;
  state.counters["tokens"] = Counter(static_cast<double>(T), Counter::kIsIterationInvariantRate);
  state.counters["FLOP"] = Counter(flops, Counter::kIsIterationInvariantRate);
  state.counters["weight_bytes"] = Counter(weight_bytes, Counter::kIsIterationInvariantRate);
  state.counters["rows"] = static_cast<double>(R);
  state.counters["active_experts"] = static_cast<double>(active);
}

void BM_Layer_MoeFfn_Qwen3(benchmark::State& state) { run_layer(state, qwen3_layer()); }
void BM_Layer_MoeFfn_Mixtral(benchmark::State& state) { run_layer(state, mixtral_layer()); }

// T first so that the smoke filter "/T:(1|8)/" matches .../T:1/pool:N and .../T:8/pool:N only.
// "pool" rather than "threads": Google Benchmark's own ->Threads(n) suffix is "/threads:n".
BENCHMARK(BM_Layer_MoeFfn_Qwen3)
    ->ArgsProduct({{1, 8, 32, 128, 512}, {1, 2}})
    ->ArgNames({"T", "pool"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Layer_MoeFfn_Mixtral)
    ->ArgsProduct({{1, 8, 32, 128, 512}, {1, 2}})
    ->ArgNames({"T", "pool"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// ---- Kernels at the Qwen3 shape, T = 512, on the calling thread (no pool). ----

/// The routing state of the Qwen3 layer for T = 512 random tokens (x, logits, Selection, plan).
struct RoutedBatch {
  std::vector<float> x;  // [T, D]
  moe::MoeFfnWorkspace ws;
};
RoutedBatch routed_qwen3_batch(Index T) {
  auto const& layer = qwen3_layer();
  RoutedBatch b;
  b.x = random_input(T, layer.d_model(), kInputSeed + static_cast<std::uint64_t>(T));
  layer.route(moe::ConstMatrixView<float>(b.x.data(), T, layer.d_model()), b.ws);
  return b;
}

void set_kernel_counters(benchmark::State& state, Index T, double bytes_per_iteration) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes_per_iteration) * state.iterations());
  state.counters["tokens"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}

/// layer.route: router GEMM + softmax + top-k + build_plan. Bytes: x and W_r read, logits written.
void BM_Kernel_Route(benchmark::State& state) {
  auto const& layer = qwen3_layer();
  Index const T = state.range(0), D = layer.d_model(), E = layer.num_experts();
  RoutedBatch b = routed_qwen3_batch(T);
  moe::ConstMatrixView<float> const xv(b.x.data(), T, D);
  for (auto _ : state) {
    layer.route(xv, b.ws);
    Index* rows = b.ws.plan.row_token.data();
    benchmark::DoNotOptimize(rows);
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, T, 4.0 * static_cast<double>(T * D + E * D + T * E));
  state.counters["FLOP"] = benchmark::Counter(2.0 * static_cast<double>(T * E * D),
                                              benchmark::Counter::kIsIterationInvariantRate);
}

/// kernels::build_plan. Bytes: Selection ids (int32) and weights read; plan written
/// (row_token, token_rows: Index; row_weight: float; expert_offsets, token_offsets: Index).
void BM_Kernel_BuildPlan(benchmark::State& state) {
  Index const T = state.range(0);
  RoutedBatch b = routed_qwen3_batch(T);
  moe::Selection const& sel = b.ws.selection;
  moe::RoutingPlan plan;
  moe::kernels::build_plan(sel, plan);
  Index const R = plan.num_rows(), E = sel.num_experts, S = sel.slots;
  for (auto _ : state) {
    moe::kernels::build_plan(sel, plan);
    Index* rows = plan.row_token.data();
    benchmark::DoNotOptimize(rows);
    benchmark::ClobberMemory();
  }
  double const idx = sizeof(Index);
  set_kernel_counters(state, T,
                      static_cast<double>(T * S) * (sizeof(moe::ExpertId) + sizeof(float)) +
                          static_cast<double>(R) * (2.0 * idx + sizeof(float)) +
                          static_cast<double>(E + 1 + T + 1) * idx);
}

/// kernels::gather_rows of all R rows of the plan into one [R, D] block (dispatch).
/// Bytes: R * D floats read and written, plus the R row indices.
void BM_Kernel_GatherRows(benchmark::State& state) {
  Index const T = state.range(0), D = qwen3_layer().d_model();
  RoutedBatch b = routed_qwen3_batch(T);
  moe::RoutingPlan const& plan = b.ws.plan;
  Index const R = plan.num_rows();
  std::vector<float> out(static_cast<std::size_t>(R * D));  // [R, D]
  for (auto _ : state) {
    moe::kernels::gather_rows(b.x.data(), D, plan.row_token.data(), R, D, out.data(), D);
    float* dst = out.data();
    benchmark::DoNotOptimize(dst);
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, T,
                      2.0 * 4.0 * static_cast<double>(R * D) +
                          static_cast<double>(R) * static_cast<double>(sizeof(Index)));
}

/// kernels::combine_rows over all T tokens from random expert outputs [R, D] (no shared experts).
/// Bytes: R * D floats read, T * D written, plus row weights, token_rows and token_offsets.
void BM_Kernel_CombineRows(benchmark::State& state) {
  Index const T = state.range(0), D = qwen3_layer().d_model();
  RoutedBatch b = routed_qwen3_batch(T);
  moe::RoutingPlan const& plan = b.ws.plan;
  Index const R = plan.num_rows();
  std::vector<float> expert_out = random_input(R, D, kInputSeed + 7);  // [R, D]
  std::vector<float> y(static_cast<std::size_t>(T * D));               // [T, D]
  moe::kernels::CombineParams p;
  p.expert_out = expert_out.data();
  p.ld_expert_out = D;
  p.row_weight = plan.row_weight.data();
  p.token_offsets = plan.token_offsets.data();
  p.token_rows = plan.token_rows.data();
  p.token_begin = 0;
  p.token_end = T;
  p.cols = D;
  p.out = y.data();
  p.ld_out = D;
  for (auto _ : state) {
    moe::kernels::combine_rows(p);
    float* out = y.data();
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
  }
  double const idx = sizeof(Index);
  set_kernel_counters(state, T,
                      4.0 * static_cast<double>(R * D + T * D) +
                          static_cast<double>(R) * (sizeof(float) + idx) +
                          static_cast<double>(T + 1) * idx);
}

BENCHMARK(BM_Kernel_Route)->Arg(kKernelTokens)->ArgName("T")->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Kernel_BuildPlan)->Arg(kKernelTokens)->ArgName("T")->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Kernel_GatherRows)->Arg(kKernelTokens)->ArgName("T")->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Kernel_CombineRows)->Arg(kKernelTokens)->ArgName("T")->Unit(benchmark::kMicrosecond);

// Context lines printed in the header and stored in the JSON "context". Registered during static
// initialisation (like the BENCHMARK registrations above) so that BENCHMARK_MAIN() can be used;
// AddCustomContext only inserts into a map that the run reads later.
bool add_context() {
  benchmark::AddCustomContext("xsimd_arch", xsimd::default_arch::name());
  benchmark::AddCustomContext("cpu", moe::cpu_features().describe());
  benchmark::AddCustomContext("kernels", moe::compiled_kernels());
  benchmark::AddCustomContext(
      "weights",
      "one fp32 copy per shape, not rotated through copies. The weights an iteration touches are "
      ">= 88 MB (Mixtral T=1: 2 experts; Qwen3 T=1: 8 experts = 151 MB; T>=8: most or all "
      "experts, up to 2.4 GB for Qwen3); compare with the last-level cache in the cpu line: "
      "where they exceed twice it they come mostly from DRAM in every iteration");
  benchmark::AddCustomContext("expert_gemm",
                              "moe panel kernels on weights packed once (MoeFfn::pack_weights), "
                              "one work item per (expert, 32-column panel)");
  return true;
}
[[maybe_unused]] bool const kContextAdded = add_context();

}  // namespace

MOE_BENCH_MAIN(
    "moe_bench: MoeFfn::forward at the Qwen3-30B-A3B and Mixtral expert shapes, and the kernels it "
    "is built from (route, build_plan, gather, combine; bench/README.md).")
