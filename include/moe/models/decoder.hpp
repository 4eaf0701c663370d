// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// A whole MoE decoder (token embedding, N blocks, final RMSNorm, LM head) loaded from a Hugging
/// Face checkpoint directory of a Qwen3-MoE or Mixtral model, with KV-cached decoding.
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/io/hf.hpp"
#include "moe/kernels/activations.hpp"
#include "moe/kernels/rms_norm.hpp"
#include "moe/layers/detail/projections.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/kv_cache.hpp"
#include "moe/layers/presets.hpp"

namespace moe::models {

/// The decoder-level keys of a Qwen3-MoE or Mixtral config.json (the MoE keys are in `moe`),
/// with the transformers defaults (Qwen3MoeConfig, MixtralConfig) for absent keys.
///
/// | field                  | key (Qwen3-MoE default / Mixtral default)                         |
/// |------------------------|-------------------------------------------------------------------|
/// | vocab_size             | vocab_size (151936 / 32000)                                       |
/// | num_hidden_layers      | num_hidden_layers (**required**: the decoder reads every layer)   |
/// | num_attention_heads    | num_attention_heads (32 / 32)                                     |
/// | num_key_value_heads    | num_key_value_heads (4 / 8)                                       |
/// | head_dim               | head_dim, else hidden_size / num_attention_heads                  |
/// | intermediate_size      | intermediate_size: Qwen3-MoE's dense MLP layers (6144)            |
/// | rope_theta             | rope_theta (10000 / 1e6); rope_scaling must be absent or null     |
/// | rms_norm_eps           | rms_norm_eps (1e-6 / 1e-5)                                        |
/// | tie_word_embeddings    | tie_word_embeddings (false): lm_head = embed_tokens               |
/// | sliding_window         | Mixtral sliding_window (null: none); Qwen3-MoE use_sliding_window |
/// |                        | must be false                                                     |
struct DecoderConfig {
  io::HfMoeConfig moe;
  Index vocab_size = 0;
  Index num_hidden_layers = 0;
  Index num_attention_heads = 0;
  Index num_key_value_heads = 0;
  Index head_dim = 0;
  Index intermediate_size = 0;
  float rope_theta = 10000.0f;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  Index sliding_window = 0;
  bool qk_norm = false;  ///< per-head RMSNorm of q and k (Qwen3-MoE)
};

/// Parses a config.json (text; `source` names it in errors) of a qwen3_moe or mixtral model.
/// Throws moe::Error for another model_type, a missing num_hidden_layers, attention_bias true,
/// a rope_scaling, Qwen3-MoE's use_sliding_window true, or sizes that do not fit (KV heads
/// dividing the heads, the MoE keys as parse_hf_config checks them).
inline DecoderConfig parse_decoder_config(std::string_view text,
                                          std::string const& source = "config.json") {
  using io::detail::JsonKind;
  DecoderConfig c;
  c.moe = io::parse_hf_config(text, source);
  bool const qwen = c.moe.family == io::HfFamily::kQwen3Moe;
  if (!qwen && c.moe.family != io::HfFamily::kMixtral) {
    moe::detail::fail("models: ", source, ": model_type \"", c.moe.model_type(),
                      "\" has no decoder in moe yet; moe::models decodes \"qwen3_moe\" and "
                      "\"mixtral\" models (the other families load layer by layer through "
                      "moe/io/hf.hpp)");
  }
  io::detail::JsonValue const root = io::detail::parse_config_object(text, source);
  io::HfMoeConfig keys;
  io::detail::HfConfigReader r(root, source, keys);
  moe::detail::check(r.find("num_hidden_layers") != nullptr, "models: ", source,
                     ": config.json has no num_hidden_layers; the decoder needs the layer count");
  c.num_hidden_layers = c.moe.num_hidden_layers;
  c.vocab_size = r.integer({"vocab_size"}, qwen ? 151936 : 32000, 1);
  c.num_attention_heads = r.integer({"num_attention_heads"}, 32, 1);
  c.num_key_value_heads = r.integer({"num_key_value_heads"}, qwen ? 4 : 8, 1);
  Index const H = c.moe.hidden_size;
  c.head_dim =
      r.find("head_dim") != nullptr ? r.integer({"head_dim"}, 0, 1) : H / c.num_attention_heads;
  c.intermediate_size = qwen ? r.integer({"intermediate_size"}, 6144, 1) : 0;
  c.rope_theta = static_cast<float>(r.number("rope_theta", qwen ? 10000.0 : 1e6));
  c.rms_norm_eps = static_cast<float>(r.number("rms_norm_eps", qwen ? 1e-6 : 1e-5));
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  c.qk_norm = qwen;
  auto fail_if = [&](bool bad, auto const&... parts) {
    if (bad) moe::detail::fail("models: ", source, ": ", parts..., "; fix config.json");
  };
  if (io::detail::JsonValue const* b = r.find("attention_bias")) {
    fail_if(b->kind != JsonKind::kBool || b->boolean,
            "attention_bias must be false (moe's attention has no projection biases)");
  }
  fail_if(r.find("rope_scaling") != nullptr,
          "rope_scaling is not supported (moe's RoPE is the default type); remove it or use a "
          "model without it");
  if (qwen) {
    fail_if(r.boolean("use_sliding_window", false),
            "use_sliding_window = true is not supported for qwen3_moe");
  } else if (r.find("sliding_window") != nullptr) {
    c.sliding_window = r.integer({"sliding_window"}, 0, 1);
  }
  fail_if(c.head_dim < 1, "head_dim = ", c.head_dim, " must be >= 1 (hidden_size / heads)");
  fail_if(c.num_attention_heads % c.num_key_value_heads != 0,
          "num_key_value_heads = ", c.num_key_value_heads,
          " must divide num_attention_heads = ", c.num_attention_heads);
  fail_if(!(c.rope_theta >= 1.0f && std::isfinite(c.rope_theta)), "rope_theta = ", c.rope_theta,
          " must be finite and >= 1");
  fail_if(!(c.rms_norm_eps > 0.0f && std::isfinite(c.rms_norm_eps)),
          "rms_norm_eps = ", c.rms_norm_eps, " must be finite and > 0");
  return c;
}

/// Reads `dir`/config.json (or a config.json path) with parse_decoder_config.
inline DecoderConfig read_decoder_config(std::filesystem::path const& path) {
  return io::detail::parse_config_file(path, [](std::string_view text, std::string const& source) {
    return parse_decoder_config(text, source);
  });
}

/// A dense SwiGLU MLP (Qwen3-MoE's layers outside the sparse step):
///   y = W_down (silu(W_gate x) * (W_up x)),  W_gate, W_up [I, H], W_down [H, I].
class DenseMlp {
 public:
  DenseMlp() = default;
  DenseMlp(Index hidden, Index intermediate)
      : H_(hidden),
        I_(intermediate),
        gate_up_(static_cast<std::size_t>(2 * hidden * intermediate), 0.0f),
        down_(static_cast<std::size_t>(hidden * intermediate), 0.0f) {}
  /// [2I, H]: gate rows [0, I), up rows [I, 2I).
  MatrixView<float> gate_up() { return {gate_up_.data(), 2 * I_, H_}; }
  MatrixView<float> down() { return {down_.data(), H_, I_}; }
  Index intermediate() const { return I_; }

  /// y [T, H] = MLP(x [T, H]); `m`, `scratch` and `q` are reused buffers.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, std::vector<float>& m,
               std::vector<float>& scratch, moe::detail::ProjectionQueue& q,
               ThreadPool* pool) const {
    Index const T = x.rows;
    m.resize(static_cast<std::size_t>(T * 2 * I_));
    Index const per = kernels::panel_scratch_size(std::max(H_, I_));
    scratch.resize(static_cast<std::size_t>((pool ? pool->size() : 1) * per));
    q.add({x.data, x.row_stride, T, gate_up_.data(), H_, m.data(), 2 * I_}, 2 * I_);
    q.run(pool, scratch.data(), per);
    for (Index t = 0; t < T; ++t) {
      float* row = m.data() + t * 2 * I_;
      kernels::glu<kernels::Activation::kSilu>(row, row + I_, row, I_);
    }
    q.add({m.data(), 2 * I_, T, down_.data(), I_, y.data, y.row_stride}, H_);
    q.run(pool, scratch.data(), per);
  }

 private:
  Index H_ = 0, I_ = 0;
  std::vector<float> gate_up_, down_;
};

/// Decoding state of a Decoder: a KvCache per layer for `sequences` independent sequences,
/// and the buffers a step reuses (no allocation once they have their size).
struct DecoderState {
  std::vector<KvCache> caches;  ///< one per layer
  GatedAttentionWorkspace attention;
  MoeFfnWorkspace ffn;
  std::vector<float> h, normed, tmp, mlp_hidden, scratch, last;
  std::vector<Index> last_rows, last_seqs;  ///< the rows that get logits, and their sequences
  moe::detail::ProjectionQueue queue;       ///< dense MLP and LM-head projections
  /// Seconds spent per part of forward() (wall clock), accumulated while `profile` is set:
  /// attention layers, FFN layers (MoE or dense), and the rest (embedding, norms, residuals,
  /// LM head).
  bool profile = false;
  double attention_seconds = 0.0, ffn_seconds = 0.0, other_seconds = 0.0;
  /// Tokens cached per sequence (every layer's cache has the same lengths).
  Index length(Index s) const { return caches.empty() ? 0 : caches.front().length(s); }
  /// Bytes of keys and values per cached token, summed over the layers.
  std::size_t kv_bytes_per_token() const {
    std::size_t n = 0;
    for (KvCache const& c : caches) n += c.bytes_per_token();
    return n;
  }
};

/// A decoder-only MoE transformer, forward only:
///   h = embed[token];  for each block: h += Attn(RMSNorm_in(h));  h += FFN(RMSNorm_post(h));
///   logits = RMSNorm_final(h) W_lm^T
/// FFN is the family's MoE layer (`Moe`: presets::Qwen3Moe or presets::MixtralMoe) where
/// config.moe.is_moe_layer(L), else a DenseMlp (Qwen3-MoE mlp_only_layers / decoder_sparse_step).
/// Attention: GatedAttention<NoGate> (GQA, RoPE at absolute positions, causal; Qwen3-MoE's q/k
/// RMSNorm; Mixtral's sliding_window). RMSNorm: x / sqrt(mean x^2 + eps) * w.
///
/// The layers' weights are copied out of the checkpoint (converted to fp32); an F32
/// checkpoint's embedding and LM head are read in place from the mapped file (`mapped`). The MoE
/// layers are packed as fp32 panels, so an FFN row never depends on the batch it runs in.
template <class Moe>
class Decoder {
 public:
  struct Block {
    GatedAttention<gating::NoGate> attention;
    std::vector<float> input_norm, post_norm;  ///< [H] each
    std::optional<Moe> moe;                    ///< the MoE FFN, or
    DenseMlp mlp;                              ///< the dense one
  };

  DecoderConfig config;
  /// [V, H] model.embed_tokens.weight (empty when read in place: see mapped). 2 MiB pages.
  HugePageVector<float> embed;
  std::vector<Block> blocks;  ///< model.layers.L
  std::vector<float> norm;    ///< [H] model.norm.weight
  /// [V, H] lm_head.weight (empty when tied, then the embedding is used, or read in place).
  /// 2 MiB pages.
  HugePageVector<float> lm_head;
  /// An F32 checkpoint's embedding and LM head are used where they lie in the mapped file (no
  /// copy; 4-byte aligned data): the checkpoint stays open while a copy of the decoder lives,
  /// and embed_view / lm_head_view point into it. Null: the vectors above hold them.
  std::shared_ptr<io::ShardedCheckpoint const> mapped;
  float const* embed_view = nullptr;
  float const* lm_head_view = nullptr;

  Index hidden() const { return config.moe.hidden_size; }
  Index vocab() const { return config.vocab_size; }
  float const* embed_data() const { return embed_view ? embed_view : embed.data(); }
  float const* lm_head_data() const {
    if (lm_head_view) return lm_head_view;
    return lm_head.empty() ? embed_data() : lm_head.data();
  }

  /// A state for `sequences` sequences with room for `capacity` tokens each (it grows).
  DecoderState make_state(Index sequences, Index capacity = 0) const {
    DecoderState st;
    Index const kvd = config.num_key_value_heads * config.head_dim;
    for (std::size_t i = 0; i < blocks.size(); ++i)
      st.caches.emplace_back(sequences, kvd, capacity);
    return st;
  }

  /// Appends new_tokens[s] tokens to each sequence s (`tokens` holds them in sequence order)
  /// and writes into logits [sequences, V] the next-token logits of every sequence that got
  /// at least one (after its last new token; other rows are left as they are). Throws
  /// moe::Error for a token id outside [0, V), counts that do not match, or a logits view of
  /// another shape.
  void forward(std::span<std::int64_t const> tokens, std::span<Index const> new_tokens,
               DecoderState& st, MatrixView<float> logits, ThreadPool* pool = nullptr) const {
    Index const H = hidden(), V = vocab(), T = static_cast<Index>(tokens.size());
    Index const B = st.caches.empty() ? 0 : st.caches.front().sequences();
    moe::detail::check(static_cast<Index>(st.caches.size()) == static_cast<Index>(blocks.size()),
                       "Decoder::forward: the state has ", st.caches.size(), " caches for ",
                       blocks.size(), " layers; make it with this decoder's make_state()");
    moe::detail::check(static_cast<Index>(new_tokens.size()) == B,
                       "Decoder::forward: new_tokens has ", new_tokens.size(), " counts for ", B,
                       " sequences");
    moe::detail::check(logits.rows == B && logits.cols == V && logits.row_stride >= V,
                       "Decoder::forward: logits is [", logits.rows, ", ", logits.cols,
                       "] but must be [", B, ", ", V, "] (one row per sequence)");
    for (std::int64_t const id : tokens) {
      moe::detail::check(id >= 0 && id < V, "Decoder::forward: token id ", id,
                         " is outside the vocabulary [0, ", V, ")");
    }
    if (T == 0) return;
    using Clock = std::chrono::steady_clock;
    auto const t_start = Clock::now();
    auto mark = Clock::now();
    // Adds the time since the last mark to `into` (null: to neither part; the rest is the total
    // minus the parts).
    auto lap = [&](double* into) {
      if (!st.profile) return;
      auto const now = Clock::now();
      if (into) *into += std::chrono::duration<double>(now - mark).count();
      mark = now;
    };
    double attention = 0.0, ffn = 0.0;
    auto size = [](std::vector<float>& v, Index n) { v.resize(static_cast<std::size_t>(n)); };
    size(st.h, T * H);
    size(st.normed, T * H);
    size(st.tmp, T * H);
    for (Index t = 0; t < T; ++t) {
      float const* e = embed_data() + tokens[static_cast<std::size_t>(t)] * H;
      std::copy(e, e + H, st.h.data() + t * H);
    }
    MatrixView<float> h(st.h.data(), T, H), normed(st.normed.data(), T, H),
        tmp(st.tmp.data(), T, H);
    for (std::size_t L = 0; L < blocks.size(); ++L) {
      Block const& b = blocks[L];
      rms_rows(h, b.input_norm, normed, pool);
      lap(nullptr);
      b.attention.forward_cached(normed, tmp, st.caches[L], new_tokens, st.attention, pool);
      lap(&attention);
      add_rows(h, tmp, pool);
      rms_rows(h, b.post_norm, normed, pool);
      lap(nullptr);
      if (b.moe) {
        ForwardOptions opt;
        opt.pool = pool;
        b.moe->forward(normed, tmp, st.ffn, opt);
      } else {
        b.mlp.forward(normed, tmp, st.mlp_hidden, st.scratch, st.queue, pool);
      }
      lap(&ffn);
      add_rows(h, tmp, pool);
    }
    // The last new token of each sequence with one: final norm, LM head.
    std::vector<Index>& last_rows = st.last_rows;
    std::vector<Index>& seqs = st.last_seqs;
    last_rows.clear();
    seqs.clear();
    for (Index s = 0, row = 0; s < B; ++s) {
      row += new_tokens[static_cast<std::size_t>(s)];
      if (new_tokens[static_cast<std::size_t>(s)] > 0) {
        last_rows.push_back(row - 1);
        seqs.push_back(s);
      }
    }
    Index const n = static_cast<Index>(last_rows.size());
    size(st.last, n * H);
    for (Index i = 0; i < n; ++i) {
      kernels::rms_norm(h.row(last_rows[static_cast<std::size_t>(i)]), norm.data(), false,
                        config.rms_norm_eps, H, st.last.data() + i * H);
    }
    size(st.tmp, std::max(T * H, n * V));
    Index const per = kernels::panel_scratch_size(H);
    size(st.scratch, (pool ? pool->size() : 1) * per);
    st.queue.add({st.last.data(), H, n, lm_head_data(), H, st.tmp.data(), V}, V);
    st.queue.run(pool, st.scratch.data(), per);
    for (Index i = 0; i < n; ++i) {
      std::copy(st.tmp.data() + i * V, st.tmp.data() + (i + 1) * V,
                logits.row(seqs[static_cast<std::size_t>(i)]));
    }
    if (st.profile) {
      st.attention_seconds += attention;
      st.ffn_seconds += ffn;
      st.other_seconds +=
          std::chrono::duration<double>(Clock::now() - t_start).count() - attention - ffn;
    }
  }

 private:
  void rms_rows(MatrixView<float> x, std::vector<float> const& w, MatrixView<float> y,
                ThreadPool* pool) const {
    Index const T = x.rows, H = x.cols;
    parallel_for(pool, (T + 63) / 64, [&](Index i, int) {
      for (Index t = i * 64; t < std::min(T, i * 64 + 64); ++t) {
        kernels::rms_norm(x.row(t), w.data(), false, config.rms_norm_eps, H, y.row(t));
      }
    });
  }
  static void add_rows(MatrixView<float> h, MatrixView<float> d, ThreadPool* pool) {
    Index const T = h.rows, H = h.cols;
    parallel_for(pool, (T + 63) / 64, [&](Index i, int) {
      for (Index t = i * 64; t < std::min(T, i * 64 + 64); ++t) {
        float* a = h.row(t);
        float const* b = d.row(t);
        for (Index c = 0; c < H; ++c) a[c] += b[c];
      }
    });
  }
};

/// A loaded decoder of either family (use std::visit).
using AnyDecoder = std::variant<Decoder<presets::Qwen3Moe>, Decoder<presets::MixtralMoe>>;

namespace detail {

/// Tensor `name` of `ckpt`, checked: present, of `shape`, F32, BF16 or F16.
inline io::TensorView const& checked_tensor(io::ShardedCheckpoint const& ckpt,
                                            std::string const& name,
                                            std::vector<std::int64_t> const& shape,
                                            std::string const& why) {
  io::TensorView const* t = ckpt.find(name);
  moe::detail::check(t != nullptr, "models: ", ckpt.source(), ": tensor ",
                     io::detail::printable_name(name), " (", io::detail::shape_string(shape),
                     ") is missing; ", why);
  moe::detail::check(
      t->shape == shape, "models: ", ckpt.source(), ": tensor ", io::detail::printable_name(name),
      " has shape ", io::detail::shape_string(t->shape), " but config.json implies ",
      io::detail::shape_string(shape), "; check that config.json belongs to these weights");
  moe::detail::check(
      t->dtype == io::Dtype::kF32 || t->dtype == io::Dtype::kBf16 || t->dtype == io::Dtype::kF16,
      "models: ", ckpt.source(), ": tensor ", io::detail::printable_name(name), " is ",
      io::dtype_name(t->dtype), "; the decoder reads F32, BF16 or F16");
  return *t;
}

/// Tensor `name` of `ckpt` as floats, checked against `shape`.
inline std::vector<float> read_tensor(io::ShardedCheckpoint const& ckpt, std::string const& name,
                                      std::vector<std::int64_t> const& shape,
                                      std::string const& why) {
  return io::to_float(checked_tensor(ckpt, name, shape, why));
}

/// The same into a vector on 2 MiB pages (the embedding and the LM head: a decode step streams
/// the whole LM head, and 4 KiB pages cost it ~5% of its read rate in TLB misses).
inline void read_tensor(io::ShardedCheckpoint const& ckpt, std::string const& name,
                        std::vector<std::int64_t> const& shape, std::string const& why,
                        HugePageVector<float>& out) {
  io::TensorView const& t = checked_tensor(ckpt, name, shape, why);
  out.resize(static_cast<std::size_t>(t.num_elements()));
  io::to_float(t, out);
}

/// Tensor `name` as F32 data in place in the mapped file, or null when it is another dtype or
/// not 4-byte aligned (then read_tensor copies it). Checks the shape like read_tensor.
inline float const* in_place_f32(io::ShardedCheckpoint const& ckpt, std::string const& name,
                                 std::vector<std::int64_t> const& shape) {
  io::TensorView const* t = ckpt.find(name);
  if (t == nullptr || t->shape != shape || t->dtype != io::Dtype::kF32) return nullptr;
  auto const* p = reinterpret_cast<float const*>(t->bytes.data());
  return reinterpret_cast<std::uintptr_t>(p) % alignof(float) == 0 &&
                 std::endian::native == std::endian::little
             ? p
             : nullptr;
}

template <class Moe>
Decoder<Moe> load_decoder(DecoderConfig const& c,
                          std::shared_ptr<io::ShardedCheckpoint const> const& mapped,
                          ThreadPool* pool) {
  io::ShardedCheckpoint const& ckpt = *mapped;
  Decoder<Moe> d;
  d.config = c;
  Index const H = c.moe.hidden_size, V = c.vocab_size, nh = c.num_attention_heads,
              kv = c.num_key_value_heads, dh = c.head_dim;
  std::string const why =
      "a decoder checkpoint holds the embedding, every layer, the final "
      "norm and (untied) lm_head";
  d.embed_view = in_place_f32(ckpt, "model.embed_tokens.weight", {V, H});
  if (d.embed_view == nullptr) read_tensor(ckpt, "model.embed_tokens.weight", {V, H}, why, d.embed);
  d.norm = read_tensor(ckpt, "model.norm.weight", {H}, why);
  if (!c.tie_word_embeddings) {
    d.lm_head_view = in_place_f32(ckpt, "lm_head.weight", {V, H});
    if (d.lm_head_view == nullptr) {
      read_tensor(ckpt, "lm_head.weight", {V, H},
                  "tie_word_embeddings is false, so lm_head.weight is needed", d.lm_head);
    }
  }
  if (d.embed_view || d.lm_head_view) d.mapped = mapped;
  GatedAttentionConfig ac;
  ac.d_model = H;
  ac.num_heads = nh;
  ac.num_kv_heads = kv;
  ac.head_dim = dh;
  ac.qk_norm = c.qk_norm ? QkNorm::kRmsNorm : QkNorm::kNone;
  ac.norm_eps = c.rms_norm_eps;
  ac.rope = true;
  ac.rope_theta = c.rope_theta;
  ac.causal = true;
  ac.sliding_window = c.sliding_window;
  for (Index L = 0; L < c.num_hidden_layers; ++L) {
    std::string const p = io::detail::concat("model.layers.", L, ".");
    typename Decoder<Moe>::Block b{GatedAttention<gating::NoGate>(ac), {}, {}, std::nullopt, {}};
    auto load_into = [&](std::span<float> dst, std::string const& name,
                         std::vector<std::int64_t> const& shape) {
      std::vector<float> const v = read_tensor(ckpt, p + name, shape, why);
      std::copy(v.begin(), v.end(), dst.begin());
    };
    auto view_span = [](MatrixView<float> m) {
      return std::span<float>(m.data, static_cast<std::size_t>(m.rows * m.cols));
    };
    load_into(view_span(b.attention.q_proj()), "self_attn.q_proj.weight", {nh * dh, H});
    load_into(view_span(b.attention.k_proj()), "self_attn.k_proj.weight", {kv * dh, H});
    load_into(view_span(b.attention.v_proj()), "self_attn.v_proj.weight", {kv * dh, H});
    load_into(view_span(b.attention.o_proj()), "self_attn.o_proj.weight", {H, nh * dh});
    if (c.qk_norm) {
      load_into(b.attention.q_norm(), "self_attn.q_norm.weight", {dh});
      load_into(b.attention.k_norm(), "self_attn.k_norm.weight", {dh});
    }
    b.input_norm = read_tensor(ckpt, p + "input_layernorm.weight", {H}, why);
    b.post_norm = read_tensor(ckpt, p + "post_attention_layernorm.weight", {H}, why);
    if (c.moe.is_moe_layer(L)) {
      b.moe.emplace(io::load_hf_layer<Moe>(c.moe, ckpt, L).layer);
      b.moe->pack_weights(experts::WeightFormat::kF32, pool);
    } else {
      Index const I = c.intermediate_size;
      b.mlp = DenseMlp(H, I);
      std::vector<float> const g = read_tensor(ckpt, p + "mlp.gate_proj.weight", {I, H}, why);
      std::vector<float> const u = read_tensor(ckpt, p + "mlp.up_proj.weight", {I, H}, why);
      auto gu = b.mlp.gate_up();
      std::copy(g.begin(), g.end(), gu.data);
      std::copy(u.begin(), u.end(), gu.data + I * H);
      load_into(view_span(b.mlp.down()), "mlp.down_proj.weight", {H, I});
    }
    d.blocks.push_back(std::move(b));
  }
  return d;
}

}  // namespace detail

/// Loads the whole model in `model_dir` (config.json, model.safetensors or the sharded index):
/// a Decoder<presets::Qwen3Moe> for qwen3_moe, Decoder<presets::MixtralMoe> for mixtral, every
/// layer through the MoE layer loader of moe/io/hf.hpp (or as a dense MLP). `pool` packs the
/// experts in parallel. Throws moe::Error naming the file and tensor for anything missing or
/// mis-shaped, and as parse_decoder_config.
inline AnyDecoder load_hf_decoder(std::filesystem::path const& model_dir,
                                  ThreadPool* pool = nullptr) {
  io::detail::check_model_dir(model_dir);
  DecoderConfig const c = read_decoder_config(model_dir);
  auto const ckpt = std::make_shared<io::ShardedCheckpoint const>(io::open_checkpoint(model_dir));
  if (c.moe.family == io::HfFamily::kQwen3Moe) {
    return detail::load_decoder<presets::Qwen3Moe>(c, ckpt, pool);
  }
  return detail::load_decoder<presets::MixtralMoe>(c, ckpt, pool);
}

}  // namespace moe::models
