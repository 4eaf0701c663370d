// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ExpertBank: the weights of E experts of one policy, and the routine that runs one of them.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moe/core/concepts.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/kernels/activations.hpp"
#include "moe/kernels/dispatch.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/quant_gemm.hpp"
#include "moe/quant/matrix.hpp"

namespace moe::experts {

/// One projection of an expert: a GLU expert's gate, up and down; an MLP expert's up (its in
/// projection) and down.
enum class Projection { kGate, kUp, kDown };

/// Stored GGUF blocks that ExpertBank::pack re-packs instead of quantizing the fp32 weights:
/// stored(e, p, f) returns the rows of expert e's projection p (a GGUF tensor's rows, row r at
/// r * quant::row_bytes(quant_format(f), depth)) when they are stored in block format f and
/// encode exactly that projection's fp32 weights (the caller's promise: a loader that decoded
/// these blocks into the weights), else nullptr. Called from pack's worker threads.
using StoredBlocks = std::function<std::byte const*(Index expert, Projection p, WeightFormat f)>;

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
/// With biases (enable_biases(); gpt-oss, ERNIE 4.5 with use_bias) expert e also has
///
/// | in_bias(e)     | [P]     | added to in_proj's outputs: gate biases [0, F), up [F, 2F)     |
/// | down_bias(e)   | [D]     | added to down_proj's outputs, before the routing weight        |
///
/// `parameters()` is every weight as one flat array (all in_proj blocks, then all down_proj
/// blocks, then with biases all in_bias blocks and all down_bias blocks), for optimizers and
/// loaders. A ClampedSwiGlu bank also holds its run-time GluClamp (glu_clamp()). A bank is a value
/// type: copying it copies the weights. The layers run its experts through the routed-experts
/// engine (moe/layers/stages/); the backward's row phase (backward_rows) runs on
/// kernels::gemm_strided: in place, allocation-free, const and thread-safe for distinct output
/// buffers.
template <ExpertPolicy Expert_>
class ExpertBank {
 public:
  using Expert = Expert_;
  static constexpr Index kInFactor = Expert::gated ? 2 : 1;
  /// The alignment of every part of a packed record, and of the record's size.
  static constexpr Index kRecordAlign = 64;

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

  /// Gives every expert trainable biases (in_bias [P], down_bias [D]), zero to start: the in
  /// projection computes x W_in^T + b_in, the down projection m W_down^T + b_down (a routed
  /// expert's output is weighted after its bias, as in gpt-oss). Idempotent; throws while an
  /// edit scope is open (the flat parameters grow).
  void enable_biases() {
    detail::check(!editing(),
                  "ExpertBank::enable_biases: the weights are open for writing (an Edit or a "
                  "layer's parameters() list is alive); enable biases before taking them");
    require_masters("enable_biases");
    if (biases_) return;
    biases_ = true;
    params_.resize(
        params_.size() + static_cast<std::size_t>(num_experts_ * (hidden_cols() + d_model_)), 0.0f);
  }
  /// Do the experts have biases (enable_biases())?
  bool has_biases() const { return biases_; }
  /// Expert e's in-projection bias [P] (gate then up) and down-projection bias [D]; empty
  /// without biases.
  std::span<float const> in_bias(Index e) const {
    return biases_ ? std::span<float const>(in_bias_ptr(e), static_cast<std::size_t>(hidden_cols()))
                   : std::span<float const>();
  }
  std::span<float const> down_bias(Index e) const {
    return biases_ ? std::span<float const>(down_bias_ptr(e), static_cast<std::size_t>(d_model_))
                   : std::span<float const>();
  }
  /// The biases as the kernels read them: null without biases.
  float const* in_bias_data(Index e) const { return biases_ ? in_bias_ptr(e) : nullptr; }
  float const* down_bias_data(Index e) const { return biases_ ? down_bias_ptr(e) : nullptr; }

  /// The clamped GLU's alpha and limit (ClampedSwiGlu banks; kernels::GluClamp).
  kernels::GluClamp glu_clamp() const { return clamp_; }
  /// Sets them; throws moe::Error unless alpha is finite and > 0 and limit > 0 (+inf allowed).
  void set_glu_clamp(kernels::GluClamp c) {
    detail::check(std::isfinite(c.alpha) && c.alpha > 0.0f && c.limit > 0.0f,
                  "ExpertBank::set_glu_clamp: alpha = ", c.alpha, ", limit = ", c.limit,
                  "; alpha must be finite and > 0, limit > 0 (gpt-oss: 1.702 and swiglu_limit 7)");
    clamp_ = c;
  }

  /// Reads: const views, which never touch a packed copy. Throw moe::Error after
  /// discard_master_weights().
  ConstMatrixView<float> in_proj(Index e) const {
    require_masters("in_proj");
    return {in_ptr(e), kInFactor * d_ffn_, d_model_};
  }
  ConstMatrixView<float> gate_proj(Index e) const requires(Expert::gated) {
    require_masters("gate_proj");
    return {in_ptr(e), d_ffn_, d_model_};
  }
  ConstMatrixView<float> up_proj(Index e) const {
    require_masters("up_proj");
    return {in_ptr(e) + (kInFactor - 1) * d_ffn_ * d_model_, d_ffn_, d_model_};
  }
  ConstMatrixView<float> down_proj(Index e) const {
    require_masters("down_proj");
    return {down_ptr(e), d_model_, d_ffn_};
  }
  std::span<float const> parameters() const {
    require_masters("parameters");
    return params_;
  }

  /// Frees the fp32 weights, keeping the pack (and the biases): an inference-only bank, for a
  /// decoder that never trains. The fp32 weights are what a bf16 or quantized pack was made
  /// from, and an fp32 pack is a copy of them, so this drops 2/3 (bf16 pack), 4/5 (q8_0) or 1/2
  /// (fp32 pack) of the experts' memory. Inference forwards run as before, bit for bit.
  /// Afterwards every use of the fp32 weights throws moe::Error: reading them (in_proj, ...,
  /// parameters()), writing (edit()), repacking (pack()), training (backward_rows; a training
  /// forward over a bf16 or quantized pack). Irreversible: load the weights again to train.
  /// Preconditions (checked): packed() and no edit open.
  void discard_master_weights() {
    if (!masters_) return;
    detail::check(!editing() && packed(), "ExpertBank::discard_master_weights: the bank is ",
                  editing() ? "open for writing (an Edit is alive)" : "not packed",
                  "; pack() it (after the last write) first: the pack is what forwards read "
                  "once the fp32 weights are gone");
    detail::check(pack_serves_inference(),
                  "ExpertBank::discard_master_weights: inference forwards read the gate and up "
                  "projections from the fp32 weights, not the pack (GLU experts whose d_ffn = ",
                  d_ffn_, " is not a multiple of the panel width ", kernels::panel_width(),
                  " in an fp32 or bf16 pack); keep the weights, or pack them quantized");
    HugePageVector<float> kept;
    if (biases_) {
      kept.assign(params_.begin() + bias_base(), params_.end());
    }
    params_ = std::move(kept);
    masters_ = false;
    train_compute_ = TrainCompute::kF32;
    train_bf16_.clear();
    train_current_ = false;
  }
  /// Do inference forwards read only the pack, never the fp32 weights? True when packed(),
  /// except for GLU experts whose d_ffn is not a multiple of kernels::panel_width() with an fp32
  /// or bf16 in projection (its gate and up halves would split a panel: those run from the fp32
  /// weights).
  bool pack_serves_inference() const {
    if (!packed()) return false;
    if constexpr (Expert::gated) {
      if (d_ffn_ % kernels::panel_width() != 0) {
        for (Index e = 0; e < num_experts_; ++e) {
          if (!is_quantized(slot(e).in.format)) return false;
        }
      }
    }
    return true;
  }
  /// False after discard_master_weights().
  bool has_master_weights() const { return masters_; }

  /// A scope for writing the weights. While any Edit of the bank is alive its packed copy is
  /// not used (packed() is false, the layers pack per call, so every write is seen) and pack()
  /// throws; when the last one ends, a bank that was packed when the first began is packed
  /// again in the same format. The views an Edit hands out are valid while it lives: a write
  /// through one after it ended is a use after scope, like a write through a dangling
  /// iterator. Not copyable; movable. `auto ed = bank.edit(); fill(ed.parameters());`
  class Edit {
   public:
    explicit Edit(ExpertBank& bank) : bank_(&bank) {
      bank_->require_masters("edit");
      bank_->begin_edit();
    }
    Edit(Edit&& other) noexcept : bank_(std::exchange(other.bank_, nullptr)) {}
    Edit(Edit const&) = delete;
    Edit& operator=(Edit const&) = delete;
    Edit& operator=(Edit&&) = delete;
    ~Edit() {
      if (bank_) bank_->end_edit(nullptr);
    }
    /// Ends the scope now (if it is the last, the bank repacks and rebuilds its bf16 train
    /// panels on `pool`); the views must not be used after it. Later calls do nothing.
    void close(ThreadPool* pool = nullptr) {
      if (bank_) std::exchange(bank_, nullptr)->end_edit(pool);
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
    /// Expert e's biases (empty without biases; see ExpertBank::in_bias).
    std::span<float> in_bias(Index e) const {
      return bank_->biases_ ? std::span<float>(bank_->in_bias_ptr(e),
                                               static_cast<std::size_t>(bank_->hidden_cols()))
                            : std::span<float>();
    }
    std::span<float> down_bias(Index e) const {
      return bank_->biases_ ? std::span<float>(bank_->down_bias_ptr(e),
                                               static_cast<std::size_t>(bank_->d_model_))
                            : std::span<float>();
    }

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
    require_masters("backward_rows");
    Index const n = h.rows, F = d_ffn_;
    if (n == 0) return;
    MatrixView<float> dm(scratch, n, F);
    float* const gemm_scratch = scratch + n * F;
    auto const wd = down_proj(e), wi = in_proj(e);
    kernels::gemm_strided(n, F, d_model_, dy.data, dy.row_stride, 1, wd.data, wd.row_stride,
                          dm.data, dm.row_stride, false, gemm_scratch);
    activation_backward(h, dm, m, dh);
    kernels::gemm_strided(n, d_model_, hidden_cols(), dh.data, dh.row_stride, 1, wi.data,
                          wi.row_stride, dx.data, dx.row_stride, false, gemm_scratch);
  }
  /// The activation's VJP over n rows: from the pre-activations h [n, P] and dm [n, F] (the
  /// gradient of m), m [n, F] recomputed and dh [n, P] (fp32; both training modes).
  void activation_backward(ConstMatrixView<float> h, ConstMatrixView<float> dm, MatrixView<float> m,
                           MatrixView<float> dh) const {
    Index const F = d_ffn_;
    for (Index i = 0; i < h.rows; ++i) {
      float const* hi = h.row(i);
      if constexpr (is_clamped_glu<Expert>) {
        kernels::clamped_glu_backward(hi, hi + F, dm.row(i), m.row(i), dh.row(i), dh.row(i) + F, F,
                                      clamp_);
      } else if constexpr (Expert::gated) {
        kernels::glu_backward<Expert::activation>(hi, hi + F, dm.row(i), m.row(i), dh.row(i),
                                                  dh.row(i) + F, F);
      } else {
        kernels::activate_backward<Expert::activation>(hi, dm.row(i), m.row(i), dh.row(i), F);
      }
    }
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
  /// AVX512-BF16 dot products where available (fp32 widening otherwise); the quantized formats
  /// quantize each projection row by row into GGUF blocks (quant::quantize_row, ggml's reference
  /// quantizers) and re-pack them for the integer kernels (kernels::pack_quant_panels).
  /// Training forwards ignore a bf16 or quantized pack and use the exact fp32 weights. Reads (the
  /// const views) never touch the pack; writes go through an Edit, during which the pack is not
  /// used and after which it is rebuilt, so results never come from stale weights. Throws
  /// moe::Error while an Edit is open, for a quantized format whose blocks do not divide the
  /// projection's depth (D for in, F for down), and for non-finite weights in a quantized one.
  /// Experts are packed in parallel on `pool` when given (quantizing is the slow part: ~0.1 s
  /// per million weights for the K-quants' scale searches); the result does not depend on it.
  void pack(WeightFormat format = WeightFormat::kF32, ThreadPool* pool = nullptr) {
    std::vector<ExpertFormat> const all(static_cast<std::size_t>(num_experts_), {format, format});
    pack(all, pool);
    uniform_ = format;
  }
  /// Packs expert e's projections in formats[e] (one entry per expert): experts of different
  /// formats in one bank (mixed precision, e.g. an AlphaQ allocation) run in one forward.
  ///
  /// With `stored`, a quantized projection whose stored blocks it returns is re-packed from them
  /// (as stored: never re-quantized, the same values) instead of quantized from its fp32
  /// weights; the others are quantized as above.
  void pack(std::span<ExpertFormat const> formats, ThreadPool* pool = nullptr,
            StoredBlocks const& stored = {}) {
    require_masters("pack");
    detail::check(!editing(),
                  "ExpertBank::pack: the weights are open for writing (an ExpertBank::Edit or a "
                  "layer's parameters() list is alive); let it end first, it repacks on its own");
    // The process's bf16 kernel (moe::bf16_kernel()) is decided here, where allocating is fine
    // (it reads the CPU once), not in the first forward over bf16 panels; a malformed
    // MOE_BF16_KERNEL is reported here too.
    (void)bf16_kernel();
    check_formats(formats, "ExpertBank::pack");
    Index const np = kernels::panel_width();
    Index const P = hidden_cols(), D = d_model_, F = d_ffn_;
    Index const in_panels = (P + np - 1) / np, down_panels = (D + np - 1) / np;
    std::vector<Slot> slots = plan_records(formats);
    Index total = 0;
    for (Slot const& sl : slots) total += sl.record_bytes;
    pack_current_ = false;  // until the new pack is complete
    arena_.clear();
    external_ = nullptr;
    arena_.assign(static_cast<std::size_t>(total), std::byte{0});
    record_offsets_.resize(static_cast<std::size_t>(num_experts_));
    for (Index e = 0, at = 0; e < num_experts_; ++e) {
      record_offsets_[static_cast<std::size_t>(e)] = at;
      at += slots[static_cast<std::size_t>(e)].record_bytes;
    }
    auto record_of = [&](Index e) {
      return arena_.data() + record_offsets_[static_cast<std::size_t>(e)];
    };
    // Non-finite weights in a quantized projection: one error naming the first, before any work.
    for (Index e = 0; e < num_experts_; ++e) {
      Slot const& sl = slots[static_cast<std::size_t>(e)];
      auto scan = [&](float const* w, Index n, char const* proj) {
        for (Index i = 0; i < n; ++i) {
          detail::check(std::isfinite(w[i]), "ExpertBank::pack: expert ", e, "'s ", proj,
                        " projection holds ", w[i], " at flat index ", i, "; only finite weights ",
                        "can be quantized (fix the weights or pack this expert as fp32/bf16)");
        }
      };
      auto from_blocks = [&](Projection p, WeightFormat f) {
        return stored && is_quantized(f) && stored(e, p, f) != nullptr;
      };
      Projection const in0 = Expert::gated ? Projection::kGate : Projection::kUp;
      bool const in_stored = from_blocks(in0, sl.in.format) &&
                             (!Expert::gated || from_blocks(Projection::kUp, sl.in.format));
      if (is_quantized(sl.in.format) && !in_stored) scan(in_ptr(e), P * D, "in");
      if (is_quantized(sl.down.format) && !from_blocks(Projection::kDown, sl.down.format))
        scan(down_ptr(e), D * F, "down");
    }
    auto pack_quant = [&](Index e, Projection proj, float const* w, Index rows, Index depth,
                          typename Slot::Part const& part) {
      quant::Format const qf = quant_format(part.format);
      std::byte* const dst = record_of(e) + part.offset;
      if (std::byte const* blocks = stored ? stored(e, proj, part.format) : nullptr) {
        kernels::pack_quant_panels(qf, blocks, rows, depth, dst);
        return;
      }
      Index const rb = quant::row_bytes(qf, depth);
      std::vector<std::byte> rows_q(static_cast<std::size_t>(rows * rb));
      for (Index r = 0; r < rows; ++r) {
        quant::quantize_row(qf, w + r * depth, depth, rows_q.data() + r * rb);
      }
      kernels::pack_quant_panels(qf, rows_q.data(), rows, depth, dst);
    };
    parallel_for(pool, num_experts_, [&](Index e, int) {
      Slot const& sl = slots[static_cast<std::size_t>(e)];
      if (is_quantized(sl.in.format)) {
        pack_quant(e, Expert::gated ? Projection::kGate : Projection::kUp, in_ptr(e),
                   Expert::gated ? F : P, D, sl.in);
        if constexpr (Expert::gated) pack_quant(e, Projection::kUp, in_ptr(e) + F * D, F, D, sl.up);
      } else {
        for (Index p = 0; p < in_panels; ++p) {
          Index const nc = std::min(np, P - p * np);
          if (sl.in.format == WeightFormat::kF32) {
            kernels::pack_panel(in_ptr(e), D, p * np, nc, D,
                                as_f32(record_of(e) + sl.in.offset) + p * D * np);
          } else {
            kernels::pack_panel_bf16(
                in_ptr(e), D, p * np, nc, D,
                as_words(record_of(e) + sl.in.offset) + p * ((D + 1) / 2) * np);
          }
        }
      }
      if (is_quantized(sl.down.format)) {
        pack_quant(e, Projection::kDown, down_ptr(e), D, F, sl.down);
      } else {
        for (Index p = 0; p < down_panels; ++p) {
          Index const nc = std::min(np, D - p * np);
          if (sl.down.format == WeightFormat::kF32) {
            kernels::pack_panel(down_ptr(e), F, p * np, nc, F,
                                as_f32(record_of(e) + sl.down.offset) + p * F * np);
          } else {
            kernels::pack_panel_bf16(
                down_ptr(e), F, p * np, nc, F,
                as_words(record_of(e) + sl.down.offset) + p * ((F + 1) / 2) * np);
          }
        }
      }
    });
    slots_ = std::move(slots);
    set_formats(formats);
    pack_current_ = true;
  }
  /// The format of a pack that used one format everywhere (kF32 before any pack; for a mixed
  /// pack, the format of expert 0's in projection: see packed_formats()).
  WeightFormat packed_format() const {
    return uniform_ ? *uniform_ : (formats_.empty() ? WeightFormat::kF32 : formats_[0].in);
  }
  /// The formats of the last pack, one per expert (empty before any pack).
  std::span<ExpertFormat const> packed_formats() const { return formats_; }
  /// Does the current pack hold any bf16 / quantized projection?
  bool packed_bf16_any() const { return packed() && any_format(WeightFormat::kBf16); }
  bool packed_quant_any() const {
    return packed() && std::any_of(slots_.begin(), slots_.end(), [](Slot const& sl) {
             return is_quantized(sl.in.format) || is_quantized(sl.down.format);
           });
  }
  /// Expert e's bf16 panels ([D or F pairs, NP] words, in then down), or null when not current
  /// or not bf16.
  std::uint32_t const* packed_in_bf16(Index e) const {
    return part_is(e, &Slot::in, WeightFormat::kBf16) ? as_words(record(e) + slot(e).in.offset)
                                                      : nullptr;
  }
  std::uint32_t const* packed_down_bf16(Index e) const {
    return part_is(e, &Slot::down, WeightFormat::kBf16) ? as_words(record(e) + slot(e).down.offset)
                                                        : nullptr;
  }
  /// Expert e's quantized in projection as the integer kernels read it (GLU: gate, up; MLP: up,
  /// none), or {} when not current or not quantized.
  std::array<kernels::QuantWeights, 2> packed_in_quant(Index e) const {
    std::array<kernels::QuantWeights, 2> q{};
    if (!packed() || e >= static_cast<Index>(slots_.size()) || !is_quantized(slot(e).in.format))
      return q;
    q[0] = quant_weights(e, slot(e).in);
    if constexpr (Expert::gated) q[1] = quant_weights(e, slot(e).up);
    return q;
  }
  std::array<kernels::QuantWeights, 2> packed_down_quant(Index e) const {
    std::array<kernels::QuantWeights, 2> q{};
    if (!packed() || e >= static_cast<Index>(slots_.size()) || !is_quantized(slot(e).down.format))
      return q;
    q[0] = quant_weights(e, slot(e).down);
    return q;
  }
  /// Bytes the current pack stores for expert e's projections (what a forward streams).
  Index packed_bytes(Index e) const {
    if (!packed()) return 0;
    Slot const& s = slot(e);
    return s.in.bytes + s.down.bytes + (is_quantized(s.in.format) ? s.up.bytes : 0);
  }
  /// Expert e's packed record: every byte a forward reads of its projections (parts 64-byte
  /// aligned, padded to a multiple of 64 bytes), as a streamed store keeps it. Empty when not
  /// packed. For a bank whose records are streamed, the record must be resident.
  std::span<std::byte const> packed_record(Index e) const {
    if (!packed()) return {};
    return {record(e), static_cast<std::size_t>(slot(e).record_bytes)};
  }
  /// The size of packed_record(e) (also for a streamed bank, resident or not; 0 unpacked).
  Index packed_record_bytes(Index e) const { return packed() ? slot(e).record_bytes : 0; }
  /// The size expert e's record would have packed in `f` (the same layout as pack's).
  Index record_bytes_for(ExpertFormat f) const {
    std::vector<ExpertFormat> const one(static_cast<std::size_t>(num_experts_), f);
    return num_experts_ == 0 ? 0 : plan_records(one).front().record_bytes;
  }

  /// Makes this an inference-only bank whose packed records live elsewhere: expert e's record
  /// (the layout pack(formats) would give it: packed_record_bytes(e) bytes, 64-byte aligned) is
  /// read from `records[e]` whenever a forward runs that expert, and must be there by then (a
  /// null entry throws moe::Error naming the expert). The table is the caller's (an expert
  /// store that fills it as experts become resident) and must outlive the bank's forwards. The
  /// bank's own pack and fp32 weights are freed (the biases stay). Throws moe::Error for
  /// formats that cannot hold the shapes, for GLU experts whose fp32/bf16 in projection would
  /// split a panel (pack_serves_inference), and while an edit is open. Irreversible, like
  /// discard_master_weights().
  void stream_records(std::span<ExpertFormat const> formats, std::byte const* const* records) {
    detail::check(!editing(),
                  "ExpertBank::stream_records: the weights are open for writing (an Edit is "
                  "alive); let it end first");
    detail::check(records != nullptr || num_experts_ == 0,
                  "ExpertBank::stream_records: the record table is null");
    check_formats(formats, "ExpertBank::stream_records");
    std::vector<Slot> slots = plan_records(formats);
    if constexpr (Expert::gated) {
      if (d_ffn_ % kernels::panel_width() != 0) {
        for (Slot const& sl : slots) {
          detail::check(is_quantized(sl.in.format), "ExpertBank::stream_records: GLU experts of ",
                        "d_ffn = ", d_ffn_, " (not a multiple of the panel width ",
                        kernels::panel_width(), ") read gate and up from the fp32 weights in an ",
                        "fp32 or bf16 pack; stream them in a quantized format");
        }
      }
    }
    HugePageVector<float> kept;
    if (biases_) kept.assign(params_.begin() + bias_base(), params_.end());
    params_ = std::move(kept);
    masters_ = false;
    train_compute_ = TrainCompute::kF32;
    train_bf16_.clear();
    train_current_ = false;
    arena_ = {};
    record_offsets_.clear();
    external_ = records;
    slots_ = std::move(slots);
    set_formats(formats);
    pack_current_ = true;
  }
  /// Are the records streamed (stream_records)?
  bool records_streamed() const { return external_ != nullptr; }

  /// Sets the arithmetic of training forwards and backwards over this bank. kBf16 (opt-in):
  /// every expert product of a training step, forward (x W_in^T, m W_down^T), backward
  /// (dM = dY W_down, dX = dH W_in) and weight gradients (dW_in += dH^T X, dW_down += dY^T m),
  /// multiplies bf16 operands (round to nearest even; activations and gradients as
  /// kernels::round_bf16_activation) and accumulates in fp32, on the CPU's bf16 unit (AMX tiles,
  /// AVX512-BF16, or fp32 FMAs on widened bf16: moe::bf16_kernel()). The fp32 weights stay the
  /// master copy the optimizer updates (parameters(), edit()) and the gradients are fp32; the
  /// bank keeps bf16 copies of the weights for these products (train panels: the in and down
  /// projections in both orientations, half the bytes of the fp32 weights), made here and
  /// again whenever an edit scope ends. Activation functions, their VJPs, biases, the router and
  /// the balance losses stay fp32. Inference forwards are unchanged (they read pack()).
  /// Every layer that trains a bank (MoeFfn, ExpertParallelMoeFfn, MoeAttention) rounds its
  /// expert inputs and hidden activations to bf16 in its training forward when the bank is in
  /// this mode. Throws while an edit scope is open, and after
  /// discard_master_weights(). kF32 drops the train panels.
  void set_train_compute(TrainCompute c, ThreadPool* pool = nullptr) {
    detail::check(!editing(),
                  "ExpertBank::set_train_compute: the weights are open for writing (an Edit or a "
                  "layer's parameters() list is alive); let it end first");
    require_masters("set_train_compute");
    train_compute_ = c;
    train_bf16_.clear();
    train_current_ = false;
    if (c == TrainCompute::kBf16) build_train_panels(pool);
  }
  TrainCompute train_compute() const { return train_compute_; }
  /// Are the bf16 train panels present and made from the current weights (kBf16, no edit open)?
  bool train_panels_current() const { return train_current_; }
  /// Expert e's bf16 train panels (null unless train_panels_current()): the forward's in
  /// projection, operand o (GLU: 0 gate, 1 up; each ceil(F / NP) panels of depth D, so gate and
  /// up never share a panel), its down projection (ceil(D / NP) panels of depth F), and the
  /// backward's W_in read as [P, D] (ceil(D / NP) panels of depth P: dX = dH W_in) and W_down
  /// read as [D, F] (ceil(F / NP) panels of depth D: dM = dY W_down), in the layout of
  /// kernels::pack_panel_bf16.
  std::uint32_t const* train_in_bf16(Index e, int o) const {
    return train_at(e, o * train_in_words());
  }
  std::uint32_t const* train_down_bf16(Index e) const {
    return train_at(e, kInFactor * train_in_words());
  }
  std::uint32_t const* train_in_t_bf16(Index e) const {
    return train_at(e, kInFactor * train_in_words() + train_down_words());
  }
  std::uint32_t const* train_down_t_bf16(Index e) const {
    return train_at(e, kInFactor * train_in_words() + train_down_words() + train_in_t_words());
  }

  /// Is the packed copy present and made from the current weights? (A bank of no experts, as an
  /// expert-parallel rank may hold, is packed once pack() has run, though it stores nothing.)
  bool packed() const { return pack_current_; }
  /// First panel of expert e's in projection ([D, NP] panels, contiguous), or null if not packed
  /// as fp32.
  float const* packed_in(Index e) const {
    return part_is(e, &Slot::in, WeightFormat::kF32) ? as_f32(record(e) + slot(e).in.offset)
                                                     : nullptr;
  }
  /// First panel of expert e's down projection ([F, NP] panels, contiguous), or null.
  float const* packed_down(Index e) const {
    return part_is(e, &Slot::down, WeightFormat::kF32) ? as_f32(record(e) + slot(e).down.offset)
                                                       : nullptr;
  }

 private:
  /// Where the pack keeps one expert's projections: the format and offset of each part (in; up,
  /// the second operand of a quantized GLU in projection; down), in floats, words or bytes of
  /// that format's storage.
  struct Slot {
    struct Part {
      WeightFormat format = WeightFormat::kF32;
      Index offset = 0;       // bytes from the record's start (a multiple of kRecordAlign)
      Index bytes = 0;        // the part's bytes (without the padding after it)
      Index panel_bytes = 0;  // quantized parts
    };
    Part in, up, down;
    Index record_bytes = 0;  // the whole record (parts and padding; a multiple of kRecordAlign)
  };
  /// Throws unless every quantized projection's blocks divide its depth (D for in, F for down).
  void check_formats(std::span<ExpertFormat const> formats, char const* who) const {
    detail::check(static_cast<Index>(formats.size()) == num_experts_, who, ": ", formats.size(),
                  " formats for ", num_experts_, " experts; give one per expert");
    for (Index e = 0; e < num_experts_; ++e) {
      ExpertFormat const& f = formats[static_cast<std::size_t>(e)];
      if (is_quantized(f.in)) {
        Index const blk = quant::block_elems(quant_format(f.in));
        detail::check(d_model_ % blk == 0, who, ": expert ", e,
                      "'s in projection has depth d_model = ", d_model_, ", not a multiple of ",
                      blk, " as ", name(f.in), " blocks need; pack it as one of ",
                      formats_holding(fallback_format(f.in), d_model_),
                      " (resolve_format picks the first)");
      }
      if (is_quantized(f.down)) {
        Index const blk = quant::block_elems(quant_format(f.down));
        detail::check(
            d_ffn_ % blk == 0, who, ": expert ", e, "'s down projection has depth d_ffn = ", d_ffn_,
            ", not a multiple of ", blk, " as ", name(f.down), " blocks need; pack it as one of ",
            formats_holding(fallback_format(f.down), d_ffn_), " (resolve_format picks the first)");
      }
    }
  }
  /// The record layout of a pack in `formats`: per expert its parts (in, up for a quantized GLU,
  /// down), each at a 64-byte aligned offset, and the record's size (a multiple of 64).
  std::vector<Slot> plan_records(std::span<ExpertFormat const> formats) const {
    Index const np = kernels::panel_width();
    Index const P = hidden_cols(), D = d_model_, F = d_ffn_;
    Index const in_panels = (P + np - 1) / np, down_panels = (D + np - 1) / np;
    std::vector<Slot> slots(static_cast<std::size_t>(num_experts_));
    for (Index e = 0; e < num_experts_; ++e) {
      ExpertFormat const& f = formats[static_cast<std::size_t>(e)];
      Slot& sl = slots[static_cast<std::size_t>(e)];
      Index at = 0;
      auto place = [&](WeightFormat wf, Index rows, Index depth, Index panels,
                       typename Slot::Part& part) {
        part.format = wf;
        part.offset = at;
        Index bytes = 0;
        if (wf == WeightFormat::kF32) {
          bytes = panels * depth * np * 4;
        } else if (wf == WeightFormat::kBf16) {
          bytes = panels * ((depth + 1) / 2) * np * 4;
        } else {
          part.panel_bytes = kernels::quant_panel_bytes(quant_format(wf), depth);
          bytes =
              (rows + kernels::kQuantPanelCols - 1) / kernels::kQuantPanelCols * part.panel_bytes;
        }
        part.bytes = bytes;
        at += (bytes + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
      };
      if (is_quantized(f.in)) {
        // GLU: gate and up are two operands of F rows each; MLP: one of F rows.
        place(f.in, Expert::gated ? F : P, D, 0, sl.in);
        if constexpr (Expert::gated) place(f.in, F, D, 0, sl.up);
      } else {
        place(f.in, P, D, in_panels, sl.in);
      }
      place(f.down, D, F, down_panels, sl.down);
      sl.record_bytes = std::max<Index>(at, kRecordAlign);
    }
    return slots;
  }
  std::byte const* record(Index e) const {
    if (external_ == nullptr) return arena_.data() + record_offsets_[static_cast<std::size_t>(e)];
    std::byte const* r = external_[e];
    detail::check(r != nullptr, "ExpertBank: expert ", e,
                  "'s packed record is not resident (a bank whose records are streamed: the "
                  "expert store must make the routed experts resident before a forward reads "
                  "them)");
    return r;
  }
  static float const* as_f32(std::byte const* p) { return reinterpret_cast<float const*>(p); }
  static float* as_f32(std::byte* p) { return reinterpret_cast<float*>(p); }
  static std::uint32_t const* as_words(std::byte const* p) {
    return reinterpret_cast<std::uint32_t const*>(p);
  }
  static std::uint32_t* as_words(std::byte* p) { return reinterpret_cast<std::uint32_t*>(p); }
  bool any_format(WeightFormat f) const {
    return std::any_of(slots_.begin(), slots_.end(),
                       [&](Slot const& sl) { return sl.in.format == f || sl.down.format == f; });
  }
  void set_formats(std::span<ExpertFormat const> formats) {
    formats_.assign(formats.begin(), formats.end());
    uniform_.reset();
    if (!formats_.empty() &&
        std::all_of(formats_.begin(), formats_.end(), [&](ExpertFormat const& f) {
          return f.in == formats_[0].in && f.down == formats_[0].in;
        })) {
      uniform_ = formats_[0].in;
    }
  }
  Slot const& slot(Index e) const { return slots_[static_cast<std::size_t>(e)]; }
  bool part_is(Index e, typename Slot::Part Slot::*part, WeightFormat f) const {
    return packed() && e < static_cast<Index>(slots_.size()) && (slot(e).*part).format == f;
  }
  kernels::QuantWeights quant_weights(Index e, typename Slot::Part const& p) const {
    return {record(e) + p.offset, quant_format(p.format), p.panel_bytes};
  }

  float* in_ptr(Index e) { return params_.data() + e * kInFactor * d_ffn_ * d_model_; }
  float const* in_ptr(Index e) const { return params_.data() + e * kInFactor * d_ffn_ * d_model_; }
  float* down_ptr(Index e) {
    return params_.data() + num_experts_ * kInFactor * d_ffn_ * d_model_ + e * d_model_ * d_ffn_;
  }
  float const* down_ptr(Index e) const {
    return params_.data() + num_experts_ * kInFactor * d_ffn_ * d_model_ + e * d_model_ * d_ffn_;
  }
  /// The biases' offset in params_ (which holds only them after discard_master_weights).
  Index bias_base() const {
    return masters_ ? num_experts_ * (kInFactor + 1) * d_ffn_ * d_model_ : 0;
  }
  void require_masters(char const* what) const {
    detail::check(masters_, "ExpertBank::", what,
                  ": the fp32 expert weights were discarded (discard_master_weights(), as an "
                  "inference-only decoder does); only inference forwards over the pack run. Load "
                  "the weights again to read, write, repack or train them");
  }
  // Words of one expert's train panels (see train_in_bf16).
  Index train_in_words() const {
    Index const np = kernels::panel_width();
    return (d_ffn_ + np - 1) / np * ((d_model_ + 1) / 2) * np;
  }
  Index train_down_words() const {
    Index const np = kernels::panel_width();
    return (d_model_ + np - 1) / np * ((d_ffn_ + 1) / 2) * np;
  }
  Index train_in_t_words() const {
    Index const np = kernels::panel_width();
    return (d_model_ + np - 1) / np * ((hidden_cols() + 1) / 2) * np;
  }
  Index train_down_t_words() const { return train_in_words(); }
  Index train_expert_words() const {
    return kInFactor * train_in_words() + train_down_words() + train_in_t_words() +
           train_down_t_words();
  }
  std::uint32_t const* train_at(Index e, Index offset) const {
    return train_current_ ? train_bf16_.data() + e * train_expert_words() + offset : nullptr;
  }
  /// Rounds every expert's weights into the train panels (see set_train_compute).
  void build_train_panels(ThreadPool* pool) {
    Index const np = kernels::panel_width(), D = d_model_, F = d_ffn_, P = hidden_cols();
    Index const words = train_expert_words();
    train_bf16_.assign(static_cast<std::size_t>(num_experts_ * words), 0u);
    parallel_for(pool, num_experts_, [&](Index e, int) {
      std::uint32_t* dst = train_bf16_.data() + e * words;
      Index const kpD = (D + 1) / 2, kpF = (F + 1) / 2;
      for (Index o = 0; o < kInFactor; ++o) {
        for (Index p = 0; p * np < F; ++p) {
          kernels::pack_panel_bf16(in_ptr(e) + o * F * D, D, p * np, std::min(np, F - p * np), D,
                                   dst + p * kpD * np);
        }
        dst += train_in_words();
      }
      for (Index p = 0; p * np < D; ++p) {
        kernels::pack_panel_bf16(down_ptr(e), F, p * np, std::min(np, D - p * np), F,
                                 dst + p * kpF * np);
      }
      dst += train_down_words();
      kernels::pack_panels_bf16_t(in_ptr(e), D, D, P, dst, false);
      dst += train_in_t_words();
      kernels::pack_panels_bf16_t(down_ptr(e), F, F, D, dst, false);
    });
    train_current_ = true;
  }

  float* in_bias_ptr(Index e) { return params_.data() + bias_base() + e * hidden_cols(); }
  float const* in_bias_ptr(Index e) const {
    return params_.data() + bias_base() + e * hidden_cols();
  }
  float* down_bias_ptr(Index e) {
    return params_.data() + bias_base() + num_experts_ * hidden_cols() + e * d_model_;
  }
  float const* down_bias_ptr(Index e) const {
    return params_.data() + bias_base() + num_experts_ * hidden_cols() + e * d_model_;
  }

  Index num_experts_ = 0;
  Index d_model_ = 0;
  Index d_ffn_ = 0;
  bool biases_ = false;
  bool masters_ = true;  // false after discard_master_weights()
  kernels::GluClamp clamp_{};
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
      train_current_ = false;
    }
  }
  void end_edit(ThreadPool* pool) {
    if (edits_.n == 1 && train_compute_ == TrainCompute::kBf16) {
      try {
        build_train_panels(pool);
      } catch (...) {  // out of memory: stale panels stay unused (a bf16 training forward throws)
        train_bf16_.clear();
      }
    }
    if (--edits_.n == 0 && repack_) {
      repack_ = false;
      try {
        std::vector<ExpertFormat> const formats = formats_;
        auto const uniform = uniform_;
        pack(formats, pool);
        uniform_ = uniform;
      } catch (...) {  // out of memory: stay unpacked (the layers pack per call), never throw
      }
    }
  }

  EditCount edits_;
  bool pack_current_ = false;  // the packed copy was made from the current weights
  bool repack_ = false;        // pack again when the open edits end
  std::vector<Slot> slots_;
  std::vector<ExpertFormat> formats_;
  std::optional<WeightFormat> uniform_;
  /// The pack: expert e's record (its parts, each 64-byte aligned) at arena_ + record_offsets_[e],
  /// or at external_[e] for a bank whose records live elsewhere (stream_records).
  HugePageVector<std::byte> arena_;
  std::vector<Index> record_offsets_;
  std::byte const* const* external_ = nullptr;
  TrainCompute train_compute_ = TrainCompute::kF32;
  bool train_current_ = false;                // train_bf16_ made from the current weights
  HugePageVector<std::uint32_t> train_bf16_;  // set_train_compute(kBf16): see train_in_bf16
};

}  // namespace moe::experts
