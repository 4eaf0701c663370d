// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// How fast can a core stream weights from DRAM while it does the FMAs those weights feed, and
// what does re-reading them cost? A model of the expert GEMM at few rows per expert (DeepSeek-V3
// at T = 512: 16 rows): the weights are cut into blocks (K slices), each block is streamed from
// DRAM once and then re-read from L2 by the other row tiles; every 64-byte line feeds the same
// number of FMAs in total whatever the number of passes. The next block is prefetched into L2
// during the current one (as kernels::expert_cols does).
//
//   BM_Stream/passes:P/fmas:F/block_kb:B   P passes over each B KB block, F FMAs per 64-byte line
//                                          and pass, one private 256 MiB buffer per thread
//   BM_Stream/.../hot:1                    the same, over one block again and again (L1): the rate
//                                          the FMAs alone allow
// Counter GB/s: bytes of lines consumed (each line once) per second, all threads together.
//
//   ./build/release/bench/moe_bench_stream --benchmark_counters_tabular=true
//
// On our 2-core AVX-512 machine (2026-11-30, one run; cold / hot GB/s, one thread | two):
//   1 pass x 16 FMAs, 64 KB    21.6 / 24.6 | 42.3 / 49.2   (cold = 0.88 | 0.86 of hot)
//   3 passes x 5, 64 KB        12.8 / 16.3 | 25.4 / 33.1   (0.79 | 0.77)
//   3 passes x 5, 32 KB        14.4 / 16.6 | 28.2 / 33.8   (0.87 | 0.83)
//   2 passes x 8, 32 KB        22.4 / 27.2 | 45.2 / 55.0   (0.82 | 0.82)
// A core keeps 0.77-0.88 of its FMA-bound rate while streaming from DRAM: streaming and FMAs
// overlap, but not fully (docs/performance.md, "What limits the remaining numbers").
#include <benchmark/benchmark.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "bench_main.hpp"
#include "moe/core/memory.hpp"
#include "moe/kernels/simd.hpp"

namespace {

using B = moe::kernels::simd::Batch<float>;
constexpr std::size_t kBufferBytes = std::size_t{256} << 20;

/// One thread's buffer: 2 MiB aligned, huge pages where the kernel grants them, written once.
std::unique_ptr<float[], void (*)(float*)> thread_buffer() {
  moe::HugePageAllocator<float> alloc;
  float* p = alloc.allocate(kBufferBytes / sizeof(float));
  std::memset(p, 0, kBufferBytes);
  return {p, [](float* q) { moe::HugePageAllocator<float>().deallocate(q, kBufferBytes / 4); }};
}

/// passes over each block of `block` floats, Fmas FMAs per 64-byte line and pass; the next
/// block prefetched into L2 a line per step, spread over the passes.
template <int Fmas>
float stream(float const* p, std::size_t n, std::size_t block, int passes) {
  constexpr std::size_t L = B::size;
  constexpr std::size_t kLineFloats = 64 / sizeof(float);
  B acc[8] = {B(0.0f), B(0.0f), B(0.0f), B(0.0f), B(0.0f), B(0.0f), B(0.0f), B(0.0f)};
  B const m(1.0001f);
  std::size_t const lines = block / kLineFloats;
  std::size_t const per_pass = (lines + passes - 1) / passes;
  for (std::size_t b = 0; b + block <= n; b += block) {
    char const* next = reinterpret_cast<char const*>(p + b + block);
    bool const prefetch = b + 2 * block <= n;
    for (int ps = 0; ps < passes; ++ps) {
      char const* q = next + ps * per_pass * 64;
      std::size_t left = prefetch ? per_pass : 0;
      for (std::size_t i = b; i < b + block; i += kLineFloats) {
        if (left > 0) {
          __builtin_prefetch(q, 0, 2);
          q += 64;
          --left;
        }
        for (std::size_t j = 0; j < kLineFloats; j += L) {
          B const v = B::load_aligned(p + i + j);
          // Fmas per line in total, spread over its batches (one batch per line with AVX-512).
          constexpr int kPerBatch = Fmas * static_cast<int>(L) / static_cast<int>(kLineFloats);
#pragma GCC unroll 16
          for (int f = 0; f < kPerBatch; ++f) acc[f & 7] = xsimd::fma(acc[f & 7], m, v);
        }
      }
    }
  }
  B s = acc[0];
  for (int j = 1; j < 8; ++j) s += acc[j];
  return moe::kernels::simd::reduce_add(s);
}

/// range: passes, FMAs per line and pass, block KB, hot (1: the same block over and over, from
/// L1/L2: the rate the FMAs alone allow).
void BM_Stream(benchmark::State& state) {
  int const passes = static_cast<int>(state.range(0));
  int const fmas = static_cast<int>(state.range(1));  // 5, 8 or 16
  std::size_t const block = static_cast<std::size_t>(state.range(2)) * 1024 / sizeof(float);
  bool const hot = state.range(3) != 0;
  auto buf = thread_buffer();
  std::size_t const n = kBufferBytes / sizeof(float);
  auto run = [&](float const* p, std::size_t count) {
    switch (fmas) {
      case 5:
        return stream<5>(p, count, block, passes);
      case 8:
        return stream<8>(p, count, block, passes);
      default:
        return stream<16>(p, count, block, passes);
    }
  };
  for (auto _ : state) {
    if (hot) {
      for (std::size_t r = 0; r < n / block; ++r) {
        benchmark::DoNotOptimize(buf.get());
        benchmark::DoNotOptimize(run(buf.get(), block));
      }
    } else {
      benchmark::DoNotOptimize(run(buf.get(), n));
    }
  }
  // Lines consumed (each counted once) per second, all threads together.
  state.counters["bytes"] = benchmark::Counter(
      static_cast<double>(kBufferBytes),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kAvgThreads);
}

/// {passes, FMAs per line and pass, block KB} x {cold (DRAM), hot (L1)}.
void stream_args(benchmark::internal::Benchmark* b) {
  for (auto const& c :
       {std::array<int, 3>{1, 16, 64}, std::array<int, 3>{3, 5, 64}, std::array<int, 3>{3, 5, 32},
        std::array<int, 3>{2, 8, 64}, std::array<int, 3>{2, 8, 32}}) {
    for (int hot : {0, 1}) b->Args({c[0], c[1], c[2], hot});
  }
}
BENCHMARK(BM_Stream)
    ->ArgNames({"passes", "fmas", "block_kb", "hot"})
    ->Apply(stream_args)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

MOE_BENCH_MAIN(
    "moe_bench_stream: how fast a core streams weights from DRAM while doing the FMAs they feed, "
    "and what re-reading them costs (the expert GEMM at few rows per expert).")
