// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// Benchmarks of one MoeFfn training step: forward_train + backward (level: layer). See
// bench/README.md ("Training step") for how to run and read them.
//
// Shapes (T tokens, D d_model, F d_ffn, E experts, K top_k, R = routed rows = T * K here):
//   BM_Train_MoeFfn_Qwen3    Qwen3-30B-A3B expert layer: D 2048, F 768,  E 128, K 8 (SwiGLU)
//   BM_Train_MoeFfn_Mixtral  Mixtral-like:              D 1024, F 3584, E 8,   K 2 (SwiGLU)
//   both at T in {128, 512}, on a moe::ThreadPool of 2 threads (the caller and one worker);
//   bf16:0 the fp32 layer, bf16:1 the bf16-compute training mode (set_train_compute(kBf16):
//   bf16 operands on the CPU's bf16 unit, fp32 accumulation, fp32 master weights and gradients),
//   side by side in one run. Its counter panels_ms is what that mode adds once per optimizer
//   step, outside the timed loop: rounding the updated weights into the bf16 copies (done when
//   the parameters() list of the step ends; timed here through set_train_compute on the pool).
//
// What one iteration times: layer.forward_train(x, y, ws) then layer.backward(ws, dy, dx, grads),
// with the workspace reused. NOT timed: zeroing the gradients (grads.zero() is a memset of the
// whole gradient, 2.4 GB for Qwen3, which a trainer does once per optimizer step, however many
// micro-batches it accumulates) and the optimizer step. backward accumulates (+=) into the same
// Gradients in every iteration; the values grow but stay finite, and the time of += does not
// depend on them. Default MoE is off and the balance policy is balance::None. The weights are not
// pre-packed (no MoeFfn::pack_weights()): in training an optimizer step changes them every step,
// which marks a packed copy stale, so forward_train packs weight panels per call as here.
//
// FLOP count of one step (multiply-add = 2 FLOP; elementwise SiLU/GLU and their backward, softmax,
// top-k, gather and combine are not counted: O(T*E + R*F + R*D), < 0.3% here):
//   forward   2*T*E*D  + 2*R*D*F*3     router logits; per row gate [F, D], up [F, D], down [D, F]
//   backward  4*T*E*D  + 4*R*D*F*3     router: dW_r = dz^T x and dx += dz W_r; per row and per
//                                      expert matrix W: dX = dY W and dW += dY^T X
//   step      6*T*E*D  + 6*R*D*F*3     = 3 x forward
// The counters fwd_ms and bwd_ms split the wall time of an iteration between the two calls.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "bench_main.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/layers/presets.hpp"

namespace {

using moe::Index;

constexpr std::uint64_t kWeightSeed = 0x5EED0001;
constexpr std::uint64_t kInputSeed = 0x5EED1000;
constexpr int kThreads = 2;

/// Router and expert weights uniform in [-1/sqrt(D), 1/sqrt(D)) (as in bench_moe_ffn.cpp).
template <class Layer>
void fill_weights(Layer& layer, std::uint64_t seed) {
  float const bound = 1.0f / std::sqrt(static_cast<float>(layer.d_model()));
  moe::MatrixView<float> const w_r = layer.router_weight();  // [E, D]
  moe::fill_uniform(std::span<float>(w_r.data, static_cast<std::size_t>(w_r.rows * w_r.cols)),
                    -bound, bound, seed);
  moe::fill_uniform(layer.experts().edit().parameters(), -bound, bound, seed + 1);
}

/// A layer and its gradients, built on first use (the filtered smoke run builds only what it
/// runs) and shared by the benchmarks of that shape.
template <class Layer>
struct Model {
  Layer layer;
  typename Layer::Gradients grads;
};

Model<moe::presets::Qwen3Moe>& qwen3_model() {
  static Model<moe::presets::Qwen3Moe> model = [] {
    Model<moe::presets::Qwen3Moe> m{moe::presets::make_qwen3_moe(), {}};  // D 2048 F 768 E 128 K 8
    fill_weights(m.layer, kWeightSeed);
    m.grads = m.layer.make_gradients();
    return m;
  }();
  return model;
}

Model<moe::presets::MixtralMoe>& mixtral_model() {
  static Model<moe::presets::MixtralMoe> model = [] {
    moe::presets::MixtralConfig c;
    c.hidden_size = 1024;
    c.intermediate_size = 3584;
    c.num_local_experts = 8;
    c.num_experts_per_tok = 2;
    Model<moe::presets::MixtralMoe> m{moe::presets::make_mixtral(c), {}};
    fill_weights(m.layer, kWeightSeed + 2);
    m.grads = m.layer.make_gradients();
    return m;
  }();
  return model;
}

template <class Layer>
void run_train_step(benchmark::State& state, Model<Layer>& model) {
  Layer& layer = model.layer;
  Index const T = state.range(0);
  Index const D = layer.d_model(), F = layer.d_ffn(), E = layer.num_experts();

  std::vector<float> x(static_cast<std::size_t>(T * D)), dy(x.size());  // [T, D]
  std::vector<float> y(x.size()), dx(x.size());                         // [T, D]
  moe::fill_uniform(x, -1.0f, 1.0f, kInputSeed + static_cast<std::uint64_t>(T));
  // dL/dy of a mean-squared loss over T*D outputs is O(1 / (T*D)).
  float const g = 1.0f / static_cast<float>(T * D);
  moe::fill_uniform(dy, -g, g, kInputSeed + 1 + static_cast<std::uint64_t>(T));
  moe::ConstMatrixView<float> const xv(x.data(), T, D), dyv(dy.data(), T, D);
  moe::MatrixView<float> const yv(y.data(), T, D), dxv(dx.data(), T, D);
  moe::ThreadPool pool(kThreads);
  bool const bf16 = state.range(1) != 0;
  using Clock = std::chrono::steady_clock;
  auto const p0 = Clock::now();
  layer.set_train_compute(
      bf16 ? moe::experts::TrainCompute::kBf16 : moe::experts::TrainCompute::kF32, &pool);
  double const panels_ms = std::chrono::duration<double, std::milli>(Clock::now() - p0).count();
  moe::MoeFfnWorkspace ws;
  layer.reserve(ws, T, kThreads);
  moe::ForwardOptions opt;
  opt.pool = &pool;

  // Warm-up step: sizes the training buffers of the workspace and gives R.
  layer.forward_train(xv, yv, ws, opt);
  Index const R = ws.plan.num_rows();
  layer.backward(ws, dyv, dxv, model.grads, &pool);

  double fwd_seconds = 0.0, bwd_seconds = 0.0;
  for (auto _ : state) {
    auto const t0 = Clock::now();
    layer.forward_train(xv, yv, ws, opt);
    auto const t1 = Clock::now();
    layer.backward(ws, dyv, dxv, model.grads, &pool);
    auto const t2 = Clock::now();
    fwd_seconds += std::chrono::duration<double>(t1 - t0).count();
    bwd_seconds += std::chrono::duration<double>(t2 - t1).count();
    float* out = dx.data();
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
  }

  double const forward_flops = 2.0 * static_cast<double>(T * E * D) +
                               static_cast<double>(R) * 2.0 * static_cast<double>(D * F) * 3.0;
  using benchmark::Counter;
  state.counters["tokens"] = Counter(static_cast<double>(T), Counter::kIsIterationInvariantRate);
  state.counters["FLOP"] = Counter(3.0 * forward_flops, Counter::kIsIterationInvariantRate);
  state.counters["fwd_ms"] = Counter(fwd_seconds * 1e3, Counter::kAvgIterations);
  state.counters["bwd_ms"] = Counter(bwd_seconds * 1e3, Counter::kAvgIterations);
  state.counters["rows"] = static_cast<double>(R);
  if (bf16) state.counters["panels_ms"] = panels_ms;
  layer.set_train_compute(moe::experts::TrainCompute::kF32);  // frees the bf16 copies
}

void BM_Train_MoeFfn_Qwen3(benchmark::State& state) { run_train_step(state, qwen3_model()); }
void BM_Train_MoeFfn_Mixtral(benchmark::State& state) { run_train_step(state, mixtral_model()); }

// Wall-clock time (UseRealTime): the CPU-time clock sees only the calling thread, not the pool's
// worker. The smoke test's filter "Mixtral/T:128" matches BM_Train_MoeFfn_Mixtral/T:128 only
// (both modes).
BENCHMARK(BM_Train_MoeFfn_Qwen3)
    ->ArgsProduct({{128, 512}, {0, 1}})
    ->ArgNames({"T", "bf16"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Train_MoeFfn_Mixtral)
    ->ArgsProduct({{128, 512}, {0, 1}})
    ->ArgNames({"T", "bf16"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

bool add_context() {
  benchmark::AddCustomContext("xsimd_arch", xsimd::default_arch::name());
  benchmark::AddCustomContext("pool", "moe::ThreadPool of 2 threads (caller + 1 worker)");
  benchmark::AddCustomContext(
      "timed", "forward_train + backward; gradients accumulated, not zeroed in the loop");
  benchmark::AddCustomContext("expert_gemm",
                              "forward: moe panel kernels, weights packed per call (no "
                              "pack_weights(), as after every optimizer step); backward: "
                              "kernels::gemm_strided per tile; bf16:1 every expert product on "
                              "bf16 panels (kernels::expert_cols: AMX, AVX512-BF16 or widened)");
  benchmark::AddCustomContext("kernels", moe::compiled_kernels());
  return true;
}
[[maybe_unused]] bool const kContextAdded = add_context();

}  // namespace

MOE_BENCH_MAIN(
    "moe_bench_train: one MoeFfn training step (forward_train + backward) in fp32 and bf16 compute "
    "(bench/README.md, \"Training step\").")
