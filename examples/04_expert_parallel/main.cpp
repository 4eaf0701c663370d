// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// 04_expert_parallel: a Qwen3-MoE-shaped layer with its experts sharded over MPI ranks
// (moe::dist::ExpertParallelMoeFfn), timed, with the bytes each step exchanges. It doubles as the
// expert-parallel benchmark: run it at 1, 2, 4 ... ranks on the same global batch to get tokens/s
// against rank count (docs/distributed.md has the numbers measured so far).
//
// What it shows:
//   - building the layer on every rank from sizes (each rank allocates only its own experts,
//     E / P of them) and filling the weights rank-locally from per-expert seeds, so nothing has
//     to be broadcast: the router is replicated by construction (same seed everywhere), and
//     verify_replicas() checks that with one collective;
//   - forward (inference) and a training step (forward_train + backward) on each rank's share of
//     a global batch, with a moe::ThreadPool per rank;
//   - ExchangeStats: rows and bytes one call moved between ranks;
//   - --check: every rank also builds the single-process MoeFfn (all experts) and compares its
//     slice of the output bitwise (small shapes only: the reference holds every expert).
//
// Command line (Open MPI; as root add --allow-run-as-root, beyond the core count --oversubscribe):
//   cmake --build build/release --target moe_expert_parallel
//   mpirun -n 2 ./build/release/examples/moe_expert_parallel             # Qwen3 shape, 512 tokens
//   mpirun -n 4 --oversubscribe ./build/release/examples/moe_expert_parallel --threads 1
//   mpirun -n 2 ./build/release/examples/moe_expert_parallel --small --check   # ctest smoke run
//   options: --tokens N (global batch, default 512) --threads t (per rank, default 1)
//            --reps r (timed repetitions, default 5) --experts E --d-model D --d-ffn F --top-k K
//            --train (also time a training step) --small (D 64, F 32, E 8, K 2, 24 tokens)
//            --check; --help / -h lists them, one line each, with their ranges. Integers are
//            read as typed (moe_cli::parse_integer: the whole string, no wrap-around) and
//            range-checked.
// Output (rank 0): one line per measurement, e.g.
//   forward  P=2 t=1 T=512  ms=...  tokens/s=...  sent/rank=... MB  recv/rank=... MB  remote
//   rows=...%
// Exit status: 0 on success (and for --help), 1 on a moe error or a failed --check, 2 on a bad
// argument (an unknown one, a missing value, an integer out of range: one line on stderr).

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "../common/cli.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/dist/expert_parallel.hpp"
#include "moe/layers/presets.hpp"

namespace {

using moe::Index;
using EpLayer = moe::dist::ExpertParallelOf<moe::presets::Qwen3Moe>;

struct Options {
  Index tokens = 512;
  Index d_model = 2048, d_ffn = 768, experts = 128, top_k = 8;
  int threads = 1;
  int reps = 5;
  bool train = false;
  bool check = false;
};

/// Every rank fills the weights of the experts it owns (seed per global expert id) and the
/// replicated router (one seed): no communication, the same values a single process would use.
void fill_weights(EpLayer& layer, Options const& o) {
  float const bound = 1.0f / std::sqrt(static_cast<float>(o.d_model));
  auto w = layer.router_weight();
  moe::fill_uniform(std::span<float>(w.data, static_cast<std::size_t>(w.rows * w.cols)), -bound,
                    bound, 1);
  auto const ids = layer.local_expert_ids();
  {
    auto const edit = layer.local_experts().edit();
    for (std::size_t j = 0; j < ids.size(); ++j) {
      auto in = edit.in_proj(static_cast<Index>(j));
      auto down = edit.down_proj(static_cast<Index>(j));
      auto const seed = 1000 + 2 * static_cast<std::uint64_t>(ids[j]);
      moe::fill_uniform(std::span<float>(in.data, static_cast<std::size_t>(in.rows * in.cols)),
                        -bound, bound, seed);
      moe::fill_uniform(
          std::span<float>(down.data, static_cast<std::size_t>(down.rows * down.cols)), -bound,
          bound, seed + 1);
    }
  }
  layer.pack_weights();
}

/// The same layer in one process (for --check).
moe::presets::Qwen3Moe reference_layer(Options const& o) {
  auto ref = moe::presets::make_qwen3_moe({.hidden_size = o.d_model,
                                           .moe_intermediate_size = o.d_ffn,
                                           .num_experts = o.experts,
                                           .num_experts_per_tok = o.top_k,
                                           .norm_topk_prob = true});
  float const bound = 1.0f / std::sqrt(static_cast<float>(o.d_model));
  auto w = ref.router_weight();
  moe::fill_uniform(std::span<float>(w.data, static_cast<std::size_t>(w.rows * w.cols)), -bound,
                    bound, 1);
  {
    auto const edit = ref.experts().edit();
    for (Index e = 0; e < o.experts; ++e) {
      auto in = edit.in_proj(e);
      auto down = edit.down_proj(e);
      auto const seed = 1000 + 2 * static_cast<std::uint64_t>(e);
      moe::fill_uniform(std::span<float>(in.data, static_cast<std::size_t>(in.rows * in.cols)),
                        -bound, bound, seed);
      moe::fill_uniform(
          std::span<float>(down.data, static_cast<std::size_t>(down.rows * down.cols)), -bound,
          bound, seed + 1);
    }
  }
  ref.pack_weights();
  return ref;
}

/// Median over repetitions of the slowest rank's time for fn (seconds).
template <class Fn>
double time_collective(int reps, Fn&& fn) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    double const t0 = MPI_Wtime();
    fn();
    double dt = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    t.push_back(dt);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void report(char const* what, Options const& o, int P, double seconds,
            moe::dist::ExchangeStats const& s) {
  double v[5] = {static_cast<double>(s.bytes_sent), static_cast<double>(s.bytes_received),
                 static_cast<double>(s.remote_rows_sent), static_cast<double>(s.rows_sent),
                 s.mpi_seconds};
  double mx[5];
  MPI_Allreduce(v, mx, 5, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, v, 5, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (me != 0) return;
  std::printf(
      "%-10s P=%d t=%d T=%ld  ms=%.2f  tokens/s=%.0f  in MPI (max rank) ms=%.2f  bytes/step: "
      "sent max/rank %.3f MB, total %.3f MB  remote rows=%.0f%% of %.0f\n",
      what, P, o.threads, static_cast<long>(o.tokens), seconds * 1e3,
      static_cast<double>(o.tokens) / seconds, mx[4] * 1e3, mx[0] / 1e6, v[0] / 1e6,
      v[3] > 0 ? 100.0 * v[2] / v[3] : 0.0, v[3]);
}

int run(Options const& o) {
  int P = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  Index const D = o.d_model;

  EpLayer layer(MPI_COMM_WORLD, D, o.d_ffn,
                moe::routing::SoftmaxTopK{o.experts, o.top_k, true, 1.0f});
  fill_weights(layer, o);
  layer.verify_replicas();

  // This rank's share of the global batch (rank order), from one global seeded input.
  Index const O = moe::dist::detail::part_begin(o.tokens, P, me);
  Index const T = moe::dist::detail::part_begin(o.tokens, P, me + 1) - O;
  std::vector<float> x_all(static_cast<std::size_t>(o.tokens * D));
  moe::fill_uniform(x_all, -1.0f, 1.0f, 7);
  std::vector<float> x(x_all.begin() + O * D, x_all.begin() + (O + T) * D);
  std::vector<float> y(x.size()), dy(x.size(), 1e-3f), dx(x.size());

  moe::ThreadPool pool(o.threads);
  moe::ThreadPool* pp = o.threads > 1 ? &pool : nullptr;
  moe::dist::ExpertParallelWorkspace ws;

  if (me == 0) {
    std::printf(
        "expert-parallel Qwen3-MoE-shaped layer: D=%ld F=%ld E=%ld top-%ld, %d ranks x %d "
        "threads, %ld tokens (%ld on rank 0), experts per rank: %ld (contiguous)\n",
        static_cast<long>(D), static_cast<long>(o.d_ffn), static_cast<long>(o.experts),
        static_cast<long>(o.top_k), P, o.threads, static_cast<long>(o.tokens), static_cast<long>(T),
        static_cast<long>(layer.local_expert_ids().size()));
  }
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, pp});  // warm-up
  double const t_fwd = time_collective(o.reps, [&] {
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, pp});
  });
  report("forward", o, P, t_fwd, ws.stats);

  if (o.train) {
    auto grads = layer.make_gradients();
    moe::dist::ExchangeStats fwd, bwd;
    double const t_step = time_collective(o.reps, [&] {
      layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, pp});
      fwd = ws.stats;
      layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, pp);
      bwd = ws.stats;
    });
    moe::dist::ExchangeStats both = fwd;
    both.bytes_sent += bwd.bytes_sent;
    both.bytes_received += bwd.bytes_received;
    both.mpi_seconds += bwd.mpi_seconds;
    report("train step", o, P, t_step, both);
  }

  int ok = 1;
  for (float v : y) ok &= std::isfinite(v) ? 1 : 0;
  if (o.check) {
    auto ref = reference_layer(o);
    std::vector<float> y_ref(x_all.size());
    moe::MoeFfnWorkspace rws;
    ref.forward({x_all.data(), o.tokens, D}, {y_ref.data(), o.tokens, D}, rws);
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, pp});
    ok &= std::memcmp(y.data(), y_ref.data() + O * D, y.size() * sizeof(float)) == 0 ? 1 : 0;
  }
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (me == 0 && o.check) {
    std::printf("output equals the single-process MoeFfn bitwise on every rank: %s\n",
                ok ? "yes" : "NO");
  }
  return ok ? 0 : 1;
}

constexpr moe_cli::Option kOptions[] = {
    {"--small", "D 64, F 32, E 8, top-2, 24 tokens, 3 repetitions (the ctest run)"},
    {"--train", "also time a training step (forward_train + backward)"},
    {"--check", "compare with the single-process MoeFfn, bitwise (small shapes: it holds all E)"},
    {"--tokens N", "global batch, split over the ranks, 0 to 2^24 (default 512)"},
    {"--threads N", "worker threads per rank, 1 to 1024 (default 1)"},
    {"--reps N", "timed repetitions, 1 to 10^6 (default 5)"},
    {"--experts E", "experts, spread over the ranks, 1 to 65536 (default 128)"},
    {"--d-model D", "hidden size, 1 to 65536 (default 2048)"},
    {"--d-ffn F", "expert intermediate size, 1 to 262144 (default 768)"},
    {"--top-k K", "experts per token, 1 to E (default 8)"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {
    "moe_expert_parallel", "[options]   (run as: mpirun -n P moe_expert_parallel ...)", kOptions};

/// What parse() decided: run, or exit with this status (after MPI_Finalize).
enum class Parsed { kRun, kHelp, kBad };

/// Reads the options into `o`. Every rank parses the same argv; only rank 0 (`me`) prints the
/// usage or the one-line error.
Parsed parse(int argc, char** argv, Options& o, int me) {
  try {
    for (int i = 1; i < argc; ++i) {
      std::string const a = argv[i];
      // The value of integer option a, read as typed and within [lo, hi] (moe::Error otherwise).
      auto const next = [&](Index lo, Index hi) {
        if (i + 1 >= argc) moe::detail::fail(a, " needs a value");
        return moe_cli::parse_integer<Index>(a, argv[++i], lo, hi);
      };
      if (moe_cli::is_help(a)) {
        if (me == 0) (void)moe_cli::print_help(kUsage);
        return Parsed::kHelp;
      } else if (a == "--small") {
        o.d_model = 64;
        o.d_ffn = 32;
        o.experts = 8;
        o.top_k = 2;
        o.tokens = 24;
        o.reps = 3;
      } else if (a == "--train") {
        o.train = true;
      } else if (a == "--check") {
        o.check = true;
      } else if (a == "--tokens") {
        o.tokens = next(0, Index{1} << 24);
      } else if (a == "--threads") {
        o.threads = static_cast<int>(next(1, moe::ThreadPool::kMaxThreads));
      } else if (a == "--reps") {
        o.reps = static_cast<int>(next(1, 1000000));
      } else if (a == "--experts") {
        o.experts = next(1, 65536);
      } else if (a == "--d-model") {
        o.d_model = next(1, 65536);
      } else if (a == "--d-ffn") {
        o.d_ffn = next(1, 262144);
      } else if (a == "--top-k") {
        o.top_k = next(1, 65536);
      } else {
        if (me == 0) (void)moe_cli::print_unknown_argument(kUsage, a);
        return Parsed::kBad;
      }
    }
  } catch (std::exception const& e) {  // moe::Error: a missing or bad value
    if (me == 0) {
      std::fprintf(stderr,
                   "moe_expert_parallel: %s; moe_expert_parallel --help lists the options\n",
                   e.what());
    }
    return Parsed::kBad;
  }
  return Parsed::kRun;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  Options o;
  int status = 0;
  Parsed const parsed = parse(argc, argv, o, me);
  if (parsed != Parsed::kRun) {
    status = parsed == Parsed::kHelp ? moe_cli::kExitHelp : moe_cli::kExitUsage;
  } else {
    try {
      status = run(o);
    } catch (std::exception const& e) {
      std::fprintf(stderr, "rank %d: %s\n", me, e.what());
      status = 1;
    }
  }
  MPI_Finalize();
  return status;
}
