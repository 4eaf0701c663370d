// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// Decoding benchmarks (docs/decoding.md, docs/performance.md): a synthetic decoder of
// Qwen3-30B-A3B's shapes with random weights (moe::models::Decoder<presets::Qwen3Moe>):
// hidden 2048, 32 query heads over 4 KV heads of head_dim 128, q/k RMSNorm, RoPE; 128 experts of
// width 768, top-8 (experts packed as bf16: 2 bytes a weight); vocabulary 151936 with an untied
// LM head; kLayers = 4 layers (the experts' fp32 weights are discarded once packed, as
// load_hf_decoder does). Two threads.
//
//   BM_Decoder_Prefill/T:512/dense:D     one prompt of 512 tokens through a fresh cache
//   BM_Decoder_Decode/ctx:C/dense:D/kv:K one decode step after a cached context of C tokens
//                                        (the step's token is rolled back after every
//                                        iteration, so the context stays C). kv:-1: C = 0,
//                                        1024, 4096 cached by a prefill (fp32 cache); kv:0 / 1:
//                                        C = 4096, 16384 of random keys and values in an fp32 /
//                                        bf16 cache (moe::KvFormat), side by side
//
// dense:1 keeps the LM head and the attention projections in bf16, as a Hugging Face Qwen3
// checkpoint stores them and as load_hf_decoder keeps them (DenseWeights::kAsStored); dense:0 in
// fp32, as a model converted to fp32 (or loaded with DenseWeights::kF32). Both compute in fp32;
// the embedding is bf16 in both (one row a step).
//
// Counters: tokens/s; for decode also the bytes one step must read (every layer's attention
// weights and the KV cache of the context, the 8 active experts' bf16 weights and the router,
// the LM head and the token's embedding row), that over the time as GB/s, and roofline = that /
// the machine's read bandwidth (bench/machine.hpp: 4 prefetched streams per thread over 4x the
// read sweep's last-level cache, at least 512 MiB), measured in pairs: one read of that buffer
// after every step (untimed), and bw GB/s = the reads' bytes over their summed time; plus the
// step's split: attn%, ffn%, other% (DecoderState::profile).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "machine.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/models/decoder.hpp"

namespace {

using moe::Index;
using Decoder = moe::models::Decoder<moe::presets::Qwen3Moe>;
constexpr int kThreads = 2;
constexpr Index kLayers = 4, kH = 2048, kHeads = 32, kKv = 4, kDh = 128, kE = 128, kI = 768,
                kTopK = 8, kVocab = 151936;

moe::ThreadPool& pool() {
  static moe::ThreadPool p(kThreads);
  return p;
}

void fill(std::span<float> v, float bound, std::uint64_t seed) {
  moe::fill_uniform(v, -bound, bound, seed);
}

/// The LM head in both precisions; set_dense() moves one into the decoder.
struct LmHeads {
  moe::models::WeightMatrix f32, bf16;
};
LmHeads& spare_heads() {
  static LmHeads h;
  return h;
}

Decoder& decoder() {
  static Decoder d = [] {
    Decoder dec;
    moe::models::DecoderConfig& c = dec.config;
    c.moe.family = moe::io::HfFamily::kQwen3Moe;
    c.moe.hidden_size = kH;
    c.moe.num_experts = kE;
    c.moe.num_experts_per_tok = kTopK;
    c.moe.expert_intermediate_size = kI;
    c.moe.norm_topk_prob = true;
    c.moe.num_hidden_layers = kLayers;
    c.vocab_size = kVocab;
    c.num_hidden_layers = kLayers;
    c.num_attention_heads = kHeads;
    c.num_key_value_heads = kKv;
    c.head_dim = kDh;
    c.rope_theta = 1e6f;
    c.rms_norm_eps = 1e-6f;
    c.qk_norm = true;
    dec.embed = moe::models::WeightMatrix::zeros(kVocab, kH);
    fill(dec.embed.f32, 1.0f, 1);
    dec.embed.to_bf16();
    LmHeads& heads = spare_heads();
    heads.f32 = moe::models::WeightMatrix::zeros(kVocab, kH);
    fill(heads.f32.f32, 0.02f, 2);
    heads.bf16 = heads.f32;
    heads.bf16.to_bf16();
    dec.norm.assign(static_cast<std::size_t>(kH), 1.0f);
    moe::GatedAttentionConfig ac;
    ac.d_model = kH;
    ac.num_heads = kHeads;
    ac.num_kv_heads = kKv;
    ac.head_dim = kDh;
    ac.qk_norm = moe::QkNorm::kRmsNorm;
    ac.rope = true;
    ac.rope_theta = 1e6f;
    for (Index L = 0; L < kLayers; ++L) {
      Decoder::Block b{moe::GatedAttention<moe::gating::NoGate>(ac), {}, {}, std::nullopt, {}};
      std::uint64_t seed = 100 * static_cast<std::uint64_t>(L + 1);
      for (auto const& p : b.attention.parameters()) {
        if (std::string_view(p.name).find("norm") == std::string_view::npos) {
          fill(p.values, 0.02f, seed++);
        }
      }
      b.input_norm.assign(static_cast<std::size_t>(kH), 1.0f);
      b.post_norm.assign(static_cast<std::size_t>(kH), 1.0f);
      b.moe.emplace(moe::presets::make_qwen3_moe({kH, kI, kE, kTopK, true}));
      fill(b.moe->experts().edit().parameters(), 0.02f, seed++);
      auto w = b.moe->router_weight();
      fill({w.data, static_cast<std::size_t>(w.rows * w.cols)}, 0.05f, seed++);
      b.moe->pack_weights(moe::experts::WeightFormat::kBf16, &pool());
      b.moe->discard_master_weights();  // as load_hf_decoder: only the bf16 pack stays
      dec.blocks.push_back(std::move(b));
    }
    return dec;
  }();
  return d;
}

/// The LM head and the attention projections in bf16 (DenseWeights::kAsStored for a bf16
/// checkpoint) or fp32.
Decoder& set_dense(bool bf16) {
  Decoder& dec = decoder();
  LmHeads& heads = spare_heads();
  if (!dec.lm_head.empty()) std::swap(dec.lm_head, dec.lm_head.is_bf16() ? heads.bf16 : heads.f32);
  std::swap(dec.lm_head, bf16 ? heads.bf16 : heads.f32);
  for (auto& b : dec.blocks) {
    b.attention.pack_weights(bf16 ? moe::experts::WeightFormat::kBf16
                                  : moe::experts::WeightFormat::kF32);
  }
  return dec;
}

std::vector<std::int64_t> tokens(Index n, std::uint64_t seed) {
  std::vector<std::int64_t> t(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    t[static_cast<std::size_t>(i)] = static_cast<std::int64_t>((seed >> 33) % kVocab);
  }
  return t;
}

/// The reader's buffer: 4x the read sweep's last-level cache, at least 512 MiB.
moe::HugePageVector<float> const& reader_buffer() {
  static Index const n =
      std::max<Index>(Index{1} << 27, moe::bench::last_level_cache().bytes) / 32 * 32;
  static moe::HugePageVector<float> const buf(static_cast<std::size_t>(n), 1.0f);
  return buf;
}

/// Seconds two threads take to read the reader's buffer once (bench/machine.hpp's
/// moe::bench::read_bandwidth: 4 prefetched streams per thread, the reader the hot-path bench
/// measures with). A decode row times one read after every step, outside the timed region, and
/// compares the sums: the host's bandwidth drifts by 2x within seconds (other VMs on the memory
/// controller), so a bandwidth measured once before or after the row misjudged it either way.
double read_seconds() {
  auto const& buf = reader_buffer();
  Index const n = static_cast<Index>(buf.size());
  return static_cast<double>(n) * 4.0 / moe::bench::read_bandwidth(buf.data(), n, kThreads, 1, 1);
}

void BM_Decoder_Prefill(benchmark::State& state) {
  Decoder const& dec = set_dense(state.range(1) != 0);
  Index const T = state.range(0);
  auto const ids = tokens(T, 7);
  std::vector<float> logits(static_cast<std::size_t>(kVocab));
  std::vector<Index> const n = {T};
  auto st = dec.make_state(1, T);
  st.profile = true;
  for (auto _ : state) {
    for (auto& c : st.caches) c.clear();
    dec.forward(ids, n, st, {logits.data(), 1, kVocab}, &pool());
    benchmark::DoNotOptimize(logits.data());
  }
  double const total = st.attention_seconds + st.ffn_seconds + st.other_seconds;
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["attn%"] = 100.0 * st.attention_seconds / total;
  state.counters["ffn%"] = 100.0 * st.ffn_seconds / total;
  state.counters["other%"] = 100.0 * st.other_seconds / total;
}
BENCHMARK(BM_Decoder_Prefill)
    ->ArgNames({"T", "dense"})
    ->Args({512, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_Decoder_Decode(benchmark::State& state) {
  bool const bf16 = state.range(1) != 0;
  Decoder const& dec = set_dense(bf16);
  Index const ctx = state.range(0);
  // kv: -1 fp32 cache filled by a prefill; 0 / 1 an fp32 / bf16 cache filled with random keys
  // and values (a step's work does not depend on them; no prefill of 16k tokens per row).
  Index const kv = state.range(2);
  bool const kv_bf16 = kv == 1;
  std::vector<float> logits(static_cast<std::size_t>(kVocab));
  auto st = dec.make_state(1, ctx + 1, kv_bf16 ? moe::KvFormat::kBf16 : moe::KvFormat::kF32);
  if (ctx > 0 && kv < 0) {
    auto const prompt = tokens(ctx, 9);
    std::vector<Index> const n = {ctx};
    dec.forward(prompt, n, st, {logits.data(), 1, kVocab}, &pool());
  } else if (ctx > 0) {
    std::vector<float> row(static_cast<std::size_t>(kKv * kDh));
    std::uint64_t seed = 11;
    for (auto& c : st.caches) {
      c.make_room(0, ctx);
      for (Index t = 0; t < ctx; ++t) {
        moe::fill_uniform(row, -1.0f, 1.0f, seed++);
        c.store_key(0, t, row.data());
        c.store_value(0, t, row.data());
      }
      c.advance(0, ctx);
    }
  }
  std::vector<std::int64_t> const one = {42};
  std::vector<Index> const n1 = {1};
  st.profile = true;
  st.attention_seconds = st.ffn_seconds = st.other_seconds = 0.0;
  (void)read_seconds();  // the reader's buffer and pages, first touched outside the pairs
  double elapsed = 0.0, reading = 0.0;
  for (auto _ : state) {
    auto const t0 = std::chrono::steady_clock::now();
    dec.forward(one, n1, st, {logits.data(), 1, kVocab}, &pool());
    benchmark::DoNotOptimize(logits.data());
    elapsed += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.PauseTiming();
    reading += read_seconds();
    for (auto& c : st.caches) c.truncate(0, ctx);
    state.ResumeTiming();
  }
  double const bw = static_cast<double>(reader_buffer().size()) * 4.0 *
                    static_cast<double>(state.iterations()) / reading;
  double const dense_bytes = bf16 ? 2.0 : 4.0;  // per LM-head / attention weight
  double const attn_weights =
      dense_bytes * static_cast<double>(kH) * static_cast<double>(2 * kHeads * kDh + 2 * kKv * kDh);
  double const kv_bytes = static_cast<double>(ctx + 1) * 2.0 * kKv * kDh * (kv_bf16 ? 2.0 : 4.0);
  double const experts = static_cast<double>(kTopK) * 3.0 * kH * kI * 2.0 + 4.0 * kE * kH;
  double const bytes =
      kLayers * (attn_weights + kv_bytes + experts) + dense_bytes * kVocab * kH + 2.0 * kH;
  double const total = st.attention_seconds + st.ffn_seconds + st.other_seconds;
  state.counters["tokens/s"] =
      benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["MB/step"] = bytes * 1e-6;
  state.counters["bw GB/s"] = bw * 1e-9;
  state.counters["roofline"] = bytes * static_cast<double>(state.iterations()) / elapsed / bw;
  state.counters["attn%"] = 100.0 * st.attention_seconds / total;
  state.counters["ffn%"] = 100.0 * st.ffn_seconds / total;
  state.counters["other%"] = 100.0 * st.other_seconds / total;
}
BENCHMARK(BM_Decoder_Decode)
    ->ArgNames({"ctx", "dense", "kv"})
    ->ArgsProduct({{0, 1024, 4096}, {0, 1}, {-1}})
    ->ArgsProduct({{4096, 16384}, {1}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("cpu", moe::cpu_features().describe());
  benchmark::AddCustomContext("llc", moe::bench::last_level_cache().describe());
  benchmark::AddCustomContext("decoder", "synthetic Qwen3-30B-A3B shapes, " +
                                             std::to_string(kLayers) + " layers, bf16 experts");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
