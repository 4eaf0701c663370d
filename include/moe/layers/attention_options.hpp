// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// AttentionOptions: the per-call options of the attention layers (threads, batch, masks,
/// positions).
#pragma once

#include <cstdint>
#include <span>

#include "moe/core/error.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"

namespace moe {

/// Optional RMSNorm on q and k (after the projections and their biases, before RoPE):
/// kRmsNorm x r w (Qwen3 q_norm/k_norm, w initialised to 1); kRmsNormOnePlus x r (1 + w)
/// (Qwen3NextRMSNorm, w initialised to 0); r = 1 / sqrt(mean x^2 + eps) over the slice that
/// QkNormScope names.
enum class QkNorm { kNone, kRmsNorm, kRmsNormOnePlus };

/// The slice one q/k RMSNorm normalises:
/// - kPerHead: each head's d_h values, with one [d_h] weight shared by the heads (Qwen3-MoE,
///   Qwen3-Next, GLM-4.5 with use_qk_norm);
/// - kAllHeads: a token's whole query [H d_h] and whole key [KV d_h], with a weight per column
///   (q_norm [H d_h], k_norm [KV d_h]; OLMoE, MiniMax-M2). Needs the queries contiguous in
///   q_proj's output: no gate, or GateLayout::kSeparate.
enum class QkNormScope { kPerHead, kAllHeads };

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
/// A layer's activations: x [T, d_model] a valid view, y [T, d_model] like it (moe::Error naming
/// `who`, the layer, otherwise).
inline void check_activations(ConstMatrixView<float> x, MatrixView<float> y, Index d_model,
                              char const* who) {
  check(x.cols == d_model, who, ": x has ", x.cols, " columns but d_model = ", d_model,
        "; pass activations [tokens, d_model]");
  check(x.rows >= 0 && x.row_stride >= x.cols && (x.data || x.rows == 0), who,
        ": x is not a valid view (rows = ", x.rows, ", row_stride = ", x.row_stride, ")");
  check(y.rows == x.rows && y.cols == d_model && y.row_stride >= y.cols && (y.data || y.rows == 0),
        who, ": y is [", y.rows, ", ", y.cols, "] but must be [", x.rows, ", ", d_model,
        "] like x");
}

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
}  // namespace detail

}  // namespace moe
