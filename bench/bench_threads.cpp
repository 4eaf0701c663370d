// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// What a ThreadPool::parallel_for costs by itself: the fork and join around items that do
// nothing. A decode step calls it tens of times a layer, each around a fraction of a
// millisecond of work, so this is paid per stage, not per token.
//
//   BM_ParallelFor/threads:N/items:I   back to back: the workers are spinning for the next job
//   BM_ParallelFor_AfterIdle/gap_us:G  after G microseconds without a job (not timed): the
//                                      workers spin for up to ThreadPool::kSpinMicroseconds,
//                                      then sleep, and must be woken
// Times are per parallel_for (manual time for the second, the gap excluded).
//
//   ./build/release/bench/moe_bench_threads
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>

#include "bench_main.hpp"
#include "moe/core/thread_pool.hpp"

namespace {

void BM_ParallelFor(benchmark::State& state) {
  moe::ThreadPool pool(static_cast<int>(state.range(0)));
  moe::Index const items = state.range(1);
  std::atomic<moe::Index> sink{0};
  for (auto _ : state) {
    pool.parallel_for(items,
                      [&](moe::Index i, int) { sink.fetch_add(i, std::memory_order_relaxed); });
  }
  benchmark::DoNotOptimize(sink.load());
}
BENCHMARK(BM_ParallelFor)->ArgNames({"threads", "items"})->Args({2, 2})->Args({2, 16});

void BM_ParallelFor_AfterIdle(benchmark::State& state) {
  using Clock = std::chrono::steady_clock;
  moe::ThreadPool pool(2);
  auto const gap = std::chrono::microseconds(state.range(0));
  std::atomic<moe::Index> sink{0};
  for (auto _ : state) {
    auto const idle = Clock::now();
    while (Clock::now() - idle < gap) {
    }
    auto const t0 = Clock::now();
    pool.parallel_for(2, [&](moe::Index i, int) { sink.fetch_add(i, std::memory_order_relaxed); });
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  benchmark::DoNotOptimize(sink.load());
}
BENCHMARK(BM_ParallelFor_AfterIdle)->ArgName("gap_us")->Arg(20)->Arg(1000)->UseManualTime();

}  // namespace

MOE_BENCH_MAIN(
    "moe_bench_threads: a ThreadPool::parallel_for's fork and join by itself, back to back and "
    "after an idle gap (docs/performance.md).")
