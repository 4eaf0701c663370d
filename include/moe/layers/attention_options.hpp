// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// AttentionOptions: the per-call options of the attention layers (threads, batch, masks,
/// positions).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"
#include "moe/kernels/rope.hpp"

namespace moe {

/// Optional RMSNorm on q and k (after the projections and their biases, before RoPE):
/// kRmsNorm x r w (Qwen3 q_norm/k_norm, w initialised to 1); kRmsNormOnePlus x r (1 + w)
/// (Qwen3NextRMSNorm, w initialised to 0); kRmsNormUnweighted x r, no parameter (Llama 4's
/// Llama4TextL2Norm, which transformers applies after RoPE: the same up to rounding, RoPE being
/// a rotation); r = 1 / sqrt(mean x^2 + eps) over the slice that QkNormScope names.
enum class QkNorm { kNone, kRmsNorm, kRmsNormOnePlus, kRmsNormUnweighted };

/// The slice one q/k RMSNorm normalises:
/// - kPerHead: each head's d_h values, with one [d_h] weight shared by the heads (Qwen3-MoE,
///   Qwen3-Next, GLM-4.5 with use_qk_norm);
/// - kAllHeads: a token's whole query [H d_h] and whole key [KV d_h], with a weight per column
///   (q_norm [H d_h], k_norm [KV d_h]; OLMoE, MiniMax-M2). Needs the queries contiguous in
///   q_proj's output: no gate, or GateLayout::kSeparate.
enum class QkNormScope { kPerHead, kAllHeads };

/// Which key head each value head reads (R = H_v / H_k value heads share a key head):
///
/// - kGrouped: value head h reads key head h / R (transformers' repeat_interleave: the R value
///   heads of key head g are consecutive);
/// - kTiled: value head h reads key head h mod H_k (llama.cpp's GGUF files of Qwen3.5, whose
///   converter reorders the value heads "from grouped to tiled" so that ggml broadcasts the key
///   heads: file head j R' + g is transformers' head g R + j).
///
/// The order is a property of the weights (v, z, b, a rows, A_log, dt_bias, the convolution's v
/// channels and out_proj's columns all follow it): the same weights permuted from one order to
/// the other give the same layer.
enum class DeltaNetHeadOrder { kGrouped, kTiled };

/// Per-call options of GatedAttention and MoeAttention forward passes.
///
/// x [T, D] holds `batch` sequences of S = T / batch tokens each, one after the other (HF's
/// [batch, seq, hidden] flattened); attention never crosses sequences.
///   - key_mask [T]: 1 = real token, 0 = padding. Padding tokens are never attended to (their
///     keys and values are skipped by every query); their own output rows are still computed.
///     A query that sees no real key at all (e.g. a left-padded position under the causal
///     mask) gets a zero attention output. Empty: no padding.
///   - positions [T]: RoPE position of each token. Empty: its index within its sequence. The
///     causal mask always uses the index within the sequence.
struct AttentionOptions {
  ThreadPool* pool = nullptr;                   ///< null: run on the calling thread
  Index batch = 1;                              ///< sequences in x; must divide T
  std::span<std::uint8_t const> key_mask = {};  ///< [T] or empty
  std::span<Index const> positions = {};        ///< [T] or empty
};

namespace detail {
/// Throws moe::Error (who: the layer's name) unless `opt` fits x of T tokens.
inline void check_attention_options(AttentionOptions const& opt, Index T, char const* who) {
  check(opt.batch >= 1 && T % opt.batch == 0, who, ": batch = ", opt.batch, " does not divide the ",
        T, " tokens; x must hold batch sequences of equal length");
  check(opt.key_mask.empty() || static_cast<Index>(opt.key_mask.size()) == T, who,
        ": key_mask has ", opt.key_mask.size(), " entries for ", T,
        " tokens; pass one per token (1 = real, 0 = padding) or none");
  check(opt.positions.empty() || static_cast<Index>(opt.positions.size()) == T, who,
        ": positions has ", opt.positions.size(), " entries for ", T,
        " tokens; pass one per token or none");
}

/// Throws moe::Error (who: the layer's name) unless x is a valid [T, d_model] view, y [T,
/// d_model] and opt fits T tokens (check_attention_options).
inline void check_attention_call(ConstMatrixView<float> x, MatrixView<float> y, Index d_model,
                                 AttentionOptions const& opt, char const* who) {
  check(x.cols == d_model, who, ": x has ", x.cols, " columns but d_model = ", d_model,
        "; pass activations [tokens, d_model]");
  check(x.rows >= 0 && x.row_stride >= x.cols && (x.data || x.rows == 0), who,
        ": x is not a valid view (rows = ", x.rows, ", row_stride = ", x.row_stride, ")");
  check(y.rows == x.rows && y.cols == d_model && y.row_stride >= y.cols && (y.data || y.rows == 0),
        who, ": y is [", y.rows, ", ", y.cols, "] but must be [", x.rows, ", ", d_model,
        "] like x");
  check_attention_options(opt, x.rows, who);
}

/// Throws moe::Error (who: the layer's name) unless y is off (factor 0) or a valid YaRN scaling.
inline void check_yarn(kernels::RopeYarn const& y, char const* who) {
  check(y.factor == 0.0f || (y.factor > 0.0f && std::isfinite(y.factor) && y.beta_fast > 0.0f &&
                             y.beta_slow > 0.0f && std::isfinite(y.beta_fast) &&
                             std::isfinite(y.beta_slow) && y.original_max_position >= 1 &&
                             y.attention_factor >= 0.0f && std::isfinite(y.attention_factor)),
        who, ": yarn = {factor ", y.factor, ", beta_fast ", y.beta_fast, ", beta_slow ",
        y.beta_slow, ", original_max_position ", y.original_max_position, ", attention_factor ",
        y.attention_factor,
        "}; YaRN needs a finite factor > 0, positive finite betas, a context >= 1 and "
        "an attention_factor >= 0 (0: the default), or factor 0 for plain RoPE");
}

/// What a forward_train keeps of its call: x [T, D] copied into x_copy, opt.key_mask into
/// mask_copy. Returns opt with its key_mask pointing at the copy (the options backward sees).
inline AttentionOptions keep_training_input(ConstMatrixView<float> x, AttentionOptions const& opt,
                                            std::vector<float>& x_copy,
                                            std::vector<std::uint8_t>& mask_copy) {
  Index const T = x.rows, D = x.cols;
  x_copy.resize(static_cast<std::size_t>(T * D));
  for (Index t = 0; t < T; ++t) std::copy(x.row(t), x.row(t) + D, x_copy.data() + t * D);
  mask_copy.assign(opt.key_mask.begin(), opt.key_mask.end());
  AttentionOptions o = opt;
  o.key_mask = mask_copy;
  return o;
}
}  // namespace detail

}  // namespace moe
