// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// The main of the bench binaries: `--help` (or `-h`) first says what the binary measures and how
// its counters read, then lists Google Benchmark's own options; an argument neither knows is an
// error (exit 1). Bench support only (not a public header).
#pragma once

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>

namespace moe::bench {

/// When argv holds --help or -h: prints `about` and how the counters read, and turns -h into
/// --help so that Google Benchmark's Initialize prints its options and exits 0.
inline void print_about_on_help(int argc, char** argv, char const* about) {
  static char help[] = "--help";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") != 0 && std::strcmp(argv[i], "-h") != 0) continue;
    std::printf(
        "%s\n\nCounters named by what they count (tokens, FLOP, OP, bytes, weight_bytes) are "
        "rates,\nprinted per second with an SI prefix: tokens=114.9/s, FLOP=8.73G/s (GFLOP/s), "
        "bytes=52.1G/s\n(GB/s). Counters with a unit in their name (best_ms, bw_GB/s) are plain "
        "values.\nbench/README.md explains every counter.\n\nGoogle Benchmark's options:\n",
        about);
    argv[i] = help;
    return;
  }
}

/// Whether argv asks only for the list of benchmarks (--benchmark_list_tests, =true or bare):
/// a binary then skips its start-up measurements.
inline bool listing_only(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--benchmark_list_tests") == 0 ||
        std::strcmp(argv[i], "--benchmark_list_tests=true") == 0) {
      return true;
    }
  }
  return false;
}

/// Initialize with the help above; false when the arguments are bad (the caller returns 1).
inline bool initialize(int& argc, char** argv, char const* about) {
  print_about_on_help(argc, argv, about);
  benchmark::Initialize(&argc, argv);
  return !benchmark::ReportUnrecognizedArguments(argc, argv);
}

}  // namespace moe::bench

/// A bench binary's main: moe::bench::initialize, then every registered benchmark.
#define MOE_BENCH_MAIN(about)                                   \
  int main(int argc, char** argv) {                             \
    if (!::moe::bench::initialize(argc, argv, about)) return 1; \
    ::benchmark::RunSpecifiedBenchmarks();                      \
    ::benchmark::Shutdown();                                    \
    return 0;                                                   \
  }
