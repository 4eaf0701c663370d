// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ExpertBank: the weights of E experts of one policy, and the routine that runs one of them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "moe/core/concepts.hpp"
#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/views.hpp"
#include "moe/kernels/activations.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/gemm_strided.hpp"

namespace moe::experts {

/// Storage of packed expert weights (ExpertBank::pack).
enum class WeightFormat {
  kF32,   ///< fp32 panels: exact
  kBf16,  ///< bf16 panels: half the bytes; inference only (forward_train uses fp32)
};

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
/// The layers run its experts through the routed-experts engine (moe/layers/stages/); the
/// backward's row phase (backward_rows) runs on kernels::gemm_strided: in place,
/// allocation-free, const and thread-safe for distinct output buffers.
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

  /// Reads: const views, which never touch a packed copy.
  ConstMatrixView<float> in_proj(Index e) const {
    return {in_ptr(e), kInFactor * d_ffn_, d_model_};
  }
  ConstMatrixView<float> gate_proj(Index e) const requires(Expert::gated) {
    return {in_ptr(e), d_ffn_, d_model_};
  }
  ConstMatrixView<float> up_proj(Index e) const {
    return {in_ptr(e) + (kInFactor - 1) * d_ffn_ * d_model_, d_ffn_, d_model_};
  }
  ConstMatrixView<float> down_proj(Index e) const { return {down_ptr(e), d_model_, d_ffn_}; }
  std::span<float const> parameters() const { return params_; }

  /// A scope for writing the weights. While any Edit of the bank is alive its packed copy is
  /// not used (packed() is false, the layers pack per call, so every write is seen) and pack()
  /// throws; when the last one ends, a bank that was packed when the first began is packed
  /// again in the same format. The views an Edit hands out are valid while it lives: a write
  /// through one after it ended is a use after scope, like a write through a dangling
  /// iterator. Not copyable; movable. `auto ed = bank.edit(); fill(ed.parameters());`
  class Edit {
   public:
    explicit Edit(ExpertBank& bank) : bank_(&bank) { bank_->begin_edit(); }
    Edit(Edit&& other) noexcept : bank_(std::exchange(other.bank_, nullptr)) {}
    Edit(Edit const&) = delete;
    Edit& operator=(Edit const&) = delete;
    Edit& operator=(Edit&&) = delete;
    ~Edit() {
      if (bank_) bank_->end_edit();
    }

    MatrixView<float> in_proj(Index e) const {
      return {bank_->in_ptr(e), kInFactor * bank_->d_ffn_, bank_->d_model_};
    }
    MatrixView<float> gate_proj(Index e) const requires(Expert::gated) {
      return {bank_->in_ptr(e), bank_->d_ffn_, bank_->d_model_};
    }
    MatrixView<float> up_proj(Index e) const {
      return {bank_->in_ptr(e) + (kInFactor - 1) * bank_->d_ffn_ * bank_->d_model_, bank_->d_ffn_,
              bank_->d_model_};
    }
    MatrixView<float> down_proj(Index e) const {
      return {bank_->down_ptr(e), bank_->d_model_, bank_->d_ffn_};
    }
    std::span<float> parameters() const { return bank_->params_; }

   private:
    ExpertBank* bank_;
  };
  /// Opens an edit scope (see Edit).
  Edit edit() { return Edit(*this); }
  /// Is an edit scope open?
  bool editing() const { return edits_.n > 0; }

  /// P: columns of the pre-activation h (2F for GLU experts, F for MLPs).
  Index hidden_cols() const { return kInFactor * d_ffn_; }

  /// Row phase of the backward of expert e over n rows, given the forward's h [n, P] and the
  /// upstream gradient dy [n, D] of the expert outputs:
  ///   dm = dy W_down [n, F];  (m, dh) from h and dm;  dx = dh W_in [n, D]
  /// Writes m [n, F] (recomputed), dh [n, P] and dx [n, D]; `scratch` holds
  /// backward_scratch_floats(n) floats.
  void backward_rows(Index e, ConstMatrixView<float> h, ConstMatrixView<float> dy,
                     MatrixView<float> m, MatrixView<float> dh, MatrixView<float> dx,
                     float* scratch) const {
    Index const n = h.rows, F = d_ffn_;
    if (n == 0) return;
    MatrixView<float> dm(scratch, n, F);
    float* const gemm_scratch = scratch + n * F;
    auto const wd = down_proj(e), wi = in_proj(e);
    kernels::gemm_strided(n, F, d_model_, dy.data, dy.row_stride, 1, wd.data, wd.row_stride,
                          dm.data, dm.row_stride, false, gemm_scratch);
    for (Index i = 0; i < n; ++i) {
      float const* hi = h.row(i);
      if constexpr (Expert::gated) {
        kernels::glu_backward<Expert::activation>(hi, hi + F, dm.row(i), m.row(i), dh.row(i),
                                                  dh.row(i) + F, F);
      } else {
        kernels::activate_backward<Expert::activation>(hi, dm.row(i), m.row(i), dh.row(i), F);
      }
    }
    kernels::gemm_strided(n, d_model_, hidden_cols(), dh.data, dh.row_stride, 1, wi.data,
                          wi.row_stride, dx.data, dx.row_stride, false, gemm_scratch);
  }
  /// Floats of scratch backward_rows needs for n rows: dm, then gemm_strided's scratch.
  Index backward_scratch_floats(Index n) const {
    return n * d_ffn_ + kernels::kGemmStridedScratchFloats;
  }

  /// Packs every expert's projections into the panel layout the micro-kernel reads
  /// (kernels::pack_panel: for each expert, ceil(P / NP) panels of [D, NP], then ceil(D / NP)
  /// panels of [F, NP]; NP = kernels::panel_width()), so that forwards stop repacking weights on
  /// every call. The fp32 copy doubles the weight memory; WeightFormat::kBf16 stores bf16 panels
  /// (kernels::pack_panel_bf16, round-to-nearest-even) that inference forwards multiply with
  /// AVX512-BF16 dot products where available (fp32 widening otherwise); training forwards
  /// ignore a bf16 pack and use the exact fp32 weights. Reads (the const views) never touch the
  /// pack; writes go through an Edit, during which the pack is not used and after which it is
  /// rebuilt, so results never come from stale weights. Throws moe::Error while an Edit is open.
  void pack(WeightFormat format = WeightFormat::kF32) {
    detail::check(!editing(),
                  "ExpertBank::pack: the weights are open for writing (an ExpertBank::Edit or a "
                  "layer's parameters() list is alive); let it end first, it repacks on its own");
    Index const np = kernels::panel_width();
    Index const P = hidden_cols(), D = d_model_, F = d_ffn_;
    Index const in_panels = (P + np - 1) / np, down_panels = (D + np - 1) / np;
    packed_.clear();
    packed_bf16_.clear();
    if (format == WeightFormat::kF32) {
      packed_.assign(
          static_cast<std::size_t>(num_experts_ * (in_panels * D + down_panels * F) * np), 0.0f);
    } else {
      packed_bf16_.assign(
          static_cast<std::size_t>(num_experts_ *
                                   (in_panels * ((D + 1) / 2) + down_panels * ((F + 1) / 2)) * np),
          0u);
    }
    for (Index e = 0; e < num_experts_; ++e) {
      for (Index p = 0; p < in_panels; ++p) {
        Index const nc = std::min(np, P - p * np);
        if (format == WeightFormat::kF32) {
          kernels::pack_panel(in_ptr(e), D, p * np, nc, D,
                              packed_.data() + packed_in_offset(e) + p * D * np);
        } else {
          kernels::pack_panel_bf16(
              in_ptr(e), D, p * np, nc, D,
              packed_bf16_.data() + bf16_in_offset(e) + p * ((D + 1) / 2) * np);
        }
      }
      for (Index p = 0; p < down_panels; ++p) {
        Index const nc = std::min(np, D - p * np);
        if (format == WeightFormat::kF32) {
          kernels::pack_panel(down_ptr(e), F, p * np, nc, F,
                              packed_.data() + packed_down_offset(e) + p * F * np);
        } else {
          kernels::pack_panel_bf16(
              down_ptr(e), F, p * np, nc, F,
              packed_bf16_.data() + bf16_down_offset(e) + p * ((F + 1) / 2) * np);
        }
      }
    }
    pack_current_ = true;
    packed_format_ = format;
  }
  /// The format of the current packed copy (meaningful when packed()).
  WeightFormat packed_format() const { return packed_format_; }
  /// Expert e's bf16 panels ([D or F pairs, NP] words, in then down), or null when not current.
  std::uint32_t const* packed_in_bf16(Index e) const {
    return packed() && !packed_bf16_.empty() ? packed_bf16_.data() + bf16_in_offset(e) : nullptr;
  }
  std::uint32_t const* packed_down_bf16(Index e) const {
    return packed() && !packed_bf16_.empty() ? packed_bf16_.data() + bf16_down_offset(e) : nullptr;
  }

  /// Is the packed copy present and made from the current weights? (A bank of no experts, as an
  /// expert-parallel rank may hold, is packed once pack() has run, though it stores nothing.)
  bool packed() const { return pack_current_; }
  /// First panel of expert e's in projection ([D, NP] panels, contiguous), or null if not packed.
  float const* packed_in(Index e) const {
    return packed() && !packed_.empty() ? packed_.data() + packed_in_offset(e) : nullptr;
  }
  /// First panel of expert e's down projection ([F, NP] panels, contiguous), or null.
  float const* packed_down(Index e) const {
    return packed() && !packed_.empty() ? packed_.data() + packed_down_offset(e) : nullptr;
  }

 private:
  Index bf16_in_offset(Index e) const {
    Index const np = kernels::panel_width();
    Index const in_panels = (hidden_cols() + np - 1) / np, down_panels = (d_model_ + np - 1) / np;
    return e * (in_panels * ((d_model_ + 1) / 2) + down_panels * ((d_ffn_ + 1) / 2)) * np;
  }
  Index bf16_down_offset(Index e) const {
    Index const np = kernels::panel_width();
    Index const in_panels = (hidden_cols() + np - 1) / np;
    return bf16_in_offset(e) + in_panels * ((d_model_ + 1) / 2) * np;
  }
  Index packed_in_offset(Index e) const {
    Index const np = kernels::panel_width();
    Index const in_panels = (hidden_cols() + np - 1) / np, down_panels = (d_model_ + np - 1) / np;
    return e * (in_panels * d_model_ + down_panels * d_ffn_) * np;
  }
  Index packed_down_offset(Index e) const {
    Index const np = kernels::panel_width();
    Index const in_panels = (hidden_cols() + np - 1) / np;
    return packed_in_offset(e) + in_panels * d_model_ * np;
  }

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
  HugePageVector<float> params_;
  /// Open edit scopes; a copy of the bank starts with none.
  struct EditCount {
    int n = 0;
    EditCount() = default;
    EditCount(EditCount const&) {}
    EditCount& operator=(EditCount const&) { return *this; }
  };
  void begin_edit() {
    if (edits_.n++ == 0) {
      repack_ = pack_current_;
      pack_current_ = false;
    }
  }
  void end_edit() {
    if (--edits_.n == 0 && repack_) {
      repack_ = false;
      try {
        pack(packed_format_);
      } catch (...) {  // out of memory: stay unpacked (the layers pack per call), never throw
      }
    }
  }

  EditCount edits_;
  bool pack_current_ = false;  // the packed copy was made from the current weights
  bool repack_ = false;        // pack again when the open edits end
  WeightFormat packed_format_ = WeightFormat::kF32;
  HugePageVector<float> packed_;
  HugePageVector<std::uint32_t> packed_bf16_;
};

}  // namespace moe::experts
