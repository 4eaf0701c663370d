// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// The hot path against the machine's limits and against a naive baseline, in one binary run.
//
// What it measures (2 threads unless the name says pool:1):
//   - BM_Peak_FmaF32 / BM_Peak_Bf16Dot / BM_Peak_AmxBf16 / BM_Peak_AmxInt8 / BM_Peak_Int8Dot /
//     BM_Peak_ReadBandwidth: this machine's fp32 FMA, AVX512-BF16 dot-product, AMX bf16 and
//     int8 tile and integer dot-product (vpdpbusd, or the ymm kernel's vpmaddubsw step)
//     throughput and DRAM read bandwidth (best of 9, printed at start-up as the "limits"
//     context: the units this build and CPU lack are named as missing).
//   - BM_Layer_<Shape>_{Forward,ForwardBf16,ForwardBackward}/T:n for the Qwen3-30B-A3B, OLMoE,
//     Mixtral-like and DeepSeek-V3-like shapes at T in {1, 8, 32, 128, 512, 2048} (and
//     _ForwardQ8_0, _ForwardQ6_K, _ForwardQ5_K, _ForwardQ5_0, _ForwardQ4_K, _ForwardQ4_0,
//     _ForwardQ3_K, _ForwardQ2_K at T <= 512: quantized experts, with GOP/s, bits/weight and
//     vs_bf16 / vs_fp32 against the bf16 and fp32 layers run beside them), with
//       tokens/s, GFLOP/s,
//       S-MFU    = achieved FLOP/s / peak FMA FLOP/s                      (MoE-CAP)
//       S-MBU    = active expert weight bytes per second / read bandwidth (MoE-CAP)
//       roofline = achieved / min(peak, AI * bandwidth), AI = FLOP / active weight bytes
//                  (peak: fp32 FMA; for the bf16 rows the peak of the unit their kernel uses),
//     against limits measured just before and just after the row (the larger of the two;
//     counters peak_GFLOP/s, bw_GB/s; the bf16 rows also unit_peak_GFLOP/s and unit_peak_frac,
//     the peak of the unit their kernel runs on: AMX, vdpbf16ps or fp32 FMAs, see the kernels
//     context): the host's bandwidth drifts too much
//     for one start-up value to judge rows measured minutes later. The fractions use the row's
//     fastest iteration (best_ms), as the limits are the best of several probes; the row's time
//     and tokens/s, GFLOP/s are means. The forward+backward rows run 3 steps each (the
//     fastest decides the fractions), so that one disturbed step does not decide the row: with a
//     minimum time instead, one step of 2.3 s (against ~0.5 s) once ended a row by itself.
//   - The bf16 rows, where CMake found Debian's libdnnl-dev: onednn_ms and vs_onednn, a oneDNN
//     baseline run beside ours (bench/onednn_baseline.hpp: per expert, bf16 matmuls in the
//     layout and kernel oneDNN picks, AMX where the CPU has it; onednn_rel_err checks that it
//     computes our layer); the label names oneDNN's kernel, or says the baseline was not built.
//     The quantized rows: int8_peak_GOP/s and int8_peak_frac against the peak of the unit
//     moe::quant_kernel() runs on (AMX tdpbssd or vpdpbusd).
//   - The baseline, vs_naive and naive_ms of the fp32 rows: the straightforward C++ port of the
//     Hugging Face loop (per expert: gather rows into a copy, Eigen GEMMs, weighted scatter-add),
//     serial, run right after ours in every iteration so that the ratio compares times measured
//     side by side. Likewise vs_fp32 and fp32_ms of the bf16 rows: the fp32 layer beside it.
//     At T <= 8 the fp32 rows also report one thread's read bandwidth (bw1_GB/s) and
//     bw_ratio = bw_GB/s / bw1_GB/s: both sides are bandwidth-bound there and the baseline is
//     serial, so this is about what a speed-up can reach (vs_naive / S-MBU exactly: the speed-up
//     if ours read at the full measured bandwidth).
//   - BM_Kernel_<Shape>_{Route,Plan,Gather,Combine}/T:512: the non-GEMM parts of the layer.
//   - BM_Kernel_<Shape>_ExpertIn{Dram,Cached}/T:512: the routed experts' gate+up projection
//     alone, as the layer runs it, with each expert's weights (from DRAM) and with every expert
//     reading expert 0's weights (from cache): what streaming the weights costs the kernel.
// FLOP counts: router 2*T*E*D; each routed row 2*D*F*3 (gate, up, down); shared experts
// 2*T*D*F_s*3. Forward+backward counts 3x the forward (dX and dW each cost a forward).
// Weights: one layer copy per shape. The last-level cache is the read sweep's where it shows the
// fall to DRAM speed, else the CPU's figure (bench/machine.hpp; the header prints both, as llc).
// Each forward row cycles through input batches (seeds 7, 8, ...; counter inputs) until the
// routed experts they touch together exceed 2x that cache, and reports w/LLC = those bytes / LLC:
// below 2 the weights can stay partly cached between two calls on the same batch, and S-MBU and
// the bandwidth roofline overstate the fraction of DRAM bandwidth reached.
// Run: ./moe_bench_hotpath --benchmark_counters_tabular=true [--benchmark_out=r.json
//      --benchmark_out_format=json]   (bench/plot_roofline.py draws the roofline from the JSON)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <moe/moe.hpp>
#include <string>
#include <utility>
#include <vector>

#include "bench_main.hpp"
#include "machine.hpp"

#if MOE_BENCH_ONEDNN
#include "onednn_baseline.hpp"
#endif

namespace {

using moe::Index;
namespace routing = moe::routing;
namespace experts = moe::experts;

constexpr int kThreads = 2;
moe::ThreadPool& pool() {
  static moe::ThreadPool p(kThreads);
  return p;
}

// ---------------------------------------------------------------------------------------------
// Machine limits, measured once.

/// Operations per second of `step` on N independent accumulator chains, one thread: N chains of
/// `iters` steps; `ops` operations a step (e.g. 2 x 16 for an fp32 FMA on 16 lanes).
template <int N, class V, class Init, class Step>
double chains_rate(Init init, Step step, double ops) {
  V acc[N];
  for (int i = 0; i < N; ++i) acc[i] = init(i);
  long const iters = 1 << 21;
  auto const t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iters; ++it) {
    for (int i = 0; i < N; ++i) acc[i] = step(acc[i]);
  }
  double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 0; i < N; ++i) benchmark::DoNotOptimize(acc[i]);
  return ops * N * static_cast<double>(iters) / s;
}

/// The peak of one unit on `threads` threads, best of `reps`: each thread runs the step on 8, 12,
/// 16 and 24 independent chains and keeps the fastest. One chain count is not enough on every
/// CPU: the unit's latency x throughput sets how many chains hide the latency, and GCC 12 keeps
/// some counts' accumulators in rotating registers (a vmovdqa per chain and step, which halved
/// the measured vpdpbusd peak on a Zen 5 at 16 chains).
template <class V, class Init, class Step>
double unit_peak(int threads, int reps, Init init, Step step, double ops) {
  std::vector<double> per(static_cast<std::size_t>(threads));
  auto run = [&](Index, int t) {
    double best = chains_rate<8, V>(init, step, ops);
    best = std::max(best, chains_rate<12, V>(init, step, ops));
    best = std::max(best, chains_rate<16, V>(init, step, ops));
    best = std::max(best, chains_rate<24, V>(init, step, ops));
    per[static_cast<std::size_t>(t)] = best;
  };
  moe::ThreadPool p(threads);
  double best = 0.0;
  for (int rep = 0; rep < reps; ++rep) {  // best of reps: other VMs share the cores
    p.parallel_for(threads, run);
    double total = 0.0;
    for (double v : per) total += v;
    best = std::max(best, total);
  }
  return best;
}

/// fp32 FMA throughput (FLOP/s: 2 per lane and FMA).
double measure_fma_peak(int threads, int reps = 9) {
  using B = xsimd::batch<float>;
  B const a(0.999999f), b(1e-7f);
  return unit_peak<B>(
      threads, reps, [](int i) { return B(static_cast<float>(i)); },
      [&](B acc) { return xsimd::fma(acc, a, b); }, 2.0 * B::size);
}

/// The last-level cache in bytes as the bench uses it (bench/machine.hpp: the read sweep where
/// it shows the fall to DRAM speed, else what the CPU reports).
double llc_bytes() { return static_cast<double>(moe::bench::last_level_cache().bytes); }

/// DRAM read bandwidth (moe::bench::read_bandwidth: 4 prefetched streams per thread) over a
/// buffer of at least 512 MiB and 4x the last-level cache (2 MiB pages, like the weights), one
/// pass, best of `reps`.
double measure_read_bandwidth(int threads, int reps = 9) {
  Index n = Index{1} << 27;  // 512 MiB of floats
  while (static_cast<double>(n) < llc_bytes()) n *= 2;
  static moe::HugePageVector<float> buf(static_cast<std::size_t>(n), 1.0f);
  return moe::bench::read_bandwidth(buf.data(), n, threads, 1, reps);
}

/// AVX512-BF16 dot-product throughput: vdpbf16ps (32 bf16 multiply-adds into 16 fp32 lanes = 64
/// FLOP an instruction). 0 without AVX512-BF16.
double measure_bf16_peak(int threads, int reps = 9) {
#if MOE_HAS_AVX512BF16
  __m512bh const a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3F803F80));  // (1, 1)
  __m512bh const b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x33D633D6));  // (1e-7, ..)
  return unit_peak<__m512>(
      threads, reps, [](int i) { return _mm512_set1_ps(static_cast<float>(i)); },
      [&](__m512 acc) { return _mm512_dpbf16_ps(acc, a, b); }, 64.0);
#else
  (void)threads;
  (void)reps;
  return 0.0;
#endif
}

/// AMX tile throughput with the operands in tile registers: 4 independent C tiles per thread,
/// as the expert kernels keep them (detail/amx_bf16.hpp). `Int8` false: tdpbf16ps (16 x 16 x 32
/// multiply-adds x 2 = 16384 FLOP an instruction); true: tdpbssd (16 x 16 x 64 x 2 = 32768 OP).
/// 0 where the kernels cannot run (moe::amx_bf16_usable(), moe::amx_int8_usable()).
template <bool Int8>
double measure_amx_peak(int threads, int reps = 9) {
#if MOE_HAS_AMX_BF16 && MOE_HAS_AMX_INT8
  if (!(Int8 ? moe::amx_int8_usable() : moe::amx_bf16_usable())) return 0.0;
  std::vector<double> per(static_cast<std::size_t>(threads));
  auto run = [&](Index, int t) {
    moe::kernels::detail::amx_configure();
    alignas(64) static thread_local std::uint16_t ones[16 * 32];
    std::fill(std::begin(ones), std::end(ones), std::uint16_t{Int8 ? 0x0101 : 0x3F80});
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    long const iters = 1 << 16;
    auto const t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < iters; ++it) {
      if constexpr (Int8) {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    double const sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    moe::kernels::detail::amx_release();
    per[static_cast<std::size_t>(t)] =
        4.0 * (Int8 ? 32768.0 : 16384.0) * static_cast<double>(iters) / sec;
  };
  moe::ThreadPool p(threads);
  double best = 0.0;
  for (int rep = 0; rep < reps; ++rep) {
    p.parallel_for(threads, run);
    double total = 0.0;
    for (double v : per) total += v;
    best = std::max(best, total);
  }
  return best;
#else
  (void)threads;
  (void)reps;
  return 0.0;
#endif
}
double measure_amx_bf16_peak(int threads, int reps = 9) {
  return measure_amx_peak<false>(threads, reps);
}

/// Integer dot-product throughput (int8 multiply-adds x 2 per second): vpdpbusd on zmm with
/// AVX512-VNNI (128 an instruction), the ymm kernel's step in AVX2 builds (64: vpdpbusd with
/// AVX-VNNI, else vpmaddubsw + vpmaddwd + vpaddd); 0 in builds with neither.
double measure_int8_peak(int threads, int reps = 9) {
#if MOE_HAS_AVX512VNNI
  __m512i const a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-1);
  return unit_peak<__m512i>(
      threads, reps, [](int i) { return _mm512_set1_epi32(i); },
      [&](__m512i acc) { return _mm512_dpbusd_epi32(acc, a, b); }, 128.0);
#elif MOE_HAS_AVX2_INT8
  // The ymm kernel's dot step: AVX-VNNI vpdpbusd, or vpmaddubsw + vpmaddwd + vpaddd (64 each).
  __m256i const a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-1);
  return unit_peak<__m256i>(
      threads, reps, [](int i) { return _mm256_set1_epi32(i); },
      [&](__m256i acc) { return moe::kernels::detail::quant_dot_ymm(acc, a, b); }, 64.0);
#else
  (void)threads;
  (void)reps;
  return 0.0;
#endif
}

/// The peak of the unit the quantized kernels run on (AMX tdpbssd where moe::quant_kernel()
/// chose AMX tiles, else vpdpbusd), measured once (compute peaks barely drift; bandwidth does).
double int8_peak() {
  static double const v =
      moe::kernels::quant_amx() ? measure_amx_peak<true>(kThreads) : measure_int8_peak(kThreads);
  return v;
}

struct Limits {
  double fma = 0.0;         // FLOP/s, kThreads threads
  double bandwidth = 0.0;   // bytes/s, kThreads threads
  double bf16 = 0.0;        // FLOP/s of AVX512-BF16 dot products, kThreads threads (0: none)
  double bandwidth1 = 0.0;  // bytes/s, one thread (measured for the rows that report it, else 0)
  double amx = 0.0;         // FLOP/s of AMX tdpbf16ps, kThreads threads (0: cannot run)
};

/// Measured once at start-up, before any layer is allocated; printed as the "limits" context.
Limits const& startup_limits() {
  static Limits l{measure_fma_peak(kThreads), measure_read_bandwidth(kThreads),
                  measure_bf16_peak(kThreads), 0.0, measure_amx_bf16_peak(kThreads)};
  return l;
}

/// The limits one layer row is judged against: measured just before and just after its timed
/// loop, the larger of the two kept. The host's read bandwidth drifts by up to 2x within minutes
/// as other VMs come and go (27.6 to 52 GB/s at start-up in runs of the same day), so a start-up
/// value misjudges rows measured minutes later. Best of 5 bandwidth passes and of 3 for the
/// FLOP peaks: about 0.3 s per measurement.
/// With `one_thread`, also the read bandwidth of one thread alone (what the serial baseline can
/// stream at most).
Limits measure_limits(bool one_thread = false) {
  return {measure_fma_peak(kThreads, 3), measure_read_bandwidth(kThreads, 5),
          measure_bf16_peak(kThreads, 3), one_thread ? measure_read_bandwidth(1, 5) : 0.0,
          measure_amx_bf16_peak(kThreads, 3)};
}
Limits larger(Limits const& a, Limits const& b) {
  return {std::max(a.fma, b.fma), std::max(a.bandwidth, b.bandwidth), std::max(a.bf16, b.bf16),
          std::max(a.bandwidth1, b.bandwidth1), std::max(a.amx, b.amx)};
}

/// The peak of the unit the bf16 layer's expert GEMMs run on in this process
/// (moe::bf16_kernel()): AMX tiles, vdpbf16ps, or fp32 FMAs for widened weights.
double bf16_unit_peak(Limits const& l) {
  if (moe::kernels::bf16_amx()) return l.amx;
  if (moe::kernels::bf16_dot_products()) return l.bf16;
  return l.fma;
}

void BM_Peak_FmaF32(benchmark::State& state) {
  int const threads = static_cast<int>(state.range(0));
  double v = 0.0;
  for (auto _ : state) v = measure_fma_peak(threads);
  state.counters["GFLOP/s"] = v / 1e9;
}
BENCHMARK(BM_Peak_FmaF32)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

void BM_Peak_Bf16Dot(benchmark::State& state) {
  int const threads = static_cast<int>(state.range(0));
  double v = 0.0;
  for (auto _ : state) v = measure_bf16_peak(threads);
  if (v == 0.0) state.SkipWithError("this build has no AVX512-BF16 (needs -mavx512bf16)");
  state.counters["GFLOP/s"] = v / 1e9;
}
BENCHMARK(BM_Peak_Bf16Dot)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

void BM_Peak_Int8Dot(benchmark::State& state) {
  int const threads = static_cast<int>(state.range(0));
  double v = 0.0;
  for (auto _ : state) v = measure_int8_peak(threads);
  if (v == 0.0) state.SkipWithError("this build has no AVX512-VNNI (needs -mavx512vnni)");
  state.counters["GOP/s"] = v / 1e9;
}
void BM_Peak_AmxBf16(benchmark::State& state) {
  int const threads = static_cast<int>(state.range(0));
  double v = 0.0;
  for (auto _ : state) v = measure_amx_bf16_peak(threads);
  if (v == 0.0) {
    state.SkipWithError(moe::compiled_amx_bf16()
                            ? "this CPU has no AMX-BF16 tiles (or Linux refused tile data)"
                            : "this build has no AMX kernels (needs -mamx-tile -mamx-bf16)");
  }
  state.counters["GFLOP/s"] = v / 1e9;
}
void BM_Peak_AmxInt8(benchmark::State& state) {
  int const threads = static_cast<int>(state.range(0));
  double v = 0.0;
  for (auto _ : state) v = measure_amx_peak<true>(threads);
  if (v == 0.0) {
    state.SkipWithError(moe::compiled_amx_int8()
                            ? "this CPU has no AMX-INT8 tiles (or Linux refused tile data)"
                            : "this build has no AMX kernels (needs -mamx-tile -mamx-int8)");
  }
  state.counters["GOP/s"] = v / 1e9;
}
BENCHMARK(BM_Peak_AmxInt8)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Peak_AmxBf16)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_Peak_Int8Dot)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

void BM_Peak_ReadBandwidth(benchmark::State& state) {
  int const threads = static_cast<int>(state.range(0));
  double v = 0.0;
  for (auto _ : state) v = measure_read_bandwidth(threads);
  state.counters["GB/s"] = v / 1e9;
}
BENCHMARK(BM_Peak_ReadBandwidth)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("threads")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

// ---------------------------------------------------------------------------------------------
// Shapes.

struct Shape {
  char const* name;
  Index D, F, E, K;
  Index n_group = 1, topk_group = 1, shared_f = 0;
};
constexpr Shape kQwen3{"Qwen3", 2048, 768, 128, 8};
constexpr Shape kOlmoe{"OLMoE", 2048, 1024, 64, 8};
constexpr Shape kMixtral{"Mixtral", 1024, 3584, 8, 2};
constexpr Shape kDeepSeek{"DeepSeekV3", 2048, 512, 256, 8, 8, 4, 512};

using SharedBank = experts::UngatedSharedExperts<experts::SwiGlu>;
using Layer = moe::MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu, SharedBank>;

/// One layer type for every shape: group-limited routing reduces to softmax/sigmoid top-k with one
/// group; the DeepSeek-like shape uses sigmoid scores, 8 groups and one shared expert.
std::unique_ptr<Layer> make_layer(Shape const& s) {
  routing::GroupLimitedTopK r;
  r.num_experts = s.E;
  r.top_k = s.K;
  r.n_group = s.n_group;
  r.topk_group = s.topk_group;
  r.normalize = true;
  r.scoring = s.shared_f > 0 ? routing::ScoreFunction::kSigmoid : routing::ScoreFunction::kSoftmax;
  r.scale = s.shared_f > 0 ? 2.5f : 1.0f;
  auto layer = std::make_unique<Layer>(
      s.D, s.F, r, SharedBank(s.shared_f > 0 ? 1 : 0, s.D, std::max<Index>(1, s.shared_f)));
  float const bound = 1.0f / std::sqrt(static_cast<float>(s.D));
  auto wr = layer->router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -bound,
                    bound, 1);
  moe::fill_uniform(layer->experts().edit().parameters(), -bound, bound, 2);
  moe::fill_uniform(layer->shared_experts().bank().edit().parameters(), -bound, bound, 3);
  return layer;
}

/// The layers of one shape at a time, one per weight format (same weights: same seeds), so that a
/// bf16 or quantized row can time the fp32 (and bf16) layer beside it; all are dropped on a
/// change of shape (the four shapes' weights plus packs would not fit in 24 GiB together), and a
/// quantized layer when another quantized format is asked for (at most fp32, bf16 and one
/// quantized layer live at once: 11.5 GB for the Qwen3 shape).
Layer& layer_for(Shape const& s, experts::WeightFormat format = experts::WeightFormat::kF32) {
  constexpr std::size_t kFormats = static_cast<std::size_t>(experts::WeightFormat::kMXFP4) + 1;
  static_assert(static_cast<std::size_t>(experts::WeightFormat::kQ5_K) < kFormats);
  static std::unique_ptr<Layer> layers[kFormats];
  static Shape const* current = nullptr;
  if (current != &s) {
    for (auto& l : layers) l.reset();
    current = &s;
  }
  auto const f = static_cast<std::size_t>(format);
  if (experts::is_quantized(format)) {
    for (std::size_t i = 2; i < kFormats; ++i) {
      if (i != f) layers[i].reset();
    }
  }
  auto& layer = layers[f];
  if (!layer) {
    layer = make_layer(s);
    layer->pack_weights(format, &pool());
  }
  return *layer;
}

std::vector<float> input(Index T, Index D, std::uint64_t seed = 7) {
  std::vector<float> x(static_cast<std::size_t>(T * D));
  moe::fill_uniform(x, -1.0f, 1.0f, seed);
  return x;
}

/// The batches a layer row cycles through, one per iteration: random batches (seeds 7, 8, ...)
/// added until the routed experts' weights they touch together (in the layer's format) exceed
/// twice the last-level cache, so that a batch's experts have left the cache by the time it comes
/// round again; at most kMaxInputs (a shape with few experts may not get there: its w/LLC says
/// so). One batch where a single one already touches that much (every T >= 8 of the four shapes
/// on a 32 MiB cache).
struct Inputs {
  static constexpr std::size_t kMaxInputs = 16;
  std::vector<std::vector<float>> xs;
  std::size_t cur = 0;
  double cycle_bytes = 0.0;  ///< routed expert weight bytes one cycle through xs touches
  std::vector<float> const& x() const { return xs[cur]; }
  void advance() { cur = (cur + 1) % xs.size(); }
};
Inputs rotating_inputs(Layer const& layer, Shape const& s, Index T, double expert_bits) {
  Inputs in;
  moe::MoeFfnWorkspace ws;
  std::vector<char> used(static_cast<std::size_t>(s.E), 0);
  double const per_expert = expert_bits / 8.0 * 3.0 * static_cast<double>(s.D * s.F);
  while (in.xs.size() < Inputs::kMaxInputs && in.cycle_bytes <= 2.0 * llc_bytes()) {
    in.xs.push_back(input(T, s.D, 7 + in.xs.size()));
    layer.route({in.xs.back().data(), T, s.D}, ws);
    for (Index e = 0; e < s.E; ++e) {
      auto& u = used[static_cast<std::size_t>(e)];
      if (ws.plan.expert_rows(e) > 0 && !u) u = 1, in.cycle_bytes += per_expert;
    }
  }
  return in;
}

struct Cost {
  double flop = 0.0;          // forward FLOP
  double weight_bytes = 0.0;  // active expert (+ shared, router) weight bytes
};
/// `expert_bits`: bits per expert weight as the pack stores them (the router stays fp32).
Cost cost_of(Shape const& s, moe::RoutingPlan const& plan, Index T, double expert_bits = 32.0) {
  Cost c;
  Index active = 0;
  for (Index e = 0; e < s.E; ++e) active += plan.expert_rows(e) > 0;
  double const R = static_cast<double>(plan.num_rows());
  c.flop = 2.0 * T * s.E * s.D + R * 2.0 * s.D * s.F * 3.0 +
           (s.shared_f > 0 ? 2.0 * T * s.D * s.shared_f * 3.0 : 0.0);
  c.weight_bytes = expert_bits / 8.0 *
                       (static_cast<double>(active) * 3.0 * s.D * s.F +
                        (s.shared_f > 0 ? 3.0 * s.D * s.shared_f : 0.0)) +
                   4.0 * static_cast<double>(s.E) * s.D;
  return c;
}

/// Mean and fastest of a series of timed runs, in seconds.
struct Timing {
  double total = 0.0, best = 1e30;
  /// Runs f once and records its time.
  template <class F>
  void run(F&& f) {
    auto const t0 = std::chrono::steady_clock::now();
    f();
    double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    total += s;
    best = std::min(best, s);
  }
};

/// What a layer row's timed loop saw: the mean and the fastest iteration of ours and of what ran
/// beside it (the naive baseline, or the fp32 layer for a bf16 row), and the machine's limits
/// measured around the loop.
struct RowTimes {
  double mean = 0.0, best = 0.0;                // seconds per iteration, ours
  double beside_mean = 0.0, beside_best = 0.0;  // seconds per iteration, beside
  Limits lim;
  double beside2_mean = 0.0, beside2_best = 0.0;  // a second one beside (quantized rows)
};

/// The timed loop of a layer row: `ours` is the row's time (manual time); `beside` runs right
/// after it in every iteration, so that a speed-up compares times measured side by side under
/// the same load from other VMs (and neither finds the other's data in cache). The limits are
/// measured just before and just after the loop, the larger of the two kept.
template <class Ours, class Beside>
RowTimes timed_rows(benchmark::State& state, Inputs& in, Ours&& ours, Beside&& beside,
                    bool one_thread) {
  Limits const before = measure_limits(one_thread);
  Timing a, b;
  for (auto _ : state) {
    double const prev = a.total;
    a.run(ours);
    state.SetIterationTime(a.total - prev);
    b.run(beside);
    in.advance();
  }
  double const n = static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
  return {a.total / n, a.best, b.total / n, b.best, larger(before, measure_limits(one_thread))};
}

/// The same with two runs beside ours (each iteration: ours, beside, beside2).
template <class Ours, class Beside, class Beside2>
RowTimes timed_rows(benchmark::State& state, Inputs& in, Ours&& ours, Beside&& beside,
                    Beside2&& beside2) {
  Limits const before = measure_limits(false);
  Timing a, b, c;
  for (auto _ : state) {
    double const prev = a.total;
    a.run(ours);
    state.SetIterationTime(a.total - prev);
    b.run(beside);
    c.run(beside2);
    in.advance();
  }
  double const n = static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
  return {a.total / n, a.best, b.total / n, b.best, larger(before, measure_limits(false)),
          c.total / n, c.best};
}

/// The counters of a layer row. tokens/s and GFLOP/s are Google Benchmark rates over the mean
/// time; S-MFU, S-MBU, roofline (and bf16_peak_frac) use the fastest iteration, like the limits
/// they are divided by, which are the best of several probes: on a host shared with other VMs
/// both sides are then what the machine gave when it was least disturbed. best_ms and the mean
/// (the row's time) are both reported.
/// w/LLC: the routed expert weight bytes one cycle through the row's inputs touches, over the
/// last-level cache (below 2: a batch's weights may still be cached when it comes round again,
/// and S-MBU overstates the DRAM bandwidth reached); inputs: how many batches the row cycles
/// through (rotating_inputs).
void set_counters(benchmark::State& state, Index T, Cost c, double flop_factor, RowTimes const& r,
                  Inputs const& in) {
  Limits const& lim = r.lim;
  double const flop = c.flop * flop_factor;
  double const achieved = flop / r.best;
  double const ai = flop / c.weight_bytes;
  state.counters["tokens"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["FLOP"] = benchmark::Counter(flop, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["best_ms"] = r.best * 1e3;
  state.counters["best_GFLOP/s"] = achieved / 1e9;
  state.counters["peak_GFLOP/s"] = lim.fma / 1e9;
  state.counters["bw_GB/s"] = lim.bandwidth / 1e9;
  state.counters["S-MFU"] = achieved / lim.fma;
  state.counters["S-MBU"] = c.weight_bytes / r.best / lim.bandwidth;
  state.counters["w/LLC"] = in.cycle_bytes / llc_bytes();
  state.counters["inputs"] = static_cast<double>(in.xs.size());
  state.counters["roofline"] = achieved / std::min(lim.fma, ai * lim.bandwidth);
  state.counters["FLOP/B"] = ai;
}

/// The speed-up over what ran beside ours: `name` (fastest over fastest), `name`_mean (mean over
/// mean) and the other's fastest time as `other`_ms.
void set_speedup(benchmark::State& state, RowTimes const& r, std::string const& name,
                 std::string const& other) {
  state.counters[other + "_ms"] = r.beside_best * 1e3;
  state.counters[name] = r.beside_best / r.best;
  state.counters[name + "_mean"] = r.beside_mean / r.mean;
}

// ---------------------------------------------------------------------------------------------
// The naive baseline: the Hugging Face loop, ported as directly as C++ allows.

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <Shape const& S>
void naive_forward(Layer const& layer, moe::MoeFfnWorkspace const& routed,
                   std::vector<float> const& x, Index T, std::vector<float>& y, bool keep,
                   std::vector<Mat>* saved) {
  std::fill(y.begin(), y.end(), 0.0f);
  auto const& plan = routed.plan;
  Eigen::Map<Mat const> X(x.data(), T, S.D);
  Eigen::Map<Mat> Y(y.data(), T, S.D);
  for (Index e = 0; e < S.E; ++e) {
    Index const n = plan.expert_rows(e);
    if (n == 0) continue;
    Mat xe(n, S.D);  // index_select: a copy
    for (Index i = 0; i < n; ++i) xe.row(i) = X.row(plan.row_token[plan.expert_offsets[e] + i]);
    auto const in = moe::as_eigen(layer.experts().in_proj(e));
    auto const down = moe::as_eigen(layer.experts().down_proj(e));
    Mat g = xe * in.topRows(S.F).transpose();
    Mat u = xe * in.bottomRows(S.F).transpose();
    Mat m = (g.array() / (1.0f + (-g.array()).exp())) * u.array();
    Mat out = m * down.transpose();
    for (Index i = 0; i < n; ++i) {
      Index const r = plan.expert_offsets[e] + i;
      Y.row(plan.row_token[r]) += plan.row_weight[r] * out.row(i);  // index_add_
    }
    if (keep) {
      saved->push_back(std::move(xe));
      saved->push_back(std::move(g));
      saved->push_back(std::move(u));
      saved->push_back(std::move(m));
    }
  }
}

template <Shape const& S>
void naive_backward(Layer const& layer, moe::MoeFfnWorkspace const& routed,
                    std::vector<float> const& dy, Index T, std::vector<Mat>& saved,
                    std::vector<float>& dx, Mat& gin, Mat& gdown) {
  std::fill(dx.begin(), dx.end(), 0.0f);
  auto const& plan = routed.plan;
  Eigen::Map<Mat const> DY(dy.data(), T, S.D);
  Eigen::Map<Mat> DX(dx.data(), T, S.D);
  std::size_t k = 0;
  for (Index e = 0; e < S.E; ++e) {
    Index const n = plan.expert_rows(e);
    if (n == 0) continue;
    Mat const& xe = saved[k];
    Mat const& g = saved[k + 1];
    Mat const& u = saved[k + 2];
    Mat const& m = saved[k + 3];
    k += 4;
    Mat dout(n, S.D);
    for (Index i = 0; i < n; ++i) {
      Index const r = plan.expert_offsets[e] + i;
      dout.row(i) = plan.row_weight[r] * DY.row(plan.row_token[r]);
    }
    auto const in = moe::as_eigen(layer.experts().in_proj(e));
    auto const down = moe::as_eigen(layer.experts().down_proj(e));
    gdown.noalias() = dout.transpose() * m;
    Mat dm = dout * down;
    Mat sig = (1.0f / (1.0f + (-g.array()).exp())).matrix();
    Mat dg =
        (dm.array() * u.array() * sig.array() * (1.0f + g.array() * (1.0f - sig.array()))).matrix();
    Mat du = (dm.array() * g.array() * sig.array()).matrix();
    gin.topRows(S.F).noalias() = dg.transpose() * xe;
    gin.bottomRows(S.F).noalias() = du.transpose() * xe;
    Mat dxe = dg * in.topRows(S.F) + du * in.bottomRows(S.F);
    for (Index i = 0; i < n; ++i) DX.row(plan.row_token[plan.expert_offsets[e] + i]) += dxe.row(i);
  }
}

// ---------------------------------------------------------------------------------------------
// The layer rows.

/// One layer row: warms `ours` and `beside` up, times them side by side (timed_rows), sets the
/// counters (FLOPs x flop_factor, weight bytes x byte_factor) and the speed-up `name` over
/// `other`. Returns the times and the cost (of one forward) for row-specific counters.
/// `one_thread`: also measure one thread's read bandwidth around the loop (Limits::bandwidth1).
template <Shape const& S, class Ours, class Beside>
std::pair<RowTimes, Cost> measure_row(benchmark::State& state, moe::MoeFfnWorkspace const& ws,
                                      Inputs& in, Index T, double flop_factor, double byte_factor,
                                      Ours&& ours, Beside&& beside, std::string const& name,
                                      std::string const& other, bool one_thread = false) {
  ours();
  beside();
  Cost c = cost_of(S, ws.plan, T);
  c.weight_bytes *= byte_factor;
  RowTimes const r = timed_rows(state, in, ours, beside, one_thread);
  set_counters(state, T, c, flop_factor, r, in);
  set_speedup(state, r, name, other);
  return {r, c};
}

template <Shape const& S>
void BM_Layer_Forward(benchmark::State& state) {
  Index const T = state.range(0);
  Layer& layer = layer_for(S);
  Inputs in = rotating_inputs(layer, S, T, 32.0);
  std::vector<float> y(in.x().size()), y_naive(in.x().size());
  moe::MoeFfnWorkspace ws, ws_naive;
  auto ours = [&] {
    layer.forward({in.x().data(), T, S.D}, {y.data(), T, S.D}, ws, {nullptr, &pool()});
    benchmark::DoNotOptimize(y.data());
  };
  auto naive = [&] {
    layer.route({in.x().data(), T, S.D}, ws_naive);  // the router is not the baseline's point
    naive_forward<S>(layer, ws_naive, in.x(), T, y_naive, false, nullptr);
    benchmark::DoNotOptimize(y_naive.data());
  };
  // At T <= 8 both sides stream weights from DRAM (bandwidth-bound), ours on kThreads threads
  // and the serial baseline on one, so the row also reports one thread's read bandwidth
  // (bw1_GB/s) and bw_ratio = bw_GB/s / bw1_GB/s: the speed-up of a kThreads-thread stream over
  // a one-thread stream on the host at that moment.
  bool const streaming = T <= 8;
  RowTimes const r =
      measure_row<S>(state, ws, in, T, 1.0, 1.0, ours, naive, "vs_naive", "naive", streaming).first;
  if (streaming && r.lim.bandwidth1 > 0.0) {
    state.counters["bw1_GB/s"] = r.lim.bandwidth1 / 1e9;
    state.counters["bw_ratio"] = r.lim.bandwidth / r.lim.bandwidth1;
  }
}

/// Forward with bf16 weight panels (WeightFormat::kBf16): the active weights cost half the bytes.
/// S-MBU counts the bytes actually read (bf16). The fp32 layer runs beside it (vs_fp32).
#if MOE_BENCH_ONEDNN
/// The oneDNN baseline of a shape (bench/onednn_baseline.hpp), built once from the fp32 layer's
/// weights.
bench::OnednnMoe& onednn_for(Shape const& s) {
  static std::unique_ptr<bench::OnednnMoe> b;
  static Shape const* current = nullptr;
  if (current != &s) {
    b.reset();
    b = std::make_unique<bench::OnednnMoe>(layer_for(s), s.D, s.F, s.shared_f);
    current = &s;
  }
  return *b;
}
#endif

/// The bf16 row: with oneDNN (CMake found libdnnl-dev), the oneDNN baseline runs beside ours
/// (onednn_ms, vs_onednn; onednn_rel_err: its output against ours, RMS of the difference over
/// the RMS of ours, on the first batch; the label names oneDNN's kernel), then the fp32 layer;
/// without it the label says so.
template <Shape const& S>
void BM_Layer_ForwardBf16(benchmark::State& state) {
  Index const T = state.range(0);
  Layer& f32 = layer_for(S);
  Layer& layer = layer_for(S, experts::WeightFormat::kBf16);
  Inputs in = rotating_inputs(layer, S, T, 16.0);
  std::vector<float> y(in.x().size()), y32(in.x().size());
  moe::MoeFfnWorkspace ws, ws32;
  auto ours = [&] {
    layer.forward({in.x().data(), T, S.D}, {y.data(), T, S.D}, ws, {nullptr, &pool()});
    benchmark::DoNotOptimize(y.data());
  };
  auto fp32 = [&] {
    f32.forward({in.x().data(), T, S.D}, {y32.data(), T, S.D}, ws32, {nullptr, &pool()});
    benchmark::DoNotOptimize(y32.data());
  };
#if MOE_BENCH_ONEDNN
  bench::OnednnMoe& dn = onednn_for(S);
  std::vector<float> ydn(in.x().size());
  moe::MoeFfnWorkspace wsdn;
  auto onednn = [&] {
    layer.route({in.x().data(), T, S.D}, wsdn);  // the router is not the baseline's point
    dn.forward(wsdn.plan, in.x().data(), T, ydn.data());
    benchmark::DoNotOptimize(ydn.data());
  };
  ours();
  onednn();
  fp32();
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    num += (static_cast<double>(ydn[i]) - y[i]) * (static_cast<double>(ydn[i]) - y[i]);
    den += static_cast<double>(y[i]) * y[i];
  }
  Cost c = cost_of(S, ws.plan, T);
  c.weight_bytes *= 0.5;
  RowTimes const r = timed_rows(state, in, ours, onednn, fp32);
  set_counters(state, T, c, 1.0, r, in);
  set_speedup(state, r, "vs_onednn", "onednn");
  state.counters["onednn_rel_err"] = std::sqrt(num / std::max(den, 1e-30));
  state.counters["fp32_ms"] = r.beside2_best * 1e3;
  state.counters["vs_fp32"] = r.beside2_best / r.best;
  state.counters["vs_fp32_mean"] = r.beside2_mean / r.mean;
  state.SetLabel("oneDNN " + dn.implementation());
#else
  auto const [r, c] = measure_row<S>(state, ws, in, T, 1.0, 0.5, ours, fp32, "vs_fp32", "fp32");
  state.SetLabel("no oneDNN baseline: libdnnl-dev was not found at build time");
#endif
  // Achieved over the measured peak of the unit the bf16 kernel runs on (AMX tiles, vdpbf16ps
  // or fp32 FMAs: moe::bf16_kernel(), printed in the kernels context).
  // The roofline too takes that unit's peak as its compute ceiling (set_counters: the fp32 one).
  if (double const unit = bf16_unit_peak(r.lim); unit > 0.0) {
    double const achieved = c.flop / r.best;
    state.counters["unit_peak_GFLOP/s"] = unit / 1e9;
    state.counters["unit_peak_frac"] = achieved / unit;
    state.counters["roofline"] =
        achieved / std::min(unit, state.counters["FLOP/B"].value * r.lim.bandwidth);
  }
}

/// Forward with quantized experts (q8_0, q6_k, q5_k, q5_0, q4_k, q4_0, q3_k, q2_k; routed and
/// shared experts alike): S-MBU counts the bytes the pack stores
/// (ExpertBank::packed_bytes: 8.5, 6.5625, 5.625, 4.625, 4.5, 3.5625 and 2.625 bits a weight),
/// GOP/s the multiply-adds x 2 like GFLOP/s. The bf16 and fp32 layers run beside it in every
/// iteration: vs_bf16, vs_fp32.
template <Shape const& S, experts::WeightFormat Format>
void BM_Layer_ForwardQuant(benchmark::State& state) {
  Index const T = state.range(0);
  Layer& f32 = layer_for(S);
  Layer& bf16 = layer_for(S, experts::WeightFormat::kBf16);
  Layer& layer = layer_for(S, Format);
  double const bits = 8.0 * static_cast<double>(layer.experts().packed_bytes(0)) /
                      (3.0 * static_cast<double>(S.D) * static_cast<double>(S.F));
  Inputs in = rotating_inputs(layer, S, T, bits);
  std::vector<float> y(in.x().size()), y16(in.x().size()), y32(in.x().size());
  moe::MoeFfnWorkspace ws, ws16, ws32;
  auto ours = [&] {
    layer.forward({in.x().data(), T, S.D}, {y.data(), T, S.D}, ws, {nullptr, &pool()});
    benchmark::DoNotOptimize(y.data());
  };
  auto run16 = [&] {
    bf16.forward({in.x().data(), T, S.D}, {y16.data(), T, S.D}, ws16, {nullptr, &pool()});
    benchmark::DoNotOptimize(y16.data());
  };
  auto run32 = [&] {
    f32.forward({in.x().data(), T, S.D}, {y32.data(), T, S.D}, ws32, {nullptr, &pool()});
    benchmark::DoNotOptimize(y32.data());
  };
  ours();
  run16();
  run32();
  Cost const c = cost_of(S, ws.plan, T, bits);
  RowTimes const r = timed_rows(state, in, ours, run16, run32);
  set_counters(state, T, c, 1.0, r, in);
  set_speedup(state, r, "vs_bf16", "bf16");
  state.counters["OP"] = benchmark::Counter(c.flop, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bits/weight"] = bits;
  if (int8_peak() > 0.0) {
    state.counters["int8_peak_GOP/s"] = int8_peak() / 1e9;
    state.counters["int8_peak_frac"] = c.flop / r.best / int8_peak();
  }
  state.counters["fp32_ms"] = r.beside2_best * 1e3;
  state.counters["vs_fp32"] = r.beside2_best / r.best;
  state.counters["vs_fp32_mean"] = r.beside2_mean / r.mean;
}

template <Shape const& S>
void BM_Layer_ForwardBackward(benchmark::State& state) {
  Index const T = state.range(0);
  Layer& layer = layer_for(S);
  Inputs in = rotating_inputs(layer, S, T, 32.0);
  std::size_t const n = in.x().size();
  std::vector<float> y(n), dy(n, 1e-3f), dx(n);
  std::vector<float> y_naive(n), dx_naive(n);
  moe::MoeFfnWorkspace ws, ws_naive;
  auto grads = layer.make_gradients();  // accumulated across iterations: fine for timing
  Mat gin(2 * S.F, S.D), gdown(S.D, S.F);
  auto ours = [&] {
    layer.forward_train({in.x().data(), T, S.D}, {y.data(), T, S.D}, ws, {nullptr, &pool()});
    layer.backward(ws, {dy.data(), T, S.D}, {dx.data(), T, S.D}, grads, &pool());
    benchmark::DoNotOptimize(dx.data());
  };
  auto naive = [&] {
    std::vector<Mat> saved;
    layer.route({in.x().data(), T, S.D}, ws_naive);
    naive_forward<S>(layer, ws_naive, in.x(), T, y_naive, true, &saved);
    naive_backward<S>(layer, ws_naive, dy, T, saved, dx_naive, gin, gdown);
    benchmark::DoNotOptimize(dx_naive.data());
  };
  measure_row<S>(state, ws, in, T, 3.0, 1.0, ours, naive, "vs_naive", "naive");
}

// ---------------------------------------------------------------------------------------------
// The non-GEMM parts at T = 512.

/// A row's batch routed once: T = state.range(0) tokens of input() through S's fp32 layer, whose
/// plan (ws.plan) the kernel rows below run on.
template <Shape const& S>
struct Routed {
  Index T;
  Layer& layer;
  std::vector<float> x;
  moe::MoeFfnWorkspace ws;
  explicit Routed(benchmark::State const& state)
      : T(state.range(0)), layer(layer_for(S)), x(input(T, S.D)) {
    layer.route({x.data(), T, S.D}, ws);
  }
};

template <Shape const& S>
void BM_Kernel_Route(benchmark::State& state) {
  Index const T = state.range(0);
  Layer& layer = layer_for(S);
  auto x = input(T, S.D);
  moe::MoeFfnWorkspace ws;
  for (auto _ : state) layer.route({x.data(), T, S.D}, ws, {nullptr, &pool()});
  state.counters["tokens"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}

template <Shape const& S>
void BM_Kernel_Plan(benchmark::State& state) {
  Routed<S> const b(state);
  moe::RoutingPlan plan;
  for (auto _ : state) moe::kernels::build_plan(b.ws.selection, plan);
}

template <Shape const& S>
void BM_Kernel_Gather(benchmark::State& state) {
  Routed<S> const b(state);
  auto const& x = b.x;
  auto const& ws = b.ws;
  Index const R = ws.plan.num_rows();
  std::vector<float> out(static_cast<std::size_t>(R * S.D));
  for (auto _ : state) {
    moe::kernels::gather_rows(x.data(), S.D, ws.plan.row_token.data(), R, S.D, out.data(), S.D);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * R * S.D * 8);
}

template <Shape const& S>
void BM_Kernel_Combine(benchmark::State& state) {
  Routed<S> const b(state);
  Index const T = b.T;
  auto const& ws = b.ws;
  Index const R = ws.plan.num_rows();
  std::vector<float> rows(static_cast<std::size_t>(R * S.D), 0.5f), y(b.x.size());
  for (auto _ : state) {
    moe::kernels::CombineParams p;
    p.expert_out = rows.data();
    p.ld_expert_out = S.D;
    p.row_weight = ws.plan.row_weight.data();
    p.token_offsets = ws.plan.token_offsets.data();
    p.token_rows = ws.plan.token_rows.data();
    p.token_begin = 0;
    p.token_end = T;
    p.cols = S.D;
    p.out = y.data();
    p.ld_out = S.D;
    moe::kernels::combine_rows(p);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(state.iterations() * (R + T) * S.D * 4);
}

// ---------------------------------------------------------------------------------------------
// The routed experts' in projection alone, with the weights in DRAM and in cache.

/// The gate+up (GLU) projection of every routed row at T, as the layer runs it (the layer's own
/// expert queue: items of 4 panels, rows read through the plan's index, SiLU(g) * u in the
/// epilogue), on kThreads threads. `Cached` = false: each expert's own packed weights, all of
/// them read from DRAM once per iteration, as in the layer. `Cached` = true: every expert
/// multiplies expert 0's weights instead, which then stay in cache; same rows, same FLOPs, same
/// code. The two rows side by side show what streaming the weights from DRAM costs the
/// micro-kernel at this shape's rows per expert (16 on average for DeepSeekV3 at T = 512, where
/// FLOP per weight byte is close to the machine's ridge point). Counters: GFLOP/s and S-MFU of the
/// fastest iteration, and the rate at which it reads weights (weight_GB/s, of bw_GB/s: bw_frac).
template <Shape const& S, bool Cached>
void BM_Kernel_ExpertIn(benchmark::State& state) {
  Routed<S> const b(state);
  auto const& x = b.x;
  auto const& plan = b.ws.plan;
  Index const R = plan.num_rows();
  auto const& bank = b.layer.experts();
  std::vector<float> m(static_cast<std::size_t>(R * S.F));
  Index const per_thread = moe::kernels::expert_scratch_floats(S.D);
  std::vector<float> scratch(static_cast<std::size_t>(per_thread * kThreads));
  std::vector<moe::detail::ExpertJob> jobs;
  std::vector<moe::detail::ExpertItem> items;
  auto run = [&] {
    for (Index e = 0; e < S.E; ++e) {
      Index const off = plan.expert_offsets[e], n = plan.expert_rows(e);
      Index const we = Cached ? 0 : e;
      moe::detail::ExpertJob job;
      job.kind = moe::detail::ExpertJob::Kind::kRoutedHidden;
      job.a = {x.data(), S.D, plan.row_token.data() + off};
      job.rows = n;
      job.depth = S.D;
      job.w = moe::detail::expert_weights(bank.in_proj(we).data, 2 * S.F, bank.packed_in(we),
                                          nullptr, S.D, S.F, false, false);
      job.c = m.data() + off * S.F;
      job.ldc = job.cols = S.F;
      moe::detail::add_expert_job(jobs, items, job);
    }
    moe::detail::run_expert_jobs<experts::SwiGlu, experts::SwiGlu>(jobs, items, &pool(),
                                                                   scratch.data(), per_thread);
    benchmark::DoNotOptimize(m.data());
  };
  run();
  Limits const before = measure_limits();
  Timing t;
  for (auto _ : state) {
    double const prev = t.total;
    t.run(run);
    state.SetIterationTime(t.total - prev);
  }
  Limits const lim = larger(before, measure_limits());
  Index active = 0;
  for (Index e = 0; e < S.E; ++e) active += plan.expert_rows(e) > 0;
  double const flop = 2.0 * static_cast<double>(R) * S.D * 2.0 * S.F;
  double const bytes = 4.0 * static_cast<double>(active) * S.D * 2.0 * S.F;
  state.counters["best_ms"] = t.best * 1e3;
  state.counters["best_GFLOP/s"] = flop / t.best / 1e9;
  state.counters["peak_GFLOP/s"] = lim.fma / 1e9;
  state.counters["S-MFU"] = flop / t.best / lim.fma;
  state.counters["rows/expert"] = static_cast<double>(R) / static_cast<double>(active);
  state.counters["weight_GB/s"] = bytes / t.best / 1e9;
  state.counters["bw_GB/s"] = lim.bandwidth / 1e9;
  state.counters["bw_frac"] = bytes / t.best / lim.bandwidth;
}

// clang-format off
#define MOE_LAYER_BENCH(SHAPE, NAME)                                                              \
  BENCHMARK_TEMPLATE(BM_Layer_Forward, SHAPE)->Name("BM_Layer_" #NAME "_Forward")                 \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)->Arg(2048)                     \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardBackward, SHAPE)->Name("BM_Layer_" #NAME "_ForwardBackward") \
      ->ArgName("T")->Arg(128)->Arg(512)->Arg(2048)->Iterations(3)                                \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Kernel_Route, SHAPE)->Name("BM_Kernel_" #NAME "_Route")                   \
      ->ArgName("T")->Arg(512)->Unit(benchmark::kMicrosecond);                                    \
  BENCHMARK_TEMPLATE(BM_Kernel_Plan, SHAPE)->Name("BM_Kernel_" #NAME "_Plan")                     \
      ->ArgName("T")->Arg(512)->Unit(benchmark::kMicrosecond);                                    \
  BENCHMARK_TEMPLATE(BM_Kernel_Gather, SHAPE)->Name("BM_Kernel_" #NAME "_Gather")                 \
      ->ArgName("T")->Arg(512)->Unit(benchmark::kMicrosecond);                                    \
  BENCHMARK_TEMPLATE(BM_Kernel_Combine, SHAPE)->Name("BM_Kernel_" #NAME "_Combine")               \
      ->ArgName("T")->Arg(512)->Unit(benchmark::kMicrosecond);                                    \
  BENCHMARK_TEMPLATE(BM_Kernel_ExpertIn, SHAPE, false)->Name("BM_Kernel_" #NAME "_ExpertInDram")  \
      ->ArgName("T")->Arg(512)->Unit(benchmark::kMillisecond)->UseManualTime();                   \
  BENCHMARK_TEMPLATE(BM_Kernel_ExpertIn, SHAPE, true)->Name("BM_Kernel_" #NAME "_ExpertInCached") \
      ->ArgName("T")->Arg(512)->Unit(benchmark::kMillisecond)->UseManualTime();                   \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardBf16, SHAPE)->Name("BM_Layer_" #NAME "_ForwardBf16")         \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)->Arg(2048)                     \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ8_0)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ8_0")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ4_K)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ4_K")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ4_0)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ4_0")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ6_K)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ6_K")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ5_K)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ5_K")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ5_1)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ5_1")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kIQ4_XS)                \
      ->Name("BM_Layer_" #NAME "_ForwardIQ4_XS")                                                  \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kIQ4_NL)                \
      ->Name("BM_Layer_" #NAME "_ForwardIQ4_NL")                                                  \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kMXFP4)                 \
      ->Name("BM_Layer_" #NAME "_ForwardMXFP4")                                                   \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ4_1)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ4_1")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ5_0)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ5_0")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ3_K)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ3_K")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime();                                           \
  BENCHMARK_TEMPLATE(BM_Layer_ForwardQuant, SHAPE, experts::WeightFormat::kQ2_K)                  \
      ->Name("BM_Layer_" #NAME "_ForwardQ2_K")                                                    \
      ->ArgName("T")->Arg(1)->Arg(8)->Arg(32)->Arg(128)->Arg(512)                                 \
      ->Unit(benchmark::kMillisecond)->UseManualTime()
// clang-format on

MOE_LAYER_BENCH(kQwen3, Qwen3);
MOE_LAYER_BENCH(kOlmoe, OLMoE);
MOE_LAYER_BENCH(kMixtral, Mixtral);
MOE_LAYER_BENCH(kDeepSeek, DeepSeekV3);

void add_context() {
  benchmark::AddCustomContext("xsimd_arch", xsimd::default_arch::name());
  benchmark::AddCustomContext("cpu", moe::cpu_features().describe());
  benchmark::AddCustomContext("kernels", moe::compiled_kernels());
  benchmark::AddCustomContext("threads", std::to_string(kThreads));
  benchmark::AddCustomContext(
      "weights",
      "packed once (MoeFfn::pack_weights); 1 layer copy per shape. Each layer row cycles through "
      "as many input batches (counter inputs, at most 16) as it takes for the routed experts they "
      "touch together to exceed 2x the last-level cache; w/LLC = those bytes / the last-level "
      "cache: rows below 2 may read weights partly from cache");
  benchmark::AddCustomContext("llc", moe::bench::last_level_cache().describe());
  benchmark::AddCustomContext(
      "baseline", "HF loop port: per expert gather copy + Eigen GEMMs + index_add, serial");
}

}  // namespace

// The limits are measured before any benchmark allocates its layers (gigabytes of weights whose
// first touch can slow the machine's memory for a while), and printed with the context.
int main(int argc, char** argv) {
  bool const listing = moe::bench::listing_only(argc, argv);  // before Initialize consumes it
  if (!moe::bench::initialize(
          argc, argv,
          "moe_bench_hotpath: the MoE hot path (routing, gather, expert GEMMs, combine) of real "
          "model shapes in fp32, bf16 and the quantized formats against the machine's measured "
          "limits (S-MFU, S-MBU, roofline) and against a naive baseline run beside it "
          "(bench/README.md, \"Hot path\"; docs/performance.md)."))
    return 1;
  if (listing) {  // the names only: no start-up measurement
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  }
  add_context();
  Limits const& lim = startup_limits();
  // Only the units this build and CPU have, each at the precision a reader needs.
  auto num = [](double v, int digits) {
    char b[32];
    std::snprintf(b, sizeof b, "%.*f", digits, v);
    return std::string(b);
  };
  std::string units = num(lim.fma / 1e9, 0) + " GFLOP/s fp32 FMA, ";
  units +=
      lim.bf16 > 0.0 ? num(lim.bf16 / 1e9, 0) + " GFLOP/s bf16 dot, " : "no bf16 dot products, ";
  units += lim.amx > 0.0 ? num(lim.amx / 1e9, 0) + " GFLOP/s AMX bf16, " : "no AMX, ";
  double const i8 = int8_peak();
  units += i8 > 0.0 ? num(i8 / 1e9, 0) + " GOP/s int8 (" +
                          (moe::kernels::quant_amx() ? std::string("AMX tdpbssd")
                           : moe::kernels::has_avx2_int8() && !moe::kernels::has_avx_vnni()
                               ? std::string("vpmaddubsw")
                               : std::string("vpdpbusd")) +
                          "), "
                    : "no integer dot products, ";
  benchmark::AddCustomContext("limits", units + num(lim.bandwidth / 1e9, 1) + " GB/s read (" +
                                            std::to_string(kThreads) +
                                            " threads, measured at start-up; each layer row "
                                            "is judged against limits measured around it)");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
