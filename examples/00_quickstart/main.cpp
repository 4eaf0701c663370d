// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// 00_quickstart: build a Qwen3-30B-A3B-shaped MoE feed-forward layer, run it, look at the routing.
//
// What it shows:
//   - moe::presets::make_qwen3_moe(): D 2048, F 768, E 128 SwiGLU experts, top-8 with
//     renormalised softmax weights (Qwen3 config.json), here with random weights;
//   - MoeFfn::pack_weights() once after the weights are set, then MoeFfn::forward with a
//     moe::ThreadPool and a reused MoeFfnWorkspace (once it has seen the batch size, a forward
//     allocates nothing);
//   - moe::routing::routing_stats on ws.plan / ws.selection: per-expert load and its balance;
//   - the cost of a call: 2*T*E*D FLOP for the router + 2*R*D*F*3 for the experts (R = T*K rows).
// Why: it is the smallest complete use of the library, and its numbers are a first sanity check.
// It is not a benchmark (one timed call; see bench/ for that).
//
// Command line:
//   cmake --preset release && cmake --build build/release --target moe_quickstart
//   ./build/release/examples/moe_quickstart            # Qwen3 shape, 512 tokens
//   ./build/release/examples/moe_quickstart --small    # D 64, F 32, E 8, K 2, 16 tokens (ctest)
//   ./build/release/examples/moe_quickstart --help     # the options, one line each
// Memory: the Qwen3 shape peaks at about 4.9 GB (printed at the end, getrusage ru_maxrss): 2.42 GB
// of fp32 expert weights, their 2.42 GB fp32 panel copy from pack_weights (the layer keeps the
// [out, in] weights for reads, edits and training; forward streams the panels; an inference-only
// layer may free them after packing, MoeFfn::discard_master_weights), and about 60 MB of router
// weights, activations and workspace. The run takes 10-25 s on a shared 2-core
// machine, most of it the kernel handing out fresh pages while the weights are zeroed, filled and
// packed; progress lines say which phase it is in.
// Exit status: 0 on success (and for --help / -h), 1 if the output has a non-finite value or moe
// reports an error, 2 on an unknown argument (one line on stderr).

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <span>
#include <thread>
#include <vector>

#include "../common/cli.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/kernels/dispatch.hpp"
#include "moe/layers/presets.hpp"
#include "moe/routing/stats.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// "2.42 GB" (10^9 bytes) or "1.3 MB".
void print_bytes(double bytes) {
  if (bytes >= 1e9) {
    std::printf("%.2f GB", bytes * 1e-9);
  } else {
    std::printf("%.1f MB", bytes * 1e-6);
  }
}

/// The process's peak resident set so far, in bytes (Linux reports ru_maxrss in KiB).
double peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) * 1024.0;
}

/// fill_uniform(out, lo, hi, seed) in ten slices with a progress line; the same values as one
/// call, since SplitMix64's state after i values is seed + i * its increment.
void fill_uniform_with_progress(std::span<float> out, float lo, float hi, std::uint64_t seed) {
  std::size_t const n = out.size(), slices = 10;
  for (std::size_t s = 0; s < slices; ++s) {
    std::size_t const b = n * s / slices, e = n * (s + 1) / slices;
    moe::fill_uniform(out.subspan(b, e - b), lo, hi, seed + b * 0x9E3779B97F4A7C15ull);
    std::printf(" %zu%%", 100 * (s + 1) / slices);
    std::fflush(stdout);
  }
}

int run(bool small) {
  moe::presets::Qwen3MoeConfig config;  // Qwen3-30B-A3B: D 2048, F 768, E 128, K 8
  moe::Index T = 512;
  if (small) {
    config.hidden_size = 64;
    config.moe_intermediate_size = 32;
    config.num_experts = 8;
    config.num_experts_per_tok = 2;
    T = 16;
  }
  moe::Index const D = config.hidden_size, F = config.moe_intermediate_size;
  moe::Index const E = config.num_experts, K = config.num_experts_per_tok;
  int const threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1,
                                 moe::ThreadPool::kMaxThreads);
  std::printf(
      "moe quickstart: Qwen3-MoE layer D %td, F %td, E %td, top-%td, %td tokens, %d "
      "thread(s)\n",
      D, F, E, K, T, threads);
  std::printf("cpu:          %s\nkernels:      %s\n", moe::cpu_features().describe().c_str(),
              moe::compiled_kernels().c_str());

  // Random weights, uniform in [-1/sqrt(D), 1/sqrt(D)), from fixed seeds.
  double const weight_bytes =  // per expert: gate|up [2F, D], down [D, F]
      static_cast<double>(E * 3 * F * D) * static_cast<double>(sizeof(float));
  std::printf("weights:      ");
  print_bytes(weight_bytes);
  std::printf(" of fp32 expert weights: allocating,");
  std::fflush(stdout);
  auto t = Clock::now();
  moe::presets::Qwen3Moe layer = moe::presets::make_qwen3_moe(config);  // zeroed weights
  std::printf(" filling:");
  std::fflush(stdout);
  float const bound = 1.0f / std::sqrt(static_cast<float>(D));
  moe::MatrixView<float> const w_r = layer.router_weight();  // [E, D]
  moe::fill_uniform(std::span<float>(w_r.data, static_cast<std::size_t>(E * D)), -bound, bound, 1);
  fill_uniform_with_progress(layer.experts().edit().parameters(), -bound, bound, 2);
  std::printf("  (%.1f s)\n", seconds_since(t));

  moe::ThreadPool pool(threads);
  std::printf("pack:         fp32 panels for the micro-kernel ...");
  std::fflush(stdout);
  t = Clock::now();
  layer.pack_weights(moe::experts::WeightFormat::kF32, &pool);  // once, after the weights are set
  double packed_bytes = 0.0;
  for (moe::Index e = 0; e < E; ++e) {
    packed_bytes += static_cast<double>(layer.experts().packed_bytes(e));
  }
  std::printf(" ");
  print_bytes(packed_bytes);
  std::printf(" more (%.1f s)\n", seconds_since(t));

  std::vector<float> x(static_cast<std::size_t>(T * D));  // [T, D] activations
  std::vector<float> y(x.size());                         // [T, D] layer output
  moe::fill_uniform(x, -1.0f, 1.0f, 3);

  moe::MoeFfnWorkspace ws;
  layer.reserve(ws, T, threads);
  moe::ForwardOptions opt;
  opt.pool = &pool;

  moe::ConstMatrixView<float> const xv(x.data(), T, D);
  moe::MatrixView<float> const yv(y.data(), T, D);
  layer.forward(xv, yv, ws, opt);  // warm-up (first touch of the workspace and the weights)
  auto const t0 = Clock::now();
  layer.forward(xv, yv, ws, opt);
  double const seconds = seconds_since(t0);

  moe::routing::RoutingStats const st = moe::routing::routing_stats(ws.plan, ws.selection);
  std::printf("expert load:  min %td  max %td  mean %.2f rows  imbalance (max/mean) %.3f\n",
              st.min_load, st.max_load, st.mean_load, st.imbalance);
  std::printf("load entropy: %.4f nats of log E = %.4f (%.1f%%)\n", st.load_entropy,
              std::log(static_cast<double>(E)),
              100.0 * st.load_entropy / std::log(static_cast<double>(E)));

  double const rows = static_cast<double>(ws.plan.num_rows());
  double const flops =
      2.0 * static_cast<double>(T * E * D) + rows * 2.0 * static_cast<double>(D * F) * 3.0;
  std::printf(
      "forward:      %.3f ms  %.0f tokens/s  %.2f GFLOP/s (router 2*T*E*D + experts "
      "2*R*D*F*3, R = %.0f)\n",
      seconds * 1e3, static_cast<double>(T) / seconds, flops / seconds * 1e-9, rows);

  auto const bad = std::find_if(y.begin(), y.end(), [](float v) { return !std::isfinite(v); });
  if (bad != y.end()) {
    std::fprintf(stderr, "error: output element %td is %g (non-finite)\n", bad - y.begin(),
                 static_cast<double>(*bad));
    return 1;
  }
  double sum_sq = 0.0;
  for (float v : y) sum_sq += static_cast<double>(v) * static_cast<double>(v);
  std::printf("output:       all %zu values finite, rms %.4g\n", y.size(),
              std::sqrt(sum_sq / static_cast<double>(y.size())));
  std::printf("peak memory:  ");
  print_bytes(peak_rss_bytes());
  std::printf(" resident (getrusage ru_maxrss) = fp32 weights ");
  print_bytes(weight_bytes);
  std::printf(" + packed panels ");
  print_bytes(packed_bytes);
  std::printf(" + router, activations, workspace\n");
  return 0;
}

constexpr moe_cli::Option kOptions[] = {
    {"--small", "D 64, F 32, E 8, top-2, 16 tokens (the ctest run), not Qwen3-30B-A3B (4.9 GB)"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {"moe_quickstart", "[--small]", kOptions};

}  // namespace

int main(int argc, char** argv) {
  bool small = false;
  for (int i = 1; i < argc; ++i) {
    if (moe_cli::is_help(argv[i])) return moe_cli::print_help(kUsage);
    if (std::strcmp(argv[i], "--small") == 0) {
      small = true;
    } else {
      return moe_cli::print_unknown_argument(kUsage, argv[i]);
    }
  }
  try {
    return run(small);
  } catch (std::exception const& e) {  // moe::Error: a precondition failed (message says which)
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
