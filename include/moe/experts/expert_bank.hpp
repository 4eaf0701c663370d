// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ExpertBank: the weights of E experts of one policy, and the routine that runs one of them.
#pragma once

#include <span>
#include <vector>

#include "moe/core/concepts.hpp"
#include "moe/core/eigen_interop.hpp"
#include "moe/core/error.hpp"
#include "moe/kernels/activations.hpp"

namespace moe::experts {

/// Owns the weights of `num_experts` experts that all compute `Expert` (a GLU or an MLP), in
/// the Hugging Face [out, in] row-major convention, one contiguous block per expert:
///
/// | view           | shape   | notes                                                        |
/// |----------------|---------|--------------------------------------------------------------|
/// | in_proj(e)     | [P, D]  | P = 2F for GLU experts: gate rows [0, F) then up rows [F, 2F) |
/// |                |         | (HF fused gate_up_proj layout); P = F for MLP experts (up)    |
/// | gate_proj(e)   | [F, D]  | GLU only: rows [0, F) of in_proj(e)                            |
/// | up_proj(e)     | [F, D]  | rows [P - F, P) of in_proj(e)                                  |
/// | down_proj(e)   | [D, F]  |                                                              |
///
/// `parameters()` is every weight as one flat array (all in_proj blocks, then all down_proj
/// blocks), for optimizers and loaders. A bank is a value type: copying it copies the weights.
/// run() is const and thread-safe for distinct output buffers.
template <ExpertPolicy Expert_>
class ExpertBank {
 public:
  using Expert = Expert_;
  static constexpr Index kInFactor = Expert::gated ? 2 : 1;

  ExpertBank() = default;
  /// Zero-initialised weights. Preconditions: num_experts >= 0, d_model >= 1, d_ffn >= 1.
  ExpertBank(Index num_experts, Index d_model, Index d_ffn)
      : num_experts_(num_experts), d_model_(d_model), d_ffn_(d_ffn) {
    detail::check(num_experts >= 0 && d_model >= 1 && d_ffn >= 1,
                  "ExpertBank: num_experts = ", num_experts, ", d_model = ", d_model,
                  ", d_ffn = ", d_ffn, "; sizes must be positive (num_experts may be 0)");
    params_.assign(static_cast<std::size_t>(num_experts * (kInFactor + 1) * d_ffn * d_model), 0.0f);
  }

  Index num_experts() const { return num_experts_; }
  Index d_model() const { return d_model_; }
  Index d_ffn() const { return d_ffn_; }

  MatrixView<float> in_proj(Index e) { return {in_ptr(e), kInFactor * d_ffn_, d_model_}; }
  ConstMatrixView<float> in_proj(Index e) const {
    return {in_ptr(e), kInFactor * d_ffn_, d_model_};
  }
  MatrixView<float> gate_proj(Index e) requires(Expert::gated) {
    return {in_ptr(e), d_ffn_, d_model_};
  }
  ConstMatrixView<float> gate_proj(Index e) const requires(Expert::gated) {
    return {in_ptr(e), d_ffn_, d_model_};
  }
  MatrixView<float> up_proj(Index e) {
    return {in_ptr(e) + (kInFactor - 1) * d_ffn_ * d_model_, d_ffn_, d_model_};
  }
  ConstMatrixView<float> up_proj(Index e) const {
    return {in_ptr(e) + (kInFactor - 1) * d_ffn_ * d_model_, d_ffn_, d_model_};
  }
  MatrixView<float> down_proj(Index e) { return {down_ptr(e), d_model_, d_ffn_}; }
  ConstMatrixView<float> down_proj(Index e) const { return {down_ptr(e), d_model_, d_ffn_}; }

  std::span<float> parameters() { return params_; }
  std::span<float const> parameters() const { return params_; }

  /// Floats of scratch that run() needs for n rows: n * P.
  Index scratch_size(Index rows) const { return rows * kInFactor * d_ffn_; }

  /// out[i] = E_e(x[i]) for the n = x.rows rows of x [n, D] into out [n, D].
  /// `scratch` holds scratch_size(n) floats. Computed with Eigen's GEMM (single-threaded; the
  /// result depends only on the inputs and n, never on the calling thread).
  void run(Index e, ConstMatrixView<float> x, MatrixView<float> out, float* scratch) const {
    Index const n = x.rows;
    if (n == 0) return;
    Index const P = kInFactor * d_ffn_;
    MatrixView<float> h(scratch, n, P);
    as_eigen(h).noalias() = as_eigen(x) * as_eigen(in_proj(e)).transpose();
    for (Index i = 0; i < n; ++i) {
      float* row = h.row(i);
      if constexpr (Expert::gated) {
        kernels::glu<Expert::activation>(row, row + d_ffn_, row, d_ffn_);
      } else {
        kernels::activate<Expert::activation>(row, row, d_ffn_);
      }
    }
    ConstMatrixView<float> a(scratch, n, d_ffn_, P);  // act(gate) * up, in the gate half of h
    as_eigen(out).noalias() = as_eigen(a) * as_eigen(down_proj(e)).transpose();
  }

 private:
  float* in_ptr(Index e) { return params_.data() + e * kInFactor * d_ffn_ * d_model_; }
  float const* in_ptr(Index e) const { return params_.data() + e * kInFactor * d_ffn_ * d_model_; }
  float* down_ptr(Index e) {
    return params_.data() + num_experts_ * kInFactor * d_ffn_ * d_model_ + e * d_model_ * d_ffn_;
  }
  float const* down_ptr(Index e) const {
    return params_.data() + num_experts_ * kInFactor * d_ffn_ * d_model_ + e * d_model_ * d_ffn_;
  }

  Index num_experts_ = 0;
  Index d_model_ = 0;
  Index d_ffn_ = 0;
  std::vector<float> params_;
};

}  // namespace moe::experts
