// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GatedAttention: multi-head / grouped-query attention with the head-specific sigmoid output
/// gate of "Gated Attention for LLMs" (Qiu et al. 2025) and Qwen3-Next, forward and backward.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/in_use.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/gating/sdpa_gate.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/rms_norm.hpp"
#include "moe/kernels/rope.hpp"
#include "moe/kernels/sdpa.hpp"
#include "moe/layers/attention_options.hpp"
#include "moe/layers/kv_cache.hpp"
#include "moe/layers/linear.hpp"
#include "moe/layers/stages/work.hpp"

namespace moe {

/// Where the gate projection W_g lives (ALGORITHMS.md section 2). With a gate of width w per
/// head (1 headwise, head_dim elementwise), G = num_heads / num_kv_heads, the rows of q_proj are:
///
/// - kSeparate: [H d_h] queries, head-major; W_g is its own [H w, D] matrix.
/// - kPackedPerKvGroup: per KV group g, [queries of heads gG .. gG+G-1 (G d_h) | their gates
///   (G w)] (qiuzh20/gated_attention Qwen3Attention: view(n_kv, -1), split).
/// - kPackedPerHead: per query head h, [query_h (d_h) | gate_h (w)] (HF Qwen3NextAttention:
///   view(-1, 2 d_h), chunk; elementwise there).
///
/// Without a gate (gating::NoGate) the three layouts coincide.
enum class GateLayout { kSeparate, kPackedPerKvGroup, kPackedPerHead };

/// Sizes and options of a GatedAttention layer (run-time values).
struct GatedAttentionConfig {
  Index d_model = 0;       ///< D
  Index num_heads = 1;     ///< H query heads
  Index num_kv_heads = 1;  ///< KV heads; must divide H (H == KV: multi-head, 1: multi-query)
  Index head_dim = 0;      ///< d_h
  GateLayout gate_layout = GateLayout::kSeparate;
  QkNorm qk_norm = QkNorm::kNone;
  float norm_eps = 1e-6f;       ///< finite, > 0 (with qk_norm)
  bool rope = false;            ///< rotate-half RoPE on q and k
  float rope_theta = 10000.0f;  ///< RoPE base: finite, >= 1
  Index rotary_dim = 0;         ///< rotated dims per head (even); 0 = head_dim (Qwen3-Next: 64)
  float scale = 0.0f;           ///< softmax scale, finite and > 0; 0 = 1 / sqrt(head_dim)
  bool causal = true;
  /// Sliding-window attention (causal only): a query sees the last `sliding_window` positions,
  /// itself included (gpt-oss: 128 on its sliding layers). 0: the whole causal prefix.
  Index sliding_window = 0;
  /// A learned sink logit per head, added to every softmax's denominator (gpt-oss
  /// self_attn.sinks [H]; parameter "sinks", initialised to 0).
  bool sinks = false;
  // Added after the fields above so that positional initialisers written for them still work.
  QkNormScope qk_norm_scope = QkNormScope::kPerHead;  ///< the slice a q/k norm covers
  /// Biases on q_proj, k_proj and v_proj (Qwen2-MoE, GLM-4.5 attention_bias): parameters
  /// "q_proj.bias" [q_proj rows], "k_proj.bias" and "v_proj.bias" [KV d_h], initialised to 0.
  /// A separate gate_proj has none.
  bool qkv_bias = false;
  bool o_bias = false;  ///< a bias on o_proj: "o_proj.bias" [D] (gpt-oss), 0 at first
  /// YaRN scaling of the RoPE frequencies (with rope; gpt-oss): factor 0 = off.
  kernels::RopeYarn yarn = {};
  /// RoPE on the pairs (2i, 2i + 1) (GPT-J style: GLM-4, ERNIE 4.5) instead of (i, i + r / 2).
  bool rope_interleaved = false;
  /// Chunked attention (causal only; Llama 4's attention_chunk_size on its RoPE layers): a query
  /// at position p sees the keys at positions [C floor(p / C), p], C = attention_chunk. 0: none.
  Index attention_chunk = 0;
  /// Llama 3 scaling of the RoPE frequencies (with rope; rope_type "llama3", Llama 4 Scout):
  /// factor 0 = off. Not with yarn.
  kernels::RopeLlama3 llama3 = {};
  /// Attention temperature tuning (Llama 4's NoPE layers, attn_temperature_tuning): the queries
  /// of the token at position p are multiplied by 1 + temperature_scale log(1 + floor((p + 1) /
  /// temperature_floor)) after their norm and RoPE. temperature_floor 0: off.
  Index temperature_floor = 0;
  float temperature_scale = 0.0f;
  /// Per-frequency divisors of the RoPE frequencies (with rope; llama.cpp's rope_freqs tensor,
  /// [rotary_dim / 2], finite and > 0): frequency i is theta^(-2i/rotary_dim) / factor_i. Empty:
  /// none. Not with yarn or llama3 (a GGUF file's Llama 3 scaling arrives as these factors).
  std::vector<float> rope_freq_factors = {};
};

/// The formats of an attention layer's packed projections (GatedAttention::pack_weights): q
/// (and a gate projection), k, v and o. One format converts to all four.
struct AttentionFormats {
  experts::WeightFormat q = experts::WeightFormat::kF32, k = experts::WeightFormat::kF32,
                        v = experts::WeightFormat::kF32, o = experts::WeightFormat::kF32;
  AttentionFormats() = default;
  AttentionFormats(experts::WeightFormat all) : q(all), k(all), v(all), o(all) {}  // NOLINT
  AttentionFormats(experts::WeightFormat q_, experts::WeightFormat k_, experts::WeightFormat v_,
                   experts::WeightFormat o_)
      : q(q_), k(k_), v(v_), o(o_) {}
  bool operator==(AttentionFormats const&) const = default;
};

/// What a GatedAttention call writes besides its output, and what forward_train keeps for
/// backward (see GatedAttention). Reused across calls: it grows to the largest call and then
/// allocates nothing, forward or backward.
struct GatedAttentionWorkspace {
  std::vector<float> qg;          ///< [T, P] q_proj (+ gate_proj) output: queries, gate logits
  std::vector<float> k_raw;       ///< [T, KV d_h] k_proj output (before norm / RoPE)
  std::vector<float> v;           ///< [T, KV d_h] values
  std::vector<float> q;           ///< [T, H d_h] queries after norm and RoPE
  std::vector<float> k;           ///< [T, KV d_h] keys after norm and RoPE
  std::vector<float> attn;        ///< [T, H d_h] SDPA output A
  std::vector<float> gate;        ///< [T, H w] sigmoid gates s
  std::vector<float> gated;       ///< [T, H d_h] A * s, the input of o_proj (gated layers only)
  std::vector<float> lse;         ///< [batch, H, S] row logsumexp of the SDPA (training)
  std::vector<float> rstd_q;      ///< [T, H] RMSNorm 1/rms of each query head
  std::vector<float> rstd_k;      ///< [T, KV]
  std::vector<float> rope_cos;    ///< [T, rotary_dim / 2]
  std::vector<float> rope_sin;    ///< [T, rotary_dim / 2]
  std::vector<float> q_temp;      ///< [T] the queries' temperature factors (training, tuning)
  std::vector<float> scratch;     ///< per-thread SDPA scratch
  stages::ProjectionQueue queue;  ///< the projections, on the engine of the experts
  InUse in_use;       ///< a call holds it: a second, overlapping call on this workspace throws
  LinearInput input;  ///< a projection's input rows (int8 rows for quantized packs)
  stages::GradTasks grad_tasks;        ///< backward weight-gradient items, reused across calls
  stages::ThreadScratch grad_scratch;  ///< per-thread scratch of the weight gradients

  // Training only (forward_train fills, backward reads).
  std::vector<float> x;                ///< [T, D] copy of the input
  std::vector<std::uint8_t> key_mask;  ///< [T] or empty
  Index batch = 1;
  std::vector<float> dgated;        ///< [T, H d_h] dL/d(o_proj input), then dL/dA
  std::vector<float> dgate;         ///< [T, H w] dL/d(gate logits)
  std::vector<float> dqg;           ///< [T, P]
  std::vector<float> dq;            ///< [T, H d_h]
  std::vector<float> dk;            ///< [T, KV d_h]
  std::vector<float> dv;            ///< [T, KV d_h]
  std::vector<float> dk_heads;      ///< [batch, H, S, d_h] per-query-head dK (GQA only)
  std::vector<float> dv_heads;      ///< [batch, H, S, d_h]
  std::vector<float> dk_raw;        ///< [T, KV d_h]
  std::vector<float> delta;         ///< [batch, H, S]
  std::vector<float> norm_partial;  ///< [token tiles, 2 d_h] q/k norm weight gradients
  std::vector<float> sink_partial;  ///< [batch, H] dL/d(sink) per sequence and head
  /// Which layer's forward_train filled the training fields, for what shapes (empty: none since
  /// the last backward); backward checks it.
  stages::Stamp stamp;

  // forward_cached only.
  std::vector<Index> row_seq;    ///< [T] sequence of each new row
  std::vector<Index> row_pos;    ///< [T] its position in that sequence
  std::vector<Index> seq_row0;   ///< [sequences + 1] first new row of each sequence
  std::vector<Index> group_pos;  ///< [sequences, G] the position of a 1-token step, per head
};

/// Multi-head / grouped-query attention with a head-specific sigmoid output gate:
///
///   [Q | gamma] = x W_q^T (+ b_q) (packed) or Q = x W_q^T (+ b_q), gamma = x W_g^T (separate)
///   K = x W_k^T (+ b_k), V = x W_v^T (+ b_v);
///   Q, K <- RoPE(RMSNorm(Q)), RoPE(RMSNorm(K)) (norm optional: per head or over all heads,
///           weighted or not; RoPE optional (off: a NoPE layer), plain, YaRN- or Llama 3-scaled)
///   Q_t <- Q_t tau(p_t)  (temperature tuning: tau(p) = 1 + a log(1 + floor((p + 1) / f)))
///   A_h = softmax(Q_h K_{g(h)}^T * scale + mask) V_{g(h)},   g(h) = h / (H / KV)
///         (mask: causal, padding, with sliding_window W the keys before pos - W + 1, with
///         attention_chunk C the keys before C floor(pos / C); with sinks the softmax
///         denominator also sums exp(z_h), z_h the head's sink logit)
///   O = A * sigmoid(gamma)   (per head: broadcast headwise, elementwise; O = A without a gate)
///   y = O W_o^T (+ b_o)
///
/// \tparam Gate_ an SdpaGatePolicy: gating::NoGate, gating::HeadwiseGate, gating::ElementwiseGate
///
/// | parameter          | shape                                  | HF name                  |
/// |--------------------|----------------------------------------|--------------------------|
/// | q_proj()           | [H d_h (+ H w if packed), D]           | q_proj.weight            |
/// | gate_proj()        | [H w, D] (kSeparate only)              | (separate W_g)           |
/// | k_proj(), v_proj() | [KV d_h, D]                            | k_proj / v_proj.weight   |
/// | o_proj()           | [D, H d_h]                             | o_proj.weight            |
/// | q_norm(), k_norm() | [d_h]; all heads: [H d_h], [KV d_h]    | q_norm / k_norm.weight   |
/// | q_bias()           | [H d_h (+ H w if packed)] (qkv_bias)   | q_proj.bias              |
/// | k_bias(), v_bias() | [KV d_h] (qkv_bias)                    | k_proj / v_proj.bias     |
/// | o_bias()           | [D] (o_bias)                           | o_proj.bias              |
/// | sinks()            | [H] (with sinks)                       | sinks (gpt-oss)          |
///
/// Biases are off by default (Qwen3 / Qwen3-Next attention_bias = false). Inputs x, y [T, D]
/// row-major holding `opt.batch` sequences (see AttentionOptions for masks and positions); y may be
/// x. Preconditions (moe::Error otherwise): KV divides H, sizes >= 1, rotary_dim even and <= d_h,
/// x.cols == D, y [T, D], batch divides T, key_mask and positions empty or [T].
///
/// The SDPA never materialises a T x T matrix (kernels::sdpa_forward, blocked online softmax).
/// Threads: projections split by output columns, SDPA by (sequence, head, 64-query chunk),
/// elementwise work by 64-token tiles; results are bitwise identical for any pool size.
/// Cost (FLOP): 2 T D (P + 2 KV d_h) + 2 T H d_h D for the projections, plus 4 d_h per visible
/// (query, key) pair and head for the SDPA (2 S (S + 1) d_h per head and sequence when causal).
///
/// Training: forward_train keeps in the workspace x, the projections (q, gate logits, k, v
/// before and after norm / RoPE), the RMSNorm factors, the SDPA output A and its row
/// logsumexp [batch, H, S], the gates s and A * s; backward recomputes the attention
/// probabilities block by block from the logsumexp (FlashAttention-2) and returns dx and the
/// parameter gradients (accumulated, laid out like parameters()).
template <gating::SdpaGatePolicy Gate_ = gating::NoGate>
class GatedAttention {
 public:
  using Gate = Gate_;
  static constexpr bool gated = Gate::kind != gating::GateKind::kNone;
  /// Token rows per elementwise work item.
  static constexpr Index kTileRows = 64;

  /// Every trainable buffer of the layer (and, as Gradients, of its gradient). The projections
  /// live on 2 MiB pages (HugePageAllocator): a decode step streams all of them for one token.
  struct Parameters {
    HugePageVector<float> q_proj, gate_proj, k_proj, v_proj, o_proj, q_norm, k_norm, sinks;
    HugePageVector<float> q_bias, k_bias, v_bias, o_bias;
    /// The named buffers in parameters() order; empty ones (no separate gate, no norm, no
    /// biases) omitted.
    ParameterList groups() {
      ParameterList list;
      auto add = [&](char const* name, HugePageVector<float>& v) { list.add_if_present(name, v); };
      add("q_proj.weight", q_proj);
      add("q_proj.bias", q_bias);
      add("gate_proj.weight", gate_proj);
      add("k_proj.weight", k_proj);
      add("k_proj.bias", k_bias);
      add("v_proj.weight", v_proj);
      add("v_proj.bias", v_bias);
      add("o_proj.weight", o_proj);
      add("o_proj.bias", o_bias);
      add("q_norm.weight", q_norm);
      add("k_norm.weight", k_norm);
      add("sinks", sinks);
      return list;
    }
    void zero() { groups().zero(); }
  };
  using Gradients = Parameters;

  GatedAttention() = default;
  /// A layer with zero projection weights and identity norms. Throws moe::Error on a bad config.
  explicit GatedAttention(GatedAttentionConfig const& config) : c_(config) {
    auto const& c = c_;
    detail::check(c.d_model >= 1 && c.head_dim >= 1 && c.num_heads >= 1 && c.num_kv_heads >= 1,
                  "GatedAttention: d_model = ", c.d_model, ", head_dim = ", c.head_dim,
                  ", num_heads = ", c.num_heads, ", num_kv_heads = ", c.num_kv_heads,
                  "; all must be >= 1");
    detail::check(c.num_heads % c.num_kv_heads == 0,
                  "GatedAttention: num_kv_heads = ", c.num_kv_heads,
                  " does not divide num_heads = ", c.num_heads,
                  "; grouped-query attention needs num_heads = G * num_kv_heads (e.g. 16 query "
                  "heads over 2 KV heads)");
    if (c_.rotary_dim == 0) c_.rotary_dim = c.head_dim;
    detail::check(
        !c.rope || (c_.rotary_dim % 2 == 0 && c_.rotary_dim <= c.head_dim && c_.rotary_dim > 0 &&
                    c.rope_theta >= 1.0f && std::isfinite(c.rope_theta)),
        "GatedAttention: rotary_dim = ", c_.rotary_dim, ", rope_theta = ", c.rope_theta,
        "; RoPE needs an even rotary_dim in [2, head_dim = ", c.head_dim,
        "] and a finite theta >= 1 (a tiny theta overflows the frequencies)");
    kernels::RopeYarn const& y = c.yarn;
    detail::check_yarn(y, "GatedAttention");
    kernels::RopeLlama3 const& l3 = c.llama3;
    detail::check(
        l3.factor == 0.0f ||
            (l3.factor > 0.0f && std::isfinite(l3.factor) && l3.low_freq_factor > 0.0f &&
             std::isfinite(l3.high_freq_factor) && l3.high_freq_factor >= l3.low_freq_factor &&
             l3.original_max_position >= 1 && !y.enabled()),
        "GatedAttention: llama3 = {factor ", l3.factor, ", low_freq_factor ", l3.low_freq_factor,
        ", high_freq_factor ", l3.high_freq_factor, ", original_max_position ",
        l3.original_max_position,
        "}; Llama 3 RoPE scaling needs a finite factor > 0, 0 < low_freq_factor <= "
        "high_freq_factor, a context >= 1 and no YaRN, or factor 0 for plain RoPE");
    std::vector<float> const& ff = c.rope_freq_factors;
    detail::check(ff.empty() || (static_cast<Index>(ff.size()) == c_.rotary_dim / 2 &&
                                 !y.enabled() && !l3.enabled() &&
                                 std::all_of(ff.begin(), ff.end(),
                                             [](float f) { return f > 0.0f && std::isfinite(f); })),
                  "GatedAttention: rope_freq_factors has ", ff.size(),
                  " values; it needs rotary_dim / 2 = ", c_.rotary_dim / 2,
                  " finite factors > 0, and no YaRN or Llama 3 scaling beside it");
    if (c.rope && !ff.empty()) {
      inv_freq_.resize(ff.size());
      kernels::rope_factored_inv_freq(c.rope_theta, c_.rotary_dim, ff.data(), inv_freq_.data());
    } else if (c.rope && y.enabled()) {
      inv_freq_.resize(static_cast<std::size_t>(c_.rotary_dim / 2));
      kernels::rope_yarn_inv_freq(c.rope_theta, c_.rotary_dim, y, inv_freq_.data());
      rope_scale_ = y.scale();
    } else if (c.rope && l3.enabled()) {
      inv_freq_.resize(static_cast<std::size_t>(c_.rotary_dim / 2));
      kernels::rope_llama3_inv_freq(c.rope_theta, c_.rotary_dim, l3, inv_freq_.data());
    }
    detail::check(c.sliding_window >= 0 && (c.sliding_window == 0 || c.causal),
                  "GatedAttention: sliding_window = ", c.sliding_window,
                  "; it must be >= 0 (0: none), and a window needs causal attention");
    detail::check(c.attention_chunk >= 0 && (c.attention_chunk == 0 || c.causal),
                  "GatedAttention: attention_chunk = ", c.attention_chunk,
                  "; it must be >= 0 (0: none), and chunks need causal attention");
    detail::check(c.temperature_floor >= 0 && std::isfinite(c.temperature_scale),
                  "GatedAttention: temperature_floor = ", c.temperature_floor,
                  ", temperature_scale = ", c.temperature_scale,
                  "; the floor must be >= 0 (0: no temperature tuning) and the scale finite");
    detail::check(c.qk_norm == QkNorm::kNone || (c.norm_eps > 0.0f && std::isfinite(c.norm_eps)),
                  "GatedAttention: norm_eps = ", c.norm_eps, "; it must be finite and > 0");
    detail::check(c.qk_norm_scope == QkNormScope::kPerHead || !gated ||
                      c.gate_layout == GateLayout::kSeparate,
                  "GatedAttention: qk_norm_scope = kAllHeads normalises the whole query, which "
                  "must be contiguous in q_proj's output; use GateLayout::kSeparate with a gate");
    if (c_.scale == 0.0f) c_.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    detail::check(std::isfinite(c_.scale) && c_.scale > 0.0f, "GatedAttention: scale = ", c_.scale,
                  "; pass a finite positive scale or 0 for 1/sqrt(head_dim)");
    Index const D = c.d_model;
    auto sized = [](Index n) { return HugePageVector<float>(static_cast<std::size_t>(n), 0.0f); };
    p_.q_proj = sized(q_proj_rows() * D);
    if (separate_gate()) p_.gate_proj = sized(gate_cols() * D);
    p_.k_proj = sized(kv_dim() * D);
    p_.v_proj = sized(kv_dim() * D);
    p_.o_proj = sized(D * q_dim());
    if (c.qk_norm != QkNorm::kNone && c.qk_norm != QkNorm::kRmsNormUnweighted) {
      float const init = c.qk_norm == QkNorm::kRmsNorm ? 1.0f : 0.0f;
      bool const all = c.qk_norm_scope == QkNormScope::kAllHeads;
      p_.q_norm.assign(static_cast<std::size_t>(all ? q_dim() : c.head_dim), init);
      p_.k_norm.assign(static_cast<std::size_t>(all ? kv_dim() : c.head_dim), init);
    }
    if (c.qkv_bias) {
      p_.q_bias = sized(q_proj_rows());
      p_.k_bias = sized(kv_dim());
      p_.v_bias = sized(kv_dim());
    }
    if (c.o_bias) p_.o_bias = sized(D);
    if (c.sinks) p_.sinks.assign(static_cast<std::size_t>(c.num_heads), 0.0f);
  }

  GatedAttentionConfig const& config() const { return c_; }
  /// The most positions back a query can see, itself included (the window a KvCache of this
  /// layer needs): sliding_window, attention_chunk, the smaller of the two when both are set,
  /// 0 (the whole prefix) when neither is.
  Index lookback() const {
    Index const w = c_.sliding_window, ch = c_.attention_chunk;
    return w > 0 && ch > 0 ? std::min(w, ch) : std::max(w, ch);
  }
  Index d_model() const { return c_.d_model; }
  Index num_heads() const { return c_.num_heads; }
  Index num_kv_heads() const { return c_.num_kv_heads; }
  Index head_dim() const { return c_.head_dim; }
  /// Gate logits per head: 0, 1 or head_dim.
  Index gate_width() const { return Gate::width(c_.head_dim); }

  MatrixView<float> q_proj() {
    unpack();
    return {p_.q_proj.data(), q_proj_rows(), c_.d_model};
  }
  ConstMatrixView<float> q_proj() const { return {p_.q_proj.data(), q_proj_rows(), c_.d_model}; }
  /// [H w, D] with GateLayout::kSeparate and a gate; an empty view otherwise.
  MatrixView<float> gate_proj() {
    unpack();
    return {p_.gate_proj.data(), separate_gate() ? gate_cols() : 0, c_.d_model};
  }
  ConstMatrixView<float> gate_proj() const {
    return {p_.gate_proj.data(), separate_gate() ? gate_cols() : 0, c_.d_model};
  }
  MatrixView<float> k_proj() {
    unpack();
    return {p_.k_proj.data(), kv_dim(), c_.d_model};
  }
  ConstMatrixView<float> k_proj() const { return {p_.k_proj.data(), kv_dim(), c_.d_model}; }
  MatrixView<float> v_proj() {
    unpack();
    return {p_.v_proj.data(), kv_dim(), c_.d_model};
  }
  ConstMatrixView<float> v_proj() const { return {p_.v_proj.data(), kv_dim(), c_.d_model}; }
  MatrixView<float> o_proj() {
    unpack();
    return {p_.o_proj.data(), c_.d_model, q_dim()};
  }
  ConstMatrixView<float> o_proj() const { return {p_.o_proj.data(), c_.d_model, q_dim()}; }
  std::span<float> q_norm() { return p_.q_norm; }
  std::span<float> k_norm() { return p_.k_norm; }
  std::span<float const> q_norm() const { return p_.q_norm; }
  std::span<float const> k_norm() const { return p_.k_norm; }
  /// Projection biases (with config().qkv_bias / o_bias; empty otherwise).
  std::span<float> q_bias() { return p_.q_bias; }
  std::span<float> k_bias() { return p_.k_bias; }
  std::span<float> v_bias() { return p_.v_bias; }
  std::span<float> o_bias() { return p_.o_bias; }
  std::span<float const> q_bias() const { return p_.q_bias; }
  std::span<float const> k_bias() const { return p_.k_bias; }
  std::span<float const> v_bias() const { return p_.v_bias; }
  std::span<float const> o_bias() const { return p_.o_bias; }
  /// [H] sink logits (with config().sinks; empty otherwise).
  std::span<float> sinks() { return p_.sinks; }
  std::span<float const> sinks() const { return p_.sinks; }

  /// Column of head h's query in the [T, P] output of q_proj (+ gate_proj), and of its gate
  /// logits (see GateLayout).
  Index query_col(Index h) const {
    Index const dh = c_.head_dim, w = gate_width(), G = group();
    switch (c_.gate_layout) {
      case GateLayout::kPackedPerKvGroup:
        return (h / G) * G * (dh + w) + (h % G) * dh;
      case GateLayout::kPackedPerHead:
        return h * (dh + w);
      default:
        return h * dh;
    }
  }
  Index gate_col(Index h) const {
    Index const dh = c_.head_dim, w = gate_width(), G = group();
    switch (c_.gate_layout) {
      case GateLayout::kPackedPerKvGroup:
        return (h / G) * G * (dh + w) + G * dh + (h % G) * w;
      case GateLayout::kPackedPerHead:
        return h * (dh + w) + dh;
      default:
        return q_dim() + h * w;
    }
  }

  /// Every trainable parameter as named flat buffers: "q_proj.weight", "q_proj.bias" (with
  /// qkv_bias), "gate_proj.weight" (separate layout with a gate), "k_proj.weight", "k_proj.bias",
  /// "v_proj.weight", "v_proj.bias", "o_proj.weight", "o_proj.bias" (with o_bias),
  /// "q_norm.weight", "k_norm.weight" (with qk_norm), "sinks" (with sinks).
  ParameterList parameters() {
    unpack();
    return p_.groups();
  }

  /// Packs the projections (q, gate, k, v, o) for forward() and forward_cached() in the
  /// formats `f` says, as moe::Linear matrices on the experts' engine: kF32 panels (exact: the
  /// same product for any number of rows), kBf16 (rounded to nearest even, widened to fp32 as
  /// they are loaded: bitwise the output of a layer whose fp32 weights are those bf16 values), or
  /// a GGUF block format (int8 activations, docs/quantization.md); a format whose blocks do not
  /// divide a projection's depth falls back along its chain (experts::resolve_format; formats()
  /// says what each got). Unpacked, those forwards multiply the fp32 parameters in place.
  /// forward_train and backward always use the fp32 parameters. The packs are dropped (unpacked
  /// again) by any non-const accessor of the weights (q_proj(), gate_proj(), k_proj(),
  /// v_proj(), o_proj(), parameters()), so they never go stale: pack after the last write.
  /// Packed in parallel on `pool` when given (the same packs). Throws moe::Error for non-finite
  /// weights in a quantized format.
  void pack_weights(AttentionFormats const& f, ThreadPool* pool = nullptr) {
    unpack();
    Index const D = c_.d_model;
    packs_.q = Linear(ConstMatrixView<float>(p_.q_proj.data(), q_proj_rows(), D), f.q, {}, pool);
    if (separate_gate()) {
      packs_.gate =
          Linear(ConstMatrixView<float>(p_.gate_proj.data(), gate_cols(), D), f.q, {}, pool);
    }
    packs_.k = Linear(ConstMatrixView<float>(p_.k_proj.data(), kv_dim(), D), f.k, {}, pool);
    packs_.v = Linear(ConstMatrixView<float>(p_.v_proj.data(), kv_dim(), D), f.v, {}, pool);
    packs_.o = Linear(ConstMatrixView<float>(p_.o_proj.data(), D, q_dim()), f.o, {}, pool);
  }
  /// Frees the projections' fp32 parameters (q, gate, k, v, o), keeping their packs: an
  /// inference-only layer, as a decoder keeps it (norms, biases and sinks stay). forward() and
  /// forward_cached() give the same results; afterwards forward_train, parameters(),
  /// make_gradients(), pack_weights() and the non-const projection accessors throw moe::Error.
  /// Irreversible. Precondition (checked): packed().
  void discard_master_weights() {
    detail::check(packed(),
                  "GatedAttention::discard_master_weights: the projections are not packed; "
                  "pack_weights() first (the packs are what inference then reads)");
    p_.q_proj = {};
    p_.gate_proj = {};
    p_.k_proj = {};
    p_.v_proj = {};
    p_.o_proj = {};
    discarded_ = true;
  }
  /// Makes the layer inference-only with projections packed elsewhere (a loader that builds them
  /// from stored blocks with Linear::from_blocks, or from values with the Linear constructor):
  /// q [q_proj_rows, D] (with the gate rows when the gate is fused into q_proj), k and v
  /// [kv_dim, D], o [D, q_dim], `gate` [gate_cols, D] exactly when the gate is a separate
  /// projection; none with a bias (the layer adds its own). The fp32 projection weights are
  /// freed as discard_master_weights() does, with the same consequences. Throws moe::Error for a
  /// pack of another shape, a pack with a bias, or a missing or unexpected gate.
  void adopt_packed_weights(Linear q, Linear k, Linear v, Linear o, Linear gate = {}) {
    Index const D = c_.d_model;
    auto check = [&](Linear const& l, char const* what, Index rows, Index depth) {
      detail::check(l.rows() == rows && l.depth() == depth && l.bias().empty(),
                    "GatedAttention::adopt_packed_weights: ", what, " is [", l.rows(), ", ",
                    l.depth(), "]", l.bias().empty() ? "" : " with a bias",
                    " but this layer needs [", rows, ", ", depth, "] without a bias");
    };
    check(q, "q", q_proj_rows(), D);
    check(k, "k", kv_dim(), D);
    check(v, "v", kv_dim(), D);
    check(o, "o", D, q_dim());
    if (separate_gate()) {
      check(gate, "gate", gate_cols(), D);
    } else {
      detail::check(gate.empty(),
                    "GatedAttention::adopt_packed_weights: this layer has no separate "
                    "gate projection; pass none");
    }
    packs_ = {std::move(q), std::move(gate), std::move(k), std::move(v), std::move(o)};
    discard_master_weights();
  }
  /// Were the fp32 projection weights discarded (discard_master_weights)?
  bool master_weights_discarded() const { return discarded_; }
  /// Are the projections packed (pack_weights, and no write access since)?
  bool packed() const { return !packs_.o.empty(); }
  /// The formats the packs hold (after any fallback; all kF32 when not packed).
  AttentionFormats formats() const {
    if (!packed()) return {};
    return {packs_.q.format(), packs_.k.format(), packs_.v.format(), packs_.o.format()};
  }
  /// The packs' format when all four share one (kF32 when not packed); formats() otherwise.
  experts::WeightFormat weight_format() const { return formats().q; }
  /// Bytes of the packed projections (what a forward over packed weights streams), or of the fp32
  /// parameters when not packed.
  std::size_t projection_bytes() const {
    if (packed()) {
      return packs_.q.bytes() + packs_.gate.bytes() + packs_.k.bytes() + packs_.v.bytes() +
             packs_.o.bytes();
    }
    return (p_.q_proj.size() + p_.gate_proj.size() + p_.k_proj.size() + p_.v_proj.size() +
            p_.o_proj.size()) *
           sizeof(float);
  }
  /// Zero gradients shaped like parameters().
  Gradients make_gradients() const {
    detail::check(!discarded_,
                  "GatedAttention::make_gradients: the projections' fp32 weights were discarded "
                  "(discard_master_weights); an inference-only layer has no gradients");
    Gradients g = p_;
    g.zero();
    return g;
  }

  /// y = GatedAttention(x). See the class comment.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, GatedAttentionWorkspace& ws,
               AttentionOptions const& opt = {}) const {
    auto const busy = ws.in_use.enter("GatedAttention::forward");
    check_call(x, y, opt);
    run_forward(x, y, ws, opt, false);
    ws.stamp = {};
  }

  /// forward() that also keeps in `ws` what backward needs (see the class comment).
  void forward_train(ConstMatrixView<float> x, MatrixView<float> y, GatedAttentionWorkspace& ws,
                     AttentionOptions const& opt = {}) const {
    auto const busy = ws.in_use.enter("GatedAttention::forward_train");
    check_call(x, y, opt);
    detail::check(!discarded_,
                  "GatedAttention::forward_train: the projections' fp32 weights were discarded "
                  "(discard_master_weights); an inference-only layer cannot train");
    Index const T = x.rows, D = c_.d_model;
    AttentionOptions const o = detail::keep_training_input(x, opt, ws.x, ws.key_mask);
    ws.batch = opt.batch;
    run_forward(ConstMatrixView<float>(ws.x.data(), T, D), y, ws, o, true);
    ws.stamp = {this, T, D, c_.num_heads, c_.head_dim};
  }

  /// Decoding with a KvCache: x [T, D] holds new tokens of the cache's sequences, new_tokens[s]
  /// of sequence s (in sequence order; sum = T, any may be 0), at positions length(s), ...,
  /// length(s) + new_tokens[s] - 1. Their keys and values are appended to the cache (which
  /// grows if needed), each new query attends causally (with the sliding window and sinks) to
  /// its sequence's cached prefix and the new tokens up to itself, and y [T, D] gets the
  /// outputs; y may be x (with `accumulate`, y += the outputs instead: a residual added in o_proj's
  /// epilogue; y must not be x then). A prefill is the first call, a decode step a call with 1
  /// token per sequence. The result equals the last rows of forward() over the whole sequence
  /// (batch 1, positions from 0), up to float rounding of the projections: they take the few-row
  /// path below 8 rows (kernels::kPanelMinRows), so a 1-token step and a long recompute round
  /// differently (measured ~1e-7 relative, tested within 1e-5); the SDPA of a row does not
  /// depend on the other rows. Inference only (no backward); needs causal attention. Throws
  /// moe::Error for a cache of another kv_dim, a new_tokens of another size than
  /// cache.sequences(), negative counts or a sum other than T.
  void forward_cached(ConstMatrixView<float> x, MatrixView<float> y, KvCache& cache,
                      std::span<Index const> new_tokens, GatedAttentionWorkspace& ws,
                      ThreadPool* pool = nullptr, bool accumulate = false) const {
    auto const busy = ws.in_use.enter("GatedAttention::forward_cached");
    check_call(x, y, {});
    detail::check(!accumulate || x.data != y.data || x.rows == 0,
                  "GatedAttention::forward_cached: accumulate adds the output to y, so y must not "
                  "be x");
    detail::check(c_.causal,
                  "GatedAttention::forward_cached: the layer is not causal; a KV cache serves "
                  "causal decoding only");
    detail::check(cache.key_dim() == kv_dim() && cache.value_dim() == kv_dim(),
                  "GatedAttention::forward_cached: the cache holds "
                  "rows of ",
                  cache.kv_dim(),
                  " floats but the layer's keys have num_kv_heads * "
                  "head_dim = ",
                  kv_dim(), "; make it with KvCache(sequences, ", kv_dim(), ")");
    detail::check_new_tokens(cache, new_tokens, x.rows, "GatedAttention");
    detail::check(cache.window() == 0 || (lookback() > 0 && lookback() <= cache.window()),
                  "GatedAttention::forward_cached: the cache keeps a window of ", cache.window(),
                  " tokens but the layer's queries look back ", lookback(),
                  " tokens (sliding_window ", c_.sliding_window, ", attention_chunk ",
                  c_.attention_chunk,
                  "; 0: the whole prefix); give this layer a cache without a window (or one of "
                  "at least lookback())");
    run_cached(x, y, cache, new_tokens, ws, pool, accumulate);
    ws.stamp = {};
  }

  /// Backward of the last forward_train on `ws`: dx [T, D] = dL/dx (overwritten) and every
  /// parameter gradient accumulated (+=) into `grads`, given dy [T, D] = dL/dy. Bitwise identical
  /// for any pool size. Call once per forward_train.
  void backward(GatedAttentionWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                Gradients& grads, ThreadPool* pool = nullptr) const {
    auto const busy = ws.in_use.enter("GatedAttention::backward");
    detail::check(ws.stamp.filled(),
                  "GatedAttention::backward: the workspace holds no training forward; call "
                  "forward_train first (and backward only once per forward)");
    detail::check(ws.stamp.layer == this,
                  "GatedAttention::backward: the workspace holds another layer's training "
                  "forward; give each layer its own workspace (or call this layer's "
                  "forward_train first)");
    Index const T = static_cast<Index>(ws.x.size()) / c_.d_model, D = c_.d_model;
    detail::check(dy.rows == T && dy.cols == D && dx.rows == T && dx.cols == D,
                  "GatedAttention::backward: dy and dx must be [", T, ", ", D,
                  "] like the forward's x; got dy [", dy.rows, ", ", dy.cols, "], dx [", dx.rows,
                  ", ", dx.cols, "]");
    bool const same =
        grads.q_proj.size() == p_.q_proj.size() && grads.gate_proj.size() == p_.gate_proj.size() &&
        grads.k_proj.size() == p_.k_proj.size() && grads.v_proj.size() == p_.v_proj.size() &&
        grads.o_proj.size() == p_.o_proj.size() && grads.q_norm.size() == p_.q_norm.size() &&
        grads.k_norm.size() == p_.k_norm.size() && grads.sinks.size() == p_.sinks.size() &&
        grads.q_bias.size() == p_.q_bias.size() && grads.k_bias.size() == p_.k_bias.size() &&
        grads.v_bias.size() == p_.v_bias.size() && grads.o_bias.size() == p_.o_bias.size();
    detail::check(same,
                  "GatedAttention::backward: gradients do not match this layer; use "
                  "make_gradients()");
    ws.stamp = {};
    run_backward(ws, dy, dx, grads, pool);
  }

  /// Rows of q_proj: H d_h queries, and the gate's H w rows when the gate is packed into it
  /// (GateLayout::kPackedPer*), as adopt_packed_weights() takes it.
  Index q_proj_rows() const { return q_dim() + (separate_gate() ? 0 : gate_cols()); }

 private:
  Index group() const { return c_.num_heads / c_.num_kv_heads; }
  Index q_dim() const { return c_.num_heads * c_.head_dim; }
  Index kv_dim() const { return c_.num_kv_heads * c_.head_dim; }
  Index gate_cols() const { return c_.num_heads * gate_width(); }
  bool separate_gate() const { return gated && c_.gate_layout == GateLayout::kSeparate; }
  /// Columns of the qg buffer: queries and gate logits in the layer's layout.
  Index qg_cols() const { return q_dim() + gate_cols(); }
  bool has_norm() const { return c_.qk_norm != QkNorm::kNone; }
  bool one_plus() const { return c_.qk_norm == QkNorm::kRmsNormOnePlus; }
  bool norm_all_heads() const { return has_norm() && c_.qk_norm_scope == QkNormScope::kAllHeads; }
  /// The q/k norm weights (null: an unweighted norm).
  float const* q_norm_w() const { return p_.q_norm.empty() ? nullptr : p_.q_norm.data(); }
  float const* k_norm_w() const { return p_.k_norm.empty() ? nullptr : p_.k_norm.data(); }
  /// The temperature-tuning factor of the queries at position pos (1 without tuning), in
  /// float as transformers computes it: log1p(floor((pos + 1) / floor_scale)) * scale + 1.
  float query_temperature(Index pos) const {
    if (c_.temperature_floor <= 0) return 1.0f;
    float const f =
        std::floor((static_cast<float>(pos) + 1.0f) / static_cast<float>(c_.temperature_floor));
    return std::log1p(f) * c_.temperature_scale + 1.0f;
  }
  Index half_rot() const { return c_.rope ? c_.rotary_dim / 2 : 0; }
  /// RoPE of one head vector (rotate-half or interleaved pairs) and its backward.
  void rotate(float* x, float const* cs, float const* sn) const {
    kernels::rope_rotate(x, cs, sn, c_.rotary_dim, c_.rope_interleaved);
  }
  void rotate_backward(float* dx, float const* cs, float const* sn) const {
    kernels::rope_rotate_backward(dx, cs, sn, c_.rotary_dim, c_.rope_interleaved);
  }
  static int threads_of(ThreadPool* pool) { return pool ? pool->size() : 1; }

  Index scratch_floats() const {
    Index n = kernels::sdpa_scratch_size(c_.head_dim, c_.head_dim);
    n = std::max(n, kernels::panel_scratch_size(std::max(c_.d_model, q_dim())));
    return (n + 15) / 16 * 16;
  }

  void check_call(ConstMatrixView<float> x, MatrixView<float> y,
                  AttentionOptions const& opt) const {
    detail::check(!p_.q_proj.empty() || discarded_,
                  "GatedAttention: the layer was default-constructed; "
                  "construct it from a GatedAttentionConfig first");
    detail::check_attention_call(x, y, c_.d_model, opt, "GatedAttention");
  }

  kernels::SdpaParams sdpa_params(GatedAttentionWorkspace const& ws, Index S, Index b, Index h,
                                  std::uint8_t const* mask) const {
    Index const dh = c_.head_dim, g = h / group();
    kernels::SdpaParams p;
    p.q = ws.q.data() + b * S * q_dim() + h * dh;
    p.ldq = q_dim();
    p.k = ws.k.data() + b * S * kv_dim() + g * dh;
    p.ldk = kv_dim();
    p.v = ws.v.data() + b * S * kv_dim() + g * dh;
    p.ldv = kv_dim();
    p.q_rows = S;
    p.kv_rows = S;
    p.head_dim = dh;
    p.value_dim = dh;
    p.scale = c_.scale;
    p.causal = c_.causal;
    p.key_mask = mask ? mask + b * S : nullptr;
    p.window = c_.sliding_window;
    p.chunk = c_.attention_chunk;
    if (!p_.sinks.empty()) p.sink = p_.sinks[static_cast<std::size_t>(h)];
    return p;
  }

  void run_forward(ConstMatrixView<float> x, MatrixView<float> y, GatedAttentionWorkspace& ws,
                   AttentionOptions const& opt, bool train) const {
    Index const T = x.rows, H = c_.num_heads, KV = c_.num_kv_heads;
    Index const dh = c_.head_dim, w = gate_width(), P = qg_cols(), HD = q_dim(), KD = kv_dim();
    Index const B = opt.batch, S = B > 0 ? T / B : 0, hr = half_rot();
    ThreadPool* pool = opt.pool;
    auto grow = [](std::vector<float>& v, Index n) { v.resize(static_cast<std::size_t>(n)); };
    grow(ws.qg, T * P);
    grow(ws.k_raw, T * KD);
    grow(ws.v, T * KD);
    grow(ws.q, T * HD);
    grow(ws.k, T * KD);
    grow(ws.attn, T * HD);
    grow(ws.gate, T * H * w);
    grow(ws.gated, gated ? T * HD : 0);
    grow(ws.lse, train ? T * H : 0);
    grow(ws.rstd_q, has_norm() ? T * H : 0);
    grow(ws.rstd_k, has_norm() ? T * KV : 0);
    grow(ws.rope_cos, T * hr);
    grow(ws.rope_sin, T * hr);
    grow(ws.q_temp, train && c_.temperature_floor > 0 ? T : 0);
    Index const per = scratch_floats();
    grow(ws.scratch, threads_of(pool) * per);
    if (T == 0) return;

    // 1. Projections: [Q | gamma] (or Q and gamma), K, V.
    run_qkv(x, ws, !train, pool);

    // 2. Per token: RoPE angles, q/k norm and RoPE, gate logits gathered.
    Index const tiles = (T + kTileRows - 1) / kTileRows;
    parallel_for(pool, tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        Index const pos = opt.positions.empty() ? t % S : opt.positions[t];
        prepare_row(ws, t, pos, ws.q.data() + t * HD, ws.k.data() + t * KD, nullptr,
                    has_norm() ? ws.rstd_q.data() + t * H : nullptr,
                    has_norm() ? ws.rstd_k.data() + t * KV : nullptr);
      }
    });

    // 3. SDPA per (sequence, head, chunk of query rows).
    std::uint8_t const* mask = opt.key_mask.empty() ? nullptr : opt.key_mask.data();
    Index const chunks = (S + kTileRows - 1) / kTileRows;
    parallel_for(pool, B * H * chunks, [&](Index i, int thread) {
      Index const b = i / (H * chunks), h = (i / chunks) % H, ch = i % chunks;
      Index const r0 = ch * kTileRows, r1 = std::min(S, r0 + kTileRows);
      kernels::sdpa_forward(sdpa_params(ws, S, b, h, mask), ws.attn.data() + b * S * HD + h * dh,
                            HD, train ? ws.lse.data() + (b * H + h) * S : nullptr, r0, r1,
                            ws.scratch.data() + thread * per);
    });

    // 4. Gate: O = A * sigmoid(gamma).
    if constexpr (gated) {
      parallel_for(pool, tiles, [&](Index i, int) {
        Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
        for (Index t = t0; t < t1; ++t) {
          float* s = ws.gate.data() + t * H * w;
          Gate::forward(ws.attn.data() + t * HD, s, s, ws.gated.data() + t * HD, H, dh);
        }
      });
    }

    // 5. y = O W_o^T.
    float const* o = gated ? ws.gated.data() : ws.attn.data();
    run_o(ConstMatrixView<float>(o, T, HD), y, ws, !train, false, pool);
  }

  /// acc[c] += sum over rows t (ascending) of m[t][c], split by column blocks over the pool:
  /// the same bits for any pool size.
  static void add_column_sums(ConstMatrixView<float> m, float* acc, ThreadPool* pool) {
    constexpr Index kCols = 256;
    parallel_for(pool, (m.cols + kCols - 1) / kCols, [&](Index i, int) {
      Index const c0 = i * kCols, c1 = std::min(m.cols, c0 + kCols);
      for (Index t = 0; t < m.rows; ++t) {
        float const* r = m.row(t);
        for (Index c = c0; c < c1; ++c) acc[c] += r[c];
      }
    });
  }

  /// detail::projection_job of one projection (bias: null or empty for none).
  static detail::ExpertJob proj_job(kernels::RowSource a, Index rows, Linear const& pack,
                                    HugePageVector<float> const& w, Index rows_w, Index depth,
                                    float* c, Index ldc, bool inference,
                                    HugePageVector<float> const* bias = nullptr,
                                    bool accumulate = false) {
    return detail::projection_job(a, rows, pack, w.data(), rows_w, depth, c, ldc, inference,
                                  bias && !bias->empty() ? bias->data() : nullptr, accumulate);
  }

  /// [Q | gamma] (or Q and gamma), K and V of every row of x (from the packs when `inference`
  /// and pack_weights made them), run on ws.queue; the q/k/v biases are added by prepare_row.
  void run_qkv(ConstMatrixView<float> x, GatedAttentionWorkspace& ws, bool inference,
               ThreadPool* pool) const {
    Index const T = x.rows, D = c_.d_model, P = qg_cols(), HD = q_dim(), KD = kv_dim();
    bool const q8 = inference && (packs_.q.quantized() || packs_.gate.quantized() ||
                                  packs_.k.quantized() || packs_.v.quantized());
    kernels::RowSource const a = ws.input.prepare(x, q8, pool);
    ws.queue.add(proj_job(a, T, packs_.q, p_.q_proj, q_proj_rows(), D, ws.qg.data(), P, inference));
    if (separate_gate()) {
      ws.queue.add(proj_job(a, T, packs_.gate, p_.gate_proj, gate_cols(), D, ws.qg.data() + HD, P,
                            inference));
    }
    ws.queue.add(proj_job(a, T, packs_.k, p_.k_proj, KD, D, ws.k_raw.data(), KD, inference));
    ws.queue.add(proj_job(a, T, packs_.v, p_.v_proj, KD, D, ws.v.data(), KD, inference));
    ws.queue.run<experts::SwiGlu, experts::SwiGlu>(pool);
  }

  /// y = O W_o^T + b_o (y += with `accumulate`: the residual added in the epilogue).
  void run_o(ConstMatrixView<float> o, MatrixView<float> y, GatedAttentionWorkspace& ws,
             bool inference, bool accumulate, ThreadPool* pool) const {
    kernels::RowSource const a = ws.input.prepare(o, inference && packs_.o.quantized(), pool);
    ws.queue.add(proj_job(a, o.rows, packs_.o, p_.o_proj, c_.d_model, q_dim(), y.data, y.row_stride,
                          inference, &p_.o_bias, accumulate));
    ws.queue.run<experts::SwiGlu, experts::SwiGlu>(pool);
  }

  /// Row t at position pos: RoPE angles into ws.rope_cos / rope_sin, its queries (norm, RoPE)
  /// into q_out [H d_h], key (norm, RoPE) into k_out [KV d_h], value into v_out (null: kept in
  /// ws.v), the RMSNorm factors into rstd_q [H] / rstd_k [KV] (null: not kept), the gate logits
  /// into ws.gate.
  void prepare_row(GatedAttentionWorkspace& ws, Index t, Index pos, float* q_out, float* k_out,
                   float* v_out, float* rstd_q = nullptr, float* rstd_k = nullptr) const {
    Index const H = c_.num_heads, KV = c_.num_kv_heads, dh = c_.head_dim, w = gate_width();
    Index const P = qg_cols(), KD = kv_dim(), hr = half_rot();
    float* cs = ws.rope_cos.data() + t * hr;
    float* sn = ws.rope_sin.data() + t * hr;
    if (!inv_freq_.empty()) {
      kernels::rope_angles(pos, inv_freq_.data(), rope_scale_, c_.rotary_dim, cs, sn);
    } else if (c_.rope) {
      kernels::rope_angles(pos, c_.rope_theta, c_.rotary_dim, cs, sn);
    }
    if (!p_.q_bias.empty()) {  // in place: training keeps the biased projections
      auto add = [](float* row, HugePageVector<float> const& b) {
        for (std::size_t c = 0; c < b.size(); ++c) row[c] += b[c];
      };
      add(ws.qg.data() + t * P, p_.q_bias);
      add(ws.k_raw.data() + t * KD, p_.k_bias);
      add(ws.v.data() + t * KD, p_.v_bias);
    }
    float const* qg = ws.qg.data() + t * P;
    float const* kr = ws.k_raw.data() + t * KD;
    float const temp = query_temperature(pos);
    if (!ws.q_temp.empty()) ws.q_temp[static_cast<std::size_t>(t)] = temp;
    if (norm_all_heads()) {  // one norm over all heads (queries contiguous: checked)
      float const rq = kernels::rms_norm(qg, q_norm_w(), one_plus(), c_.norm_eps, H * dh, q_out);
      float const rk = kernels::rms_norm(kr, k_norm_w(), one_plus(), c_.norm_eps, KD, k_out);
      if (rstd_q) rstd_q[0] = rq;
      if (rstd_k) rstd_k[0] = rk;
    }
    for (Index h = 0; h < H; ++h) {
      float* q = q_out + h * dh;
      if (norm_all_heads()) {
        // normalised above
      } else if (has_norm()) {
        float const r =
            kernels::rms_norm(qg + query_col(h), q_norm_w(), one_plus(), c_.norm_eps, dh, q);
        if (rstd_q) rstd_q[h] = r;
      } else {
        std::copy(qg + query_col(h), qg + query_col(h) + dh, q);
      }
      if (c_.rope) rotate(q, cs, sn);
      if (temp != 1.0f) {
        for (Index d = 0; d < dh; ++d) q[d] *= temp;
      }
      if constexpr (gated) {
        std::copy(qg + gate_col(h), qg + gate_col(h) + w, ws.gate.data() + (t * H + h) * w);
      }
    }
    for (Index g = 0; g < KV; ++g) {
      float const* kg = kr + g * dh;
      float* k = k_out + g * dh;
      if (norm_all_heads()) {
        // normalised above
      } else if (has_norm()) {
        float const r = kernels::rms_norm(kg, k_norm_w(), one_plus(), c_.norm_eps, dh, k);
        if (rstd_k) rstd_k[g] = r;
      } else {
        std::copy(kg, kg + dh, k);
      }
      if (c_.rope) rotate(k, cs, sn);
    }
    if (v_out) std::copy(ws.v.data() + t * KD, ws.v.data() + (t + 1) * KD, v_out);
  }

  void run_cached(ConstMatrixView<float> x, MatrixView<float> y, KvCache& cache,
                  std::span<Index const> new_tokens, GatedAttentionWorkspace& ws, ThreadPool* pool,
                  bool accumulate) const {
    Index const T = x.rows, H = c_.num_heads, dh = c_.head_dim;
    Index const w = gate_width(), P = qg_cols(), HD = q_dim(), KD = kv_dim(), hr = half_rot();
    Index const B = cache.sequences();
    auto grow = [](std::vector<float>& v, Index n) { v.resize(static_cast<std::size_t>(n)); };
    grow(ws.qg, T * P);
    grow(ws.k_raw, T * KD);
    grow(ws.v, T * KD);
    grow(ws.q, T * HD);
    grow(ws.k, T * KD);  // the new keys, before the cache stores (and rounds) them
    grow(ws.attn, T * HD);
    grow(ws.gate, T * H * w);
    grow(ws.gated, gated ? T * HD : 0);
    grow(ws.rope_cos, T * hr);
    grow(ws.rope_sin, T * hr);
    ws.q_temp.clear();
    Index const per = scratch_floats();
    grow(ws.scratch, threads_of(pool) * per);
    detail::place_new_rows(cache, new_tokens, T, ws.row_seq, ws.row_pos, ws.seq_row0);
    if (T == 0) return;

    run_qkv(x, ws, true, pool);

    // Queries into ws.q; keys and values into the cache (at absolute positions).
    Index const tiles = (T + kTileRows - 1) / kTileRows;
    parallel_for(pool, tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        Index const s = ws.row_seq[static_cast<std::size_t>(t)];
        Index const pos = ws.row_pos[static_cast<std::size_t>(t)];
        prepare_row(ws, t, pos, ws.q.data() + t * HD, ws.k.data() + t * KD, nullptr);
        cache.store_key(s, pos, ws.k.data() + t * KD);  // rounded to bf16 in a bf16 cache
        cache.store_value(s, pos, ws.v.data() + t * KD);
      }
    });

    // SDPA over the cached prefix + new rows. Work items: a sequence with one new token and no
    // sinks takes one item per KV group, its G query heads as G rows against the group's keys
    // (the key blocks packed once for all of them); otherwise one item per (head, chunk of 64
    // new rows). A row's result does not depend on the rows it is computed with.
    Index const chunk_rows = kTileRows, G = group(), KVh = c_.num_kv_heads;
    bool const grouped_ok = p_.sinks.empty() && G > 1;
    ws.group_pos.resize(static_cast<std::size_t>(B * G));
    auto items_of = [&](Index s) {
      Index const n = new_tokens[static_cast<std::size_t>(s)];
      return n == 1 && grouped_ok ? KVh : H * ((n + chunk_rows - 1) / chunk_rows);
    };
    Index items = 0;
    for (Index s = 0; s < B; ++s) {
      items += items_of(s);
      // Positions relative to the cache's row 0 (first(s): 0 without a window).
      std::fill(ws.group_pos.begin() + s * G, ws.group_pos.begin() + (s + 1) * G, cache.rows(s));
    }
    parallel_for(pool, items, [&](Index item, int thread) {
      Index s = 0, base = 0;
      for (;; ++s) {
        Index const here = items_of(s);
        if (item < base + here) break;
        base += here;
      }
      Index const n = new_tokens[static_cast<std::size_t>(s)];
      Index const row0 = ws.seq_row0[static_cast<std::size_t>(s)];
      Index const len = cache.rows(s);  // rows held before this call's tokens
      kernels::SdpaParams p;
      p.ldk = KD;
      p.ldv = KD;
      p.kv_rows = len + n;
      p.head_dim = dh;
      p.value_dim = dh;
      p.scale = c_.scale;
      p.causal = true;
      p.window = c_.sliding_window;
      p.chunk = c_.attention_chunk;
      p.key_origin = cache.first(s);
      float* const scratch = ws.scratch.data() + thread * per;
      if (n == 1 && grouped_ok) {
        Index const g = item - base;
        p.q = ws.q.data() + row0 * HD + g * G * dh;
        p.ldq = dh;  // the G heads of one token, side by side
        detail::bind_cached_kv(p, cache, s, g * dh, g * dh);
        p.q_rows = G;
        p.q_pos = ws.group_pos.data() + s * G;
        kernels::sdpa_forward(p, ws.attn.data() + row0 * HD + g * G * dh, dh, nullptr, 0, G,
                              scratch);
        return;
      }
      Index const chunks = (n + chunk_rows - 1) / chunk_rows;
      Index const h = (item - base) / chunks, ch = (item - base) % chunks;
      Index const r0 = ch * chunk_rows, r1 = std::min(n, r0 + chunk_rows);
      Index const g = h / G;
      p.q = ws.q.data() + row0 * HD + h * dh;
      p.ldq = HD;
      detail::bind_cached_kv(p, cache, s, g * dh, g * dh);
      p.q_rows = n;
      p.causal_offset = len;
      if (!p_.sinks.empty()) p.sink = p_.sinks[static_cast<std::size_t>(h)];
      kernels::sdpa_forward(p, ws.attn.data() + row0 * HD + h * dh, HD, nullptr, r0, r1, scratch);
    });
    for (Index s = 0; s < B; ++s) cache.advance(s, new_tokens[static_cast<std::size_t>(s)]);

    if constexpr (gated) {
      parallel_for(pool, tiles, [&](Index i, int) {
        for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
          float* sg = ws.gate.data() + t * H * w;
          Gate::forward(ws.attn.data() + t * HD, sg, sg, ws.gated.data() + t * HD, H, dh);
        }
      });
    }
    float const* o = gated ? ws.gated.data() : ws.attn.data();
    run_o(ConstMatrixView<float>(o, T, HD), y, ws, true, accumulate, pool);
  }

  void run_backward(GatedAttentionWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                    Gradients& grads, ThreadPool* pool) const {
    Index const D = c_.d_model, H = c_.num_heads, KV = c_.num_kv_heads, G = group();
    Index const T = static_cast<Index>(ws.x.size()) / D;
    Index const dh = c_.head_dim, w = gate_width(), P = qg_cols(), HD = q_dim(), KD = kv_dim();
    Index const B = ws.batch, S = T / B, hr = half_rot();
    auto zeroed = [](std::vector<float>& v, Index n) {
      v.assign(static_cast<std::size_t>(n), 0.0f);
    };
    auto sized = [](std::vector<float>& v, Index n) { v.resize(static_cast<std::size_t>(n)); };
    sized(ws.dgated, T * HD);
    sized(ws.dgate, T * H * w);
    sized(ws.dqg, T * P);
    zeroed(ws.dq, T * HD);
    zeroed(ws.dk, T * KD);
    zeroed(ws.dv, T * KD);
    zeroed(ws.dk_heads, G > 1 ? T * HD : 0);
    zeroed(ws.dv_heads, G > 1 ? T * HD : 0);
    sized(ws.dk_raw, T * KD);
    sized(ws.delta, T * H);
    sized(ws.sink_partial, p_.sinks.empty() ? 0 : B * H);
    Index const tiles = (T + kTileRows - 1) / kTileRows;
    Index const nq = static_cast<Index>(p_.q_norm.size()),
                nk = static_cast<Index>(p_.k_norm.size());
    zeroed(ws.norm_partial, tiles * (nq + nk));
    Index const per = scratch_floats();
    sized(ws.scratch, threads_of(pool) * per);
    if (T == 0) return;
    ConstMatrixView<float> x(ws.x.data(), T, D);
    float const* o_in = gated ? ws.gated.data() : ws.attn.data();

    // 1. dO = dy W_o; gate VJP: dA = dO * s, dgamma (into dgate).
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, n = std::min(kTileRows, T - t0);
      kernels::gemm_strided(n, HD, D, dy.data + t0 * dy.row_stride, dy.row_stride, 1,
                            p_.o_proj.data(), HD, ws.dgated.data() + t0 * HD, HD, false);
      for (Index t = t0; t < t0 + n; ++t) {
        float* d = ws.dgated.data() + t * HD;
        Gate::backward(ws.attn.data() + t * HD, ws.gate.data() + t * H * w, d, d,
                       ws.dgate.data() + t * H * w, H, dh);
      }
    });

    // 2. SDPA backward per (sequence, head); per-head dK, dV when heads share a KV head.
    parallel_for(pool, B * H, [&](Index i, int thread) {
      Index const b = i / H, h = i % H, g = h / G;
      std::uint8_t const* mask = ws.key_mask.empty() ? nullptr : ws.key_mask.data();
      kernels::SdpaParams const p = sdpa_params(ws, S, b, h, mask);
      kernels::SdpaGrads gr;
      gr.o = ws.attn.data() + b * S * HD + h * dh;
      gr.ldo = HD;
      gr.dout = ws.dgated.data() + b * S * HD + h * dh;
      gr.lddo = HD;
      gr.lse = ws.lse.data() + (b * H + h) * S;
      gr.delta = ws.delta.data() + (b * H + h) * S;
      gr.dq = ws.dq.data() + b * S * HD + h * dh;
      gr.lddq = HD;
      if (G == 1) {
        gr.dk = ws.dk.data() + b * S * KD + g * dh;
        gr.dv = ws.dv.data() + b * S * KD + g * dh;
        gr.lddk = gr.lddv = KD;
      } else {
        gr.dk = ws.dk_heads.data() + (b * H + h) * S * dh;
        gr.dv = ws.dv_heads.data() + (b * H + h) * S * dh;
        gr.lddk = gr.lddv = dh;
      }
      kernels::sdpa_backward_delta(gr, dh, 0, S, ws.delta.data() + (b * H + h) * S);
      kernels::sdpa_backward(p, gr, ws.scratch.data() + thread * per);
      if (!p_.sinks.empty()) {
        ws.sink_partial[static_cast<std::size_t>(b * H + h)] =
            kernels::sdpa_sink_grad(p.sink, gr.lse, gr.delta, S);
      }
    });
    for (Index h = 0; h < static_cast<Index>(grads.sinks.size()); ++h) {  // sequences in order
      for (Index b = 0; b < B; ++b) grads.sinks[h] += ws.sink_partial[b * H + h];
    }

    // 3. Per token: sum dK, dV over the heads of each group (ascending), RoPE and norm VJPs,
    //    gate logits scattered back into dqg.
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
      float* pq = has_norm() ? ws.norm_partial.data() + i * (nq + nk) : nullptr;
      float* pk = has_norm() ? pq + nq : nullptr;
      for (Index t = t0; t < t1; ++t) {
        Index const b = t / S, s = t % S;
        float const* cs = ws.rope_cos.data() + t * hr;
        float const* sn = ws.rope_sin.data() + t * hr;
        float const* qg = ws.qg.data() + t * P;
        float* dqg = ws.dqg.data() + t * P;
        for (Index h = 0; h < H; ++h) {
          float* dq = ws.dq.data() + t * HD + h * dh;
          if (!ws.q_temp.empty()) {
            for (Index d = 0; d < dh; ++d) dq[d] *= ws.q_temp[static_cast<std::size_t>(t)];
          }
          if (c_.rope) rotate_backward(dq, cs, sn);
          if (norm_all_heads()) {
            // below, once the heads' RoPE is undone
          } else if (has_norm()) {
            kernels::rms_norm_backward(qg + query_col(h), q_norm_w(), one_plus(),
                                       ws.rstd_q[t * H + h], dh, dq, dqg + query_col(h), pq);
          } else {
            std::copy(dq, dq + dh, dqg + query_col(h));
          }
          if constexpr (gated) {
            float const* dgm = ws.dgate.data() + (t * H + h) * w;
            std::copy(dgm, dgm + w, dqg + gate_col(h));
          }
        }
        if (norm_all_heads()) {  // queries contiguous: columns [0, H d_h) of qg
          kernels::rms_norm_backward(qg, q_norm_w(), one_plus(), ws.rstd_q[t * H], HD,
                                     ws.dq.data() + t * HD, dqg, pq);
        }
        for (Index g = 0; g < KV; ++g) {
          float* dk = ws.dk.data() + t * KD + g * dh;
          float* dv = ws.dv.data() + t * KD + g * dh;
          if (G > 1) {
            for (Index j = 0; j < G; ++j) {
              Index const hh = g * G + j;
              float const* sk = ws.dk_heads.data() + ((b * H + hh) * S + s) * dh;
              float const* sv = ws.dv_heads.data() + ((b * H + hh) * S + s) * dh;
              for (Index c = 0; c < dh; ++c) {
                dk[c] += sk[c];
                dv[c] += sv[c];
              }
            }
          }
          if (c_.rope) rotate_backward(dk, cs, sn);
          float* dkr = ws.dk_raw.data() + t * KD + g * dh;
          if (norm_all_heads()) {
            // below
          } else if (has_norm()) {
            kernels::rms_norm_backward(ws.k_raw.data() + t * KD + g * dh, k_norm_w(), one_plus(),
                                       ws.rstd_k[t * KV + g], dh, dk, dkr, pk);
          } else {
            std::copy(dk, dk + dh, dkr);
          }
        }
        if (norm_all_heads()) {
          kernels::rms_norm_backward(ws.k_raw.data() + t * KD, k_norm_w(), one_plus(),
                                     ws.rstd_k[t * KV], KD, ws.dk.data() + t * KD,
                                     ws.dk_raw.data() + t * KD, pk);
        }
      }
    });

    // 4. Weight gradients, in items of 64 gradient rows.
    auto& items = ws.grad_tasks;
    items.clear();
    ConstMatrixView<float> dqg(ws.dqg.data(), T, P);
    items.add(x, dqg, MatrixView<float>(grads.q_proj.data(), q_proj_rows(), D));
    if (separate_gate()) {
      items.add(x, ConstMatrixView<float>(ws.dqg.data() + HD, T, w * H, P),
                MatrixView<float>(grads.gate_proj.data(), gate_cols(), D));
    }
    items.add(x, ConstMatrixView<float>(ws.dk_raw.data(), T, KD),
              MatrixView<float>(grads.k_proj.data(), KD, D));
    items.add(x, ConstMatrixView<float>(ws.dv.data(), T, KD),
              MatrixView<float>(grads.v_proj.data(), KD, D));
    items.add(ConstMatrixView<float>(o_in, T, HD), dy,
              MatrixView<float>(grads.o_proj.data(), D, HD));
    items.run(pool, ws.grad_scratch);
    if (has_norm()) {  // tile partials summed in tile order
      for (Index i = 0; i < tiles; ++i) {
        float const* part = ws.norm_partial.data() + i * (nq + nk);
        for (Index c = 0; c < nq; ++c) grads.q_norm[c] += part[c];
        for (Index c = 0; c < nk; ++c) grads.k_norm[c] += part[nq + c];
      }
    }
    if (!p_.q_bias.empty()) {
      add_column_sums(ConstMatrixView<float>(ws.dqg.data(), T, q_proj_rows(), P),
                      grads.q_bias.data(), pool);
      add_column_sums(ConstMatrixView<float>(ws.dk_raw.data(), T, KD), grads.k_bias.data(), pool);
      add_column_sums(ConstMatrixView<float>(ws.dv.data(), T, KD), grads.v_bias.data(), pool);
    }
    if (!p_.o_bias.empty()) add_column_sums(dy, grads.o_bias.data(), pool);

    // 5. dx = d[Q|gamma] W_q (+ dgamma W_g) + dK_raw W_k + dV W_v.
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, n = std::min(kTileRows, T - t0);
      float* const dxt = dx.data + t0 * dx.row_stride;
      Index const ldx = dx.row_stride;
      kernels::gemm_strided(n, D, q_proj_rows(), ws.dqg.data() + t0 * P, P, 1, p_.q_proj.data(), D,
                            dxt, ldx, false);
      if (separate_gate()) {
        kernels::gemm_strided(n, D, gate_cols(), ws.dqg.data() + t0 * P + HD, P, 1,
                              p_.gate_proj.data(), D, dxt, ldx, true);
      }
      kernels::gemm_strided(n, D, KD, ws.dk_raw.data() + t0 * KD, KD, 1, p_.k_proj.data(), D, dxt,
                            ldx, true);
      kernels::gemm_strided(n, D, KD, ws.dv.data() + t0 * KD, KD, 1, p_.v_proj.data(), D, dxt, ldx,
                            true);
    });
  }

  /// Drops the packs of pack_weights (before a write: throws once the weights are discarded).
  void unpack() {
    detail::check(!discarded_,
                  "GatedAttention: the projections' fp32 weights were discarded "
                  "(discard_master_weights); this layer is inference-only and cannot be written, "
                  "repacked or trained");
    packs_ = {};
  }

  GatedAttentionConfig c_{};
  /// [rotary_dim / 2] with YaRN or Llama 3 RoPE, else empty (theta^(-2i/d) computed per call)
  std::vector<float> inv_freq_;
  float rope_scale_ = 1.0f;  ///< cos and sin multiplied by it (YaRN's attention factor)
  Parameters p_;
  /// pack_weights: the projections as the engine's packed matrices (all empty: not packed).
  struct Packs {
    Linear q, gate, k, v, o;
  } packs_;
  bool discarded_ = false;  ///< discard_master_weights() was called
};

}  // namespace moe
