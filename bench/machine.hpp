// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// What the benches measure of the machine before judging a row against it: the read bandwidth
// of a streaming reader, and the last-level cache as the CPU reports it and as a read sweep
// shows it. Bench support only (not a public header).
//
// Why a sweep: the CPU's figure is not always the cache a 2-core guest gets. A VM on an AMD EPYC
// Turin host reports 508 MiB of L3 through CPUID (the host socket's, not the one CCD's 32 MiB it
// runs on); an Intel Xeon VM reports 480 MiB while its bandwidth falls to DRAM's between 128 and
// 200 MiB; some VMs report nothing at all. The sweep reads buffers of 1 MiB to 1 GiB repeatedly
// (hot) with both threads and takes as the effective last-level cache the largest size from
// 8 MiB up still read faster than the midpoint between the 8 MiB bandwidth and DRAM's (the
// slower of the two largest buffers). A row's weights fall out of cache between two calls when
// the weights touched in between exceed twice that.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "moe/core/cpu.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::bench {

/// Read bandwidth in bytes/s: `threads` threads each sum their part of buf[0, n) floats `passes`
/// times as 4 streams, each prefetched 2 KiB ahead (a plain loop of loads, the hardware prefetcher
/// alone, measured 35-36 GB/s on a shared host where this reader measured 51: with other VMs on
/// the memory controller it does not show what the machine gives a reader that keeps enough
/// requests in flight). n is a multiple of threads x 4 streams x 2 batches. Best of `reps`.
inline double read_bandwidth(float const* buf, Index n, int threads, int passes, int reps) {
  using B = xsimd::batch<float>;
  ThreadPool pool(threads);
  double best = 0.0;
  for (int rep = 0; rep < reps; ++rep) {  // best of reps: the host's bandwidth is shared
    auto const t0 = std::chrono::steady_clock::now();
    pool.parallel_for(threads, [&](Index i, int) {
      constexpr Index kStreams = 4, kAhead = 2048 / sizeof(float);
      Index const len = n / threads / kStreams;  // floats per stream
      float const* base = buf + n / threads * i;
      B s[2 * kStreams];
      for (B& v : s) v = B(0.0f);
      for (int pass = 0; pass < passes; ++pass) {
        for (Index j = 0; j < len; j += 2 * B::size) {
          for (Index st = 0; st < kStreams; ++st) {
            float const* q = base + st * len + j;
            __builtin_prefetch(q + kAhead);
            __builtin_prefetch(q + kAhead + B::size);
            s[2 * st] += B::load_aligned(q);
            s[2 * st + 1] += B::load_aligned(q + B::size);
          }
        }
      }
      B total(0.0f);
      for (B const& v : s) total += v;
      benchmark::DoNotOptimize(total);
    });
    double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(n) * 4.0 * passes / s);
  }
  return best;
}

/// One size of the read sweep.
struct SweepPoint {
  std::int64_t bytes = 0;
  double bandwidth = 0.0;  ///< bytes/s, 2 threads, the buffer read repeatedly (hot)
};

/// The last-level cache as the benches use it.
struct LastLevelCache {
  std::int64_t reported = 0;  ///< moe::cpu_features().llc_bytes (0: none reported)
  std::int64_t swept = 0;     ///< largest sweep size still read at cache speed (0: no fall seen)
  std::int64_t bytes = 0;     ///< what the benches use: swept if the sweep saw the fall, else
                              ///< the reported size, else the sweep's largest size
  std::vector<SweepPoint> sweep;
  /// "32 MiB (read sweep, 2 threads: 1 MiB 410 GB/s, ...; cache speed up to 32 MiB; the CPU
  /// reports 508 MiB)".
  std::string describe() const {
    // snprintf rather than string concatenation: GCC 12 warns (-Wrestrict) on chains of
    // std::string operator+ at -O3.
    char buf[160];
    std::string s;
    std::snprintf(buf, sizeof buf,
                  "%lld MiB (read sweep, 2 threads:", static_cast<long long>(bytes >> 20));
    s.append(buf);
    for (std::size_t i = 0; i < sweep.size(); ++i) {
      std::snprintf(buf, sizeof buf, " %lld MiB %.0f GB/s%s",
                    static_cast<long long>(sweep[i].bytes >> 20), sweep[i].bandwidth / 1e9,
                    i + 1 < sweep.size() ? "," : ";");
      s.append(buf);
    }
    if (swept > 0) {
      std::snprintf(buf, sizeof buf, " cache speed up to %lld MiB",
                    static_cast<long long>(swept >> 20));
      s.append(buf);
    } else {
      s.append(" no fall to DRAM speed seen");
    }
    if (reported > 0) {
      std::snprintf(buf, sizeof buf, "; the CPU reports %lld MiB)",
                    static_cast<long long>(reported >> 20));
      s.append(buf);
    } else {
      s.append("; the CPU reports none)");
    }
    return s;
  }
};

/// Sweeps once (about 1-2 s; 1 GiB of memory while it runs) and caches the result.
inline LastLevelCache const& last_level_cache() {
  static LastLevelCache const llc = [] {
    LastLevelCache c;
    c.reported = cpu_features().llc_bytes;
    constexpr std::int64_t kMin = std::int64_t{1} << 20, kMax = std::int64_t{1} << 30;
    HugePageVector<float> buf(static_cast<std::size_t>(kMax / 4), 1.0f);
    for (std::int64_t b = kMin; b <= kMax; b *= 2) c.sweep.push_back({b, 0.0});
    // Three rounds over all sizes, the best of each size kept: the host's bandwidth drifts by
    // tens of percent within seconds, and rounds spread that over the sizes.
    for (int round = 0; round < 3; ++round) {
      for (SweepPoint& p : c.sweep) {
        // >= 256 MiB read, and the buffer at least twice (the first pass warms the cache).
        int const passes =
            static_cast<int>(std::max<std::int64_t>(2, (std::int64_t{256} << 20) / p.bytes));
        p.bandwidth = std::max(p.bandwidth, read_bandwidth(buf.data(), p.bytes / 4, 2, passes, 1));
      }
    }
    // Cache level: the bandwidth at 8 MiB (past any L2, inside any L3 worth the name); DRAM
    // level: the slower of the two largest sizes. The cache ends where the bandwidth drops below
    // the midpoint of the two (robust to the drift of either; a plain ratio to DRAM's was not).
    double const cache = c.sweep[3].bandwidth;
    double const dram = std::min(c.sweep.back().bandwidth, c.sweep[c.sweep.size() - 2].bandwidth);
    double const mid = 0.5 * (cache + dram);
    if (cache > 1.25 * dram) {
      for (SweepPoint const& p : c.sweep) {
        if (p.bytes < (std::int64_t{8} << 20)) continue;
        if (p.bandwidth < mid) break;
        c.swept = p.bytes;
      }
    }
    if (c.swept >= kMax / 2) c.swept = 0;  // no fall within the sweep
    c.bytes = c.swept > 0 ? c.swept : (c.reported > 0 ? c.reported : kMax);
    return c;
  }();
  return llc;
}

}  // namespace moe::bench
