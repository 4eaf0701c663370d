// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// A whole MoE decoder (token embedding, N blocks, final RMSNorm, LM head) loaded from a Hugging
/// Face checkpoint directory of a Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, GLM-4.5, MiniMax-M2,
/// gpt-oss or ERNIE 4.5 model, with KV-cached decoding.
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
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
#include "moe/experts/weight_format.hpp"
#include "moe/io/hf.hpp"
#include "moe/kernels/activations.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/rms_norm.hpp"
#include "moe/layers/detail/projections.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/kv_cache.hpp"
#include "moe/layers/presets.hpp"
#include "moe/models/decoder_config.hpp"

namespace moe::models {

/// How the decoder stores its dense weights: the embedding, the LM head, the attention
/// projections and the dense MLPs (the MoE experts: DecoderOptions::experts).
enum class DenseWeights {
  /// bf16 tensors stay bf16 (half the bytes; each weight is widened to fp32 as it is loaded, so
  /// the logits equal, bitwise, those of fp32 copies of the same values), F32 tensors stay fp32,
  /// F16 ones become fp32.
  kAsStored,
  kF32,   ///< all fp32 (exact for every dtype)
  kBf16,  ///< all bf16: F32 and F16 tensors rounded to bf16 (nearest even)
};

/// "as-stored", "fp32", "bf16".
constexpr char const* name(DenseWeights w) {
  return w == DenseWeights::kAsStored ? "as-stored" : w == DenseWeights::kF32 ? "fp32" : "bf16";
}

/// The DenseWeights called `s` (see name()); throws moe::Error for any other string.
inline DenseWeights parse_dense_weights(std::string_view s) {
  for (DenseWeights w : {DenseWeights::kAsStored, DenseWeights::kF32, DenseWeights::kBf16}) {
    if (s == name(w)) return w;
  }
  moe::detail::fail("parse_dense_weights: unknown dense-weight mode '", s,
                    "'; use one of as-stored, fp32, bf16");
}

/// How load_hf_decoder keeps a checkpoint's weights.
struct DecoderOptions {
  DenseWeights dense = DenseWeights::kAsStored;
  /// The MoE layers' routed and shared experts (MoeFfn::pack_weights): kF32 is exact; kBf16 and
  /// the GGUF block formats quantize them at load time (forward only, see docs/quantization.md).
  experts::WeightFormat experts = experts::WeightFormat::kF32;
};

/// A [rows, cols] row-major weight matrix of the decoder, fp32 or bf16 (the top half of each
/// float, as std::uint16_t), held on 2 MiB pages (a decode step streams the LM head, and 4 KiB
/// pages cost it ~5% of its read rate in TLB misses) or read in place from the mapped
/// checkpoint. Exactly one of f32, bf16, f32_view, bf16_view holds the values (none: empty).
struct WeightMatrix {
  Index rows = 0, cols = 0;
  HugePageVector<float> f32;
  HugePageVector<std::uint16_t> bf16;
  float const* f32_view = nullptr;
  std::uint16_t const* bf16_view = nullptr;

  /// A held fp32 matrix of zeros.
  static WeightMatrix zeros(Index rows, Index cols) {
    WeightMatrix m;
    m.rows = rows;
    m.cols = cols;
    m.f32.assign(static_cast<std::size_t>(rows * cols), 0.0f);
    return m;
  }
  bool empty() const { return f32_data() == nullptr && bf16_data() == nullptr; }
  bool is_bf16() const { return bf16_data() != nullptr; }
  bool in_place() const { return f32_view != nullptr || bf16_view != nullptr; }
  float const* f32_data() const { return f32_view ? f32_view : f32.empty() ? nullptr : f32.data(); }
  std::uint16_t const* bf16_data() const {
    return bf16_view ? bf16_view : bf16.empty() ? nullptr : bf16.data();
  }
  /// Bytes of the values (what a product with every row reads).
  std::size_t bytes() const { return static_cast<std::size_t>(rows * cols) * (is_bf16() ? 2 : 4); }
  /// out[c] = row r, widened to fp32 (exact).
  void read_row(Index r, float* out) const {
    if (std::uint16_t const* b = bf16_data()) {
      for (Index c = 0; c < cols; ++c) out[c] = kernels::bf16_to_float(b[r * cols + c]);
    } else {
      float const* f = f32_data() + r * cols;
      std::copy(f, f + cols, out);
    }
  }
  /// Rounds the values to bf16 (nearest even) into held storage; no-op when already bf16.
  void to_bf16() {
    float const* f = f32_data();
    if (f == nullptr) return;
    HugePageVector<std::uint16_t> b(static_cast<std::size_t>(rows * cols));
    kernels::round_to_bf16(f, b.size(), b.data());
    *this = WeightMatrix{rows, cols, {}, std::move(b), nullptr, nullptr};
  }
  /// The projection C[:, 0:rows] = A W^T (A [n, cols], lda; C ldc) as a ProjectionQueue job.
  moe::detail::ProjectionQueue::Job job(float const* a, Index lda, Index n, float* c,
                                        Index ldc) const {
    moe::detail::ProjectionQueue::Job j{a, lda, n, f32_data(), cols, c, ldc};
    j.w_bf16 = bf16_data();
    return j;
  }
};

/// A dense SwiGLU MLP (Qwen3-MoE's layers outside the sparse step):
///   y = W_down (silu(W_gate x) * (W_up x)),  W_gate, W_up [I, H], W_down [H, I].
struct DenseMlp {
  WeightMatrix gate, up;  ///< [I, H] each
  WeightMatrix down;      ///< [H, I]

  Index intermediate() const { return gate.rows; }

  /// y [T, H] = MLP(x [T, H]); `m`, `scratch` and `q` are reused buffers.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, std::vector<float>& m,
               std::vector<float>& scratch, moe::detail::ProjectionQueue& q,
               ThreadPool* pool) const {
    Index const T = x.rows, H = down.rows, I = gate.rows;
    m.resize(static_cast<std::size_t>(T * 2 * I));
    Index const per = kernels::panel_scratch_size(std::max(H, I));
    scratch.resize(static_cast<std::size_t>((pool ? pool->size() : 1) * per));
    q.add(gate.job(x.data, x.row_stride, T, m.data(), 2 * I), I);
    q.add(up.job(x.data, x.row_stride, T, m.data() + I, 2 * I), I);
    q.run(pool, scratch.data(), per);
    for (Index t = 0; t < T; ++t) {
      float* row = m.data() + t * 2 * I;
      kernels::glu<kernels::Activation::kSilu>(row, row + I, row, I);
    }
    q.add(down.job(m.data(), 2 * I, T, y.data, y.row_stride), H);
    q.run(pool, scratch.data(), per);
  }
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
/// FFN is the family's MoE layer (`Moe`: presets::Qwen3Moe for qwen3_moe and olmoe,
/// presets::MixtralMoe, presets::Qwen2Moe, presets::DeepseekV3Moe for glm4_moe and minimax_m2)
/// where config.moe.is_moe_layer(L), else a DenseMlp (Qwen3-MoE / Qwen2-MoE mlp_only_layers and
/// decoder_sparse_step, GLM-4.5 first_k_dense_replace). Attention: GatedAttention<NoGate> (GQA,
/// RoPE at absolute positions, full or partial, causal) with the family's q/k RMSNorm (per head
/// or over all heads), projection biases and sliding window (DecoderConfig). RMSNorm:
/// x / sqrt(mean x^2 + eps) * w.
///
/// Weights (see DecoderOptions): the embedding, LM head, attention and dense-MLP projections are
/// kept in fp32 or bf16 (DenseWeights; by default as the checkpoint stores them); the
/// embedding, LM head and dense MLPs are read in place from the mapped file where the dtype and
/// alignment allow (`mapped` then keeps it open), the attention projections are copied
/// (GatedAttention::pack_weights(kBf16) for bf16). The MoE layers' experts are packed in
/// DecoderOptions::experts (fp32 panels by default, so an FFN row never depends on the batch it
/// runs in), and their fp32 weights discarded (MoeFfn::discard_master_weights: a decoder does not
/// train; only the pack stays in memory).
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
  WeightMatrix embed;         ///< [V, H] model.embed_tokens.weight
  std::vector<Block> blocks;  ///< model.layers.L
  std::vector<float> norm;    ///< [H] model.norm.weight
  WeightMatrix lm_head;       ///< [V, H] lm_head.weight (empty when tied: the embedding is used)
  /// The checkpoint, kept open while a matrix above is read in place from it (else null).
  std::shared_ptr<io::ShardedCheckpoint const> mapped;

  Index hidden() const { return config.moe.hidden_size; }
  Index vocab() const { return config.vocab_size; }
  /// The LM head's weights: lm_head, or the embedding when tied.
  WeightMatrix const& output_weights() const { return lm_head.empty() ? embed : lm_head; }

  /// A state for `sequences` sequences with room for `capacity` tokens each (it grows), its
  /// caches holding keys and values as `kv` says (KvFormat::kBf16: half the bytes a step reads
  /// from a long context; the logits move by the rounding of the cached keys and values). A
  /// sliding-window layer's cache keeps only its window (KvCache's `window`: about 2 W rows
  /// however long the context; a sequence cannot be truncated back past it).
  DecoderState make_state(Index sequences, Index capacity = 0, KvFormat kv = KvFormat::kF32) const {
    DecoderState st;
    Index const kvd = config.num_key_value_heads * config.head_dim;
    for (Block const& b : blocks) {
      Index const window = b.attention.config().sliding_window;
      st.caches.emplace_back(sequences, kvd, window > 0 ? std::min(capacity, 2 * window) : capacity,
                             kv, window);
    }
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
      embed.read_row(tokens[static_cast<std::size_t>(t)], st.h.data() + t * H);
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
    st.queue.add(output_weights().job(st.last.data(), H, n, st.tmp.data(), V), V);
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

/// A loaded decoder of any family (use std::visit): Qwen3Moe holds qwen3_moe and olmoe,
/// DeepseekV3Moe holds glm4_moe, minimax_m2 and ernie4_5_moe.
using AnyDecoder = std::variant<Decoder<presets::Qwen3Moe>, Decoder<presets::MixtralMoe>,
                                Decoder<presets::Qwen2Moe>, Decoder<presets::DeepseekV3Moe>,
                                Decoder<presets::GptOssMoe>>;

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
      t->dtype == io::Dtype::kF32 || t->dtype == io::Dtype::kBf16 || t->dtype == io::Dtype::kF16 ||
          (t->dtype == io::Dtype::kF8E4M3 && shape.size() == 2),
      "models: ", ckpt.source(), ": tensor ", io::detail::printable_name(name), " is ",
      io::dtype_name(t->dtype),
      "; the decoder reads F32, BF16 or F16 (and F8_E4M3 matrices with their weight_scale_inv)");
  return *t;
}

/// Tensor `name` of `ckpt` as floats, checked against `shape`; an F8_E4M3 matrix is
/// dequantised with its "<name>_scale_inv" blocks (config.moe's quantization_config, as the MoE
/// loader does for the experts).
inline std::vector<float> read_tensor(io::ShardedCheckpoint const& ckpt, std::string const& name,
                                      std::vector<std::int64_t> const& shape,
                                      std::string const& why,
                                      io::HfMoeConfig const* moe_config = nullptr) {
  io::TensorView const& t = checked_tensor(ckpt, name, shape, why);
  if (t.dtype != io::Dtype::kF8E4M3) return io::to_float(t);
  static io::HfMoeConfig const default_blocks{};  // 128 x 128 FP8 blocks
  io::HfTensor ht;
  ht.name = name;
  ht.shape = shape;
  return io::detail::read_hf_tensor(ckpt, ht, moe_config ? *moe_config : default_blocks, 0, "");
}

/// Does `mode` keep a tensor of `dtype` in bf16?
inline bool keeps_bf16(io::Dtype dtype, DenseWeights mode) {
  return mode == DenseWeights::kBf16 ||
         (mode == DenseWeights::kAsStored && dtype == io::Dtype::kBf16);
}

/// Tensor `name` of `ckpt` (checked against `shape`) as a WeightMatrix stored as `mode` says,
/// in place in the mapped file when its dtype is the one kept and its data is aligned for it.
inline WeightMatrix read_matrix(io::ShardedCheckpoint const& ckpt, std::string const& name,
                                std::vector<std::int64_t> const& shape, std::string const& why,
                                DenseWeights mode, io::HfMoeConfig const* moe_config = nullptr) {
  io::TensorView const& t = checked_tensor(ckpt, name, shape, why);
  WeightMatrix m;
  m.rows = shape.front();
  m.cols = static_cast<Index>(t.num_elements()) / std::max<Index>(1, m.rows);
  bool const keep_bf16 = keeps_bf16(t.dtype, mode);
  auto const addr = reinterpret_cast<std::uintptr_t>(t.bytes.data());
  bool const little = std::endian::native == std::endian::little;
  if (keep_bf16 && t.dtype == io::Dtype::kBf16) {
    if (little && addr % alignof(std::uint16_t) == 0) {
      m.bf16_view = reinterpret_cast<std::uint16_t const*>(t.bytes.data());
    } else {
      m.bf16.resize(static_cast<std::size_t>(t.num_elements()));
      for (std::size_t i = 0; i < m.bf16.size(); ++i) {
        m.bf16[i] = io::detail::load_le<std::uint16_t>(t.bytes.data() + 2 * i);
      }
    }
    return m;
  }
  if (t.dtype == io::Dtype::kF32 && little && addr % alignof(float) == 0 && !keep_bf16) {
    m.f32_view = reinterpret_cast<float const*>(t.bytes.data());
    return m;
  }
  if (t.dtype == io::Dtype::kF8E4M3) {  // dequantised (kAsStored keeps it in fp32)
    std::vector<float> const v = read_tensor(ckpt, name, shape, why, moe_config);
    m.f32.assign(v.begin(), v.end());
  } else {
    m.f32.resize(static_cast<std::size_t>(t.num_elements()));
    io::to_float(t, m.f32);
  }
  if (keep_bf16) m.to_bf16();
  return m;
}

template <class Moe>
Decoder<Moe> load_decoder(DecoderConfig const& c,
                          std::shared_ptr<io::ShardedCheckpoint const> const& mapped,
                          DecoderOptions const& options, ThreadPool* pool) {
  io::ShardedCheckpoint const& ckpt = *mapped;
  DenseWeights const mode = options.dense;
  Decoder<Moe> d;
  d.config = c;
  Index const H = c.moe.hidden_size, V = c.vocab_size, nh = c.num_attention_heads,
              kv = c.num_key_value_heads, dh = c.head_dim;
  std::string const why =
      "a decoder checkpoint holds the embedding, every layer, the final "
      "norm and (untied) lm_head";
  d.embed = read_matrix(ckpt, "model.embed_tokens.weight", {V, H}, why, mode);
  d.norm = read_tensor(ckpt, "model.norm.weight", {H}, why);
  if (!c.tie_word_embeddings) {
    d.lm_head = read_matrix(ckpt, "lm_head.weight", {V, H},
                            "tie_word_embeddings is false, so lm_head.weight is needed", mode);
  }
  bool in_place = d.embed.in_place() || d.lm_head.in_place();
  GatedAttentionConfig ac;
  ac.d_model = H;
  ac.num_heads = nh;
  ac.num_kv_heads = kv;
  ac.head_dim = dh;
  ac.qk_norm = c.qk_norm ? QkNorm::kRmsNorm : QkNorm::kNone;
  ac.qk_norm_scope = c.qk_norm_scope;
  ac.qkv_bias = c.qkv_bias;
  ac.o_bias = c.o_bias;
  ac.norm_eps = c.rms_norm_eps;
  ac.rope = true;
  ac.rope_theta = c.rope_theta;
  ac.rotary_dim = c.rotary_dim;
  ac.yarn = c.yarn;
  ac.sinks = c.sinks;
  ac.rope_interleaved = c.rope_interleaved;
  ac.causal = true;
  for (Index L = 0; L < c.num_hidden_layers; ++L) {
    std::string const p = io::detail::concat("model.layers.", L, ".");
    ac.sliding_window = static_cast<std::size_t>(L) < c.layer_windows.size()
                            ? c.layer_windows[static_cast<std::size_t>(L)]
                            : c.sliding_window;
    typename Decoder<Moe>::Block b{GatedAttention<gating::NoGate>(ac), {}, {}, std::nullopt, {}};
    auto load_into = [&](std::span<float> dst, std::string const& name,
                         std::vector<std::int64_t> const& shape) {
      std::vector<float> const v = read_tensor(ckpt, p + name, shape, why, &c.moe);
      std::copy(v.begin(), v.end(), dst.begin());
    };
    auto view_span = [](MatrixView<float> m) {
      return std::span<float>(m.data, static_cast<std::size_t>(m.rows * m.cols));
    };
    bool attention_bf16 = true;
    auto load_projection = [&](MatrixView<float> dst, std::string const& name,
                               std::vector<std::int64_t> const& shape) {
      load_into(view_span(dst), name, shape);
      attention_bf16 = attention_bf16 && keeps_bf16(ckpt.find(p + name)->dtype, mode);
    };
    load_projection(b.attention.q_proj(), "self_attn.q_proj.weight", {nh * dh, H});
    load_projection(b.attention.k_proj(), "self_attn.k_proj.weight", {kv * dh, H});
    load_projection(b.attention.v_proj(), "self_attn.v_proj.weight", {kv * dh, H});
    load_projection(b.attention.o_proj(), "self_attn.o_proj.weight", {H, nh * dh});
    if (c.qk_norm) {
      bool const all = c.qk_norm_scope == QkNormScope::kAllHeads;
      load_into(b.attention.q_norm(), "self_attn.q_norm.weight", {all ? nh * dh : dh});
      load_into(b.attention.k_norm(), "self_attn.k_norm.weight", {all ? kv * dh : dh});
    }
    if (c.qkv_bias) {
      load_into(b.attention.q_bias(), "self_attn.q_proj.bias", {nh * dh});
      load_into(b.attention.k_bias(), "self_attn.k_proj.bias", {kv * dh});
      load_into(b.attention.v_bias(), "self_attn.v_proj.bias", {kv * dh});
    }
    if (c.o_bias) load_into(b.attention.o_bias(), "self_attn.o_proj.bias", {H});
    if (c.sinks) load_into(b.attention.sinks(), "self_attn.sinks", {nh});
    if (attention_bf16) b.attention.pack_weights(experts::WeightFormat::kBf16);
    b.input_norm = read_tensor(ckpt, p + "input_layernorm.weight", {H}, why);
    b.post_norm = read_tensor(ckpt, p + "post_attention_layernorm.weight", {H}, why);
    if (c.moe.is_moe_layer(L)) {
      b.moe.emplace(io::load_hf_layer<Moe>(c.moe, ckpt, L).layer);
      b.moe->pack_weights(options.experts, pool);
      // A decoder never trains: keep only the pack (unless inference would read the fp32
      // weights: GLU experts of an odd width in an fp32 or bf16 pack).
      if (b.moe->can_discard_master_weights()) b.moe->discard_master_weights();
    } else {
      Index const I = c.intermediate_size;
      b.mlp.gate = read_matrix(ckpt, p + "mlp.gate_proj.weight", {I, H}, why, mode, &c.moe);
      b.mlp.up = read_matrix(ckpt, p + "mlp.up_proj.weight", {I, H}, why, mode, &c.moe);
      b.mlp.down = read_matrix(ckpt, p + "mlp.down_proj.weight", {H, I}, why, mode, &c.moe);
      in_place = in_place || b.mlp.gate.in_place() || b.mlp.up.in_place() || b.mlp.down.in_place();
    }
    d.blocks.push_back(std::move(b));
  }
  if (in_place) d.mapped = mapped;
  return d;
}

}  // namespace detail

/// Loads the whole model in `model_dir` (config.json, model.safetensors or the sharded index):
/// a Decoder of the family's MoE type (AnyDecoder), every MoE layer through the layer loader of
/// moe/io/hf.hpp (or as a dense MLP), its weights kept as `options` says (by default: bf16
/// tensors in bf16, the rest in fp32, experts as fp32 panels; FP8 matrices dequantised).
/// `pool` packs the experts in parallel. Throws moe::Error naming the file and tensor for
/// anything missing or mis-shaped, and as parse_decoder_config.
inline AnyDecoder load_hf_decoder(std::filesystem::path const& model_dir,
                                  ThreadPool* pool = nullptr, DecoderOptions const& options = {}) {
  io::detail::check_model_dir(model_dir);
  DecoderConfig const c = read_decoder_config(model_dir);
  auto const ckpt = std::make_shared<io::ShardedCheckpoint const>(io::open_checkpoint(model_dir));
  switch (c.moe.family) {
    case io::HfFamily::kMixtral:
      return detail::load_decoder<presets::MixtralMoe>(c, ckpt, options, pool);
    case io::HfFamily::kQwen2Moe:
      return detail::load_decoder<presets::Qwen2Moe>(c, ckpt, options, pool);
    case io::HfFamily::kGlm4Moe:
    case io::HfFamily::kMinimaxM2:
    case io::HfFamily::kErnie45Moe:
      return detail::load_decoder<presets::DeepseekV3Moe>(c, ckpt, options, pool);
    case io::HfFamily::kGptOss:
      return detail::load_decoder<presets::GptOssMoe>(c, ckpt, options, pool);
    default:  // qwen3_moe, olmoe (parse_decoder_config refused the others)
      return detail::load_decoder<presets::Qwen3Moe>(c, ckpt, options, pool);
  }
}

}  // namespace moe::models
