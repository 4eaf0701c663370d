// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// Benchmarks of the attention layers and of the SDPA kernel (docs/attention.md, "Numbers").
//
// Shapes (T tokens in one sequence, causal):
//   BM_Kernel_Sdpa_Forward / _Backward   one head, d = dv = 128, one thread (CPU time)
//   BM_Layer_GatedAttention_Forward / _Train
//       D 1024, 8 query heads over 2 KV heads, head_dim 128, elementwise gate packed per query
//       head (Qwen3-Next layout), q/k RMSNorm (1 + w), RoPE on 64 of 128 dims; pool of 2 threads
//   BM_Layer_MoeAttention_Forward / _ForwardBf16 / _Train
//       UMoE: D 1024, 16 SiLU-MLP experts of F 512 (bank packed once: fp32 panels, or bf16 panels
//       for the _ForwardBf16 rows), top-2, d_qk 128, query rank 32 + residual query, RoPE,
//       headwise gate, no shared expert; pool of 2 threads
//   all at T in {128, 512, 2048}.
//   BM_Layer_MlaAttention_Decode
//       multi-head latent attention with DeepSeek-V2-Lite's attention shape: D 2048, 16 heads,
//       no q lora (q_proj), kv_lora_rank 512, nope 128, rope 64, v 128; fp32 weights; one decode
//       step (1 new token) on a context of ctx = 4096 cached tokens (random latent rows), in the
//       absorbed (order 0) or naive (order 1) order, fp32 (cache 0) or bf16 (cache 1) latent
//       cache; pool of 2 threads. Counters: tokens/s, cache MB/step = the latent rows a step reads
//       ((ctx + 1) (R + d_r) 4 or 2 bytes), MB/step = that + the projection weights (fp32), and
//       GB/s = MB/step over the time.
//   BM_Kernel_DeltaRule_Chunked / _Recurrent   one head of the gated delta rule, d_k = d_v = 128,
//       chunks of 64, one thread, T in {128, 512}
//   BM_Layer_GatedDeltaNet_Prefill / _PrefillRecurrent / _Projections
//       Qwen3-Next-style linear attention: D 1024, 4 key heads, 8 value heads, d_k = d_v = 128,
//       kernel 4, projections packed (kF32), one sequence from the zero state (chunked /
//       recurrent delta rule); _Projections
//       runs only the layer's matrix products (in_proj_qkvz, in_proj_ba, out_proj, fp32 panels)
//       on the same rows, so Projections / Prefill is the share of the GEMM-shaped work; pool of
//       2 threads, T in {128, 512}
//   BM_Layer_GatedDeltaNet_Train    forward_train (chunked) + backward (recurrent, checkpointed),
//       FLOP counted as 3 x the forward's
//   BM_Layer_GatedDeltaNet_Decode   one 1-token step after a prompt of `context` tokens (1024,
//       16384): the state is the same size whatever the context, so the rows should match
//
// FLOP count (multiply-add = 2 FLOP; softmax, exp, norms, RoPE, gates and activations are not
// counted). A causal sequence of S tokens has V = S (S + 1) / 2 visible (query, key) pairs:
//   SDPA forward     4 d V per head (q.k and p v: 2 d each)
//   SDPA backward   10 d V per head (recomputed q.k, dO v^T, dq, dk, dv)
//   GatedAttention forward  2 T D (H d_h + H w + 2 KV d_h) projections + 2 T H d_h D o_proj
//                           + 4 d_h V H
//   GatedAttention train    3 x the projection FLOPs + 14 d_h V H (forward + backward SDPA)
//   MoeAttention forward    2 T D E (router) + per routed row R = T k: 2 D r + 2 r d_qk (query),
//                           2 D (gate), 4 D F (expert) + 2 T D d_qk (key) + 2 T D d_qk (residual)
//                           + 2 (d_qk + D) V_routed, V_routed = sum over rows of visible keys
//   MoeAttention train      3 x the projection FLOPs + (8 d_qk + 6 D) V_routed (forward
//                           2 d_qk + 2 D; backward recomputed q.k 2 d_qk, dO v^T 2 D, dq, dk
//                           4 d_qk, dv 2 D; the dq / dk-dv split recomputes q.k and dO v^T once
//                           more, which is not counted)
//   MlaAttention decode     MlaAttention::cached_flops + the projections 2 D (H d_q + R + d_r)
//                           + 2 H d_v D
//   delta rule       recurrent 4 d_k d_v per token and head (chunked: the same count, although it
//                    does about twice that); GatedDeltaNet forward 2 T D (2 K + 2 V + 2 H_v) +
//                    2 T V D projections + the delta rule's count (convolution, norms not counted)
// The counter FLOP is that count over the wall time (a rate: printed as FLOP=...G/s).

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "bench_main.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/kernels/delta_rule.hpp"
#include "moe/kernels/dispatch.hpp"
#include "moe/kernels/sdpa.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/gated_deltanet.hpp"
#include "moe/layers/linear.hpp"
#include "moe/layers/mla_attention.hpp"
#include "moe/layers/moe_attention.hpp"
#include "moe/routing/softmax_top_k.hpp"

namespace {

using benchmark::Counter;
using moe::Index;
constexpr int kThreads = 2;

double visible_pairs(Index S) { return 0.5 * static_cast<double>(S) * static_cast<double>(S + 1); }

std::vector<float> random_vector(Index n, std::uint64_t seed, float bound) {
  std::vector<float> v(static_cast<std::size_t>(n));
  moe::fill_uniform(v, -bound, bound, seed);
  return v;
}

void set_counters(benchmark::State& state, Index T, double flops) {
  state.counters["tokens"] = Counter(static_cast<double>(T), Counter::kIsIterationInvariantRate);
  state.counters["FLOP"] = Counter(flops, Counter::kIsIterationInvariantRate);
}

// --- SDPA kernel, one head ---------------------------------------------------------------

struct Head {
  Index T, d = 128;
  std::vector<float> q, k, v, o, lse, delta, dout, dq, dk, dv, scratch;
  moe::kernels::SdpaParams p;
  moe::kernels::SdpaGrads g;
  explicit Head(Index T_) : T(T_) {
    q = random_vector(T * d, 1, 1.0f);
    k = random_vector(T * d, 2, 1.0f);
    v = random_vector(T * d, 3, 1.0f);
    dout = random_vector(T * d, 4, 1.0f);
    o.resize(q.size());
    dq.resize(q.size());
    dk.resize(q.size());
    dv.resize(q.size());
    lse.resize(static_cast<std::size_t>(T));
    delta.resize(lse.size());
    scratch.resize(static_cast<std::size_t>(moe::kernels::sdpa_scratch_size(d, d)));
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.ldq = p.ldk = p.ldv = d;
    p.q_rows = p.kv_rows = T;
    p.head_dim = p.value_dim = d;
    p.scale = 1.0f / std::sqrt(static_cast<float>(d));
    p.causal = true;
    g.o = o.data();
    g.dout = dout.data();
    g.ldo = g.lddo = g.lddq = g.lddk = g.lddv = d;
    g.lse = lse.data();
    g.delta = delta.data();
    g.dq = dq.data();
    g.dk = dk.data();
    g.dv = dv.data();
  }
};

void BM_Kernel_Sdpa_Forward(benchmark::State& state) {
  Head h(state.range(0));
  for (auto _ : state) {
    moe::kernels::sdpa_forward(h.p, h.o.data(), h.d, nullptr, 0, h.T, h.scratch.data());
    benchmark::DoNotOptimize(h.o.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, h.T, 4.0 * static_cast<double>(h.d) * visible_pairs(h.T));
}

void BM_Kernel_Sdpa_Backward(benchmark::State& state) {
  Head h(state.range(0));
  moe::kernels::sdpa_forward(h.p, h.o.data(), h.d, h.lse.data(), 0, h.T, h.scratch.data());
  moe::kernels::sdpa_backward_delta(h.g, h.d, 0, h.T, h.delta.data());
  for (auto _ : state) {  // accumulates into dq, dk, dv; their values do not affect the time
    moe::kernels::sdpa_backward(h.p, h.g, h.scratch.data());
    benchmark::DoNotOptimize(h.dq.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, h.T, 10.0 * static_cast<double>(h.d) * visible_pairs(h.T));
}

// --- GatedAttention ------------------------------------------------------------------------

using Gated = moe::GatedAttention<moe::gating::ElementwiseGate>;

Gated& gated_layer() {
  static Gated layer = [] {
    moe::GatedAttentionConfig c;
    c.d_model = 1024;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 128;
    c.gate_layout = moe::GateLayout::kPackedPerHead;
    c.qk_norm = moe::QkNorm::kRmsNormOnePlus;
    c.rope = true;
    c.rotary_dim = 64;
    Gated l(c);
    std::uint64_t seed = 10;
    for (auto& p : l.parameters()) moe::fill_uniform(p.values, -0.03f, 0.03f, seed++);
    return l;
  }();
  return layer;
}

/// Projection FLOPs of one GatedAttention forward over T tokens, and the SDPA pairs term.
double gated_projection_flops(Gated const& l, Index T) {
  double const D = static_cast<double>(l.d_model()), H = static_cast<double>(l.num_heads());
  double const dh = static_cast<double>(l.head_dim()), KV = static_cast<double>(l.num_kv_heads());
  double const w = static_cast<double>(l.gate_width());
  return 2.0 * static_cast<double>(T) * D * (H * dh + H * w + 2.0 * KV * dh) +
         2.0 * static_cast<double>(T) * H * dh * D;
}

void BM_Layer_GatedAttention_Forward(benchmark::State& state) {
  Gated& layer = gated_layer();
  Index const T = state.range(0), D = layer.d_model();
  auto x = random_vector(T * D, 20, 1.0f);
  std::vector<float> y(x.size());
  moe::ThreadPool pool(kThreads);
  moe::GatedAttentionWorkspace ws;
  moe::AttentionOptions opt;
  opt.pool = &pool;
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, opt);
  for (auto _ : state) {
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, opt);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  double const attn =
      4.0 * static_cast<double>(layer.head_dim() * layer.num_heads()) * visible_pairs(T);
  set_counters(state, T, gated_projection_flops(layer, T) + attn);
}

void BM_Layer_GatedAttention_Train(benchmark::State& state) {
  Gated& layer = gated_layer();
  Index const T = state.range(0), D = layer.d_model();
  auto x = random_vector(T * D, 21, 1.0f);
  auto dy = random_vector(T * D, 22, 1.0f / static_cast<float>(T * D));
  std::vector<float> y(x.size()), dx(x.size());
  moe::ThreadPool pool(kThreads);
  moe::GatedAttentionWorkspace ws;
  moe::AttentionOptions opt;
  opt.pool = &pool;
  auto grads = layer.make_gradients();
  // One step first, as the forward rows do: the workspace grows (and its pages fault in) here,
  // not in the timed loop, where it weighed on rows of only a few iterations.
  layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, opt);
  layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, &pool);
  for (auto _ : state) {
    layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, opt);
    layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, &pool);
    benchmark::DoNotOptimize(dx.data());
    benchmark::ClobberMemory();
  }
  double const attn =
      14.0 * static_cast<double>(layer.head_dim() * layer.num_heads()) * visible_pairs(T);
  set_counters(state, T, 3.0 * gated_projection_flops(layer, T) + attn);
}

// --- MoeAttention (UMoE) --------------------------------------------------------------------

using Bank = moe::experts::ExpertBank<moe::experts::SiluMlp>;
using Umoe = moe::MoeAttention<moe::routing::SoftmaxTopK, moe::experts::SiluMlp,
                               moe::experts::NoSharedExperts, moe::gating::HeadwiseGate>;

struct UmoeModel {
  Bank bank{16, 1024, 512};
  Umoe layer;
  explicit UmoeModel(moe::experts::WeightFormat format = moe::experts::WeightFormat::kF32) {
    moe::fill_uniform(bank.edit().parameters(), -0.03f, 0.03f, 30);
    moe::MoeAttentionConfig c;
    c.d_model = 1024;
    c.qk_dim = 128;
    c.q_rank = 32;
    c.residual_query = true;
    c.rope = true;
    layer = Umoe(c, {16, 2, false, 1.0f}, bank);
    std::uint64_t seed = 31;
    for (auto& p : layer.parameters()) moe::fill_uniform(p.values, -0.03f, 0.03f, seed++);
    bank.pack(format);  // panels once, as MoeFfn::pack_weights does for the FFN use
  }
};

UmoeModel& umoe_model() {
  static UmoeModel m;
  return m;
}
/// The same layer over a bank packed as bf16 panels (inference).
UmoeModel& umoe_model_bf16() {
  static UmoeModel m(moe::experts::WeightFormat::kBf16);
  return m;
}

/// FLOPs of one MoeAttention forward (projections, experts) and its routed SDPA pairs.
double umoe_flops(moe::MoeAttentionWorkspace const& ws, Index T, bool train) {
  double const D = 1024, E = 16, F = 512, dk = 128, r = 32;  // the UmoeModel shape
  double const R = static_cast<double>(ws.plan.num_rows());
  double pairs = 0.0;  // each routed row sees tok_pos + 1 keys
  for (Index j = 0; j < ws.plan.num_rows(); ++j) pairs += static_cast<double>(ws.tok_pos[j] + 1);
  double const t = static_cast<double>(T);
  double const proj =
      2.0 * t * D * E + R * (2.0 * D * r + 2.0 * r * dk + 2.0 * D + 4.0 * D * F) + 4.0 * t * D * dk;
  double const per_pair = train ? 8.0 * dk + 6.0 * D : 2.0 * dk + 2.0 * D;
  return (train ? 3.0 : 1.0) * proj + per_pair * pairs;
}

void umoe_forward(benchmark::State& state, UmoeModel& m) {
  Index const T = state.range(0), D = 1024;
  auto x = random_vector(T * D, 40, 1.0f);
  std::vector<float> y(x.size());
  moe::ThreadPool pool(kThreads);
  moe::MoeAttentionWorkspace ws;
  moe::AttentionOptions opt;
  opt.pool = &pool;
  m.layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, opt);
  for (auto _ : state) {
    m.layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, opt);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, T, umoe_flops(ws, T, false));
}
void BM_Layer_MoeAttention_Forward(benchmark::State& state) { umoe_forward(state, umoe_model()); }
void BM_Layer_MoeAttention_ForwardBf16(benchmark::State& state) {
  umoe_forward(state, umoe_model_bf16());
}

void BM_Layer_MoeAttention_Train(benchmark::State& state) {
  UmoeModel& m = umoe_model();
  Index const T = state.range(0), D = 1024;
  auto x = random_vector(T * D, 41, 1.0f);
  auto dy = random_vector(T * D, 42, 1.0f / static_cast<float>(T * D));
  std::vector<float> y(x.size()), dx(x.size());
  moe::ThreadPool pool(kThreads);
  moe::MoeAttentionWorkspace ws;
  moe::AttentionOptions opt;
  opt.pool = &pool;
  auto grads = m.layer.make_gradients();
  Bank bank_grads(16, 1024, 512);
  m.layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, opt);  // grow the workspace
  m.layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, bank_grads, &pool);
  for (auto _ : state) {
    m.layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, opt);
    m.layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, bank_grads, &pool);
    benchmark::DoNotOptimize(dx.data());
    benchmark::ClobberMemory();
  }
  m.layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, opt);
  set_counters(state, T, umoe_flops(ws, T, true));
}

// --- MlaAttention (DeepSeek-V2-Lite's attention), one decode step -------------------------

moe::MlaAttention& mla_layer() {
  static moe::MlaAttention layer = [] {
    moe::MlaAttentionConfig c;
    c.d_model = 2048;
    c.num_heads = 16;
    c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 128;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 128;
    moe::MlaAttention l(c);
    std::uint64_t seed = 50;
    for (auto& p : l.parameters()) {
      bool const norm = p.name.find("layernorm") != std::string_view::npos;
      moe::fill_uniform(p.values, norm ? 0.9f : -0.02f, norm ? 1.1f : 0.02f, seed++);
    }
    return l;
  }();
  return layer;
}

void BM_Layer_MlaAttention_Decode(benchmark::State& state) {
  moe::MlaAttention const& layer = mla_layer();
  Index const ctx = state.range(0), D = layer.d_model(), W = layer.latent_dim();
  auto const order = state.range(1) == 0 ? moe::MlaOrder::kAbsorbed : moe::MlaOrder::kNaive;
  bool const bf16 = state.range(2) != 0;
  moe::KvCache cache =
      layer.make_cache(1, ctx + 1, bf16 ? moe::KvFormat::kBf16 : moe::KvFormat::kF32);
  auto const rows = random_vector(ctx * W, 51, 1.0f);  // the context's latent rows
  for (Index t = 0; t < ctx; ++t) cache.store_key(0, t, rows.data() + t * W);
  cache.advance(0, ctx);
  auto x = random_vector(D, 52, 1.0f);
  std::vector<float> y(x.size());
  moe::ThreadPool pool(kThreads);
  moe::MlaAttentionWorkspace ws;
  Index const one[1] = {1};
  auto step = [&] {
    layer.forward_cached({x.data(), 1, D}, {y.data(), 1, D}, cache, one, ws, &pool, order);
    cache.truncate(0, ctx);
  };
  step();  // grow the workspace
  for (auto _ : state) {
    step();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  auto const& c = layer.config();
  double const H = static_cast<double>(c.num_heads), dq = static_cast<double>(layer.qk_head_dim());
  double const R = static_cast<double>(c.kv_lora_rank), dv = static_cast<double>(c.v_head_dim);
  double const dn = static_cast<double>(c.qk_nope_head_dim), d = static_cast<double>(D);
  double const kv_b = H * (dn + dv) * R;  // counted by cached_flops
  double const other = d * (H * dq + static_cast<double>(W)) + H * dv * d;
  double const cache_bytes = static_cast<double>((ctx + 1) * W) * (bf16 ? 2.0 : 4.0);
  double const bytes = cache_bytes + 4.0 * (other + kv_b);
  state.counters["tokens"] = Counter(1.0, Counter::kIsIterationInvariantRate);
  state.counters["FLOP"] =
      Counter(layer.cached_flops(order, 1, ctx) + 2.0 * other, Counter::kIsIterationInvariantRate);
  state.counters["cache MB/step"] = cache_bytes * 1e-6;
  state.counters["MB/step"] = bytes * 1e-6;
  state.counters["bytes"] = Counter(bytes, Counter::kIsIterationInvariantRate);
}

// --- Gated DeltaNet ----------------------------------------------------------------------

struct DeltaHead {
  Index T, d = 128;
  std::vector<float> q, k, v, g, beta, o, S, scratch;
  moe::kernels::DeltaRuleHead p;
  explicit DeltaHead(Index T_) : T(T_) {
    q = random_vector(T * d, 1, 1.0f / std::sqrt(static_cast<float>(d)));
    k = random_vector(T * d, 2, 1.0f / std::sqrt(static_cast<float>(d)));
    v = random_vector(T * d, 3, 1.0f);
    g = random_vector(T, 4, 0.1f);
    for (float& x : g) x = -std::fabs(x);
    beta = random_vector(T, 5, 0.5f);
    for (float& x : beta) x += 0.5f;
    o.resize(v.size());
    S.assign(static_cast<std::size_t>(d * d), 0.0f);
    scratch.resize(static_cast<std::size_t>(moe::kernels::delta_rule_chunked_scratch(64, d, d)));
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.g = g.data();
    p.beta = beta.data();
    p.o = o.data();
    p.ldq = p.ldk = p.ldv = p.ldo = d;
    p.tokens = T;
    p.dk = p.dv = d;
  }
};

void delta_rule_kernel(benchmark::State& state, moe::DeltaRule rule) {
  DeltaHead h(state.range(0));
  for (auto _ : state) {
    std::fill(h.S.begin(), h.S.end(), 0.0f);
    if (rule == moe::DeltaRule::kChunked) {
      moe::kernels::delta_rule_chunked(h.p, h.S.data(), h.scratch.data(), 64);
    } else {
      moe::kernels::delta_rule_recurrent(h.p, h.S.data(), h.scratch.data());
    }
    benchmark::DoNotOptimize(h.o.data());
  }
  set_counters(state, h.T, 4.0 * static_cast<double>(h.T * h.d * h.d));
}
void BM_Kernel_DeltaRule_Chunked(benchmark::State& state) {
  delta_rule_kernel(state, moe::DeltaRule::kChunked);
}
void BM_Kernel_DeltaRule_Recurrent(benchmark::State& state) {
  delta_rule_kernel(state, moe::DeltaRule::kRecurrent);
}

moe::GatedDeltaNet& deltanet_layer() {
  static moe::GatedDeltaNet layer = [] {
    moe::GatedDeltaNetConfig c;
    c.d_model = 1024;
    c.num_key_heads = 4;
    c.num_value_heads = 8;
    c.key_head_dim = 128;
    c.value_head_dim = 128;
    moe::GatedDeltaNet l(c);
    std::uint64_t seed = 30;
    for (auto& p : l.parameters()) moe::fill_uniform(p.values, -0.03f, 0.03f, seed++);
    l.pack_weights(moe::experts::WeightFormat::kF32);  // as a decoder keeps it
    return l;
  }();
  return layer;
}

double deltanet_flops(moe::GatedDeltaNet const& l, Index T) {
  auto const& c = l.config();
  double const t = static_cast<double>(T), D = static_cast<double>(c.d_model);
  return 2.0 * t * D * static_cast<double>(l.proj_cols() + l.value_dim()) +
         4.0 * t * static_cast<double>(c.num_value_heads * c.key_head_dim * c.value_head_dim);
}

void deltanet_prefill(benchmark::State& state, moe::DeltaRule rule) {
  auto& layer = deltanet_layer();
  Index const T = state.range(0), D = layer.d_model();
  auto x = random_vector(T * D, 31, 1.0f);
  std::vector<float> y(x.size());
  moe::ThreadPool pool(kThreads);
  moe::GatedDeltaNetWorkspace ws;
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, &pool, rule);
  for (auto _ : state) {
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, &pool, rule);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, T, deltanet_flops(layer, T));
}
void BM_Layer_GatedDeltaNet_Prefill(benchmark::State& state) {
  deltanet_prefill(state, moe::DeltaRule::kChunked);
}
void BM_Layer_GatedDeltaNet_PrefillRecurrent(benchmark::State& state) {
  deltanet_prefill(state, moe::DeltaRule::kRecurrent);
}

void BM_Layer_GatedDeltaNet_Train(benchmark::State& state) {
  auto& layer = deltanet_layer();
  Index const T = state.range(0), D = layer.d_model();
  auto x = random_vector(T * D, 38, 1.0f);
  auto dy = random_vector(T * D, 39, 1.0f / static_cast<float>(T * D));
  std::vector<float> y(x.size()), dx(x.size());
  moe::ThreadPool pool(kThreads);
  moe::GatedDeltaNetWorkspace ws;
  auto grads = layer.make_gradients();
  layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, &pool);  // the workspace grows here
  layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, &pool);
  for (auto _ : state) {
    layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, &pool);
    layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, &pool);
    benchmark::DoNotOptimize(dx.data());
  }
  set_counters(state, T, 3.0 * deltanet_flops(layer, T));
}

void BM_Layer_GatedDeltaNet_Projections(benchmark::State& state) {
  auto& layer = deltanet_layer();
  Index const T = state.range(0), D = layer.d_model(), P = layer.proj_cols(), V = layer.value_dim();
  // The same shapes as the layer's packs (in_proj_qkvz, in_proj_ba, out_proj; the values do
  // not matter for the time).
  Index const qkvz = 2 * layer.key_dim() + 2 * V;
  auto matrix = [](Index rows, Index cols, std::uint64_t seed) {
    auto const w = random_vector(rows * cols, seed, 0.03f);
    return moe::Linear(moe::ConstMatrixView<float>(w.data(), rows, cols),
                       moe::experts::WeightFormat::kF32);
  };
  moe::Linear const w_qkvz = matrix(qkvz, D, 35), w_ba = matrix(P - qkvz, D, 36);
  moe::Linear const w_out = matrix(D, V, 37);
  auto x = random_vector(T * D, 32, 1.0f);
  auto o = random_vector(T * V, 33, 1.0f);
  std::vector<float> proj(static_cast<std::size_t>(T * P)), y(x.size());
  moe::ThreadPool pool(kThreads);
  moe::LinearQueue queue;
  auto once = [&] {  // in the layer's order: the input projections, then out_proj
    queue.add(w_qkvz, {x.data(), T, D}, {proj.data(), T, qkvz, P});
    queue.add(w_ba, {x.data(), T, D}, {proj.data() + qkvz, T, P - qkvz, P});
    queue.run(&pool);
    queue.add(w_out, {o.data(), T, V}, {y.data(), T, D});
    queue.run(&pool);
  };
  once();
  for (auto _ : state) {
    once();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, T, 2.0 * static_cast<double>(T * D * (P + V)));
}

void BM_Layer_GatedDeltaNet_Decode(benchmark::State& state) {
  auto& layer = deltanet_layer();
  Index const context = state.range(0), D = layer.d_model(), piece = 1024;
  moe::ThreadPool pool(kThreads);
  moe::GatedDeltaNetWorkspace ws;
  auto state_ = layer.make_state();
  auto x = random_vector(piece * D, 34, 1.0f);
  std::vector<float> y(x.size());
  for (Index done = 0; done < context; done += piece) {  // the prompt, 1024 tokens a call
    Index const n = std::min(piece, context - done);
    layer.forward({x.data(), n, D}, {y.data(), n, D}, state_, ws, &pool);
  }
  for (auto _ : state) {  // steps continuing the sequence (a few more tokens of context)
    layer.forward({x.data(), 1, D}, {y.data(), 1, D}, state_, ws, &pool);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["state_bytes"] = static_cast<double>(state_.bytes());
  set_counters(state, 1, deltanet_flops(layer, 1));
}

// Layers: wall-clock time (UseRealTime; the CPU clock misses the pool's worker). The smoke
// test's filter "/T:128(/|$)" runs every benchmark at T 128 only.
BENCHMARK(BM_Kernel_Sdpa_Forward)->ArgsProduct({{128, 512, 2048}})->ArgNames({"T"});
BENCHMARK(BM_Kernel_Sdpa_Backward)->ArgsProduct({{128, 512, 2048}})->ArgNames({"T"});
BENCHMARK(BM_Layer_GatedAttention_Forward)
    ->ArgsProduct({{128, 512, 2048}})
    ->ArgNames({"T"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Layer_GatedAttention_Train)
    ->ArgsProduct({{128, 512, 2048}})
    ->ArgNames({"T"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Layer_MoeAttention_Forward)
    ->ArgsProduct({{128, 512, 2048}})
    ->ArgNames({"T"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Layer_MoeAttention_ForwardBf16)
    ->ArgsProduct({{128, 512, 2048}})
    ->ArgNames({"T"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Layer_MoeAttention_Train)
    ->ArgsProduct({{128, 512, 2048}})
    ->ArgNames({"T"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Layer_MlaAttention_Decode)
    ->ArgsProduct({{4096}, {0, 1}, {0, 1}})
    ->ArgNames({"ctx", "order", "cache"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_Kernel_DeltaRule_Chunked)->ArgsProduct({{128, 512}})->ArgNames({"T"});
BENCHMARK(BM_Kernel_DeltaRule_Recurrent)->ArgsProduct({{128, 512}})->ArgNames({"T"});
/// The Gated DeltaNet layer rows: T 128 and 512, wall time in milliseconds.
void deltanet_rows(benchmark::internal::Benchmark* b) {
  b->ArgsProduct({{128, 512}})->ArgNames({"T"})->UseRealTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_Layer_GatedDeltaNet_Prefill)->Apply(deltanet_rows);
BENCHMARK(BM_Layer_GatedDeltaNet_PrefillRecurrent)->Apply(deltanet_rows);
BENCHMARK(BM_Layer_GatedDeltaNet_Projections)->Apply(deltanet_rows);
BENCHMARK(BM_Layer_GatedDeltaNet_Train)->Apply(deltanet_rows);
BENCHMARK(BM_Layer_GatedDeltaNet_Decode)
    ->ArgsProduct({{1024, 16384}})
    ->ArgNames({"context"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

bool add_context() {
  benchmark::AddCustomContext("xsimd_arch", xsimd::default_arch::name());
  benchmark::AddCustomContext("cpu", moe::cpu_features().describe());
  benchmark::AddCustomContext("kernels", moe::compiled_kernels());
  benchmark::AddCustomContext("pool", "layers: moe::ThreadPool of 2 threads; kernels: 1 thread");
  benchmark::AddCustomContext("flops", "see the comment at the top of bench_attention.cpp");
  return true;
}
[[maybe_unused]] bool const kContextAdded = add_context();

}  // namespace

MOE_BENCH_MAIN(
    "moe_bench_attention: the attention layers (gated attention, MoE attention, MLA, Gated "
    "DeltaNet) and the SDPA kernel, prefill and decode steps on a KV cache (docs/attention.md).")
