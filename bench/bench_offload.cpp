// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// Streamed experts (docs/offload.md): the synthetic decoder of Qwen3-30B-A3B's shapes
// (synthetic_decoder.hpp) with kLayers = 12 layers, bf16 dense weights and q8_0 experts (5.0 MiB
// an expert, 7.5 GiB in all), its experts written once to an expert store (in
// $MOE_BENCH_STORE_DIR, else the system's temporary directory; removed at exit) and streamed
// through a cache of `budget_mib` MiB, reads throttled to an emulated drive of `mbps` MB/s and
// 100 us a read (mbps:0: unthrottled, the page cache's speed). Two compute threads, 4 readers.
//
//   BM_Decoder_Streamed/budget_mib:B/mbps:W/policy:P   one decode step (context 0, a new random
//                                                       token each step; the routing of random
//                                                       weights has no locality, so the hit rate
//                                                       is about the budget's share)
//   BM_Decoder_Resident                                 the same step with every expert in RAM
//                                                       (registered first: the streamed rows
//                                                       then stream this decoder's experts)
//
// Counters: tok_per_s; hit (the cache's hit rate); MiB_per_tok read from the store; ceiling =
// the I/O ceiling in tokens/s, bandwidth / bytes read per token (reads alone, fully overlapped);
// of_ceiling = tok_per_s / ceiling (the target is >= 0.8); wait% = the share of the step spent
// waiting for reads; pf_prec / pf_recall = the prefetch's precision and recall (StreamStats).
// Policies: 0 lru, 1 lfu, 2 layer-lru. Each row runs 16 untimed steps first
// (the cache warms up) and its statistics count the timed steps only.
//
//   BM_Miss/source:S/format:F   what one miss costs, for an expert of Qwen3-30B-A3B's shape
//                               (D 2048, F 768, GLU) in format F (0 q8_0, 1 q4_k, 2 bf16):
//                               S 0 = a pread of its record from a page-cached expert store;
//                               S 1 = ExpertBank::pack_record from its stored GGUF blocks (bf16:
//                               from fp32 weights), as streaming from the model's file does.
//                               The row's time is one miss; GB_per_s: record bytes made.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_main.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/models/decoder.hpp"
#include "moe/quant/blocks.hpp"
#include "synthetic_decoder.hpp"

namespace {

using moe::Index;
using Decoder = moe::bench::SyntheticDecoder;
constexpr int kThreads = 2;
constexpr Index kLayers = 12;

moe::ThreadPool& pool() {
  static moe::ThreadPool p(kThreads);
  return p;
}

Decoder& resident() {
  static Decoder dec = [] {
    moe::models::DecoderOptions o;
    o.dense = moe::experts::WeightFormat::kBf16;
    o.experts = moe::experts::WeightFormat::kQ8_0;
    return moe::bench::make_synthetic_decoder(kLayers, o, &pool());
  }();
  return dec;
}

/// The expert store of resident()'s experts, written once.
std::string const& store_path() {
  static std::string const path = [] {
    char const* dir = std::getenv("MOE_BENCH_STORE_DIR");
    std::filesystem::path const p =
        std::filesystem::path(dir ? dir : std::filesystem::temp_directory_path().string()) /
        "moe_bench_offload.moex";
    resident().write_expert_store(p.string());
    std::atexit([] { std::filesystem::remove(store_path()); });
    return p.string();
  }();
  return path;
}

void decode_steps(Decoder const& dec, benchmark::State& state, moe::offload::ExpertStreamer* s) {
  std::vector<float> logits(static_cast<std::size_t>(moe::bench::kVocab));
  auto st = dec.make_state(1, 1);
  auto const ids = moe::bench::synthetic_tokens(4096, 17);
  std::vector<Index> const n1 = {1};
  std::size_t next = 0;
  auto step = [&] {
    std::vector<std::int64_t> const one = {ids[next++ % ids.size()]};
    dec.forward(one, n1, st, {logits.data(), 1, moe::bench::kVocab}, &pool());
    benchmark::DoNotOptimize(logits.data());
    for (auto& c : st.caches) c.truncate(0, 0);
  };
  for (int i = 0; i < 16; ++i) step();  // warm-up: the cache fills
  if (s) s->reset_stats();
  double elapsed = 0.0;
  for (auto _ : state) {
    auto const t0 = std::chrono::steady_clock::now();
    step();
    elapsed += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  double const tps = static_cast<double>(state.iterations()) / elapsed;
  state.counters["tok_per_s"] = tps;
  if (s) {
    moe::offload::StreamStats const& ss = s->stats();
    double const per_token = static_cast<double>(ss.bytes_read) /
                             static_cast<double>(std::max<Index>(1, s->tokens_since_reset()));
    state.counters["hit"] = ss.hit_rate();
    state.counters["MiB_per_tok"] = per_token / 1048576.0;
    double const mbps = static_cast<double>(state.range(1));
    if (mbps > 0 && per_token > 0) {
      double const ceiling = mbps * 1e6 / per_token;
      state.counters["ceiling"] = ceiling;
      state.counters["of_ceiling"] = tps / ceiling;
    }
    state.counters["wait%"] = 100.0 * ss.wait_seconds / elapsed;
    state.counters["pf_prec"] = ss.prefetch_precision();
    state.counters["pf_recall"] = ss.prefetch_recall();
  }
}

void BM_Decoder_Resident(benchmark::State& state) {
  if (resident().streamer) {
    state.SkipWithError("the decoder streams its experts already (run this row first)");
    return;
  }
  decode_steps(resident(), state, nullptr);
}

void BM_Decoder_Streamed(benchmark::State& state) {
  static char const* const kPolicies[] = {"lru", "lfu", "layer-lru"};
  auto const store = std::make_shared<moe::offload::ExpertStore const>(
      store_path(), moe::offload::StoreReadOptions{false, static_cast<double>(state.range(1)) * 1e6,
                                                   state.range(1) > 0 ? 1e-4 : 0.0});
  moe::offload::StreamerOptions o;
  o.budget_bytes = static_cast<std::uint64_t>(state.range(0)) << 20;
  o.policy = kPolicies[state.range(2)];
  o.reader_threads = 4;
  auto const streamer = std::make_shared<moe::offload::ExpertStreamer>(store, o);
  // The decoder itself (no copy: 7.5 GiB): its banks free their packs the first time, and
  // switch to this row's streamer after.
  (void)store_path();
  resident().stream_experts(streamer);
  decode_steps(resident(), state, streamer.get());
}

void BM_Miss(benchmark::State& state) {
  namespace ex = moe::experts;
  using Bank = ex::ExpertBank<ex::SwiGlu>;
  constexpr Index E = 8, D = 2048, F = 768;
  static ex::WeightFormat const kFormats[] = {ex::WeightFormat::kQ8_0, ex::WeightFormat::kQ4_K,
                                              ex::WeightFormat::kBf16};
  ex::WeightFormat const wf = kFormats[state.range(1)];
  Bank bank(E, D, F);
  moe::fill_uniform(bank.edit().parameters(), -0.05f, 0.05f, 5);
  std::vector<ex::ExpertFormat> const formats(E, {wf, wf});
  bank.pack(formats, &pool());
  auto const record_bytes = static_cast<std::uint64_t>(bank.packed_record_bytes(0));
  moe::offload::RecordBuffer buf(
      moe::offload::detail::round_up(record_bytes, moe::offload::kStoreAlign));
  Index e = 0;
  if (state.range(0) == 0) {
    std::filesystem::path const p = std::filesystem::temp_directory_path() / "moe_bench_miss.moex";
    {
      moe::offload::ExpertStoreWriter w(p.string(), {1, E, D, F, true});
      w.add_layer(bank);
      w.finish();
    }
    moe::offload::ExpertStore const store(p.string());
    for (Index i = 0; i < E; ++i) store.read(0, i, buf.data());  // page-cached
    for (auto _ : state) {
      store.read(0, e, buf.data());
      benchmark::DoNotOptimize(buf.data());
      e = (e + 1) % E;
    }
    std::filesystem::remove(p);
  } else {
    // The stored blocks of every projection (what a GGUF file holds), and the fp32 weights.
    std::vector<std::vector<std::byte>> blocks;
    auto rows_of = [&](float const* w, Index rows, Index depth) {
      moe::quant::Format const qf = ex::quant_format(wf);
      Index const rb = moe::quant::row_bytes(qf, depth);
      std::vector<std::byte> out(static_cast<std::size_t>(rows * rb));
      for (Index r = 0; r < rows; ++r)
        moe::quant::quantize_row(qf, w + r * depth, depth, out.data() + r * rb);
      return out;
    };
    Bank const& cb = bank;
    if (ex::is_quantized(wf)) {
      for (Index i = 0; i < E; ++i) {
        blocks.push_back(rows_of(cb.gate_proj(i).data, F, D));
        blocks.push_back(rows_of(cb.up_proj(i).data, F, D));
        blocks.push_back(rows_of(cb.down_proj(i).data, D, F));
      }
    }
    ex::ExpertSource const source{
        ex::is_quantized(wf) ? ex::StoredBlocks([&](Index i, ex::Projection pr, ex::WeightFormat) {
          return blocks[static_cast<std::size_t>(3 * i + static_cast<Index>(pr))].data();
        })
                             : ex::StoredBlocks{},
        [&](Index i, float* in, float* down) {
          if (in) std::copy_n(cb.in_proj(i).data, 2 * F * D, in);
          if (down) std::copy_n(cb.down_proj(i).data, D * F, down);
        }};
    Bank layout = [] {
      ex::EmptyWeights const scope;
      return Bank(E, D, F);
    }();
    std::vector<std::byte const*> table(E, nullptr);
    layout.stream_records(formats, table.data());
    for (auto _ : state) {
      layout.pack_record(e, source, buf.data());
      benchmark::DoNotOptimize(buf.data());
      e = (e + 1) % E;
    }
  }
  double const n = static_cast<double>(state.iterations());
  state.counters["bytes"] =
      benchmark::Counter(n * static_cast<double>(record_bytes), benchmark::Counter::kIsRate);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::RegisterBenchmark("BM_Decoder_Resident", BM_Decoder_Resident)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_Decoder_Streamed", BM_Decoder_Streamed)
      ->ArgNames({"budget_mib", "mbps", "policy"})
      ->ArgsProduct({{2048, 4096}, {3000}, {0}})
      ->Args({2048, 0, 0})
      ->Args({2048, 3000, 1})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_Miss", BM_Miss)
      ->ArgNames({"source", "format"})
      ->ArgsProduct({{0, 1}, {0, 1, 2}})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  if (!moe::bench::initialize(
          argc, argv,
          "moe_bench_offload: decoding with the routed experts streamed from an expert store or "
          "the model's file through a bounded cache, against the same decoder resident, and the "
          "cost of one expert miss (docs/offload.md)."))
    return 1;
  benchmark::AddCustomContext("cpu", moe::cpu_features().describe());
  benchmark::AddCustomContext(
      "decoder", "synthetic Qwen3-30B-A3B shapes, " + std::to_string(kLayers) +
                     " layers, bf16 dense, q8_0 experts streamed (see bench_offload.cpp)");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
