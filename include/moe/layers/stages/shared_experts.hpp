// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The shared-expert stage: S experts every token goes through, each with an optional sigmoid
/// gate g_{t,s} = sigmoid(<w_s, x_t>) (computed here and nowhere else); forward projections
/// on the layer's projection queue, backward rows per token tile, weight gradients and the
/// gate's term of dx. Shared expert s's rows are plane s of [S, T, .] buffers. Not public API.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "moe/core/thread_pool.hpp"
#include "moe/layers/stages/combine.hpp"
#include "moe/layers/stages/routed_experts.hpp"
#include "moe/layers/stages/work.hpp"

namespace moe::stages {

/// Where a shared-expert gradient goes: `params` laid out like the shared bank's parameters()
/// (every in_proj block, then every down_proj block) and the gate [S, D] (gated only).
struct SharedGradTarget {
  float* params = nullptr;
  float* gate = nullptr;
};

/// The shared-expert stage's buffers, and its steps for a SharedExpertPolicy `Shared` (the
/// buffers do not depend on the policy, so one workspace type serves every layer type).
struct SharedStage {
  std::vector<float> hidden;             ///< [S, T, P_s] pre-activations (training)
  std::vector<float> act;                ///< [S, T, F_s] activations
  std::vector<float> out;                ///< [S, T, D] outputs
  std::vector<float> gate;               ///< [T, S] sigmoid gates (gated only)
  std::vector<std::uint32_t> act_pairs;  ///< [S, T, ceil(F_s / 2)] (inference, bf16 pairs)
  std::vector<std::byte> act_q8;         ///< [S, T] int8 rows (inference, quantized experts)
  std::vector<float> dy, dx, dhidden;    ///< backward: [S, T, D], [S, T, D], [S, T, P_s]
  std::vector<float> dgate;              ///< [T, S] dL/d(gate logits)
  std::vector<float> x16;  ///< [T, D] the inputs rounded to bf16 (bf16-compute training)

  template <class Shared>
  static Index count(Shared const& sh) {
    return sh.count();
  }
  template <class Shared>
  static Index hidden_cols(Shared const& sh) {
    if constexpr (Shared::has_experts) return sh.bank().hidden_cols();
    (void)sh;
    return 0;
  }
  template <class Shared>
  static Index ffn(Shared const& sh) {
    if constexpr (Shared::has_experts) return sh.bank().d_ffn();
    (void)sh;
    return 0;
  }
  /// Does an inference forward hand the shared projections bf16 pairs?
  template <class Shared>
  static bool uses_pairs(Shared const& sh, bool train) {
    if constexpr (Shared::has_experts) return detail::uses_bf16_pairs(sh.bank(), !train);
    (void)sh;
    (void)train;
    return false;
  }

  /// Does a training forward over these shared experts run in bf16 (set_train_compute)?
  template <class Shared>
  static bool trains_bf16(Shared const& sh) {
    if constexpr (Shared::has_experts) return detail::trains_bf16(sh.bank());
    (void)sh;
    return false;
  }
  /// Does an inference forward hand the shared projections int8 rows?
  template <class Shared>
  static bool uses_q8(Shared const& sh, bool train) {
    if constexpr (Shared::has_experts) return detail::uses_q8_rows(sh.bank(), !train);
    (void)sh;
    (void)train;
    return false;
  }

  template <class Shared>
  void prepare(Shared const& sh, Index T, ExpertMode mode, Index D) {
    Index const ns = count(sh), Ps = hidden_cols(sh), Fs = ffn(sh);
    hidden.resize(static_cast<std::size_t>(mode.train ? ns * T * Ps : 0));
    act.resize(static_cast<std::size_t>(ns * T * Fs));
    out.resize(static_cast<std::size_t>(ns * T * D));
    gate.resize(static_cast<std::size_t>(Shared::gated ? ns * T : 0));
    act_pairs.resize(static_cast<std::size_t>(mode.pairs ? ns * T * ((Fs + 1) / 2) : 0));
    act_q8.resize(static_cast<std::size_t>(mode.q8 ? ns * T * kernels::q8_row_bytes(Fs) : 0));
  }
  template <class Shared>
  void reserve(Shared const& sh, Index T, Index D) {
    Index const ns = count(sh), Fs = ffn(sh);
    act.reserve(static_cast<std::size_t>(ns * T * Fs));
    out.reserve(static_cast<std::size_t>(ns * T * D));
    gate.reserve(static_cast<std::size_t>(ns * T));
    if (kernels::bf16_dot_products()) {
      act_pairs.reserve(static_cast<std::size_t>(ns * T * ((Fs + 1) / 2)));
    }
    if (uses_q8(sh, false)) {
      act_q8.reserve(static_cast<std::size_t>(ns * T * kernels::q8_row_bytes(Fs)));
    }
  }

  /// The rows the shared experts' in projections read: x, or in a bf16-compute training forward
  /// (mode.train, the shared bank in TrainCompute::kBf16) x rounded to bf16 into x16.
  template <class Shared>
  ConstMatrixView<float> inputs(Shared const& sh, ConstMatrixView<float> x, ExpertMode mode,
                                ThreadPool* pool) {
    if (!mode.train || !trains_bf16(sh)) return x;
    Index const T = x.rows, D = x.cols;
    x16.resize(static_cast<std::size_t>(T * D));
    parallel_for(pool, (T + kTokenTile - 1) / kTokenTile, [&](Index i, int) {
      for (Index t = i * kTokenTile; t < std::min(T, (i + 1) * kTokenTile); ++t) {
        for (Index c = 0; c < D; ++c) x16[t * D + c] = kernels::round_bf16_activation(x(t, c));
      }
    });
    return {x16.data(), T, D};
  }
  /// bf16-compute training: the shared experts' m rounded to bf16 after the in projections.
  template <class Shared>
  void round_hidden(Shared const& sh, ExpertMode mode, ThreadPool* pool) {
    if (mode.train && trains_bf16(sh)) {
      round_bf16(act.data(), static_cast<Index>(act.size()), pool);
    }
  }

  /// gate[t, s] = sigmoid(<w_s, x_t>) (the one place the shared gate is computed).
  template <class Shared>
  void gates(Shared const& sh, ConstMatrixView<float> x, ThreadPool* pool) {
    if constexpr (Shared::gated) {
      Index const T = x.rows, D = x.cols, ns = count(sh);
      if (ns == 0) return;
      parallel_for(pool, (T + kTokenTile - 1) / kTokenTile, [&](Index i, int) {
        Index const t0 = i * kTokenTile, t1 = std::min(T, t0 + kTokenTile);
        for (Index t = t0; t < t1; ++t) {
          float const* xt = x.row(t);
          for (Index s = 0; s < ns; ++s) {
            float const* g = sh.gate_weight().row(s);
            float z = 0.0f;
            for (Index d = 0; d < D; ++d) z = std::fma(g[d], xt[d], z);
            gate[static_cast<std::size_t>(t * ns + s)] = 1.0f / (1.0f + std::exp(-z));
          }
        }
      });
    } else {
      (void)sh;
      (void)x;
      (void)pool;
    }
  }

  /// In projections of every shared expert over the T rows of `a` (activation fused); expert s
  /// reads a.from(s * plane_rows) (0: every expert reads the same rows, the layer's x).
  /// `path_rows`: the token count of the single-process layer (kernel path of raw weights).
  template <class Shared>
  void enqueue_in(ProjectionQueue& q, Shared const& sh, kernels::RowSource a, Index T,
                  ExpertMode mode, Index path_rows, Index plane_rows = 0) {
    if constexpr (Shared::has_experts) {
      auto const& sb = sh.bank();
      Index const ns = count(sh), Ps = sb.hidden_cols(), Fs = sb.d_ffn();
      for (Index s = 0; s < ns; ++s) {
        detail::ExpertJob job;
        job.kind = detail::ExpertJob::Kind::kSharedHidden;
        job.a = a.from(s * plane_rows);
        job.rows = T;
        job.depth = sb.d_model();
        job.w = in_weights(sb, s, !mode.train, path_rows);
        job.c = act.data() + s * T * Fs;
        job.ldc = Fs;
        job.cols = Fs;
        job.h = mode.train ? hidden.data() + s * T * Ps : nullptr;
        job.ldh = Ps;
        job.bias = sb.in_bias_data(s);
        job.clamp = sb.glu_clamp();
        q.add(job);
      }
    } else {
      (void)q, (void)sh, (void)a, (void)T, (void)mode, (void)path_rows, (void)plane_rows;
    }
  }

  template <class Shared>
  detail::PairsTask act_pairs_task(Shared const& sh, Index T) {
    Index const Fs = ffn(sh);
    return {act.data(),
            Fs,
            count(sh) * T,
            Fs,
            act_pairs.empty() ? nullptr : act_pairs.data(),
            act_q8.empty() ? nullptr : act_q8.data()};
  }

  template <class Shared>
  void enqueue_down(ProjectionQueue& q, Shared const& sh, Index T, ExpertMode mode,
                    Index path_rows) {
    if constexpr (Shared::has_experts) {
      auto const& sb = sh.bank();
      Index const ns = count(sh), D = sb.d_model(), Fs = sb.d_ffn(), kpFs = (Fs + 1) / 2;
      Index const rb = kernels::q8_row_bytes(Fs);
      for (Index s = 0; s < ns; ++s) {
        detail::ExpertJob job;
        job.a = {act.data() + s * T * Fs,
                 Fs,
                 nullptr,
                 act_pairs.empty() ? nullptr : act_pairs.data() + s * T * kpFs,
                 kpFs,
                 act_q8.empty() ? nullptr : act_q8.data() + s * T * rb,
                 rb};
        job.rows = T;
        job.depth = Fs;
        job.w = down_weights(sb, s, !mode.train, path_rows);
        job.c = out.data() + s * T * D;
        job.ldc = D;
        job.cols = D;
        job.bias = sb.down_bias_data(s);
        q.add(job);
      }
    } else {
      (void)q, (void)sh, (void)T, (void)mode, (void)path_rows;
    }
  }

  /// The combine's view of this stage's outputs.
  template <class Shared>
  void add_to(CombineSource& src, Shared const& sh) const {
    src.shared = out.data();
    src.num_shared = count(sh);
    src.shared_gate = Shared::gated ? gate.data() : nullptr;
  }

  /// Backward buffers for T tokens (dy and dgate are written by the combine VJP).
  template <class Shared>
  void prepare_backward(Shared const& sh, Index T, Index D) {
    Index const ns = count(sh);
    dy.resize(static_cast<std::size_t>(ns * T * D));
    dx.resize(static_cast<std::size_t>(ns * T * D));
    dhidden.resize(static_cast<std::size_t>(ns * T * hidden_cols(sh)));
    dgate.assign(static_cast<std::size_t>(ns * T), 0.0f);
  }
  void add_to(CombineGrads& g) {
    g.d_shared = dy.data();
    g.dgate = dgate.data();
  }

  template <class Shared>
  static Index backward_scratch(Shared const& sh) {
    if constexpr (Shared::has_experts) {
      return detail::expert_backward_scratch(sh.bank(), kTokenTile);
    }
    (void)sh;
    return 0;
  }

  /// Row phase of the backward per (shared expert, token tile): m, dhidden and dx.
  template <class Shared>
  void backward_rows(Shared const& sh, Index T, ThreadPool* pool, ThreadScratch& scratch) {
    if constexpr (Shared::has_experts) {
      auto const& sb = sh.bank();
      Index const ns = count(sh), D = sb.d_model(), Ps = sb.hidden_cols(), Fs = sb.d_ffn();
      Index const tiles = (T + kTokenTile - 1) / kTokenTile;
      scratch.grow(pool, backward_scratch(sh));
      parallel_for(pool, ns * tiles, [&](Index i, int thread) {
        Index const s = i / tiles, t0 = (i % tiles) * kTokenTile;
        Index const n = std::min(kTokenTile, T - t0), off = s * T + t0;
        detail::expert_backward_rows(sb, s, ConstMatrixView<float>(hidden.data() + off * Ps, n, Ps),
                                     ConstMatrixView<float>(dy.data() + off * D, n, D),
                                     MatrixView<float>(act.data() + off * Fs, n, Fs),
                                     MatrixView<float>(dhidden.data() + off * Ps, n, Ps),
                                     MatrixView<float>(dx.data() + off * D, n, D),
                                     scratch.of(thread));
      });
    } else {
      (void)sh, (void)T, (void)pool, (void)scratch;
    }
  }

  /// Weight gradients over the T tokens of x: in_proj += dH^T X, down_proj += dY^T m, gate +=
  /// dgate^T x, into `target`. X is x, or plane s of `inputs` [S, T, D] when given.
  template <class Shared>
  void add_weight_grads(GradTasks& tasks, Shared const& sh, ConstMatrixView<float> x,
                        SharedGradTarget target, float const* inputs = nullptr) const {
    if constexpr (Shared::has_experts) {
      auto const& sb = sh.bank();
      Index const T = x.rows, ns = count(sh), D = sb.d_model(), Ps = sb.hidden_cols();
      Index const Fs = sb.d_ffn();
      constexpr Index kBlock = 256;
      bool const bf16 = detail::trains_bf16(sb);
      for (Index s = 0; s < ns; ++s) {
        ConstMatrixView<float> const xs =
            inputs ? ConstMatrixView<float>(inputs + s * T * D, T, D) : x;
        tasks.add(xs, ConstMatrixView<float>(dhidden.data() + s * T * Ps, T, Ps),
                  MatrixView<float>(target.params + s * Ps * D, Ps, D), kBlock, bf16);
        tasks.add(ConstMatrixView<float>(act.data() + s * T * Fs, T, Fs),
                  ConstMatrixView<float>(dy.data() + s * T * D, T, D),
                  MatrixView<float>(target.params + ns * Ps * D + s * D * Fs, D, Fs), kBlock, bf16);
        if (sb.has_biases()) {  // the flat layout of ExpertBank::parameters()
          float* const b = target.params + ns * (Ps * D + D * Fs);
          tasks.add_bias(ConstMatrixView<float>(dhidden.data() + s * T * Ps, T, Ps),
                         std::span<float>(b + s * Ps, static_cast<std::size_t>(Ps)));
          tasks.add_bias(ConstMatrixView<float>(dy.data() + s * T * D, T, D),
                         std::span<float>(b + ns * Ps + s * D, static_cast<std::size_t>(D)));
        }
      }
      if (Shared::gated && ns > 0) {
        tasks.add(x, ConstMatrixView<float>(dgate.data(), T, ns),
                  MatrixView<float>(target.gate, ns, D), ns);
      }
    } else {
      (void)tasks, (void)sh, (void)x, (void)target, (void)inputs;
    }
  }

  /// dx += dgate W_g (gated only; k = 0 otherwise).
  template <class Shared>
  DxTerm gate_dx_term(Shared const& sh) const {
    if constexpr (Shared::gated) {
      auto const g = sh.gate_weight();
      return {dgate.data(), count(sh), count(sh), g.data, g.row_stride};
    }
    (void)sh;
    return {};
  }
};

/// The SharedGradTarget of a shared-expert policy object holding gradients (its bank and its
/// gate), with the bank's edit scope open while this lives.
template <class Shared, bool = Shared::has_experts>
class SharedGradScope {
 public:
  explicit SharedGradScope(Shared&) {}
  SharedGradTarget target() const { return {}; }
};
template <class Shared>
class SharedGradScope<Shared, true> {
 public:
  explicit SharedGradScope(Shared& g) : edit_(g.bank()), gate_(g.gate_weight().data) {}
  SharedGradTarget target() const { return {edit_.parameters().data(), gate_}; }

 private:
  typename std::remove_cvref_t<decltype(std::declval<Shared&>().bank())>::Edit edit_;
  float* gate_;
};

}  // namespace moe::stages
