// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// 02_gated_moe_block: a Qwen3-Next-style decoder block (gated attention, then an MoE FFN with a
// gated shared expert) on random weights, with a timing line and the statistics of the gate.
//
// What it shows:
//   - moe::GatedAttention<gating::ElementwiseGate> with Qwen3-Next's attention: grouped-query
//     (16 query heads over 2 KV heads, head_dim 256), the gate packed into q_proj per query head
//     (HF layout: [query_h | gate_h]), q/k RMSNorm in the (1 + w) form, partial RoPE (64 of 256
//     dims, theta 1e7), causal; O = SDPA(Q, K, V) * sigmoid(x W_g), then o_proj;
//   - moe::presets::make_qwen2_moe: softmax top-k router with a sigmoid-gated shared expert,
//     sized like Qwen3-Next's MoE (F 512, top-10, shared expert 512) but with 64 experts instead
//     of 512 so that the fp32 weights fit in memory (0.8 GB instead of 6.4 GB);
//   - the block: h = x + Attn(RMSNorm(x)),  y = h + MoE(RMSNorm(h))  (norms with w = 0);
//   - gate statistics from the workspace (ws.gate holds sigmoid(x W_g) for every token, head and
//     element): their mean, and the fraction below 0.1 (the paper reports sparse gates for
//     trained models; random weights give values around 0.5).
// It is not a benchmark (one timed call; see bench/bench_attention.cpp).
//
// Command line:
//   cmake --preset release && cmake --build build/release --target moe_gated_block_example
//   ./build/release/examples/moe_gated_block_example           # D 2048, T 512, E 64
//   ./build/release/examples/moe_gated_block_example --small   # D 64, T 32, E 8 (the ctest test)
//   ./build/release/examples/moe_gated_block_example --help    # the options, one line each
// Exit status: 0 on success (and for --help / -h), 1 on a non-finite output or a moe error, 2 on
// an unknown argument (one line on stderr).

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
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/kernels/rms_norm.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/presets.hpp"

namespace {

using moe::Index;
using Clock = std::chrono::steady_clock;

/// out[t] = x[t] / rms(x[t]) (Qwen3NextRMSNorm with w = 0), row by row.
void rms_norm_rows(std::vector<float> const& x, std::vector<float>& out, Index D) {
  std::vector<float> const w(static_cast<std::size_t>(D), 0.0f);
  Index const T = static_cast<Index>(x.size()) / D;
  for (Index t = 0; t < T; ++t) {
    moe::kernels::rms_norm(x.data() + t * D, w.data(), true, 1e-6f, D, out.data() + t * D);
  }
}

template <class Params>
void fill_all(Params params, float bound, std::uint64_t seed) {
  for (auto& p : params) moe::fill_uniform(p.values, -bound, bound, seed++);
}

int run(bool small) {
  // Qwen3-Next-80B-A3B full-attention layer: D, heads, KV heads, head_dim, layout, norm, eps,
  // RoPE, theta, rotary dims, scale (0: 1/sqrt(head_dim)), causal; MoE: D, F, shared F,
  // experts, top-k, renormalised weights.
  auto const layout = moe::GateLayout::kPackedPerHead;
  auto const norm = moe::QkNorm::kRmsNormOnePlus;
  moe::GatedAttentionConfig ac{2048, 16, 2, 256, layout, norm, 1e-6f, true, 1e7f, 64, 0.0f, true};
  moe::presets::Qwen2MoeConfig mc{2048, 512, 512, 64, 10, true};
  Index T = 512;
  if (small) {
    ac = {64, 4, 2, 16, layout, norm, 1e-6f, true, 1e7f, 4, 0.0f, true};
    mc = {64, 32, 32, 8, 2, true};
    T = 32;
  }
  Index const D = ac.d_model;
  float const bound = 1.0f / std::sqrt(static_cast<float>(D));

  moe::GatedAttention<moe::gating::ElementwiseGate> attn(ac);
  fill_all(attn.parameters(), bound, 1);
  std::fill(attn.q_norm().begin(), attn.q_norm().end(), 0.0f);  // (1 + w) form: w = 0
  std::fill(attn.k_norm().begin(), attn.k_norm().end(), 0.0f);
  moe::presets::Qwen2Moe moe_ffn = moe::presets::make_qwen2_moe(mc);
  fill_all(moe_ffn.parameters(), bound, 10);
  moe_ffn.pack_weights();  // expert weights in the micro-kernel's panel layout, once

  std::vector<float> x(static_cast<std::size_t>(T * D)), normed(x.size()), h(x.size()), y(x.size());
  moe::fill_uniform(x, -1.0f, 1.0f, 20);
  int const threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1,
                                 moe::ThreadPool::kMaxThreads);
  moe::ThreadPool pool(threads);
  moe::GatedAttentionWorkspace aws;
  moe::MoeFfnWorkspace fws;
  moe::AttentionOptions aopt;
  aopt.pool = &pool;
  moe::ForwardOptions fopt;
  fopt.pool = &pool;

  double attn_s = 0.0, moe_s = 0.0;
  for (int rep = 0; rep < 2; ++rep) {  // the first pass warms up workspaces and weights
    auto const t0 = Clock::now();
    rms_norm_rows(x, normed, D);
    attn.forward({normed.data(), T, D}, {h.data(), T, D}, aws, aopt);
    for (std::size_t i = 0; i < x.size(); ++i) h[i] += x[i];
    auto const t1 = Clock::now();
    rms_norm_rows(h, normed, D);
    moe_ffn.forward({normed.data(), T, D}, {y.data(), T, D}, fws, fopt);
    for (std::size_t i = 0; i < x.size(); ++i) y[i] += h[i];
    auto const t2 = Clock::now();
    attn_s = std::chrono::duration<double>(t1 - t0).count();
    moe_s = std::chrono::duration<double>(t2 - t1).count();
  }

  std::printf(
      "Qwen3-Next-style block: D %td, %td q heads / %td kv heads x %td, elementwise gate; "
      "MoE E %td top-%td F %td + gated shared expert; %td tokens, %d thread(s)\n",
      D, ac.num_heads, ac.num_kv_heads, ac.head_dim, mc.num_experts, mc.num_experts_per_tok,
      mc.moe_intermediate_size, T, threads);
  double const total = attn_s + moe_s;
  std::printf("time: attention %.3f ms + MoE %.3f ms = %.3f ms  (%.0f tokens/s)\n", attn_s * 1e3,
              moe_s * 1e3, total * 1e3, static_cast<double>(T) / total);

  double sum = 0.0;
  std::size_t below = 0;
  for (float g : aws.gate) {
    sum += g;
    below += g < 0.1f ? 1 : 0;
  }
  double const n = static_cast<double>(aws.gate.size());
  std::printf("gate: %zu values (tokens x heads x head_dim), mean %.4f, below 0.1: %.2f%%\n",
              aws.gate.size(), sum / n, 100.0 * static_cast<double>(below) / n);

  double ss = 0.0;
  bool finite = true;
  for (float v : y) {
    finite = finite && std::isfinite(v);
    ss += static_cast<double>(v) * v;
  }
  if (!finite) {
    std::fprintf(stderr, "error: the block output has non-finite values\n");
    return 1;
  }
  std::printf("output: all %zu values finite, rms %.4g\n", y.size(),
              std::sqrt(ss / static_cast<double>(y.size())));
  return 0;
}

constexpr moe_cli::Option kOptions[] = {
    {"--small", "D 64, T 32, E 8 (the ctest run) instead of D 2048, T 512, E 64 (0.8 GB)"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {"moe_gated_block_example", "[--small]", kOptions};

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
