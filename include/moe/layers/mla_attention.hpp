// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MlaAttention: multi-head latent attention (DeepSeek-V2 / V3, Kimi K2; transformers'
/// DeepseekV2Attention and DeepseekV3Attention), forward, backward and cached decoding over a
/// latent KV cache in two computation orders (naive and absorbed).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/float16.hpp"
#include "moe/core/in_use.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/rms_norm.hpp"
#include "moe/kernels/rope.hpp"
#include "moe/kernels/sdpa.hpp"
#include "moe/layers/attention_options.hpp"
#include "moe/layers/kv_cache.hpp"
#include "moe/layers/linear.hpp"
#include "moe/layers/stages/work.hpp"

namespace moe {

/// transformers' yarn_get_mscale: 0.1 m ln(s) + 1 for a YaRN factor s > 1, else 1.
inline double yarn_get_mscale(double factor, double m) {
  return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

/// The RoPE scaling of a DeepSeek config's `rope_scaling` {type "yarn", factor,
/// original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}, as
/// transformers' _compute_yarn_parameters reads it: cos and sin are scaled by
/// yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) when both mscale
/// keys are non-zero (DeepSeek-V3: 1 / 1, so 1), else by yarn_get_mscale(factor, 1). Some
/// transformers versions take factor = max_position_embeddings / original_max_position_embeddings
/// instead of the key (DeepSeek-V3: 163840 / 4096 = 40, Kimi K2: 131072 / 4096 = 32: the same).
inline kernels::RopeYarn deepseek_yarn(float factor, Index original_max_position,
                                       float beta_fast = 32.0f, float beta_slow = 1.0f,
                                       float mscale = 1.0f, float mscale_all_dim = 0.0f) {
  kernels::RopeYarn y;
  y.factor = factor;
  y.original_max_position = original_max_position;
  y.beta_fast = beta_fast;
  y.beta_slow = beta_slow;
  if (mscale != 0.0f && mscale_all_dim != 0.0f) {
    y.attention_factor = static_cast<float>(yarn_get_mscale(factor, mscale) /
                                            yarn_get_mscale(factor, mscale_all_dim));
  }
  return y;
}

/// Sizes and options of an MlaAttention layer, named after the keys of DeepseekV3Config /
/// DeepseekV2Config (run-time values).
struct MlaAttentionConfig {
  Index d_model = 0;           ///< D: hidden_size
  Index num_heads = 1;         ///< H: num_attention_heads
  Index q_lora_rank = 0;       ///< r_q: q_lora_rank; 0 = null (V2-Lite: one q_proj)
  Index kv_lora_rank = 0;      ///< R: kv_lora_rank (V3: 512)
  Index qk_nope_head_dim = 0;  ///< d_n (V3: 128)
  Index qk_rope_head_dim = 0;  ///< d_r, even (V3: 64): the rotated dims, key shared by heads
  Index v_head_dim = 0;        ///< d_v (V3: 128)
  float rope_theta = 10000.0f;
  /// RoPE on the pairs (2i, 2i + 1) of the d_r dims (V3's rope_interleave, default true; V2's
  /// complex product is the same rotation) instead of (i, i + d_r / 2). V3 also permutes q_pe
  /// and k_pe to [even | odd] before rotate_half; the same permutation of both changes no
  /// q.k, so the layer does not apply it.
  bool rope_interleave = true;
  /// rope_scaling of type yarn (deepseek_yarn builds it from the config keys): factor 0 = off.
  kernels::RopeYarn yarn = {};
  /// V3's softmax correction: with yarn on and this non-zero (rope_scaling.mscale_all_dim),
  /// scale = qk_head_dim^-1/2 m^2, m = yarn_get_mscale(yarn.factor, softmax_mscale_all_dim).
  /// transformers' DeepseekV2Attention has no such term: leave it 0 for V2.
  float softmax_mscale_all_dim = 0.0f;
  float scale = 0.0f;      ///< softmax scale, finite and > 0; 0 = the rule above
  float norm_eps = 1e-6f;  ///< q_a_layernorm / kv_a_layernorm eps (transformers: the 1e-6 default)
  /// attention_bias: biases on q_a_proj (with q_lora_rank), kv_a_proj_with_mqa and o_proj.
  bool attention_bias = false;
};

/// The two ways cached decoding computes attention (MlaAttention::forward_cached):
/// kNaive expands every cached latent row through kv_b_proj into per-head keys and values;
/// kAbsorbed folds W_UK into the queries and W_UV after the attention, attending over the
/// latent rows themselves; kAuto picks the one with fewer FLOPs (MlaAttention::choose_order).
enum class MlaOrder { kAuto, kNaive, kAbsorbed };

/// What an MlaAttention call writes besides its output, and what forward_train keeps for
/// backward. Reused across calls: it grows to the largest call and then allocates nothing.
struct MlaAttentionWorkspace {
  std::vector<float> qa;               ///< [T, r_q] q_a_proj output (+ bias)
  std::vector<float> qa_n;             ///< [T, r_q] after q_a_layernorm
  std::vector<float> kva;              ///< [T, R + d_r] kv_a_proj_with_mqa output (+ bias)
  std::vector<float> ckv;              ///< [T, R] latent after kv_a_layernorm
  std::vector<float> rstd;             ///< [T, 2] 1/rms of the q and kv norms
  std::vector<float> q;                ///< [T, H d_q] queries (RoPE on each head's last d_r)
  std::vector<float> kvb;              ///< [T, H (d_n + d_v)] kv_b_proj output: k_nope | v per head
  std::vector<float> kpe;              ///< [T, d_r] the shared rotated key part
  std::vector<float> k;                ///< [T, H d_q] keys [k_nope_h | k_pe]
  std::vector<float> attn;             ///< [T, H d_v] attention output (o_proj input)
  std::vector<float> lse;              ///< [batch, H, S] row logsumexp (training)
  std::vector<float> rope_cos;         ///< [T, d_r / 2]
  std::vector<float> rope_sin;         ///< [T, d_r / 2]
  std::vector<float> scratch;          ///< per-thread SDPA scratch
  stages::ProjectionQueue queue;       ///< the projections, on the experts' engine
  LinearInput input;                   ///< a projection's input rows (int8 for quantized packs)
  InUse in_use;                        ///< a second, overlapping call on this workspace throws
  stages::GradTasks grad_tasks;        ///< backward weight-gradient items
  stages::ThreadScratch grad_scratch;  ///< their per-thread scratch

  // Training only.
  std::vector<float> x;                ///< [T, D] copy of the input
  std::vector<std::uint8_t> key_mask;  ///< [T] or empty
  Index batch = 1;
  std::vector<float> dattn;         ///< [T, H d_v] dL/dA
  std::vector<float> dq, dk;        ///< [T, H d_q] dL/dq, dL/dk (then the RoPE VJPs)
  std::vector<float> dkvb;          ///< [T, H (d_n + d_v)] dL/d(kv_b_proj output)
  std::vector<float> dckv;          ///< [T, R] dL/dc^
  std::vector<float> dkva;          ///< [T, R + d_r] dL/d(kv_a_proj output)
  std::vector<float> dqa;           ///< [T, r_q] dL/d(q_a_proj output)
  std::vector<float> delta;         ///< [batch, H, S] the SDPA backward's row terms
  std::vector<float> norm_partial;  ///< [token tiles, r_q + R] norm weight gradients
  stages::Stamp stamp;              ///< whose forward_train filled the training fields

  // forward_cached only.
  std::vector<Index> row_seq, row_pos;  ///< [T] each new row's sequence and position
  std::vector<Index> seq_row0;          ///< [sequences + 1] first new row of each sequence
  std::vector<Index> q_pos;             ///< [T H] the absorbed order's query positions
  std::vector<float> latent;            ///< [T, R + d_r] the new cache rows
  std::vector<float> q_abs;             ///< [T H, R + d_r] absorbed queries [W_UK^T q_nope | q_pe]
  std::vector<float> o_lat;             ///< [T H, R] attention output over the latent rows
  std::vector<float> lat_all;           ///< [L, R + d_r] a bf16 cache's rows widened (naive order)
  std::vector<float> kvb_all;           ///< [L, H (d_n + d_v)] expanded cached rows (naive order)
  std::vector<float> k_all;             ///< [L, H d_q] (naive order)
};

/// Multi-head latent attention (DeepSeek-V2 / V3), causal, as transformers computes it:
///
///   q   = q_b_proj(RMSNorm_qa(x W_qa^T (+ b_qa)))   (q_lora_rank set)  or  x W_q^T
///   [c | k_pe] = x W_kva^T (+ b_kva),  c in R^R, k_pe in R^{d_r}
///   c^ = RMSNorm_kv(c);  [k_nope_h | v_h] = c^ W_kvb,h^T      (per head h)
///   q_h = [q_nope_h | RoPE(q_pe_h)],  k_h = [k_nope_h | RoPE(k_pe)]   (k_pe shared by heads)
///   A_h = softmax(q_h K_h^T * scale + causal mask) V_h;   y = [A_1 .. A_H] W_o^T (+ b_o)
///
/// with d_q = d_n + d_r, RMSNorm(x) = x / sqrt(mean x^2 + eps) * w, RoPE plain or YaRN-scaled on
/// the d_r dims only (rotate-half or interleaved pairs), scale = d_q^-1/2 (times m^2 with V3's
/// softmax_mscale_all_dim, see MlaAttentionConfig).
///
/// | parameter          | shape                   | HF name                           |
/// |--------------------|-------------------------|-----------------------------------|
/// | q_a_proj           | [r_q, D] (q_lora_rank)  | q_a_proj.weight (+ .bias)         |
/// | q_a_layernorm      | [r_q]                   | q_a_layernorm.weight              |
/// | q_b_proj           | [H d_q, r_q]            | q_b_proj.weight                   |
/// | q_proj             | [H d_q, D] (no lora)    | q_proj.weight                     |
/// | kv_a_proj_with_mqa | [R + d_r, D]            | kv_a_proj_with_mqa.weight (+bias) |
/// | kv_a_layernorm     | [R]                     | kv_a_layernorm.weight             |
/// | kv_b_proj          | [H (d_n + d_v), R]      | kv_b_proj.weight                  |
/// | o_proj             | [D, H d_v]              | o_proj.weight (+ .bias)           |
///
/// Rows of q_b_proj / q_proj are head-major [q_nope_h | q_pe_h]; rows of kv_b_proj head-major
/// [k_nope_h (d_n rows) | v_h (d_v rows)]: W_UK,h and W_UV,h. Biases (attention_bias) start at
/// 0, norm weights at 1, projections at 0.
///
/// x, y [T, D] row-major hold `opt.batch` sequences (AttentionOptions: key_mask, positions,
/// pool). Preconditions (moe::Error otherwise): sizes >= 1 (q_lora_rank >= 0), d_r even, finite
/// theta >= 1, a valid yarn, x.cols == D, y [T, D].
///
/// Threads: projections split by output columns, the SDPA by (sequence, head, 64-query chunk),
/// per-token work by 64-token tiles, reductions in a fixed order: forward, backward and
/// forward_cached are bitwise identical for any pool size.
///
/// Training: forward_train keeps x, the projections, the norm factors, q, k, the attention
/// output and its logsumexp; backward recomputes the probabilities block by block
/// (FlashAttention-2) and returns dx and every parameter's gradient (accumulated).
class MlaAttention {
 public:
  static constexpr Index kTileRows = 64;

  /// Every trainable buffer (and, as Gradients, its gradient); empty ones omitted in groups().
  struct Parameters {
    HugePageVector<float> q_a_proj, q_a_bias, q_a_norm, q_b_proj, q_proj;
    HugePageVector<float> kv_a_proj, kv_a_bias, kv_a_norm, kv_b_proj, o_proj, o_bias;
    void zero() { groups().zero(); }
    /// The named buffers in the class table's order, absent (empty) ones omitted.
    ParameterList groups() {
      using Buffer = HugePageVector<float> Parameters::*;
      static constexpr std::pair<char const*, Buffer> kNamed[] = {
          {"q_a_proj.weight", &Parameters::q_a_proj},
          {"q_a_proj.bias", &Parameters::q_a_bias},
          {"q_a_layernorm.weight", &Parameters::q_a_norm},
          {"q_b_proj.weight", &Parameters::q_b_proj},
          {"q_proj.weight", &Parameters::q_proj},
          {"kv_a_proj_with_mqa.weight", &Parameters::kv_a_proj},
          {"kv_a_proj_with_mqa.bias", &Parameters::kv_a_bias},
          {"kv_a_layernorm.weight", &Parameters::kv_a_norm},
          {"kv_b_proj.weight", &Parameters::kv_b_proj},
          {"o_proj.weight", &Parameters::o_proj},
          {"o_proj.bias", &Parameters::o_bias}};
      ParameterList list;
      for (auto const& [name, buffer] : kNamed) list.add_if_present(name, this->*buffer);
      return list;
    }
  };
  using Gradients = Parameters;

  MlaAttention() = default;
  /// A layer with zero projections, unit norm weights and zero biases. Throws moe::Error on a
  /// bad config.
  explicit MlaAttention(MlaAttentionConfig const& config) : c_(config) {
    auto const& c = c_;
    detail::check(c.d_model >= 1 && c.num_heads >= 1 && c.kv_lora_rank >= 1 &&
                      c.qk_nope_head_dim >= 0 && c.qk_rope_head_dim >= 2 && c.v_head_dim >= 1 &&
                      c.q_lora_rank >= 0,
                  "MlaAttention: d_model = ", c.d_model, ", num_heads = ", c.num_heads,
                  ", kv_lora_rank = ", c.kv_lora_rank, ", qk_nope_head_dim = ", c.qk_nope_head_dim,
                  ", qk_rope_head_dim = ", c.qk_rope_head_dim, ", v_head_dim = ", c.v_head_dim,
                  ", q_lora_rank = ", c.q_lora_rank,
                  "; d_model, num_heads, kv_lora_rank and v_head_dim must be >= 1, "
                  "qk_rope_head_dim >= 2, qk_nope_head_dim and q_lora_rank >= 0 (0: no q lora)");
    detail::check(
        c.qk_rope_head_dim % 2 == 0 && std::isfinite(c.rope_theta) && c.rope_theta >= 1.0f,
        "MlaAttention: qk_rope_head_dim = ", c.qk_rope_head_dim, ", rope_theta = ", c.rope_theta,
        "; RoPE needs an even qk_rope_head_dim and a finite theta >= 1");
    kernels::RopeYarn const& y = c.yarn;
    detail::check_yarn(y, "MlaAttention");
    detail::check(std::isfinite(c.norm_eps) && c.norm_eps > 0.0f,
                  "MlaAttention: norm_eps = ", c.norm_eps, "; it must be finite and > 0");
    detail::check(std::isfinite(c.softmax_mscale_all_dim),
                  "MlaAttention: softmax_mscale_all_dim = ", c.softmax_mscale_all_dim,
                  "; it must be finite (0: none)");
    inv_freq_.resize(static_cast<std::size_t>(c.qk_rope_head_dim / 2));
    if (y.enabled()) {
      kernels::rope_yarn_inv_freq(c.rope_theta, c.qk_rope_head_dim, y, inv_freq_.data());
      rope_scale_ = y.scale();
    } else {
      for (Index i = 0; i < c.qk_rope_head_dim / 2; ++i) {  // HF's rounding: as rope_angles
        double const e = static_cast<double>(2 * i) / static_cast<double>(c.qk_rope_head_dim);
        inv_freq_[static_cast<std::size_t>(i)] =
            static_cast<float>(1.0 / std::pow(static_cast<double>(c.rope_theta), e));
      }
    }
    if (c_.scale == 0.0f) {
      double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
      if (y.enabled() && c.softmax_mscale_all_dim != 0.0f) {
        double const m = yarn_get_mscale(y.factor, c.softmax_mscale_all_dim);
        s *= m * m;
      }
      c_.scale = static_cast<float>(s);
    }
    detail::check(std::isfinite(c_.scale) && c_.scale > 0.0f, "MlaAttention: scale = ", c_.scale,
                  "; pass a finite positive scale or 0 for qk_head_dim^-1/2 (times mscale^2)");
    Index const D = c.d_model;
    auto sized = [](Index n, float v = 0.0f) {
      return HugePageVector<float>(static_cast<std::size_t>(n), v);
    };
    if (has_q_lora()) {
      p_.q_a_proj = sized(c.q_lora_rank * D);
      p_.q_a_norm = sized(c.q_lora_rank, 1.0f);
      p_.q_b_proj = sized(q_dim() * c.q_lora_rank);
      if (c.attention_bias) p_.q_a_bias = sized(c.q_lora_rank);
    } else {
      p_.q_proj = sized(q_dim() * D);
    }
    p_.kv_a_proj = sized(latent_dim() * D);
    if (c.attention_bias) p_.kv_a_bias = sized(latent_dim());
    p_.kv_a_norm = sized(c.kv_lora_rank, 1.0f);
    p_.kv_b_proj = sized(kvb_dim() * c.kv_lora_rank);
    p_.o_proj = sized(D * v_dim());
    if (c.attention_bias) p_.o_bias = sized(D);
  }

  /// The config, with scale resolved (the default rule applied).
  MlaAttentionConfig const& config() const { return c_; }
  Index d_model() const { return c_.d_model; }      ///< D
  Index num_heads() const { return c_.num_heads; }  ///< H
  /// d_q = qk_nope_head_dim + qk_rope_head_dim.
  Index qk_head_dim() const { return c_.qk_nope_head_dim + c_.qk_rope_head_dim; }
  /// Floats a latent cache row holds: kv_lora_rank + qk_rope_head_dim.
  Index latent_dim() const { return c_.kv_lora_rank + c_.qk_rope_head_dim; }
  /// The softmax scale in use (config().scale after the default rule).
  float scale() const { return c_.scale; }
  /// q through q_a_proj, q_a_layernorm and q_b_proj (q_lora_rank > 0), or one q_proj.
  bool has_q_lora() const { return c_.q_lora_rank > 0; }

  /// Every trainable parameter as named flat buffers with transformers' names (see the class
  /// comment), in that table's order; absent ones omitted. Drops the packs of pack_weights.
  ParameterList parameters() {
    check_trainable("parameters()");
    packs_ = {};
    return p_.groups();
  }
  /// Zero gradients shaped like parameters().
  Gradients make_gradients() const {
    Gradients g = p_;
    g.zero();
    return g;
  }

  /// Packs the projections (q_a, q_b or q, kv_a, kv_b, o) as moe::Linear matrices in `format`
  /// (kF32 exact, kBf16, or a GGUF block format with its fallback chain) for forward() and
  /// forward_cached(); forward_train, backward and the absorbed order's W_UK / W_UV products
  /// read the fp32 parameters. parameters() drops the packs (they never go stale).
  void pack_weights(experts::WeightFormat format, ThreadPool* pool = nullptr) {
    check_trainable("pack_weights");
    Index const D = c_.d_model, R = c_.kv_lora_rank;
    auto pack = [&](HugePageVector<float> const& w, Index rows, Index depth) {
      return w.empty() ? Linear()
                       : Linear(ConstMatrixView<float>(w.data(), rows, depth), format, {}, pool);
    };
    packs_.q_a = pack(p_.q_a_proj, c_.q_lora_rank, D);
    packs_.q_b = pack(p_.q_b_proj, q_dim(), c_.q_lora_rank);
    packs_.q = pack(p_.q_proj, q_dim(), D);
    packs_.kv_a = pack(p_.kv_a_proj, latent_dim(), D);
    packs_.kv_b = pack(p_.kv_b_proj, kvb_dim(), R);
    packs_.o = pack(p_.o_proj, D, v_dim());
  }
  /// Are the projections packed (pack_weights, and no parameters() call since)?
  bool packed() const { return !packs_.o.empty(); }
  /// For an inference-only layer (a decoder's): frees the fp32 weights of the packed projections
  /// q_a, q_b (or q), kv_a and o; kv_b_proj stays (the absorbed order reads W_UK and W_UV from it),
  /// as do the norms and biases. Needs packed(); afterwards forward_train, backward,
  /// parameters() and pack_weights throw moe::Error.
  void discard_master_weights() {
    detail::check(packed(),
                  "MlaAttention::discard_master_weights: the projections are not packed; call "
                  "pack_weights first (inference reads the packs)");
    for (HugePageVector<float>* w :
         {&p_.q_a_proj, &p_.q_b_proj, &p_.q_proj, &p_.kv_a_proj, &p_.o_proj}) {
      HugePageVector<float>().swap(*w);
    }
    discarded_ = true;
  }
  /// Can the layer train (its fp32 weights were not discarded)?
  bool has_master_weights() const { return !discarded_; }
  /// The format of the packed projections (kF32 when not packed).
  experts::WeightFormat weight_format() const {
    return packed() ? packs_.o.format() : experts::WeightFormat::kF32;
  }
  /// Bytes of the projections a decode step streams: the packs (or the fp32 weights when not
  /// packed); the absorbed order also reads the fp32 kv_b_proj (W_UK, W_UV), counted too.
  std::size_t projection_bytes() const {
    auto f32 = [](HugePageVector<float> const& w) { return w.size() * sizeof(float); };
    if (!packed()) {
      return f32(p_.q_a_proj) + f32(p_.q_b_proj) + f32(p_.q_proj) + f32(p_.kv_a_proj) +
             f32(p_.kv_b_proj) + f32(p_.o_proj);
    }
    return packs_.q_a.bytes() + packs_.q_b.bytes() + packs_.q.bytes() + packs_.kv_a.bytes() +
           packs_.kv_b.bytes() + packs_.o.bytes() + f32(p_.kv_b_proj);
  }

  /// A latent cache for `sequences` sequences: kv_lora_rank + qk_rope_head_dim values a token
  /// ([c^ | RoPE(k_pe)], the normed latent and the rotated shared key), fp32 or bf16, room for
  /// `capacity` tokens each (it grows as needed). bytes_per_token() = 4 (R + d_r), or 2 (R + d_r)
  /// in bf16: DeepSeek-V3's 576 values a token and layer against the H (d_q + d_v) = 40960 of
  /// the per-head keys and values it expands to (71x fewer bytes).
  KvCache make_cache(Index sequences, Index capacity = 0, KvFormat format = KvFormat::kF32) const {
    return KvCache::keys_only(sequences, latent_dim(), capacity, format);
  }

  /// y = MlaAttention(x), causal. See the class comment.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, MlaAttentionWorkspace& ws,
               AttentionOptions const& opt = {}) const {
    checked_forward(x, y, ws, opt, false);
  }
  /// forward() that also keeps in `ws` what backward needs (fp32 parameters, never the packs).
  void forward_train(ConstMatrixView<float> x, MatrixView<float> y, MlaAttentionWorkspace& ws,
                     AttentionOptions const& opt = {}) const {
    checked_forward(x, y, ws, opt, true);
  }

  /// Backward of the last forward_train on `ws`: dx [T, D] = dL/dx (overwritten) and every
  /// parameter gradient accumulated (+=) into `grads` (make_gradients()), given dy = dL/dy.
  /// Bitwise identical for any pool size. Call once per forward_train.
  void backward(MlaAttentionWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                Gradients& grads, ThreadPool* pool = nullptr) const {
    auto const busy = ws.in_use.enter("MlaAttention::backward");
    check_trainable("backward");
    detail::check(ws.stamp.filled() && ws.stamp.layer == this,
                  "MlaAttention::backward: the workspace holds no training forward of this "
                  "layer; call its forward_train first (and backward once per forward)");
    Index const D = c_.d_model, T = static_cast<Index>(ws.x.size()) / D;
    detail::check(dy.rows == T && dy.cols == D && dx.rows == T && dx.cols == D,
                  "MlaAttention::backward: dy and dx must be [", T, ", ", D,
                  "] like the forward's x; got dy [", dy.rows, ", ", dy.cols, "], dx [", dx.rows,
                  ", ", dx.cols, "]");
    bool const same =
        grads.q_a_proj.size() == p_.q_a_proj.size() &&
        grads.q_a_bias.size() == p_.q_a_bias.size() &&
        grads.q_a_norm.size() == p_.q_a_norm.size() &&
        grads.q_b_proj.size() == p_.q_b_proj.size() && grads.q_proj.size() == p_.q_proj.size() &&
        grads.kv_a_proj.size() == p_.kv_a_proj.size() &&
        grads.kv_a_bias.size() == p_.kv_a_bias.size() &&
        grads.kv_a_norm.size() == p_.kv_a_norm.size() &&
        grads.kv_b_proj.size() == p_.kv_b_proj.size() && grads.o_proj.size() == p_.o_proj.size() &&
        grads.o_bias.size() == p_.o_bias.size();
    detail::check(same,
                  "MlaAttention::backward: gradients do not match this layer; use "
                  "make_gradients()");
    ws.stamp = {};
    run_backward(ws, dy, dx, grads, pool);
  }

  /// Floating-point operations of one forward_cached call on a sequence with `context` tokens
  /// cached before it and `new_tokens` new ones, per order (multiply-adds count 2), with
  /// P = new_tokens * context + new_tokens (new_tokens + 1) / 2 visible (query, key) pairs:
  ///   naive:    2 L R H (d_n + d_v)           expand the L = context + new_tokens latent rows
  ///           + 2 P H (d_q + d_v)             attention over per-head keys and values
  ///   absorbed: 2 n H R (d_n + d_v)           W_UK into the queries, W_UV after
  ///           + 2 P H (2 R + d_r)             attention over the latent rows (keys R + d_r,
  ///                                           values R)
  /// (the projections both share are left out).
  double cached_flops(MlaOrder order, Index new_tokens, Index context) const {
    double const n = static_cast<double>(new_tokens), L = static_cast<double>(context) + n;
    double const pairs = n * static_cast<double>(context) + n * (n + 1.0) / 2.0;
    double const H = static_cast<double>(c_.num_heads), R = static_cast<double>(c_.kv_lora_rank);
    double const dn = static_cast<double>(c_.qk_nope_head_dim),
                 dr = static_cast<double>(c_.qk_rope_head_dim),
                 dv = static_cast<double>(c_.v_head_dim);
    if (order == MlaOrder::kNaive)
      return 2.0 * L * R * H * (dn + dv) + 2.0 * pairs * H * (dn + dr + dv);
    return 2.0 * n * H * R * (dn + dv) + 2.0 * pairs * H * (2.0 * R + dr);
  }
  /// The rule of MlaOrder::kAuto: kAbsorbed when its cached_flops is at most the naive order's
  /// (summed over the call's sequences), kNaive otherwise. With n new tokens on a long context
  /// (context >> n) the absorbed order wins while n (2 R + d_r - d_q - d_v) < R (d_n + d_v):
  /// decode steps always, DeepSeek-V3 (R 512, d_n = d_v 128, d_r 64) up to ~170 new tokens; a
  /// prefill from an empty cache (context 0) goes naive whenever 2 R > d_n + d_v.
  MlaOrder choose_order(std::span<Index const> new_tokens, KvCache const& cache) const {
    double naive = 0.0, absorbed = 0.0;
    for (Index s = 0; s < static_cast<Index>(new_tokens.size()); ++s) {
      Index const n = new_tokens[static_cast<std::size_t>(s)];
      if (n == 0) continue;
      naive += cached_flops(MlaOrder::kNaive, n, cache.length(s));
      absorbed += cached_flops(MlaOrder::kAbsorbed, n, cache.length(s));
    }
    return absorbed <= naive ? MlaOrder::kAbsorbed : MlaOrder::kNaive;
  }

  /// Decoding with a latent cache (make_cache): x [T, D] holds new tokens of the cache's
  /// sequences, new_tokens[s] of sequence s (in order; sum = T, any may be 0), at positions
  /// length(s) .. length(s) + new_tokens[s] - 1. Their latent rows [c^ | RoPE(k_pe)] are
  /// appended (rounded to bf16 in a bf16 cache), each new query attends causally to its
  /// sequence's cached prefix and the new tokens up to itself, and y [T, D] gets the outputs (y
  /// may be x; with `accumulate`, y += the outputs, y must not be x then). `order` picks the
  /// computation (kAuto: choose_order). Both orders give forward()'s last rows over the whole
  /// sequence up to float rounding (the projections' few-row path, the re-association of
  /// W_UK / W_UV; tested within 2e-5 relative to the output's scale). Throws moe::Error for a
  /// cache of another width, a cache with a window, or bad new_tokens.
  void forward_cached(ConstMatrixView<float> x, MatrixView<float> y, KvCache& cache,
                      std::span<Index const> new_tokens, MlaAttentionWorkspace& ws,
                      ThreadPool* pool = nullptr, MlaOrder order = MlaOrder::kAuto,
                      bool accumulate = false) const {
    auto const busy = ws.in_use.enter("MlaAttention::forward_cached");
    check_call(x, y, {});
    detail::check(!accumulate || x.data != y.data || x.rows == 0,
                  "MlaAttention::forward_cached: accumulate adds the output to y, so y must not "
                  "be x");
    detail::check(cache.key_dim() == latent_dim() && cache.value_dim() == 0 && cache.window() == 0,
                  "MlaAttention::forward_cached: the cache holds keys of ", cache.key_dim(),
                  " floats and values of ", cache.value_dim(), " (window ", cache.window(),
                  "); this layer needs a latent cache of kv_lora_rank + qk_rope_head_dim = ",
                  latent_dim(), " floats and no window: make it with make_cache()");
    detail::check_new_tokens(cache, new_tokens, x.rows, "MlaAttention");
    if (order == MlaOrder::kAuto) order = choose_order(new_tokens, cache);
    run_cached(x, y, cache, new_tokens, ws, pool, order, accumulate);
    ws.stamp = {};
  }

 private:
  Index q_dim() const { return c_.num_heads * qk_head_dim(); }
  Index kvb_dim() const { return c_.num_heads * (c_.qk_nope_head_dim + c_.v_head_dim); }
  Index v_dim() const { return c_.num_heads * c_.v_head_dim; }
  Index half_rot() const { return c_.qk_rope_head_dim / 2; }
  static int threads_of(ThreadPool* pool) { return pool ? pool->size() : 1; }
  /// Workspace buffers and their sizes (floats).
  using Sized = std::pair<std::vector<float>*, Index>;
  static void resize_all(std::initializer_list<Sized> buffers) {
    for (auto const& [v, n] : buffers) v->resize(static_cast<std::size_t>(n));
  }
  static void zero_all(std::initializer_list<Sized> buffers) {
    for (auto const& [v, n] : buffers) v->assign(static_cast<std::size_t>(n), 0.0f);
  }
  Index scratch_floats() const {
    Index n = kernels::sdpa_scratch_size(std::max(qk_head_dim(), latent_dim()),
                                         std::max(c_.v_head_dim, c_.kv_lora_rank));
    return (n + 15) / 16 * 16;
  }
  void rotate(float* x, float const* cs, float const* sn) const {
    kernels::rope_rotate(x, cs, sn, c_.qk_rope_head_dim, c_.rope_interleave);
  }
  void rotate_backward(float* dx, float const* cs, float const* sn) const {
    kernels::rope_rotate_backward(dx, cs, sn, c_.qk_rope_head_dim, c_.rope_interleave);
  }

  void check_call(ConstMatrixView<float> x, MatrixView<float> y,
                  AttentionOptions const& opt) const {
    detail::check(!p_.kv_a_proj.empty() || discarded_,
                  "MlaAttention: the layer was default-constructed; "
                  "construct it from an MlaAttentionConfig first");
    detail::check_attention_call(x, y, c_.d_model, opt, "MlaAttention");
  }

  /// Runs one projection on ws.queue (the rows of a prepared once per call).
  void project(ConstMatrixView<float> a, Linear const& pack, HugePageVector<float> const& w,
               Index rows_w, float* c, Index ldc, HugePageVector<float> const& bias,
               MlaAttentionWorkspace& ws, bool inference, ThreadPool* pool,
               bool accumulate = false) const {
    kernels::RowSource const src = ws.input.prepare(a, inference && pack.quantized(), pool);
    ws.queue.add(detail::projection_job(src, a.rows, pack, w.data(), rows_w, a.cols, c, ldc,
                                        inference, bias.empty() ? nullptr : bias.data(),
                                        accumulate));
    ws.queue.run<experts::SwiGlu, experts::SwiGlu>(pool);
  }

  /// Steps 1-2 of every forward: q_a / q and kv_a from x; the two RMSNorms; q_b from the normed
  /// q latent; with `expand`, kv_b of the normed kv latent into ws.kvb.
  void run_projections(ConstMatrixView<float> x, MlaAttentionWorkspace& ws, bool inference,
                       bool expand, ThreadPool* pool) const {
    Index const T = x.rows, ql = c_.q_lora_rank, R = c_.kv_lora_rank, LD = latent_dim();
    Index const QD = q_dim(), KB = kvb_dim();
    resize_all({{&ws.qa, T * ql},
                {&ws.qa_n, T * ql},
                {&ws.kva, T * LD},
                {&ws.ckv, T * R},
                {&ws.rstd, T * 2},
                {&ws.q, T * QD},
                {&ws.kvb, expand ? T * KB : 0},
                {&ws.kpe, T * c_.qk_rope_head_dim},
                {&ws.attn, T * v_dim()},
                {&ws.rope_cos, T * half_rot()},
                {&ws.rope_sin, T * half_rot()},
                {&ws.scratch, threads_of(pool) * scratch_floats()}});
    if (T == 0) return;
    if (has_q_lora()) {
      project(x, packs_.q_a, p_.q_a_proj, ql, ws.qa.data(), ql, p_.q_a_bias, ws, inference, pool);
    } else {
      project(x, packs_.q, p_.q_proj, QD, ws.q.data(), QD, {}, ws, inference, pool);
    }
    project(x, packs_.kv_a, p_.kv_a_proj, LD, ws.kva.data(), LD, p_.kv_a_bias, ws, inference, pool);
    Index const tiles = (T + kTileRows - 1) / kTileRows;
    parallel_for(pool, tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        if (has_q_lora()) {
          ws.rstd[2 * t] = kernels::rms_norm(ws.qa.data() + t * ql, p_.q_a_norm.data(), false,
                                             c_.norm_eps, ql, ws.qa_n.data() + t * ql);
        }
        ws.rstd[2 * t + 1] = kernels::rms_norm(ws.kva.data() + t * LD, p_.kv_a_norm.data(), false,
                                               c_.norm_eps, R, ws.ckv.data() + t * R);
      }
    });
    if (has_q_lora()) {
      project(ConstMatrixView<float>(ws.qa_n.data(), T, ql), packs_.q_b, p_.q_b_proj, QD,
              ws.q.data(), QD, {}, ws, inference, pool);
    }
    if (expand) {
      project(ConstMatrixView<float>(ws.ckv.data(), T, R), packs_.kv_b, p_.kv_b_proj, KB,
              ws.kvb.data(), KB, {}, ws, inference, pool);
    }
  }

  /// RoPE angles of row t at position pos into ws.rope_cos / rope_sin; the query heads' d_r
  /// dims rotated in place; the shared key part rotated into ws.kpe.
  void rotate_row(MlaAttentionWorkspace& ws, Index t, Index pos) const {
    Index const hr = half_rot(), dq = qk_head_dim(), dn = c_.qk_nope_head_dim;
    Index const dr = c_.qk_rope_head_dim, R = c_.kv_lora_rank, LD = latent_dim();
    float* cs = ws.rope_cos.data() + t * hr;
    float* sn = ws.rope_sin.data() + t * hr;
    kernels::rope_angles(pos, inv_freq_.data(), rope_scale_, c_.qk_rope_head_dim, cs, sn);
    for (Index h = 0; h < c_.num_heads; ++h)
      rotate(ws.q.data() + t * q_dim() + h * dq + dn, cs, sn);
    float* kpe = ws.kpe.data() + t * dr;
    std::copy(ws.kva.data() + t * LD + R, ws.kva.data() + t * LD + R + dr, kpe);
    rotate(kpe, cs, sn);
  }

  /// Per-head keys [k_nope_h | k_pe] of `rows` rows: k_nope from kvb [rows, H (d_n + d_v)], the
  /// shared rotated part from kpe (row stride ld_kpe), into k [rows, H d_q].
  void build_keys(float const* kvb, float const* kpe, Index ld_kpe, Index rows, float* k) const {
    Index const dq = qk_head_dim(), dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim;
    Index const KB = kvb_dim(), QD = q_dim(), dkv = dn + c_.v_head_dim;
    for (Index t = 0; t < rows; ++t) {
      for (Index h = 0; h < c_.num_heads; ++h) {
        float* kh = k + t * QD + h * dq;
        std::copy(kvb + t * KB + h * dkv, kvb + t * KB + h * dkv + dn, kh);
        std::copy(kpe + t * ld_kpe, kpe + t * ld_kpe + dr, kh + dn);
      }
    }
  }

  /// SDPA parameters of head h over keys k [kv_rows, H d_q] and kvb's values.
  kernels::SdpaParams head_params(float const* q, float const* k, float const* kvb, Index h,
                                  Index q_rows, Index kv_rows) const {
    Index const dq = qk_head_dim(), dkv = c_.qk_nope_head_dim + c_.v_head_dim;
    kernels::SdpaParams p;
    p.q = q + h * dq;
    p.ldq = q_dim();
    p.k = k + h * dq;
    p.ldk = q_dim();
    p.v = kvb + h * dkv + c_.qk_nope_head_dim;
    p.ldv = kvb_dim();
    p.q_rows = q_rows;
    p.kv_rows = kv_rows;
    p.head_dim = dq;
    p.value_dim = c_.v_head_dim;
    p.scale = c_.scale;
    p.causal = true;
    return p;
  }

  /// forward / forward_train: the checks, what training keeps, the stamp backward checks.
  void checked_forward(ConstMatrixView<float> x, MatrixView<float> y, MlaAttentionWorkspace& ws,
                       AttentionOptions const& opt, bool train) const {
    auto const busy =
        ws.in_use.enter(train ? "MlaAttention::forward_train" : "MlaAttention::forward");
    check_call(x, y, opt);
    if (train) check_trainable("forward_train");
    ws.stamp = {};
    if (!train) {
      run_forward(x, y, ws, opt, false);
      return;
    }
    AttentionOptions const o = detail::keep_training_input(x, opt, ws.x, ws.key_mask);
    ws.batch = opt.batch;
    run_forward(ConstMatrixView<float>(ws.x.data(), x.rows, c_.d_model), y, ws, o, true);
    ws.stamp = {this, x.rows, c_.d_model, c_.num_heads, qk_head_dim()};
  }

  void run_forward(ConstMatrixView<float> x, MatrixView<float> y, MlaAttentionWorkspace& ws,
                   AttentionOptions const& opt, bool train) const {
    Index const T = x.rows, H = c_.num_heads, B = opt.batch, S = B > 0 ? T / B : 0;
    Index const QD = q_dim(), VD = v_dim(), KB = kvb_dim(), dv = c_.v_head_dim;
    ThreadPool* pool = opt.pool;
    resize_all({{&ws.k, T * QD}, {&ws.lse, train ? T * H : 0}});
    Index const per = scratch_floats();
    run_projections(x, ws, !train, true, pool);
    if (T == 0) return;

    Index const tiles = (T + kTileRows - 1) / kTileRows;
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
      for (Index t = t0; t < t1; ++t)
        rotate_row(ws, t, opt.positions.empty() ? t % S : opt.positions[t]);
      build_keys(ws.kvb.data() + t0 * KB, ws.kpe.data() + t0 * c_.qk_rope_head_dim,
                 c_.qk_rope_head_dim, t1 - t0, ws.k.data() + t0 * QD);
    });

    std::uint8_t const* mask = opt.key_mask.empty() ? nullptr : opt.key_mask.data();
    Index const chunks = (S + kTileRows - 1) / kTileRows;
    parallel_for(pool, B * H * chunks, [&](Index i, int thread) {
      Index const b = i / (H * chunks), h = (i / chunks) % H, ch = i % chunks;
      Index const r0 = ch * kTileRows, r1 = std::min(S, r0 + kTileRows);
      kernels::SdpaParams p = head_params(ws.q.data() + b * S * QD, ws.k.data() + b * S * QD,
                                          ws.kvb.data() + b * S * KB, h, S, S);
      p.key_mask = mask ? mask + b * S : nullptr;
      kernels::sdpa_forward(p, ws.attn.data() + b * S * VD + h * dv, VD,
                            train ? ws.lse.data() + (b * H + h) * S : nullptr, r0, r1,
                            ws.scratch.data() + thread * per);
    });

    project(ConstMatrixView<float>(ws.attn.data(), T, VD), packs_.o, p_.o_proj, c_.d_model, y.data,
            y.row_stride, p_.o_bias, ws, !train, pool);
  }

  void run_backward(MlaAttentionWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                    Gradients& grads, ThreadPool* pool) const {
    Index const D = c_.d_model, H = c_.num_heads, T = static_cast<Index>(ws.x.size()) / D;
    Index const B = ws.batch, S = T / B, ql = c_.q_lora_rank, R = c_.kv_lora_rank;
    Index const LD = latent_dim(), QD = q_dim(), VD = v_dim(), KB = kvb_dim();
    Index const dq = qk_head_dim(), dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim;
    Index const dv = c_.v_head_dim, dkv = dn + dv, hr = half_rot();
    Index const tiles = (T + kTileRows - 1) / kTileRows, per = scratch_floats();
    resize_all({{&ws.dattn, T * VD},
                {&ws.dckv, T * R},
                {&ws.dkva, T * LD},
                {&ws.dqa, T * ql},
                {&ws.delta, T * H},
                {&ws.scratch, threads_of(pool) * per}});
    zero_all({{&ws.dq, T * QD},
              {&ws.dk, T * QD},
              {&ws.dkvb, T * KB},
              {&ws.norm_partial, tiles * (ql + R)}});
    if (T == 0) return;
    ConstMatrixView<float> x(ws.x.data(), T, D);

    // 1. dA = dy W_o.
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, n = std::min(kTileRows, T - t0);
      kernels::gemm_strided(n, VD, D, dy.data + t0 * dy.row_stride, dy.row_stride, 1,
                            p_.o_proj.data(), VD, ws.dattn.data() + t0 * VD, VD, false);
    });

    // 2. SDPA backward per (sequence, head): dq, dk into [T, H d_q], dv into dkvb's v columns.
    parallel_for(pool, B * H, [&](Index i, int thread) {
      Index const b = i / H, h = i % H;
      kernels::SdpaParams p = head_params(ws.q.data() + b * S * QD, ws.k.data() + b * S * QD,
                                          ws.kvb.data() + b * S * KB, h, S, S);
      p.key_mask = ws.key_mask.empty() ? nullptr : ws.key_mask.data() + b * S;
      Index const row = b * S, head = b * H + h;
      kernels::SdpaGrads const g{.o = ws.attn.data() + row * VD + h * dv,
                                 .ldo = VD,
                                 .dout = ws.dattn.data() + row * VD + h * dv,
                                 .lddo = VD,
                                 .lse = ws.lse.data() + head * S,
                                 .delta = ws.delta.data() + head * S,
                                 .dq = ws.dq.data() + row * QD + h * dq,
                                 .lddq = QD,
                                 .dk = ws.dk.data() + row * QD + h * dq,
                                 .lddk = QD,
                                 .dv = ws.dkvb.data() + row * KB + h * dkv + dn,
                                 .lddv = KB};
      kernels::sdpa_backward_delta(g, dv, 0, S, ws.delta.data() + (b * H + h) * S);
      kernels::sdpa_backward(p, g, ws.scratch.data() + thread * per);
    });

    // 3. Per token: RoPE VJPs (queries in place; the shared key part summed over heads in
    //    ascending order), dk_nope into dkvb, dc^ = dkvb W_kvb, the RMSNorm VJPs (weight
    //    gradients per tile), dqa_n = dq W_qb.
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows), n = t1 - t0;
      float* part = ws.norm_partial.data() + i * (ql + R);
      for (Index t = t0; t < t1; ++t) {
        float const* cs = ws.rope_cos.data() + t * hr;
        float const* sn = ws.rope_sin.data() + t * hr;
        float* dkpe = ws.dkva.data() + t * LD + R;
        std::fill(dkpe, dkpe + dr, 0.0f);
        for (Index h = 0; h < H; ++h) {
          rotate_backward(ws.dq.data() + t * QD + h * dq + dn, cs, sn);
          float const* dkh = ws.dk.data() + t * QD + h * dq;
          std::copy(dkh, dkh + dn, ws.dkvb.data() + t * KB + h * dkv);
          for (Index c = 0; c < dr; ++c) dkpe[c] += dkh[dn + c];
        }
        rotate_backward(dkpe, cs, sn);
      }
      kernels::gemm_strided(n, R, KB, ws.dkvb.data() + t0 * KB, KB, 1, p_.kv_b_proj.data(), R,
                            ws.dckv.data() + t0 * R, R, false);
      if (has_q_lora()) {
        kernels::gemm_strided(n, ql, QD, ws.dq.data() + t0 * QD, QD, 1, p_.q_b_proj.data(), ql,
                              ws.dqa.data() + t0 * ql, ql, false);
      }
      for (Index t = t0; t < t1; ++t) {
        kernels::rms_norm_backward(ws.kva.data() + t * LD, p_.kv_a_norm.data(), false,
                                   ws.rstd[2 * t + 1], R, ws.dckv.data() + t * R,
                                   ws.dkva.data() + t * LD, part + ql);
        if (has_q_lora()) {
          kernels::rms_norm_backward(ws.qa.data() + t * ql, p_.q_a_norm.data(), false,
                                     ws.rstd[2 * t], ql, ws.dqa.data() + t * ql,
                                     ws.dqa.data() + t * ql, part);
        }
      }
    });

    // 4. Weight gradients.
    auto& items = ws.grad_tasks;
    items.clear();
    ConstMatrixView<float> dkva(ws.dkva.data(), T, LD), dqm(ws.dq.data(), T, QD);
    ConstMatrixView<float> dqa(ws.dqa.data(), T, ql);
    if (has_q_lora()) {
      items.add(x, dqa, MatrixView<float>(grads.q_a_proj.data(), ql, D));
      if (!grads.q_a_bias.empty()) items.add_bias(dqa, grads.q_a_bias);
      items.add(ConstMatrixView<float>(ws.qa_n.data(), T, ql), dqm,
                MatrixView<float>(grads.q_b_proj.data(), QD, ql));
    } else {
      items.add(x, dqm, MatrixView<float>(grads.q_proj.data(), QD, D));
    }
    items.add(x, dkva, MatrixView<float>(grads.kv_a_proj.data(), LD, D));
    if (!grads.kv_a_bias.empty()) items.add_bias(dkva, grads.kv_a_bias);
    items.add(ConstMatrixView<float>(ws.ckv.data(), T, R),
              ConstMatrixView<float>(ws.dkvb.data(), T, KB),
              MatrixView<float>(grads.kv_b_proj.data(), KB, R));
    items.add(ConstMatrixView<float>(ws.attn.data(), T, VD), dy,
              MatrixView<float>(grads.o_proj.data(), D, VD));
    if (!grads.o_bias.empty()) items.add_bias(dy, grads.o_bias);
    items.run(pool, ws.grad_scratch);
    for (Index i = 0; i < tiles; ++i) {  // norm partials in tile order
      float const* part = ws.norm_partial.data() + i * (ql + R);
      for (Index c = 0; c < ql; ++c) grads.q_a_norm[static_cast<std::size_t>(c)] += part[c];
      for (Index c = 0; c < R; ++c) grads.kv_a_norm[static_cast<std::size_t>(c)] += part[ql + c];
    }

    // 5. dx = dqa W_qa (or dq W_q) + dkva W_kva.
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, n = std::min(kTileRows, T - t0);
      float* const dxt = dx.data + t0 * dx.row_stride;
      if (has_q_lora()) {
        kernels::gemm_strided(n, D, ql, ws.dqa.data() + t0 * ql, ql, 1, p_.q_a_proj.data(), D, dxt,
                              dx.row_stride, false);
      } else {
        kernels::gemm_strided(n, D, QD, ws.dq.data() + t0 * QD, QD, 1, p_.q_proj.data(), D, dxt,
                              dx.row_stride, false);
      }
      kernels::gemm_strided(n, D, LD, ws.dkva.data() + t0 * LD, LD, 1, p_.kv_a_proj.data(), D, dxt,
                            dx.row_stride, true);
    });
  }

  void run_cached(ConstMatrixView<float> x, MatrixView<float> y, KvCache& cache,
                  std::span<Index const> new_tokens, MlaAttentionWorkspace& ws, ThreadPool* pool,
                  MlaOrder order, bool accumulate) const {
    Index const T = x.rows, B = cache.sequences(), R = c_.kv_lora_rank;
    Index const LD = latent_dim(), VD = v_dim(), dr = c_.qk_rope_head_dim;
    ws.latent.resize(static_cast<std::size_t>(T * LD));
    detail::place_new_rows(cache, new_tokens, T, ws.row_seq, ws.row_pos, ws.seq_row0);
    if (T == 0) return;
    run_projections(x, ws, true, false, pool);

    // New latent rows [c^ | RoPE(k_pe)] into the cache; queries rotated.
    Index const tiles = (T + kTileRows - 1) / kTileRows;
    parallel_for(pool, tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        Index const s = ws.row_seq[static_cast<std::size_t>(t)];
        Index const pos = ws.row_pos[static_cast<std::size_t>(t)];
        rotate_row(ws, t, pos);
        float* row = ws.latent.data() + t * LD;
        std::copy(ws.ckv.data() + t * R, ws.ckv.data() + (t + 1) * R, row);
        std::copy(ws.kpe.data() + t * dr, ws.kpe.data() + (t + 1) * dr, row + R);
        cache.store_key(s, pos, row);
      }
    });

    if (order == MlaOrder::kAbsorbed) {
      attend_absorbed(cache, new_tokens, ws, pool);
    } else {
      attend_naive(cache, new_tokens, ws, pool);
    }
    for (Index s = 0; s < B; ++s) cache.advance(s, new_tokens[static_cast<std::size_t>(s)]);
    project(ConstMatrixView<float>(ws.attn.data(), T, VD), packs_.o, p_.o_proj, c_.d_model, y.data,
            y.row_stride, p_.o_bias, ws, true, pool, accumulate);
  }

  /// Cached rows [0, rows) of sequence s as fp32 [rows, R + d_r]: the cache itself (fp32), or
  /// widened into `buf` (bf16).
  float const* latent_rows(KvCache const& cache, Index s, Index rows,
                           std::vector<float>& buf) const {
    if (!cache.is_bf16()) return cache.key_data(s);
    Index const n = rows * latent_dim();
    buf.resize(static_cast<std::size_t>(n));
    std::uint16_t const* src = cache.key_data_bf16(s);
    for (Index i = 0; i < n; ++i) buf[static_cast<std::size_t>(i)] = bf16_to_float(src[i]);
    return buf.data();
  }

  /// Naive order: per sequence, every cached latent row expanded through kv_b_proj into
  /// per-head keys [k_nope_h | k_pe] and values, then the SDPA of the new query rows.
  void attend_naive(KvCache const& cache, std::span<Index const> new_tokens,
                    MlaAttentionWorkspace& ws, ThreadPool* pool) const {
    Index const H = c_.num_heads, R = c_.kv_lora_rank, LD = latent_dim(), QD = q_dim();
    Index const VD = v_dim(), KB = kvb_dim(), dv = c_.v_head_dim, per = scratch_floats();
    for (Index s = 0; s < cache.sequences(); ++s) {
      Index const n = new_tokens[static_cast<std::size_t>(s)];
      if (n == 0) continue;
      Index const len = cache.length(s), L = len + n;
      Index const row0 = ws.seq_row0[static_cast<std::size_t>(s)];
      float const* lat = latent_rows(cache, s, L, ws.lat_all);
      ws.kvb_all.resize(static_cast<std::size_t>(L * KB));
      ws.k_all.resize(static_cast<std::size_t>(L * QD));
      project(ConstMatrixView<float>(lat, L, R, LD), packs_.kv_b, p_.kv_b_proj, KB,
              ws.kvb_all.data(), KB, {}, ws, true, pool);
      Index const tiles = (L + kTileRows - 1) / kTileRows;
      parallel_for(pool, tiles, [&](Index i, int) {
        Index const t0 = i * kTileRows, m = std::min(kTileRows, L - t0);
        build_keys(ws.kvb_all.data() + t0 * KB, lat + t0 * LD + R, LD, m,
                   ws.k_all.data() + t0 * QD);
      });
      Index const chunks = (n + kTileRows - 1) / kTileRows;
      parallel_for(pool, H * chunks, [&](Index i, int thread) {
        Index const h = i / chunks, r0 = (i % chunks) * kTileRows;
        kernels::SdpaParams p =
            head_params(ws.q.data() + row0 * QD, ws.k_all.data(), ws.kvb_all.data(), h, n, L);
        p.causal_offset = len;
        kernels::sdpa_forward(p, ws.attn.data() + row0 * VD + h * dv, VD, nullptr, r0,
                              std::min(n, r0 + kTileRows), ws.scratch.data() + thread * per);
      });
    }
  }

  /// Absorbed order: q_lat,h = W_UK,h^T q_nope,h; the H heads of a token attend as H query
  /// rows [q_lat,h | q_pe,h] over the sequence's latent rows (keys [c^ | k_pe], values c^);
  /// then A_h = W_UV,h o_lat,h.
  void attend_absorbed(KvCache const& cache, std::span<Index const> new_tokens,
                       MlaAttentionWorkspace& ws, ThreadPool* pool) const {
    Index const T = static_cast<Index>(ws.row_seq.size()), H = c_.num_heads, R = c_.kv_lora_rank;
    Index const LD = latent_dim(), QD = q_dim(), VD = v_dim(), dq = qk_head_dim();
    Index const dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim, dv = c_.v_head_dim;
    Index const dkv = dn + dv, per = scratch_floats();
    ws.q_abs.resize(static_cast<std::size_t>(T * H * LD));
    ws.o_lat.resize(static_cast<std::size_t>(T * H * R));
    ws.q_pos.resize(static_cast<std::size_t>(T * H));
    // q_lat [T, R] of head h = q_nope,h [T, d_n] W_UK,h [d_n, R] (rows of kv_b_proj).
    parallel_for(pool, H, [&](Index h, int) {
      float* out = ws.q_abs.data() + h * LD;
      if (dn > 0) {
        kernels::gemm_strided(T, R, dn, ws.q.data() + h * dq, QD, 1,
                              p_.kv_b_proj.data() + h * dkv * R, R, out, H * LD, false);
      } else {
        for (Index t = 0; t < T; ++t) std::fill(out + t * H * LD, out + t * H * LD + R, 0.0f);
      }
      for (Index t = 0; t < T; ++t) {
        float const* qpe = ws.q.data() + t * QD + h * dq + dn;
        std::copy(qpe, qpe + dr, out + t * H * LD + R);
        ws.q_pos[static_cast<std::size_t>(t * H + h)] = ws.row_pos[static_cast<std::size_t>(t)];
      }
    });
    // Per sequence, chunks of query rows (token-major, H per token) over the latent rows: up to
    // 64, fewer when a call has fewer rows than threads x 64 (a decode step's H rows are split
    // over the pool; every item reads all the sequence's rows, and a row's result does not
    // depend on the split).
    Index const threads = threads_of(pool);
    Index const chunk = std::clamp<Index>((T * H + threads - 1) / threads, 8, kTileRows);
    Index items = 0;
    auto chunks_of = [&](Index s) {
      return (new_tokens[static_cast<std::size_t>(s)] * H + chunk - 1) / chunk;
    };
    for (Index s = 0; s < cache.sequences(); ++s) items += chunks_of(s);
    parallel_for(pool, items, [&](Index item, int thread) {
      Index s = 0, base = 0;
      for (;; ++s) {
        if (item < base + chunks_of(s)) break;
        base += chunks_of(s);
      }
      Index const n = new_tokens[static_cast<std::size_t>(s)];
      Index const row0 = ws.seq_row0[static_cast<std::size_t>(s)] * H;
      kernels::SdpaParams p;
      p.q = ws.q_abs.data() + row0 * LD;
      p.ldq = LD;
      if (cache.is_bf16()) {  // values: the first R columns of the key rows
        p.k_bf16 = p.v_bf16 = cache.key_data_bf16(s);
      } else {
        p.k = p.v = cache.key_data(s);
      }
      p.ldk = p.ldv = LD;
      p.q_rows = n * H;
      p.kv_rows = cache.length(s) + n;
      p.head_dim = LD;
      p.value_dim = R;
      p.scale = c_.scale;
      p.causal = true;
      p.q_pos = ws.q_pos.data() + row0;
      Index const r0 = (item - base) * chunk;
      kernels::sdpa_forward(p, ws.o_lat.data() + row0 * R, R, nullptr, r0,
                            std::min(n * H, r0 + chunk), ws.scratch.data() + thread * per);
    });
    // A_h [T, d_v] = o_lat,h [T, R] W_UV,h^T (W_UV,h: d_v rows of kv_b_proj, read in place).
    for (Index h = 0; h < H; ++h) {
      ws.queue.add(stages::raw_job(ws.o_lat.data() + h * R, H * R, T,
                                   p_.kv_b_proj.data() + (h * dkv + dn) * R, R,
                                   ws.attn.data() + h * dv, VD, dv));
    }
    ws.queue.run<experts::SwiGlu, experts::SwiGlu>(pool);
  }

  MlaAttentionConfig c_{};
  std::vector<float> inv_freq_;  ///< [d_r / 2] RoPE (or YaRN) inverse frequencies
  float rope_scale_ = 1.0f;      ///< YaRN's cos / sin scale (1 without YaRN)
  Parameters p_;
  struct Packs {
    Linear q_a, q_b, q, kv_a, kv_b, o;
  } packs_;
  bool discarded_ = false;  ///< discard_master_weights() was called

  void check_trainable(char const* what) const {
    detail::check(!discarded_, "MlaAttention::", what,
                  ": the projections' fp32 weights were discarded (discard_master_weights); this "
                  "layer is inference-only");
  }
};

}  // namespace moe
