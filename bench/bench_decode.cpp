// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// Decoding benchmarks (docs/decoding.md, docs/performance.md): the synthetic decoder of
// Qwen3-30B-A3B's shapes with random weights (synthetic_decoder.hpp), kLayers = 4 layers. Two
// threads.
//
//   BM_Decoder_Prefill/T:512/w:W         one prompt of 512 tokens through a fresh cache
//   BM_Decoder_Decode/ctx:C/w:W/kv:K     one decode step after a cached context of C tokens
//                                        (the step's token is rolled back after every
//                                        iteration, so the context stays C). kv:-1: C = 0,
//                                        1024, 4096 cached by a prefill (fp32 cache); kv:0 / 1:
//                                        C = 4096, 16384 of random keys and values in an fp32 /
//                                        bf16 cache (moe::KvFormat), side by side
//
// w: the weights of every matrix (each multiplied by moe's one projection engine, moe::Linear):
//   w:0  fp32 dense (embedding, attention, LM head), bf16 experts (a model converted to fp32)
//   w:1  bf16 dense, bf16 experts (a Hugging Face BF16 checkpoint as load_hf_decoder keeps it)
//   w:2  bf16 dense, q4_k experts (the step the Q4_K_M mix is compared with: experts quantized,
//        the rest as stored)
//   w:3  llama.cpp's Q4_K_M mix (DecoderOptions::q4_k_m(): q4_k, q6_k on the LM head and on
//        attn_v / ffn_down of half the layers)
// Only one routed-expert layer is quantized (30-60 s for 600 M weights); the 4 layers are copies
// of it (separate memory: each step still streams 4 layers' experts from DRAM).
//
// Counters: tokens/s; for decode also the bytes one step must read (every layer's attention
// packs and the KV cache of the context, the 8 active experts' packs and the router, the LM
// head's pack and the token's embedding row), that over the time as GB/s, and roofline = that /
// the machine's read bandwidth (bench/machine.hpp: 4 prefetched streams per thread over 4x the
// read sweep's last-level cache, at least 512 MiB), measured in pairs: one read of that buffer
// after every step (untimed), and bw GB/s = the reads' bytes over their summed time; plus the
// step's split: attn%, ffn%, other% (DecoderState::profile).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench_main.hpp"
#include "machine.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/models/decoder.hpp"
#include "synthetic_decoder.hpp"

namespace {

using moe::Index;
using Decoder = moe::bench::SyntheticDecoder;
using moe::bench::kDh;
using moe::bench::kE;
using moe::bench::kH;
using moe::bench::kKv;
using moe::bench::kTopK;
using moe::bench::kVocab;
constexpr int kThreads = 2;
constexpr Index kLayers = 4;

moe::ThreadPool& pool() {
  static moe::ThreadPool p(kThreads);
  return p;
}

/// The formats of configuration w (see the top of this file).
moe::models::DecoderOptions options_of(int w) {
  using moe::experts::WeightFormat;
  moe::models::DecoderOptions o;
  if (w == 3) return moe::models::DecoderOptions::q4_k_m();
  o.dense = w == 0 ? WeightFormat::kF32 : WeightFormat::kBf16;
  o.experts = w == 2 ? WeightFormat::kQ4_K : WeightFormat::kBf16;
  return o;
}

/// The decoder of configuration w, built once (the same random weights for every w).
Decoder const& decoder(int w) {
  static std::optional<Decoder> built[4];
  std::optional<Decoder>& slot = built[w];
  if (slot) return *slot;
  for (auto& other : built) other.reset();  // one configuration in memory at a time
  slot.emplace(moe::bench::make_synthetic_decoder(kLayers, options_of(w), &pool()));
  return *slot;
}

std::vector<std::int64_t> tokens(Index n, std::uint64_t seed) {
  return moe::bench::synthetic_tokens(n, seed);
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
  Decoder const& dec = decoder(static_cast<int>(state.range(1)));
  Index const T = state.range(0);
  auto const ids = tokens(T, 7);
  std::vector<float> logits(static_cast<std::size_t>(kVocab));
  std::vector<Index> const n = {T};
  auto st = dec.make_state(1, T);
  st.profile = true;
  for (auto _ : state) {
    st.clear();
    dec.forward(ids, n, st, {logits.data(), 1, kVocab}, &pool());
    benchmark::DoNotOptimize(logits.data());
  }
  double const total = st.attention_seconds + st.ffn_seconds + st.other_seconds;
  state.counters["tokens"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["attn%"] = 100.0 * st.attention_seconds / total;
  state.counters["ffn%"] = 100.0 * st.ffn_seconds / total;
  state.counters["other%"] = 100.0 * st.other_seconds / total;
}
void BM_Decoder_Decode(benchmark::State& state) {
  Decoder const& dec = decoder(static_cast<int>(state.range(1)));
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
  double const kv_bytes = static_cast<double>(ctx + 1) * 2.0 * kKv * kDh * (kv_bf16 ? 2.0 : 4.0);
  double experts = 0.0;
  for (auto const& b : dec.blocks) {
    experts += kTopK * static_cast<double>(b.moe->experts().packed_bytes(0)) + 4.0 * kE * kH;
  }
  double const bytes = static_cast<double>(dec.dense_bytes_per_step()) + kLayers * kv_bytes +
                       experts + static_cast<double>(dec.embed.bytes()) / kVocab;
  double const total = st.attention_seconds + st.ffn_seconds + st.other_seconds;
  state.counters["tokens"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["MB/step"] = bytes * 1e-6;
  state.counters["bw GB/s"] = bw * 1e-9;
  state.counters["roofline"] = bytes * static_cast<double>(state.iterations()) / elapsed / bw;
  state.counters["attn%"] = 100.0 * st.attention_seconds / total;
  state.counters["ffn%"] = 100.0 * st.ffn_seconds / total;
  state.counters["other%"] = 100.0 * st.other_seconds / total;
}
// Rows grouped by w, so that each configuration is built once (decoder() keeps one at a time).
void register_rows() {
  for (int w : {0, 1, 2, 3}) {
    if (w > 0) {
      benchmark::RegisterBenchmark("BM_Decoder_Prefill", BM_Decoder_Prefill)
          ->ArgNames({"T", "w"})
          ->Args({512, w})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
    auto* rows = benchmark::RegisterBenchmark("BM_Decoder_Decode", BM_Decoder_Decode)
                     ->ArgNames({"ctx", "w", "kv"})
                     ->ArgsProduct({{0, 1024, 4096}, {w}, {-1}});
    if (w == 1) rows->ArgsProduct({{4096, 16384}, {1}, {0, 1}});
    rows->UseRealTime()->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_rows();
  bool const listing = moe::bench::listing_only(argc, argv);  // before Initialize consumes it
  if (!moe::bench::initialize(
          argc, argv,
          "moe_bench_decode: prefill and decode steps of a synthetic decoder of Qwen3-30B-A3B's "
          "shapes with random weights in each weight format, the bytes a step reads and the "
          "fraction of read bandwidth it reaches (docs/decoding.md, docs/performance.md)."))
    return 1;
  if (!listing) {  // the last-level cache is measured (a sweep): not for the names only
    benchmark::AddCustomContext("cpu", moe::cpu_features().describe());
    benchmark::AddCustomContext("llc", moe::bench::last_level_cache().describe());
  }
  benchmark::AddCustomContext("decoder", "synthetic Qwen3-30B-A3B shapes, " +
                                             std::to_string(kLayers) +
                                             " layers, weights by w (see bench_decode.cpp)");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
