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

/// Where ExpertBank::pack_from reads the experts of a bank that has no fp32 weights:
/// - `blocks` (optional): stored GGUF blocks, re-packed as they are (StoredBlocks);
/// - `weights(e, in, down)`: writes expert e's fp32 weights, the in projection [P, D] (GLU: gate
///   rows [0, F), then up rows [F, 2F)) to `in` when it is not null, the down projection [D, F]
///   to `down` when it is not null. pack_from asks only for what it needs (fp32 or bf16 parts,
///   quantized parts without stored blocks), one expert at a time per thread, from several
///   worker threads at once.
struct ExpertSource {
  StoredBlocks blocks;
  std::function<void(Index expert, float* in, float* down)> weights;
};

/// A scope in which the ExpertBanks constructed on this thread hold no fp32 weights (as
/// accelerate's init_empty_weights builds a model without storage): such a bank allocates only
/// its biases (enable_biases()), can have them written (an Edit before it is packed: the
/// weight views of that Edit throw), and gets its experts from pack_from() or stream_records().
/// It is inference-only from the start, like a bank after discard_master_weights(). A loader
/// builds a layer in this scope to pack each expert straight from a file, so the fp32 weights of
/// a layer (45 GB for one DeepSeek-V3 MoE layer) are never allocated. Nests; not copyable.
class EmptyWeights {
 public:
  EmptyWeights() noexcept { ++depth(); }
  ~EmptyWeights() { --depth(); }
  EmptyWeights(EmptyWeights const&) = delete;
  EmptyWeights& operator=(EmptyWeights const&) = delete;
  /// Is such a scope alive on this thread?
  static bool active() noexcept { return depth() > 0; }

 private:
  static int& depth() noexcept {
    thread_local int d = 0;
    return d;
  }
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
  /// Zero-initialised weights; none inside an EmptyWeights scope (the bank then has no fp32
  /// weights: has_master_weights() is false). Preconditions: num_experts >= 0, d_model >= 1,
  /// d_ffn >= 1.
  ExpertBank(Index num_experts, Index d_model, Index d_ffn)
      : num_experts_(num_experts), d_model_(d_model), d_ffn_(d_ffn) {
    detail::check(num_experts >= 0 && d_model >= 1 && d_ffn >= 1,
                  "ExpertBank: num_experts = ", num_experts, ", d_model = ", d_model,
                  ", d_ffn = ", d_ffn, "; sizes must be positive (num_experts may be 0)");
    if (EmptyWeights::active()) {
      masters_ = false;
      empty_ = true;
      return;
    }
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
  /// False after discard_master_weights(), and for a bank built in an EmptyWeights scope.
  bool has_master_weights() const { return masters_; }

  /// A scope for writing the weights. While any Edit of the bank is alive its packed copy is
  /// not used (packed() is false, the layers pack per call, so every write is seen) and pack()
  /// throws; when the last one ends, a bank that was packed when the first began is packed
  /// again in the same format. The views an Edit hands out are valid while it lives: a write
  /// through one after it ended is a use after scope, like a write through a dangling
  /// iterator. Not copyable; movable. `auto ed = bank.edit(); fill(ed.parameters());`
  /// A bank without fp32 weights (EmptyWeights) can be edited before it is packed: only its
  /// biases; the weight views and parameters() throw moe::Error.
  class Edit {
   public:
    explicit Edit(ExpertBank& bank) : bank_(&bank) {
      if (!(bank_->empty_ && !bank_->packed())) bank_->require_masters("edit");
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
      bank_->require_masters("Edit::in_proj");
      return {bank_->in_ptr(e), kInFactor * bank_->d_ffn_, bank_->d_model_};
    }
    MatrixView<float> gate_proj(Index e) const requires(Expert::gated) {
      bank_->require_masters("Edit::gate_proj");
      return {bank_->in_ptr(e), bank_->d_ffn_, bank_->d_model_};
    }
    MatrixView<float> up_proj(Index e) const {
      bank_->require_masters("Edit::up_proj");
      return {bank_->in_ptr(e) + (kInFactor - 1) * bank_->d_ffn_ * bank_->d_model_, bank_->d_ffn_,
              bank_->d_model_};
    }
    MatrixView<float> down_proj(Index e) const {
      bank_->require_masters("Edit::down_proj");
      return {bank_->down_ptr(e), bank_->d_model_, bank_->d_ffn_};
    }
    std::span<float> parameters() const {
      bank_->require_masters("Edit::parameters");
      return bank_->params_;
    }
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
    check_formats(formats, "ExpertBank::pack");
    // Non-finite weights in a quantized projection: one error naming the first, before any work.
    for (Index e = 0; e < num_experts_; ++e) {
      ExpertFormat const& f = formats[static_cast<std::size_t>(e)];
      bool const in_stored = stored_in(e, f.in, stored, true) != nullptr &&
                             (!Expert::gated || stored_in(e, f.in, stored, false) != nullptr);
      if (is_quantized(f.in) && !in_stored)
        scan_finite(e, in_ptr(e), hidden_cols() * d_model_, "in");
      if (is_quantized(f.down) && !stored_down(e, f.down, stored))
        scan_finite(e, down_ptr(e), d_model_ * d_ffn_, "down");
    }
    pack_records(formats, pool, stored, [&](Index e, int, bool, bool) {
      return std::pair<float const*, float const*>{in_ptr(e), down_ptr(e)};
    });
  }

  /// Packs a bank that has no fp32 weights (built in an EmptyWeights scope) from `source`: the
  /// same records pack(formats, pool, source.blocks) makes from fp32 weights equal to what
  /// source.weights writes, bit for bit, without ever holding more than one expert's fp32
  /// weights per thread (experts are packed in parallel on `pool`). The bank stays
  /// inference-only. Throws moe::Error for a bank with fp32 weights (pack() them), while an edit
  /// is open, for formats that cannot hold the shapes (as pack), for GLU experts whose fp32 or
  /// bf16 in projection would split a panel (inference reads those from fp32 weights: see
  /// pack_serves_inference; pack them quantized, or build the bank with its weights), for a
  /// source without `weights` that needs them, and for non-finite weights to be quantized
  /// (naming an expert that holds one).
  void pack_from(std::span<ExpertFormat const> formats, ExpertSource const& source,
                 ThreadPool* pool = nullptr) {
    detail::check(!masters_ || num_experts_ == 0,
                  "ExpertBank::pack_from: this bank has fp32 weights; pack() them (pack_from "
                  "fills a bank built without them, in an EmptyWeights scope)");
    detail::check(!editing(),
                  "ExpertBank::pack_from: the biases are open for writing (an Edit is alive); "
                  "let it end first");
    check_formats(formats, "ExpertBank::pack_from");
    check_inference_formats(formats, "ExpertBank::pack_from");
    masters_ = false;  // (a bank of no experts may have had them)
    empty_ = true;
    int const threads = pool ? pool->size() : 1;
    std::vector<HugePageVector<float>> scratch(static_cast<std::size_t>(threads));
    pack_records(formats, pool, source.blocks, [&](Index e, int tid, bool in, bool down) {
      return source_weights(source, formats[static_cast<std::size_t>(e)], e, in, down,
                            scratch[static_cast<std::size_t>(tid)], "ExpertBank::pack_from");
    });
  }

  /// Writes expert e's packed record (packed_record_bytes(e) bytes, in the format and layout of
  /// the current pack or of the streamed records) into `dst` (64-byte aligned), from `source`
  /// as pack_from reads it: a streamed bank's record made on demand from a model's own file.
  /// The bytes pack_from would give. Const and thread-safe (one expert's fp32 weights are
  /// allocated when a part needs them). Throws moe::Error when not packed, for an expert out
  /// of range, and as pack_from does.
  void pack_record(Index e, ExpertSource const& source, std::byte* dst) const {
    detail::check(packed() && e >= 0 && e < num_experts_, "ExpertBank::pack_record: expert ", e,
                  packed() ? " is out of range" : " of a bank that is not packed", " (a bank of ",
                  num_experts_,
                  " experts; pack it or give it its formats with "
                  "stream_records first)");
    (void)bf16_kernel();
    std::fill_n(dst, slot(e).record_bytes, std::byte{0});  // the padding, as pack() leaves it
    HugePageVector<float> scratch;
    pack_expert(e, slot(e), dst, source.blocks, [&](Index, int, bool in, bool down) {
      return source_weights(source, formats_[static_cast<std::size_t>(e)], e, in, down, scratch,
                            "ExpertBank::pack_record");
    });
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
    check_inference_formats(formats, "ExpertBank::stream_records");
    std::vector<Slot> slots = plan_records(formats);
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
  /// Stored blocks of expert e's first in operand (GLU gate, MLP up; `first`) or its up
  /// operand (GLU), or its down projection, in format f; null when f is not quantized or they
  /// are not stored.
  std::byte const* stored_in(Index e, WeightFormat f, StoredBlocks const& stored,
                             bool first) const {
    if (!stored || !is_quantized(f)) return nullptr;
    return stored(e, first && Expert::gated ? Projection::kGate : Projection::kUp, f);
  }
  std::byte const* stored_down(Index e, WeightFormat f, StoredBlocks const& stored) const {
    return stored && is_quantized(f) ? stored(e, Projection::kDown, f) : nullptr;
  }
  void scan_finite(Index e, float const* w, Index n, char const* proj) const {
    for (Index i = 0; i < n; ++i) {
      detail::check(std::isfinite(w[i]), "ExpertBank: expert ", e, "'s ", proj,
                    " projection holds ", w[i], " at flat index ", i, "; only finite weights ",
                    "can be quantized (fix the weights or pack this expert as fp32/bf16)");
    }
  }
  /// Throws for GLU experts whose fp32 or bf16 in projection would split a panel: inference
  /// reads those from the fp32 weights (pack_serves_inference), which `who` does not keep.
  void check_inference_formats(std::span<ExpertFormat const> formats, char const* who) const {
    if constexpr (Expert::gated) {
      if (d_ffn_ % kernels::panel_width() == 0) return;
      for (ExpertFormat const& f : formats) {
        detail::check(is_quantized(f.in), who, ": GLU experts of d_ffn = ", d_ffn_,
                      " (not a multiple of the panel width ", kernels::panel_width(),
                      ") read gate and up from the fp32 weights in an fp32 or bf16 pack; pack "
                      "them in a quantized format, or keep their fp32 weights");
      }
    } else {
      (void)formats;
      (void)who;
    }
  }
  /// Expert e's fp32 weights from `source` into `buf` (in, down: the parts asked for), the
  /// parts to be quantized (format f) checked finite.
  std::pair<float const*, float const*> source_weights(ExpertSource const& source,
                                                       ExpertFormat const& f, Index e, bool in,
                                                       bool down, HugePageVector<float>& buf,
                                                       char const* who) const {
    detail::check(static_cast<bool>(source.weights), who, ": expert ", e,
                  " needs fp32 weights (a format without stored blocks) and the source has "
                  "none (ExpertSource::weights)");
    Index const in_floats = hidden_cols() * d_model_, down_floats = d_model_ * d_ffn_;
    if (buf.empty()) buf.resize(static_cast<std::size_t>(in_floats + down_floats));
    float* const w_in = buf.data();
    float* const w_down = buf.data() + in_floats;
    source.weights(e, in ? w_in : nullptr, down ? w_down : nullptr);
    if (in && is_quantized(f.in)) scan_finite(e, w_in, in_floats, "in");
    if (down && is_quantized(f.down)) scan_finite(e, w_down, down_floats, "down");
    return {w_in, w_down};
  }
  /// Fills expert e's record `dst` (layout `sl`): each quantized projection from its stored
  /// blocks when `stored` has them, every other part from weights(e, thread, need_in,
  /// need_down) -> {in [P, D], down [D, F]} (only the parts asked for are read).
  template <class Weights>
  void pack_expert(Index e, Slot const& sl, std::byte* dst, StoredBlocks const& stored,
                   Weights&& weights, int tid = 0) const {
    Index const np = kernels::panel_width();
    Index const P = hidden_cols(), D = d_model_, F = d_ffn_;
    Index const in_panels = (P + np - 1) / np, down_panels = (D + np - 1) / np;
    auto pack_quant = [&](std::byte const* blocks, float const* w, Index rows, Index depth,
                          typename Slot::Part const& part) {
      quant::Format const qf = quant_format(part.format);
      std::byte* const out = dst + part.offset;
      if (blocks != nullptr) {
        kernels::pack_quant_panels(qf, blocks, rows, depth, out);
        return;
      }
      Index const rb = quant::row_bytes(qf, depth);
      std::vector<std::byte> rows_q(static_cast<std::size_t>(rows * rb));
      for (Index r = 0; r < rows; ++r) {
        quant::quantize_row(qf, w + r * depth, depth, rows_q.data() + r * rb);
      }
      kernels::pack_quant_panels(qf, rows_q.data(), rows, depth, out);
    };
    auto pack_panels = [&](float const* w, Index depth, Index cols, Index panels, WeightFormat f,
                           std::byte* out) {
      for (Index p = 0; p < panels; ++p) {
        Index const nc = std::min(np, cols - p * np);
        if (f == WeightFormat::kF32) {
          kernels::pack_panel(w, depth, p * np, nc, depth, as_f32(out) + p * depth * np);
        } else {
          kernels::pack_panel_bf16(w, depth, p * np, nc, depth,
                                   as_words(out) + p * ((depth + 1) / 2) * np);
        }
      }
    };
    bool const q_in = is_quantized(sl.in.format);
    std::byte const* const b_in = stored_in(e, sl.in.format, stored, true);
    std::byte const* const b_up =
        Expert::gated ? stored_in(e, sl.in.format, stored, false) : nullptr;
    std::byte const* const b_down = stored_down(e, sl.down.format, stored);
    bool const need_in = !q_in || b_in == nullptr || (Expert::gated && b_up == nullptr);
    bool const need_down = b_down == nullptr;
    std::pair<float const*, float const*> w{nullptr, nullptr};
    if (need_in || need_down) w = weights(e, tid, need_in, need_down);
    if (q_in) {
      pack_quant(b_in, w.first, Expert::gated ? F : P, D, sl.in);
      if constexpr (Expert::gated) {
        pack_quant(b_up, w.first == nullptr ? nullptr : w.first + F * D, F, D, sl.up);
      }
    } else {
      pack_panels(w.first, D, P, in_panels, sl.in.format, dst + sl.in.offset);
    }
    if (is_quantized(sl.down.format)) {
      pack_quant(b_down, w.second, D, F, sl.down);
    } else {
      pack_panels(w.second, F, D, down_panels, sl.down.format, dst + sl.down.offset);
    }
  }
  /// pack and pack_from: lays out the records of `formats` and fills them on `pool`, each
  /// quantized projection from its stored blocks when `stored` has them, every other part from
  /// weights(e, thread, need_in, need_down) -> {in [P, D], down [D, F]} (only the parts asked
  /// for are read).
  template <class Weights>
  void pack_records(std::span<ExpertFormat const> formats, ThreadPool* pool,
                    StoredBlocks const& stored, Weights&& weights) {
    // The process's bf16 kernel (moe::bf16_kernel()) is decided here, where allocating is fine
    // (it reads the CPU once), not in the first forward over bf16 panels; a malformed
    // MOE_BF16_KERNEL is reported here too.
    (void)bf16_kernel();
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
    parallel_for(pool, num_experts_, [&](Index e, int tid) {
      pack_expert(e, slots[static_cast<std::size_t>(e)],
                  arena_.data() + record_offsets_[static_cast<std::size_t>(e)], stored, weights,
                  tid);
    });
    slots_ = std::move(slots);
    set_formats(formats);
    pack_current_ = true;
  }
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
    if (masters_) return;
    if (empty_) {
      detail::fail("ExpertBank::", what,
                   ": the bank was built without fp32 weights (in an EmptyWeights scope, as a "
                   "loader of inference-only models does); only inference forwards over its pack "
                   "(pack_from, stream_records) run. Build it outside such a scope to read, "
                   "write, repack or train the weights");
    }
    detail::fail("ExpertBank::", what,
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
  bool masters_ = true;  // false after discard_master_weights() and for an empty bank
  bool empty_ = false;   // built in an EmptyWeights scope (never had fp32 weights)
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

// The expert banks of the preset layers (layers/presets.hpp: SwiGlu for five of them, ClampedSwiGlu
// for gpt-oss), compiled once in moe_expert_kernels (src/precompiled/layers_softmax.cpp): where
// MOE_EXTERN_EXPERT_KERNELS is defined, their members (packing, the parameter edits, the training
// panels) are declared extern, and a unit that runs a preset layer does not compile them again.
#define MOE_PRESET_EXPERT_BANKS(X) X(::moe::experts::SwiGlu) X(::moe::experts::ClampedSwiGlu)
#define MOE_EXPERT_BANK_INSTANTIATION(EXTERN, E) \
  EXTERN template class ::moe::experts::ExpertBank<E>;
#if defined(MOE_EXTERN_EXPERT_KERNELS)
#define MOE_EXPERT_BANK_EXTERN_INSTANTIATION(E) MOE_EXPERT_BANK_INSTANTIATION(extern, E)
MOE_PRESET_EXPERT_BANKS(MOE_EXPERT_BANK_EXTERN_INSTANTIATION)
#undef MOE_EXPERT_BANK_EXTERN_INSTANTIATION
#endif
