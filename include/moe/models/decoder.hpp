// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// A whole MoE decoder (token embedding, N blocks, final RMSNorm, LM head) loaded from a Hugging
/// Face checkpoint directory (or a GGUF file: moe/models/gguf_decoder.hpp) of a family
/// DecoderConfig lists, with KV-cached decoding (a fixed-size recurrent state for Gated DeltaNet
/// layers).
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/in_use.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/io/hf.hpp"
#include "moe/kernels/activations.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/kernels/rms_norm.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/gated_deltanet.hpp"
#include "moe/layers/kv_cache.hpp"
#include "moe/layers/linear.hpp"
#include "moe/layers/mla_attention.hpp"
#include "moe/layers/presets.hpp"
#include "moe/models/checkpoint_experts.hpp"
#include "moe/models/decoder_config.hpp"
#include "moe/offload/store.hpp"
#include "moe/offload/streamer.hpp"
#include "moe/offload/trace.hpp"

namespace moe::models {

/// The classes of a decoder's matrices, for choosing their formats (DecoderOptions).
enum class MatrixClass {
  kEmbedding,    ///< model.embed_tokens.weight (rows read, never multiplied)
  kLmHead,       ///< lm_head.weight, or the embedding's values when tied
  kAttnQ,        ///< q_proj (and a gate projection; a Gated DeltaNet's input projections)
  kAttnK,        ///< k_proj
  kAttnV,        ///< v_proj
  kAttnO,        ///< o_proj (a Gated DeltaNet's out_proj)
  kDenseGateUp,  ///< a dense MLP's gate_proj and up_proj
  kDenseDown,    ///< a dense MLP's down_proj
  kExpertsIn,    ///< routed and shared experts' gate and up projections
  kExpertsDown,  ///< routed and shared experts' down projections
};

/// "embedding", "lm_head", "attn_q", "attn_k", "attn_v", "attn_o", "dense_gate_up",
/// "dense_down", "experts_in", "experts_down".
constexpr char const* name(MatrixClass c) {
  constexpr char const* kNames[] = {"embedding",  "lm_head",     "attn_q",        "attn_k",
                                    "attn_v",     "attn_o",      "dense_gate_up", "dense_down",
                                    "experts_in", "experts_down"};
  return kNames[static_cast<int>(c)];
}

/// How load_hf_decoder stores each class of matrices. Every matrix is multiplied by the engine of
/// the experts (moe::Linear), in fp32, bf16 or a GGUF block format; a format whose blocks do not
/// divide a matrix's depth falls back along its chain (experts::resolve_format), and
/// Decoder::fallbacks lists where it did.
///   - `dense` (unset: as stored: BF16 tensors bf16, F32/F16/F8 tensors fp32, GGUF blocks in
///     their format: see below) is the format of the embedding, the LM head, the attention
///     projections and the dense MLPs, unless the class's own field is set (`embedding`,
///     `lm_head`, `attention`, `dense_mlp`);
///   - `experts`, `shared_experts` (unset: `experts`): the MoE layers' routed and shared experts
///     (both unset: as stored when the checkpoint stores them as GGUF blocks, per expert, else
///     fp32);
///   - `mix = kQ4_K_M`: llama.cpp's Q4_K_M choice per matrix (llama-quant.cpp, read 2026-12-06;
///     overrides the fields above): every matrix q4_k except the LM head (q6_k; the embedding
///     too when tied), attn_v and every ffn_down (dense, experts, shared) in the layers
///     use_more_bits picks (q6_k: L < n/8, L >= 7n/8, or (L - n/8) % 3 == 2; half of them), and
///     with exactly 8 experts (Mixtral) attn_k and attn_v in q8_0 and attn_o in q5_k; fallbacks
///     as above (llama.cpp's Q4_K -> Q5_0 is q4_0 here; its Q5_K -> Q5_1 is moe's too).
/// Matrices stored as GGUF blocks (a GGUF file's quantized tensors, a moe_quantize checkpoint:
/// moe/io/block_tensor.hpp) run as stored wherever their format is the one chosen: the blocks
/// are re-packed for the kernels, never re-quantized. "As stored" for a block type moe has no
/// kernel for (the IQ1-IQ3 types) is q8_0
/// (experts::load_format): decoded bit-exactly, then quantized to Q8_0.
struct DecoderOptions {
  enum class Mix { kUniform, kQ4_K_M };
  std::optional<experts::WeightFormat> dense;
  std::optional<experts::WeightFormat> embedding, lm_head, attention, dense_mlp;
  std::optional<experts::WeightFormat> experts;
  std::optional<experts::WeightFormat> shared_experts;
  Mix mix = Mix::kUniform;
  /// Routed experts streamed from this expert store (moe/offload/store.hpp: written by
  /// Decoder::write_expert_store, moe_generate --write-expert-store) instead of loaded: the
  /// checkpoint's routed expert weights are checked but never read, each MoE layer's experts
  /// run in the store's formats (`experts` is ignored), read on demand through a cache as
  /// `streaming` says (Decoder::streamer). Empty: every expert loaded and resident.
  std::string expert_store;
  offload::StoreReadOptions store_read;  ///< with expert_store: how the store is read
  /// With expert_store or stream_experts: the cache's budget and policy.
  offload::StreamerOptions streaming;
  /// Routed experts streamed straight from the model's own file (a GGUF file or safetensors
  /// checkpoint) through the cache `streaming` describes, no expert store written: each miss
  /// packs the expert's record from the file (models::CheckpointExperts). Quantized formats must
  /// be the ones the file stores (the default: as stored); not with expert_store.
  bool stream_experts = false;

  /// llama.cpp's Q4_K_M mix (see above).
  static DecoderOptions q4_k_m() {
    DecoderOptions o;
    o.mix = Mix::kQ4_K_M;
    return o;
  }

  /// llama.cpp's use_more_bits(L, n): the layers whose attn_v and ffn_down Q4_K_M keeps in q6_k.
  static constexpr bool more_bits(Index layer, Index layers) {
    return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
  }

  /// Do these options choose the experts' formats (otherwise they stay as stored)?
  bool asks_experts(bool shared) const {
    return mix == Mix::kQ4_K_M || experts.has_value() || (shared && shared_experts.has_value());
  }

  /// The format asked for a matrix of class `c` in layer `layer` of `layers` (`experts`: the
  /// model's routed experts; `tied`: the LM head is the embedding; `stored`: how the checkpoint
  /// stores the tensor, as the format that holds it: kF32 for F32, F16 and F8 tensors, kBf16
  /// for BF16, experts::load_format of a GGUF block type), before any fallback. `shared`: a
  /// shared expert's projection.
  experts::WeightFormat format_of(MatrixClass c, Index layer, Index layers, Index num_experts,
                                  bool tied, experts::WeightFormat stored,
                                  bool shared = false) const {
    using experts::WeightFormat;
    if (mix == Mix::kQ4_K_M) {
      bool const more = more_bits(layer, layers), eight = num_experts == 8;
      switch (c) {
        case MatrixClass::kLmHead:
          return WeightFormat::kQ6_K;
        case MatrixClass::kEmbedding:
          return tied ? WeightFormat::kQ6_K : WeightFormat::kQ4_K;
        case MatrixClass::kAttnK:
          return eight ? WeightFormat::kQ8_0 : WeightFormat::kQ4_K;
        case MatrixClass::kAttnV:
          return eight ? WeightFormat::kQ8_0 : more ? WeightFormat::kQ6_K : WeightFormat::kQ4_K;
        case MatrixClass::kAttnO:
          return eight ? WeightFormat::kQ5_K : WeightFormat::kQ4_K;
        case MatrixClass::kDenseDown:
        case MatrixClass::kExpertsDown:
          return more ? WeightFormat::kQ6_K : WeightFormat::kQ4_K;
        default:
          return WeightFormat::kQ4_K;
      }
    }
    if (c == MatrixClass::kExpertsIn || c == MatrixClass::kExpertsDown) {
      if (shared && shared_experts) return *shared_experts;
      if (experts) return *experts;
      return experts::is_quantized(stored) ? stored : WeightFormat::kF32;
    }
    std::optional<WeightFormat> own;
    switch (c) {
      case MatrixClass::kEmbedding:
        own = embedding;
        break;
      case MatrixClass::kLmHead:
        own = lm_head;
        break;
      case MatrixClass::kDenseGateUp:
      case MatrixClass::kDenseDown:
        own = dense_mlp;
        break;
      default:
        own = attention;
        break;
    }
    if (own) return *own;
    if (dense) return *dense;
    return stored;
  }
};

/// A matrix of a loaded decoder that got another format than the one asked for (its blocks do
/// not divide the matrix's depth; experts::resolve_format).
struct Fallback {
  std::string matrix;                   ///< e.g. "model.layers.3.mlp.down_proj.weight"
  experts::WeightFormat asked, chosen;  ///< the format asked for and the one it got
  Index depth = 0;                      ///< the depth that asked's blocks do not divide
};

/// The token embedding [V, H]: rows read by token id (never multiplied), stored in fp32, bf16
/// (each value as the top half of a float), or GGUF blocks row by row (row r: the bytes
/// quant::row_bytes(format, H) of a GGUF tensor's row; read through ggml's dequantizer), or read in
/// place from the mapped checkpoint (fp32, bf16, or GGUF blocks as stored).
struct Embedding {
  Index rows = 0, cols = 0;
  experts::WeightFormat format = experts::WeightFormat::kF32;
  HugePageVector<float> f32;
  HugePageVector<std::uint16_t> bf16;
  HugePageVector<std::byte> blocks;
  float const* f32_view = nullptr;
  std::uint16_t const* bf16_view = nullptr;
  std::byte const* blocks_view = nullptr;  ///< rows of `format` blocks in the mapped checkpoint

  /// Rows of w [V, H] stored in `format` (quantized with ggml's reference quantizer; the caller
  /// resolved the format for H).
  static Embedding pack(ConstMatrixView<float> w, experts::WeightFormat format) {
    Embedding e;
    e.rows = w.rows;
    e.cols = w.cols;
    e.format = format;
    std::size_t const n = static_cast<std::size_t>(w.rows * w.cols);
    if (format == experts::WeightFormat::kF32) {
      e.f32.resize(n);
      for (Index r = 0; r < w.rows; ++r) std::copy(w.row(r), w.row(r) + w.cols, &e.f32[r * w.cols]);
    } else if (format == experts::WeightFormat::kBf16) {
      e.bf16.resize(n);
      for (Index r = 0; r < w.rows; ++r)
        kernels::round_to_bf16(w.row(r), w.cols, &e.bf16[r * w.cols]);
    } else {
      quant::Format const qf = experts::quant_format(format);
      Index const rb = quant::row_bytes(qf, w.cols);
      e.blocks.resize(static_cast<std::size_t>(w.rows * rb));
      for (Index r = 0; r < w.rows; ++r) {
        quant::quantize_row(qf, w.row(r), w.cols, e.blocks.data() + r * rb);
      }
    }
    return e;
  }
  bool in_place() const {
    return f32_view != nullptr || bf16_view != nullptr || blocks_view != nullptr;
  }
  /// Bytes of the stored values.
  std::size_t bytes() const {
    if (experts::is_quantized(format)) {
      return static_cast<std::size_t>(rows * quant::row_bytes(experts::quant_format(format), cols));
    }
    return static_cast<std::size_t>(rows * cols) * (format == experts::WeightFormat::kBf16 ? 2 : 4);
  }
  /// out[c] = row r, exact (widened or dequantized).
  void read_row(Index r, float* out) const {
    if (experts::is_quantized(format)) {
      quant::Format const qf = experts::quant_format(format);
      std::byte const* b = blocks_view ? blocks_view : blocks.data();
      quant::dequantize_row(qf, b + r * quant::row_bytes(qf, cols), cols, out);
    } else if (std::uint16_t const* b = bf16_view      ? bf16_view
                                        : bf16.empty() ? nullptr
                                                       : bf16.data()) {
      for (Index c = 0; c < cols; ++c) out[c] = kernels::bf16_to_float(b[r * cols + c]);
    } else {
      float const* f = (f32_view ? f32_view : f32.data()) + r * cols;
      std::copy(f, f + cols, out);
    }
  }
};

/// A dense SwiGLU MLP (Qwen3-MoE's layers outside the sparse step):
///   y = W_down (silu(W_gate x) * (W_up x)),  W_gate, W_up [I, H], W_down [H, I],
/// on the engine of the experts: gate and up in one pass with silu(g) * u in the epilogue (one
/// GLU job, as a routed expert's), then down (its output added to the residual in its epilogue).
struct DenseMlp {
  Linear gate, up;  ///< [I, H] each, one format
  Linear down;      ///< [H, I]

  Index intermediate() const { return gate.rows(); }
  std::size_t bytes() const { return gate.bytes() + up.bytes() + down.bytes(); }

  /// h [T, H] += MLP(x [T, H]); `m` is a reused buffer.
  void forward_add(ConstMatrixView<float> x, MatrixView<float> h, std::vector<float>& m,
                   LinearQueue& q, ThreadPool* pool) const {
    Index const T = x.rows, I = gate.rows();
    m.resize(static_cast<std::size_t>(T * I));
    MatrixView<float> const mv(m.data(), T, I);
    q.add_swiglu(gate, up, x, mv);
    q.run(pool);
    q.add(down, mv, h, true);
    q.run(pool);
  }
};

/// Decoding state of a Decoder for `sequences()` independent sequences: a KvCache per attention
/// layer, a DeltaNetState per sequence for each Gated DeltaNet layer (a fixed size, whatever
/// the context), and the buffers a step reuses (no allocation once they have their size).
struct DecoderState {
  /// One per layer: keys and values, a latent cache for an MLA layer, none (no sequences) for a
  /// Gated DeltaNet layer.
  std::vector<KvCache> caches;
  /// [layer][sequence]: a Gated DeltaNet layer's states (empty for the other layers).
  std::vector<std::vector<DeltaNetState>> recurrent;
  Index sequence_count = 0;
  GatedAttentionWorkspace attention;
  MlaAttentionWorkspace mla;
  GatedDeltaNetWorkspace deltanet;
  std::vector<DeltaNetState*> recurrent_of;  ///< one layer's states, for its call
  MoeFfnWorkspace ffn;
  std::vector<float> h, normed, tmp, mlp_hidden, last;
  std::vector<Index> last_rows, last_seqs;  ///< the rows that get logits, and their sequences
  LinearQueue queue;                        ///< dense MLP and LM-head projections
  std::vector<std::int32_t> stream_ids;     ///< a streamed MoE layer's routed experts
  std::vector<float> stream_gates;          ///< and their largest routing weights
  std::vector<std::int32_t> prefetch_ids;   ///< what the next streamed MoE layer reads ahead
  std::vector<float> prefetch_x;            ///< its router's input (the next post-norm of h)
  std::vector<ExpertId> swap_scratch;       ///< cache-aware routing
  MoeFfnWorkspace ffn_ahead;                ///< its routing
  /// When set (a state of one sequence), every forward appends its tokens' routing to this trace
  /// (token-major: each token's MoE layers in order; Decoder::trace_shape gives its shape): the
  /// K experts each layer chose in rank order with their router scores, and the router's M
  /// highest-scoring experts. What moe_cache_sim replays and ReusePredictor trains on.
  offload::Trace* trace = nullptr;
  std::vector<std::int32_t> trace_ids;  ///< a forward's steps, [T, MoE layers, K + M]
  std::vector<float> trace_scores;      ///< and their scores
  InUse in_use;  ///< forward() holds it: a second, overlapping call on this state throws
  /// Seconds spent per part of forward() (wall clock), accumulated while `profile` is set:
  /// attention layers, FFN layers (MoE or dense), and the rest (embedding, norms, residuals,
  /// LM head).
  bool profile = false;
  double attention_seconds = 0.0, ffn_seconds = 0.0, other_seconds = 0.0;
  Index sequences() const { return sequence_count; }
  /// Tokens seen per sequence (every layer has seen the same).
  Index length(Index s) const {
    for (KvCache const& c : caches) {
      if (c.sequences() > 0) return c.length(s);
    }
    for (std::vector<DeltaNetState> const& r : recurrent) {
      if (!r.empty()) return r.at(static_cast<std::size_t>(s)).tokens;
    }
    return 0;
  }
  /// Bytes of keys and values per cached token, summed over the layers.
  std::size_t kv_bytes_per_token() const {
    std::size_t n = 0;
    for (KvCache const& c : caches) {
      if (c.sequences() > 0) n += c.bytes_per_token();  // (none for a Gated DeltaNet layer)
    }
    return n;
  }
  /// Bytes of the Gated DeltaNet layers' states (all sequences), the same at any length.
  std::size_t recurrent_bytes() const {
    std::size_t n = 0;
    for (std::vector<DeltaNetState> const& r : recurrent) {
      for (DeltaNetState const& st : r) n += st.bytes();
    }
    return n;
  }
  /// Back to empty sequences (every cache and recurrent state), keeping the memory.
  void clear() {
    for (KvCache& c : caches) c.clear();
    for (std::vector<DeltaNetState>& r : recurrent) {
      for (DeltaNetState& st : r) st.reset();
    }
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
/// Weights (see DecoderOptions): every matrix in the format its class asks for (by default as
/// the checkpoint stores it: BF16 tensors bf16, the rest fp32), each multiplied by the engine of
/// the experts (moe::Linear: the attention projections through GatedAttention::pack_weights, the
/// dense MLPs, the LM head); the embedding's rows are read (in place from the mapped file when it
/// is fp32 or bf16 as stored: `mapped` then keeps it open). The MoE layers' experts are packed in
/// their formats and their fp32 weights discarded (MoeFfn::discard_master_weights: a decoder does
/// not train; only the pack stays in memory). Residuals are added in the epilogues of o_proj and
/// of the dense MLPs' down_proj. A token's logits do not depend on the batch it runs in, with
/// packed experts (every projection's output element is one FMA chain of its row).
template <class Moe>
class Decoder {
 public:
  /// A block's token mixer: GQA attention; the same with Qwen3-Next's sigmoid output gate;
  /// multi-head latent attention (DeepSeek-V2 / V3, Kimi K2); or a Gated DeltaNet (Qwen3-Next's
  /// linear-attention layers).
  using Mixer = std::variant<GatedAttention<gating::NoGate>,
                             GatedAttention<gating::ElementwiseGate>, MlaAttention, GatedDeltaNet>;

  struct Block {
    Mixer mixer;
    std::vector<float> input_norm, post_norm;  ///< [H] each (the (1 + w) form already added)
    std::optional<Moe> moe;                    ///< the MoE FFN, or
    DenseMlp mlp;                              ///< the dense one

    /// The mixer as each kind, or null when it is another.
    GatedAttention<gating::NoGate> const* attention() const {
      return std::get_if<GatedAttention<gating::NoGate>>(&mixer);
    }
    GatedAttention<gating::ElementwiseGate> const* gated_attention() const {
      return std::get_if<GatedAttention<gating::ElementwiseGate>>(&mixer);
    }
    MlaAttention const* mla() const { return std::get_if<MlaAttention>(&mixer); }
    GatedDeltaNet const* deltanet() const { return std::get_if<GatedDeltaNet>(&mixer); }

    /// The mixer's projection format (its first projection's: q_proj, or all of MLA's).
    experts::WeightFormat attention_format() const {
      return std::visit([](auto const& m) { return m.weight_format(); }, mixer);
    }
    /// Bytes of the mixer's packed projections (what one decode step streams).
    std::size_t projection_bytes() const {
      return std::visit([](auto const& m) { return m.projection_bytes(); }, mixer);
    }
  };

  DecoderConfig config;
  Embedding embed;            ///< [V, H] model.embed_tokens.weight
  std::vector<Block> blocks;  ///< model.layers.L
  std::vector<float> norm;    ///< [H] model.norm.weight
  /// [V, H] lm_head.weight, or the embedding's values when tied (packed in the LM head's format).
  Linear lm_head;
  /// The checkpoint, kept open while the embedding is read in place from it (else null).
  std::shared_ptr<io::ShardedCheckpoint const> mapped;
  /// The matrices that got another format than DecoderOptions asked for, in load order.
  std::vector<Fallback> fallbacks;
  /// What the load noticed but did not refuse, one sentence each (e.g. an lm_head.weight that
  /// tie_word_embeddings leaves unread); moe_generate prints them.
  std::vector<std::string> warnings;
  /// Where the routed experts come from when they are streamed (stream_experts), else null:
  /// every expert is resident in its bank. Copies of the decoder share it.
  std::shared_ptr<offload::ExpertStreamer> streamer;

  /// The shape of a routing trace of this model (DecoderState::trace): its MoE layers, experts,
  /// top-k, and `candidates` router candidates a step (clamped to [top-k, experts]).
  offload::TraceShape trace_shape(Index candidates = 32) const {
    Index const E = config.moe.num_experts, K = config.moe.num_experts_per_tok;
    return {static_cast<Index>(moe_blocks().size()), E, K, std::clamp(candidates, K, E)};
  }

  /// The blocks with an MoE layer, in order: the i-th is MoE layer i of an expert store.
  std::vector<std::size_t> moe_blocks() const {
    std::vector<std::size_t> out;
    for (std::size_t L = 0; L < blocks.size(); ++L) {
      if (blocks[L].moe) out.push_back(L);
    }
    return out;
  }
  /// The shape of this decoder's routed experts as an expert store holds them.
  offload::StoreShape expert_store_shape() const {
    std::vector<std::size_t> const m = moe_blocks();
    moe::detail::check(!m.empty(), "Decoder: the model has no MoE layer to store or stream");
    auto const& bank = blocks[m.front()].moe->experts();
    return {static_cast<Index>(m.size()), bank.num_experts(), bank.d_model(), bank.d_ffn(),
            Moe::Expert::gated};
  }
  /// Writes every MoE layer's routed experts, packed as they are, as an expert store at `path`
  /// (offload/store.hpp; the shared experts stay with the dense weights). Throws moe::Error for
  /// experts whose records are streamed or that inference reads from fp32 weights.
  void write_expert_store(std::string const& path) const {
    offload::ExpertStoreWriter w(path, expert_store_shape());
    for (std::size_t const L : moe_blocks()) w.add_layer(blocks[L].moe->experts());
    w.finish();
  }
  /// Streams the routed experts from `s` (its store holds this model's MoE layers in order, in
  /// this machine's layout: offload::ExpertStore::check_layer): every MoE layer's bank frees its
  /// pack and reads the records s makes resident (ExpertBank::stream_records). Each forward then
  /// routes a layer, has s read the chosen experts that are not cached, runs them and releases
  /// them. The logits are those of the resident experts, bit for bit. Irreversible (load the
  /// model again to hold the experts in memory).
  void stream_experts(std::shared_ptr<offload::ExpertStreamer> s) {
    moe::detail::check(s != nullptr, "Decoder::stream_experts: no streamer");
    std::vector<std::size_t> const m = moe_blocks();
    offload::RecordSource const& store = s->store();
    offload::StoreShape const& shape = store.shape();
    moe::detail::check(static_cast<Index>(m.size()) == shape.num_layers,
                       "Decoder::stream_experts: the model has ", m.size(),
                       " MoE layers and the store '", store.path(), "' ", shape.num_layers,
                       "; the store belongs to another model");
    auto const* file = dynamic_cast<offload::ExpertStore const*>(&store);
    for (std::size_t i = 0; i < m.size(); ++i) {
      auto const& bank = blocks[m[i]].moe->experts();
      if (file) {
        file->check_layer(static_cast<Index>(i), bank);
      } else {
        moe::detail::check(shape.num_experts == bank.num_experts() &&
                               shape.d_model == bank.d_model() && shape.d_ffn == bank.d_ffn(),
                           "Decoder::stream_experts: '", store.path(),
                           "' holds experts of d_model ", shape.d_model, ", d_ffn ", shape.d_ffn,
                           ", ", shape.num_experts,
                           " a layer, not this model's; it belongs to another model");
      }
    }
    for (std::size_t i = 0; i < m.size(); ++i) {
      auto const id = static_cast<Index>(i);
      blocks[m[i]].moe->experts().stream_records(store.layer_formats(id), s->records(id));
    }
    streamer = std::move(s);
  }

  Index hidden() const { return config.moe.hidden_size; }
  Index vocab() const { return config.vocab_size; }
  /// The context the model was trained for (config.json's max_position_embeddings; 0: not
  /// known). Longer contexts run, outside what the model was trained on.
  Index max_context() const { return config.max_position_embeddings; }
  /// A warning (one sentence) when a context of `tokens` tokens (prompt and new tokens) is longer
  /// than max_context(), else empty.
  std::string context_warning(Index tokens) const {
    if (max_context() <= 0 || tokens <= max_context()) return {};
    return io::detail::concat("a context of ", tokens, " tokens is longer than the ", max_context(),
                              " the model was trained for (config.json's "
                              "max_position_embeddings); the tokens past it may be poor");
  }
  /// The routing MoE layer `index` just ran (st.ffn.selection) into the forward's trace steps.
  void record_routing(Index index, Index T, DecoderState& st) const {
    offload::TraceShape const& sh = st.trace->shape();
    Index const K = sh.top_k, M = sh.num_candidates, E = sh.num_experts, w = K + M;
    Selection const& sel = st.ffn.selection;
    moe::detail::check(sel.slots == K && sel.num_experts == E,
                       "Decoder::forward: a routing trace records top-k routing (", K,
                       " experts a token); this router fills ", sel.slots, " slots");
    std::vector<std::int32_t> order(static_cast<std::size_t>(E));
    for (Index t = 0; t < T; ++t) {
      auto const at = static_cast<std::size_t>((t * sh.num_layers + index) * w);
      float const* p = sel.scores.data() + t * E;
      for (Index r = 0; r < K; ++r) {
        ExpertId const e = sel.expert[static_cast<std::size_t>(t * K + r)];
        moe::detail::check(e >= 0, "Decoder::forward: a routing trace needs every token's ", K,
                           " slots filled (no capacity drops)");
        st.trace_ids[at + static_cast<std::size_t>(r)] = static_cast<std::int32_t>(e);
        st.trace_scores[at + static_cast<std::size_t>(r)] = p[e];
      }
      // The M highest scores, ties to the lower expert.
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(
          order.begin(), order.begin() + M, order.end(),
          [&](std::int32_t a, std::int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      for (Index m = 0; m < M; ++m) {
        st.trace_ids[at + static_cast<std::size_t>(K + m)] = order[static_cast<std::size_t>(m)];
        st.trace_scores[at + static_cast<std::size_t>(K + m)] =
            p[order[static_cast<std::size_t>(m)]];
      }
    }
  }

  /// Block L's MoE layer (MoE layer `index`) with streamed experts: route, request the chosen
  /// experts (hits pinned, misses being read), start reading ahead for the next MoE layer, run
  /// the experts on that routing (forward() is route + the same run; the resident experts
  /// first, the others once read), release. h: the residual stream the MoE
  /// layer's input x was normed from.
  void forward_streamed(std::size_t L, Index index, MatrixView<float> h, ConstMatrixView<float> x,
                        MatrixView<float> y, DecoderState& st, ForwardOptions const& opt) const;
  /// Reads ahead the experts the next MoE layer (after block L; MoE layer index + 1) will likely
  /// need, as StreamerOptions::prefetch says: its router applied to the current residual stream
  /// h normed with its own post-attention norm (the attention between changes h a little), and
  /// the experts it ran for the previous token.
  void prefetch_ahead(std::size_t L, Index index, MatrixView<float> h, DecoderState& st,
                      ForwardOptions const& opt) const;

  /// Bytes of the dense matrices a decode step of one token streams: every attention
  /// projection, dense MLP and the LM head (the embedding's one row aside).
  std::size_t dense_bytes_per_step() const {
    std::size_t n = lm_head.bytes();
    for (Block const& b : blocks) n += b.projection_bytes() + b.mlp.bytes();
    return n;
  }

  /// A state for `sequences` sequences with room for `capacity` tokens each (it grows), its
  /// caches holding keys and values as `kv` says (KvFormat::kBf16: half the bytes a step reads
  /// from a long context; the logits move by the rounding of the cached keys and values). A
  /// sliding-window layer's cache keeps only its window (KvCache's `window`: about 2 W rows
  /// however long the context; a sequence cannot be truncated back past it). A Gated DeltaNet
  /// layer has a DeltaNetState per sequence instead (GatedDeltaNet::state_bytes(), whatever the
  /// context; it cannot be truncated: DecoderState::clear() starts over).
  DecoderState make_state(Index sequences, Index capacity = 0, KvFormat kv = KvFormat::kF32) const {
    moe::detail::check(sequences >= 0, "Decoder::make_state: sequences = ", sequences,
                       " must be >= 0");
    DecoderState st;
    st.sequence_count = sequences;
    st.recurrent.resize(blocks.size());
    Index const kvd = config.num_key_value_heads * config.head_dim;
    for (std::size_t L = 0; L < blocks.size(); ++L) {
      Block const& b = blocks[L];
      if (MlaAttention const* m = b.mla()) {  // latent rows: kv_lora_rank + qk_rope_head_dim
        st.caches.push_back(m->make_cache(sequences, capacity, kv));
      } else if (GatedDeltaNet const* dn = b.deltanet()) {
        st.caches.emplace_back();
        st.recurrent[L].assign(static_cast<std::size_t>(sequences), dn->make_state());
      } else {
        // a sliding window or an attention chunk
        Index const window = std::visit(
            [](auto const& a) -> Index {
              if constexpr (requires { a.lookback(); }) {
                return a.lookback();
              } else {
                return 0;
              }
            },
            b.mixer);
        st.caches.emplace_back(sequences, kvd,
                               window > 0 ? std::min(capacity, 2 * window) : capacity, kv, window);
      }
    }
    return st;
  }

  /// Appends new_tokens[s] tokens to each sequence s (`tokens` holds them in sequence order)
  /// and writes into logits [sequences, V] the next-token logits of every sequence that got
  /// at least one (after its last new token; other rows are left as they are). Throws
  /// moe::Error for a token id outside [0, V), counts that do not match, or a logits view of
  /// another shape.
  void forward(std::span<std::int64_t const> tokens, std::span<Index const> new_tokens,
               DecoderState& st, MatrixView<float> logits, ThreadPool* pool = nullptr) const;

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

// Decoder's heavy members, defined out of the class (not inline): with MOE_EXTERN_DECODERS
// (the end of this file) a translation unit leaves their instantiation to the one that
// instantiates Decoder explicitly.

template <class Moe>
void Decoder<Moe>::forward_streamed(std::size_t L, Index index, MatrixView<float> h,
                                    ConstMatrixView<float> x, MatrixView<float> y, DecoderState& st,
                                    ForwardOptions const& opt) const {
  Moe const& layer = *blocks[L].moe;
  layer.route(x, st.ffn, opt);
  if (offload::CacheRoutingOptions const& cr = streamer->options().cache_routing; cr.enabled) {
    Index const swaps = offload::cache_aware_swap(
        st.ffn.selection, ConstMatrixView<float>(st.ffn.logits.data(), x.rows, layer.num_experts()),
        [&](ExpertId e) { return streamer->resident(index, e); }, cr, st.swap_scratch);
    if (swaps > 0) kernels::build_plan(st.ffn.selection, st.ffn.plan);
    streamer->count_swaps(swaps);
  }
  RoutingPlan const& plan = st.ffn.plan;
  st.stream_ids.clear();
  st.stream_gates.clear();
  for (Index e = 0; e < layer.num_experts(); ++e) {
    Index const r0 = plan.expert_offsets[static_cast<std::size_t>(e)],
                r1 = plan.expert_offsets[static_cast<std::size_t>(e) + 1];
    if (r1 == r0) continue;
    float g = 0.0f;
    for (Index r = r0; r < r1; ++r) g = std::max(g, plan.row_weight[static_cast<std::size_t>(r)]);
    st.stream_ids.push_back(static_cast<std::int32_t>(e));
    st.stream_gates.push_back(g);
  }
  streamer->request(index, st.stream_ids, st.stream_gates);
  struct Release {
    offload::ExpertStreamer& s;
    Index i;
    ~Release() { s.release(i); }
  } const release{*streamer, index};
  prefetch_ahead(L, index, h, st, opt);
  // The experts whose records are in run while the others are read (bit for bit the same).
  std::span<unsigned char const> const ready = streamer->ready(index);
  bool const all = std::all_of(st.stream_ids.begin(), st.stream_ids.end(), [&](std::int32_t e) {
    return ready[static_cast<std::size_t>(e)] != 0;
  });
  if (all) {
    layer.forward_with_plan(x, plan, y, st.ffn, opt.pool);
  } else {
    layer.forward_with_plan(x, plan, y, st.ffn, opt.pool,
                            ExpertSchedule{ready, [&] { streamer->wait(index); }});
  }
}

template <class Moe>
void Decoder<Moe>::prefetch_ahead(std::size_t L, Index index, MatrixView<float> h, DecoderState& st,
                                  ForwardOptions const& opt) const {
  offload::StreamerOptions const& so = streamer->options();
  std::size_t next = L + 1;
  while (next < blocks.size() && !blocks[next].moe) ++next;
  if (next >= blocks.size() || so.prefetch == "none") return;
  st.prefetch_ids.clear();
  if (so.prefetch_previous()) {
    std::span<std::int32_t const> const last = streamer->last_experts(index + 1);
    st.prefetch_ids.assign(last.begin(), last.end());
  }
  if (so.prefetch_router()) {
    Block const& nb = blocks[next];
    st.prefetch_x.resize(static_cast<std::size_t>(h.rows * h.cols));
    MatrixView<float> const xn(st.prefetch_x.data(), h.rows, h.cols);
    rms_rows(h, nb.post_norm, xn, opt.pool);
    nb.moe->route(xn, st.ffn_ahead, opt);
    RoutingPlan const& plan = st.ffn_ahead.plan;
    for (Index e = 0; e < nb.moe->num_experts(); ++e) {
      if (plan.expert_offsets[static_cast<std::size_t>(e) + 1] >
          plan.expert_offsets[static_cast<std::size_t>(e)]) {
        st.prefetch_ids.push_back(static_cast<std::int32_t>(e));
      }
    }
  }
  std::sort(st.prefetch_ids.begin(), st.prefetch_ids.end());
  st.prefetch_ids.erase(std::unique(st.prefetch_ids.begin(), st.prefetch_ids.end()),
                        st.prefetch_ids.end());
  streamer->prefetch(index + 1, st.prefetch_ids);
}

template <class Moe>
void Decoder<Moe>::forward(std::span<std::int64_t const> tokens, std::span<Index const> new_tokens,
                           DecoderState& st, MatrixView<float> logits, ThreadPool* pool) const {
  auto const busy = st.in_use.enter("Decoder::forward");
  Index const H = hidden(), V = vocab(), T = static_cast<Index>(tokens.size());
  Index const B = st.sequences();
  moe::detail::check(st.caches.size() == blocks.size() && st.recurrent.size() == blocks.size(),
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
  if (streamer) streamer->begin_forward(T);
  Index moe_layer = 0;
  if (st.trace) {
    moe::detail::check(
        B == 1 && st.trace->shape().num_layers == static_cast<Index>(moe_blocks().size()) &&
            st.trace->shape().num_experts == config.moe.num_experts &&
            st.trace->shape().top_k == config.moe.num_experts_per_tok,
        "Decoder::forward: the state's trace records one sequence of this model's "
        "routing (Decoder::trace_shape); this state has ",
        B, " sequences or the trace another shape");
    Index const w = st.trace->shape().top_k + st.trace->shape().num_candidates;
    st.trace_ids.resize(static_cast<std::size_t>(T * st.trace->shape().num_layers * w));
    st.trace_scores.resize(st.trace_ids.size());
  }
  size(st.h, T * H);
  size(st.normed, T * H);
  size(st.tmp, T * H);
  for (Index t = 0; t < T; ++t) {
    embed.read_row(tokens[static_cast<std::size_t>(t)], st.h.data() + t * H);
  }
  MatrixView<float> h(st.h.data(), T, H), normed(st.normed.data(), T, H), tmp(st.tmp.data(), T, H);
  for (std::size_t L = 0; L < blocks.size(); ++L) {
    Block const& b = blocks[L];
    rms_rows(h, b.input_norm, normed, pool);
    lap(nullptr);
    // h += Attn(normed): the residual added in o_proj's epilogue.
    if (MlaAttention const* m = b.mla()) {
      m->forward_cached(normed, h, st.caches[L], new_tokens, st.mla, pool, MlaOrder::kAuto, true);
    } else if (GatedDeltaNet const* dn = b.deltanet()) {
      std::vector<DeltaNetState>& states = st.recurrent[L];
      st.recurrent_of.resize(states.size());
      for (std::size_t s = 0; s < states.size(); ++s) st.recurrent_of[s] = &states[s];
      dn->forward_cached(normed, h, st.recurrent_of, new_tokens, st.deltanet, pool,
                         DeltaRule::kAuto, true);
    } else if (auto const* g = b.gated_attention()) {
      g->forward_cached(normed, h, st.caches[L], new_tokens, st.attention, pool, true);
    } else {
      b.attention()->forward_cached(normed, h, st.caches[L], new_tokens, st.attention, pool, true);
    }
    lap(&attention);
    rms_rows(h, b.post_norm, normed, pool);
    lap(nullptr);
    if (b.moe) {
      ForwardOptions opt;
      opt.pool = pool;
      if (streamer) {
        forward_streamed(L, moe_layer, h, normed, tmp, st, opt);
      } else {
        b.moe->forward(normed, tmp, st.ffn, opt);
      }
      if (st.trace) record_routing(moe_layer, T, st);
      ++moe_layer;
      add_rows(h, tmp, pool);
    } else {
      b.mlp.forward_add(normed, h, st.mlp_hidden, st.queue, pool);
    }
    lap(&ffn);
  }
  if (st.trace) {  // the forward's steps, token-major
    offload::TraceShape const& sh = st.trace->shape();
    auto const K = static_cast<std::size_t>(sh.top_k),
               M = static_cast<std::size_t>(sh.num_candidates);
    for (std::size_t i = 0; i < static_cast<std::size_t>(T * sh.num_layers); ++i) {
      std::span<std::int32_t const> const ids(st.trace_ids.data() + i * (K + M), K + M);
      std::span<float const> const sc(st.trace_scores.data() + i * (K + M), K + M);
      st.trace->append(ids.first(K), sc.first(K), ids.subspan(K), sc.subspan(K));
    }
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
  st.queue.add(lm_head, ConstMatrixView<float>(st.last.data(), n, H),
               MatrixView<float>(st.tmp.data(), n, V));
  st.queue.run(pool);
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

/// A loaded decoder of any family (use std::visit): Qwen3Moe holds qwen3_moe and olmoe,
/// DeepseekV3Moe holds glm4_moe, minimax_m2 and ernie4_5_moe.
using AnyDecoder = std::variant<Decoder<presets::Qwen3Moe>, Decoder<presets::MixtralMoe>,
                                Decoder<presets::Qwen2Moe>, Decoder<presets::DeepseekV3Moe>,
                                Decoder<presets::GptOssMoe>, Decoder<presets::Llama4Moe>>;

namespace detail {

/// Tensor `name` of `ckpt`, checked: present, of `shape`, F32, BF16 or F16 (F8_E4M3 for a
/// matrix), or a matrix stored as GGUF blocks (io::find_block_tensor checks its view).
inline io::TensorView const& checked_tensor(io::ShardedCheckpoint const& ckpt,
                                            std::string const& name,
                                            std::vector<std::int64_t> const& shape,
                                            std::string const& why) {
  io::TensorView const* t = ckpt.find(name);
  moe::detail::check(t != nullptr, "models: ", ckpt.source(), ": tensor ",
                     io::detail::printable_name(name), " (", io::detail::shape_string(shape),
                     ") is missing; ", why);
  if (shape.size() == 2 && io::find_block_tensor(ckpt, name, shape[0], shape[1])) return *t;
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

/// Matrix `name` [rows, cols] of `ckpt` when it is stored as GGUF blocks, else nullopt.
inline std::optional<io::BlockTensor> block_tensor(io::ShardedCheckpoint const& ckpt,
                                                   std::string const& name,
                                                   std::vector<std::int64_t> const& shape) {
  if (shape.size() != 2) return std::nullopt;
  return io::find_block_tensor(ckpt, name, shape[0], shape[1]);
}

/// Tensor `name` of `ckpt` as floats, checked against `shape`; an F8_E4M3 matrix is
/// dequantised with its "<name>_scale_inv" blocks (config.moe's quantization_config, as the MoE
/// loader does for the experts), GGUF blocks with ggml's dequantizers.
inline std::vector<float> read_tensor(io::ShardedCheckpoint const& ckpt, std::string const& name,
                                      std::vector<std::int64_t> const& shape,
                                      std::string const& why,
                                      io::HfMoeConfig const* moe_config = nullptr) {
  io::TensorView const& t = checked_tensor(ckpt, name, shape, why);
  if (std::optional<io::BlockTensor> const b = block_tensor(ckpt, name, shape)) {
    return b->dequantize();
  }
  if (t.dtype != io::Dtype::kF8E4M3) return io::to_float(t);
  static io::HfMoeConfig const default_blocks{};  // 128 x 128 FP8 blocks
  io::HfTensor ht;
  ht.name = name;
  ht.shape = shape;
  return io::detail::read_hf_tensor(ckpt, ht, moe_config ? *moe_config : default_blocks, 0, "");
}

/// How `ckpt` stores matrix `name` of `shape`, as the format that holds it without loss (the
/// `stored` of DecoderOptions::format_of): a block type's experts::load_format, kBf16 for BF16,
/// else kF32.
inline experts::WeightFormat stored_format(io::ShardedCheckpoint const& ckpt,
                                           std::string const& name,
                                           std::vector<std::int64_t> const& shape) {
  if (std::optional<io::BlockTensor> const b = block_tensor(ckpt, name, shape)) {
    return experts::load_format(b->type);
  }
  io::TensorView const* t = ckpt.find(name);
  return t != nullptr && t->dtype == io::Dtype::kBf16 ? experts::WeightFormat::kBf16
                                                      : experts::WeightFormat::kF32;
}

/// Is Decoder<Moe> an alternative of AnyDecoder (without instantiating Decoder<Moe>)?
template <class Moe, class... D>
constexpr bool decodes_as(std::variant<D...>*) {
  return (std::is_same_v<Decoder<Moe>, D> || ...);
}

/// Where a checkpoint keeps the text model's tensors: `model` + "embed_tokens.weight",
/// `model` + "layers.L.", `model` + "norm.weight", `head` + "lm_head.weight".
struct CheckpointRoot {
  std::string model = "model.", head;
};

/// The text model's prefixes: "model." (a text-only checkpoint), "language_model.model." and
/// "language_model." (Llama4ForConditionalGeneration), or "model.language_model." and ""
/// (Qwen3_5MoeForConditionalGeneration, Qwen3-VL's layout).
inline CheckpointRoot checkpoint_root(io::ShardedCheckpoint const& ckpt) {
  if (ckpt.contains("model.embed_tokens.weight")) return {};
  if (ckpt.contains("language_model.model.embed_tokens.weight")) {
    return {"language_model.model.", "language_model."};
  }
  if (ckpt.contains("model.language_model.embed_tokens.weight")) {
    return {"model.language_model.", ""};
  }
  return {};
}

/// The layer loader's options for MoE layer L under `root` (a nested text model names its module
/// explicitly).
inline io::HfLoadOptions moe_layer_options(CheckpointRoot const& root, DecoderConfig const& c,
                                           Index L) {
  io::HfLoadOptions o;
  if (root.model != "model.") {
    o.prefix = io::detail::concat(root.model, "layers.", L, ".", c.moe.spec().names.module);
  }
  return o;
}

/// What load_decoder threads through: the checkpoint, the options, and the fallbacks it records.
struct Loading {
  io::ShardedCheckpoint const& ckpt;
  DecoderConfig const& c;
  DecoderOptions const& options;
  ThreadPool* pool;
  std::vector<Fallback>& fallbacks;
  std::string why;
  CheckpointRoot root = checkpoint_root(ckpt);  ///< the text model's tensor prefixes

  bool tied() const { return c.tie_word_embeddings; }
  /// The format for a matrix of class `cls` in layer L, of depth `depth`, stored as `stored`
  /// (stored_format): the options' choice, resolved (a fallback recorded under `matrix`).
  experts::WeightFormat format(std::string const& matrix, MatrixClass cls, Index L, Index depth,
                               experts::WeightFormat stored, bool shared = false) const {
    experts::WeightFormat const asked =
        options.format_of(cls, L, c.num_hidden_layers, c.moe.num_experts, tied(), stored, shared);
    experts::WeightFormat const chosen = experts::resolve_format(asked, depth);
    if (chosen != asked) fallbacks.push_back({matrix, asked, chosen, depth});
    return chosen;
  }
  /// Tensor `name` [rows, depth] as a Linear of class `cls` in layer L: its stored blocks
  /// re-packed when the format chosen is theirs, else its values packed in that format.
  Linear linear(std::string const& name, Index rows, Index depth, MatrixClass cls, Index L) const {
    std::vector<std::int64_t> const shape = {rows, depth};
    checked_tensor(ckpt, name, shape, why);
    experts::WeightFormat const f = format(name, cls, L, depth, stored_format(ckpt, name, shape));
    if (std::optional<io::BlockTensor> const b = block_tensor(ckpt, name, shape);
        b && b->runs_as(f)) {
      return Linear::from_blocks(f, b->row(0), rows, depth, {}, pool);
    }
    std::vector<float> const v = read_tensor(ckpt, name, shape, why, &c.moe);
    return Linear(ConstMatrixView<float>(v.data(), rows, depth), f, {}, pool);
  }
};

/// The embedding in the format DecoderOptions asks for, read in place from the mapped file when
/// that is how it is stored (F32, BF16 or GGUF blocks) and its data is aligned for it. When it
/// is converted and `values` is given, the float values it was made from are moved there (a tied
/// LM head packs them: the tensor is read once).
inline Embedding read_embedding(Loading const& ld, Index V, Index H,
                                std::vector<float>* values = nullptr) {
  std::string const name = ld.root.model + "embed_tokens.weight";
  std::vector<std::int64_t> const shape = {V, H};
  io::TensorView const& t = checked_tensor(ld.ckpt, name, shape, ld.why);
  experts::WeightFormat const f =
      ld.format(name, MatrixClass::kEmbedding, 0, H, stored_format(ld.ckpt, name, shape));
  auto const addr = reinterpret_cast<std::uintptr_t>(t.bytes.data());
  bool const little = std::endian::native == std::endian::little;
  Embedding e;
  e.rows = V;
  e.cols = H;
  e.format = f;
  if (std::optional<io::BlockTensor> const b = block_tensor(ld.ckpt, name, shape);
      b && b->runs_as(f)) {
    e.blocks_view = b->row(0);  // dequantize_row reads its blocks with memcpy: any alignment
    return e;
  }
  if (little && f == experts::WeightFormat::kBf16 && t.dtype == io::Dtype::kBf16 &&
      addr % alignof(std::uint16_t) == 0) {
    e.bf16_view = reinterpret_cast<std::uint16_t const*>(t.bytes.data());
    return e;
  }
  if (little && f == experts::WeightFormat::kF32 && t.dtype == io::Dtype::kF32 &&
      addr % alignof(float) == 0) {
    e.f32_view = reinterpret_cast<float const*>(t.bytes.data());
    return e;
  }
  std::vector<float> v = read_tensor(ld.ckpt, name, shape, ld.why, &ld.c.moe);
  e = Embedding::pack(ConstMatrixView<float>(v.data(), V, H), f);
  if (values) *values = std::move(v);
  return e;
}

/// The multi-head latent attention tensors of a layer (under "self_attn."), by MlaAttention's
/// parameter names (transformers'), with their shapes.
inline std::vector<std::pair<std::string, std::vector<std::int64_t>>> mla_tensors(
    DecoderConfig const& c) {
  DecoderMla const& m = c.mla;
  std::int64_t const H = c.moe.hidden_size, nh = c.num_attention_heads, ql = m.q_lora_rank,
                     R = m.kv_lora_rank, dr = m.qk_rope_head_dim,
                     dq = m.qk_nope_head_dim + m.qk_rope_head_dim;
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  if (ql > 0) {
    out.push_back({"q_a_proj.weight", {ql, H}});
    if (c.qkv_bias) out.push_back({"q_a_proj.bias", {ql}});
    out.push_back({"q_a_layernorm.weight", {ql}});
    out.push_back({"q_b_proj.weight", {nh * dq, ql}});
  } else {
    out.push_back({"q_proj.weight", {nh * dq, H}});
  }
  out.push_back({"kv_a_proj_with_mqa.weight", {R + dr, H}});
  if (c.qkv_bias) out.push_back({"kv_a_proj_with_mqa.bias", {R + dr}});
  out.push_back({"kv_a_layernorm.weight", {R}});
  out.push_back({"kv_b_proj.weight", {nh * (m.qk_nope_head_dim + m.v_head_dim), R}});
  out.push_back({"o_proj.weight", {H, nh * m.v_head_dim}});
  if (c.qkv_bias) out.push_back({"o_proj.bias", {H}});
  return out;
}

/// The Gated DeltaNet layer of config c (Qwen3-Next's linear attention).
inline GatedDeltaNetConfig deltanet_config(DecoderConfig const& c) {
  GatedDeltaNetConfig g;
  g.d_model = c.moe.hidden_size;
  g.num_key_heads = c.deltanet.num_key_heads;
  g.num_value_heads = c.deltanet.num_value_heads;
  g.key_head_dim = c.deltanet.key_head_dim;
  g.value_head_dim = c.deltanet.value_head_dim;
  g.conv_kernel = c.deltanet.conv_kernel;
  g.norm_eps = c.rms_norm_eps;
  g.layout = c.deltanet.split_projections ? DeltaNetLayout::kQwen35 : DeltaNetLayout::kQwen3Next;
  g.head_order = c.deltanet.head_order;
  return g;
}

/// The tensors of a Gated DeltaNet layer under "linear_attn." (Qwen3NextGatedDeltaNet's or
/// Qwen3_5GatedDeltaNet's names, without the prefix) and their shapes: the GatedDeltaNet
/// parameter of the same name; the input projections first, in parameters() order.
inline std::vector<std::pair<std::string, std::vector<std::int64_t>>> deltanet_tensors(
    DecoderConfig const& c) {
  DecoderDeltaNet const& d = c.deltanet;
  Index const H = c.moe.hidden_size, K = d.num_key_heads * d.key_head_dim,
              V = d.num_value_heads * d.value_head_dim, Hv = d.num_value_heads;
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  if (d.split_projections) {
    out = {{"in_proj_qkv.weight", {2 * K + V, H}},
           {"in_proj_z.weight", {V, H}},
           {"in_proj_b.weight", {Hv, H}},
           {"in_proj_a.weight", {Hv, H}}};
  } else {
    out = {{"in_proj_qkvz.weight", {2 * K + 2 * V, H}}, {"in_proj_ba.weight", {2 * Hv, H}}};
  }
  out.insert(out.end(), {{"conv1d.weight", {2 * K + V, 1, d.conv_kernel}},
                         {"A_log", {Hv}},
                         {"dt_bias", {Hv}},
                         {"norm.weight", {d.value_head_dim}},
                         {"out_proj.weight", {H, V}}});
  return out;
}

/// The MLA layer of config c (its sizes, RoPE, YaRN and softmax correction).
inline MlaAttentionConfig mla_config(DecoderConfig const& c) {
  MlaAttentionConfig a;
  a.d_model = c.moe.hidden_size;
  a.num_heads = c.num_attention_heads;
  a.q_lora_rank = c.mla.q_lora_rank;
  a.kv_lora_rank = c.mla.kv_lora_rank;
  a.qk_nope_head_dim = c.mla.qk_nope_head_dim;
  a.qk_rope_head_dim = c.mla.qk_rope_head_dim;
  a.v_head_dim = c.mla.v_head_dim;
  a.rope_theta = c.rope_theta;
  a.rope_interleave = c.mla.rope_interleave;
  a.yarn = c.yarn;
  a.softmax_mscale_all_dim = c.mla.softmax_mscale_all_dim;
  a.attention_bias = c.qkv_bias;
  return a;
}

/// Checks every tensor of the model against config.json from the checkpoint's headers (presence,
/// dtype, shape; the MoE layers as the layer loader checks them) before anything is allocated:
/// a config.json implying a huge model for small tensors is refused by its shapes at once, not
/// after committing the memory it implies. The shapes are those load_decoder reads.
inline void check_decoder_tensors(io::ShardedCheckpoint const& ckpt, DecoderConfig const& c,
                                  std::string const& why) {
  Index const H = c.moe.hidden_size, V = c.vocab_size, nh = c.num_attention_heads,
              kv = c.num_key_value_heads, dh = c.head_dim;
  CheckpointRoot const root = checkpoint_root(ckpt);
  checked_tensor(ckpt, root.model + "embed_tokens.weight", {V, H}, why);
  checked_tensor(ckpt, root.model + "norm.weight", {H}, why);
  if (!c.tie_word_embeddings) checked_tensor(ckpt, root.head + "lm_head.weight", {V, H}, why);
  for (Index L = 0; L < c.num_hidden_layers; ++L) {
    std::string const p = io::detail::concat(root.model, "layers.", L, ".");
    auto check = [&](char const* name, std::vector<std::int64_t> const& shape) {
      checked_tensor(ckpt, p + name, shape, why);
    };
    if (c.linear_layer(L)) {
      for (auto const& [name, shape] : deltanet_tensors(c)) {
        check(("linear_attn." + name).c_str(), shape);
      }
    } else if (c.mla.enabled) {
      for (auto const& [name, shape] : mla_tensors(c)) check(("self_attn." + name).c_str(), shape);
    } else {
      check("self_attn.q_proj.weight", {(c.attention_gate ? 2 : 1) * nh * dh, H});
      check("self_attn.k_proj.weight", {kv * dh, H});
      check("self_attn.v_proj.weight", {kv * dh, H});
      check("self_attn.o_proj.weight", {H, nh * dh});
    }
    if (c.qk_norm && !c.linear_layer(L)) {
      bool const all = c.qk_norm_scope == QkNormScope::kAllHeads;
      check("self_attn.q_norm.weight", {all ? nh * dh : dh});
      check("self_attn.k_norm.weight", {all ? kv * dh : dh});
    }
    if (c.qkv_bias) {
      check("self_attn.q_proj.bias", {nh * dh});
      check("self_attn.k_proj.bias", {kv * dh});
      check("self_attn.v_proj.bias", {kv * dh});
    }
    if (c.o_bias) check("self_attn.o_proj.bias", {H});
    if (c.sinks) check("self_attn.sinks", {nh});
    check("input_layernorm.weight", {H});
    check("post_attention_layernorm.weight", {H});
    if (c.moe.is_moe_layer(L)) {
      io::detail::checked_hf_layer_tensors(c.moe, ckpt, L, moe_layer_options(root, c, L));
    } else {
      Index const I = c.intermediate_size;
      std::string const dense(c.moe.spec().decoder.dense_module);
      checked_tensor(ckpt, p + dense + "gate_proj.weight", {I, H}, why);
      checked_tensor(ckpt, p + dense + "up_proj.weight", {I, H}, why);
      checked_tensor(ckpt, p + dense + "down_proj.weight", {H, I}, why);
    }
  }
}

/// The formats of an MoE layer's expert bank (routed, or `shared`: `experts` of width `d_ffn`)
/// of layer L as the options ask (as stored by default: `stored`, the formats of the stored
/// blocks, stays).
inline std::vector<experts::ExpertFormat> expert_formats(
    Loading const& ld, std::vector<experts::ExpertFormat> const& stored, std::string const& who,
    bool shared, Index L, Index experts, Index d_ffn) {
  if (!ld.options.asks_experts(shared) && !stored.empty()) return stored;  // as stored
  experts::ExpertFormat const s =
      stored.empty() ? experts::ExpertFormat{} : stored.front();  // uniform in a GGUF
  experts::ExpertFormat const f{
      ld.format(who + " (gate/up)", MatrixClass::kExpertsIn, L, ld.c.moe.hidden_size, s.in, shared),
      ld.format(who + " (down)", MatrixClass::kExpertsDown, L, d_ffn, s.down, shared)};
  return std::vector<experts::ExpertFormat>(static_cast<std::size_t>(experts), f);
}

/// The layer loader's options for MoE layer L of a decoder: its prefix, the experts packed
/// straight from the checkpoint in the formats the options ask (expert_formats), on ld.pool,
/// without fp32 weights.
inline io::HfLoadOptions decoder_moe_options(Loading const& ld, Index L) {
  io::HfLoadOptions lo = moe_layer_options(ld.root, ld.c, L);
  lo.pool = ld.pool;
  std::string const p = io::detail::concat(ld.root.model, "layers.", L, ".mlp.");
  lo.pack_formats = [&ld, L, p](bool shared, Index experts, Index d_ffn,
                                std::vector<experts::ExpertFormat> const& stored) {
    return expert_formats(ld, stored, p + (shared ? "shared_experts" : "experts"), shared, L,
                          experts, d_ffn);
  };
  return lo;
}

/// Writes the routed experts of config `c` over `ckpt` as an expert store at `path`, one MoE
/// layer at a time, each packed as load_decoder packs it; returns the fallbacks.
template <class Moe>
std::vector<Fallback> write_expert_store(DecoderConfig const& c, io::ShardedCheckpoint const& ckpt,
                                         std::string const& path, DecoderOptions const& options,
                                         ThreadPool* pool) {
  std::vector<Fallback> fallbacks;
  Loading const ld{ckpt,
                   c,
                   options,
                   pool,
                   fallbacks,
                   "a decoder checkpoint holds the embedding, every layer, the final norm and "
                   "(untied) lm_head"};
  check_decoder_tensors(ckpt, c, ld.why);
  Index moe_layers = 0;
  for (Index L = 0; L < c.num_hidden_layers; ++L) moe_layers += c.moe.is_moe_layer(L) ? 1 : 0;
  offload::ExpertStoreWriter w(path, {moe_layers, c.moe.num_experts, c.moe.hidden_size,
                                      c.moe.expert_intermediate_size, Moe::Expert::gated});
  for (Index L = 0; L < c.num_hidden_layers; ++L) {
    if (!c.moe.is_moe_layer(L)) continue;
    // The shared experts are loaded (the layer holds them) but not written: their formats'
    // fallbacks are not the store's.
    std::vector<Fallback> unused;
    Loading const shared_ld{ckpt, c, options, pool, unused, ld.why};
    io::HfLoadOptions lo = decoder_moe_options(ld, L);
    lo.pack_formats =
        [routed = lo.pack_formats, shared_formats = decoder_moe_options(shared_ld, L).pack_formats](
            bool shared, Index n, Index f, std::vector<experts::ExpertFormat> const& stored) {
          return (shared ? shared_formats : routed)(shared, n, f, stored);
        };
    io::HfLayer<Moe> const loaded = io::load_hf_layer<Moe>(c.moe, ckpt, L, lo);
    w.add_layer(loaded.layer.experts());
  }
  w.finish();
  return fallbacks;
}

template <class Moe>
Decoder<Moe> load_decoder(DecoderConfig const& c,
                          std::shared_ptr<io::ShardedCheckpoint const> const& mapped,
                          DecoderOptions const& options, ThreadPool* pool) {
  io::ShardedCheckpoint const& ckpt = *mapped;
  Decoder<Moe> d;
  d.config = c;
  Loading const ld{ckpt,
                   c,
                   options,
                   pool,
                   d.fallbacks,
                   "a decoder checkpoint holds the embedding, every layer, the final norm and "
                   "(untied) lm_head"};
  std::string const& why = ld.why;
  check_decoder_tensors(ckpt, c, why);  // before anything is allocated
  Index const H = c.moe.hidden_size, V = c.vocab_size, nh = c.num_attention_heads,
              kv = c.num_key_value_heads, dh = c.head_dim;
  // Streamed experts: the store is opened (and its shape checked) before anything is allocated.
  std::shared_ptr<offload::ExpertStreamer> streamer;
  std::size_t moe_layer = 0;
  moe::detail::check(!(options.stream_experts && !options.expert_store.empty()),
                     "models: stream the experts from the expert store '", options.expert_store,
                     "' or from the model's file (stream_experts), not both");
  if (options.stream_experts) {  // headers only: every MoE layer's records and their formats
    auto source = std::make_shared<CheckpointExperts<typename Moe::Bank>>(mapped, c.moe);
    for (Index L = 0; L < c.num_hidden_layers; ++L) {
      if (!c.moe.is_moe_layer(L)) continue;
      std::string const who = io::detail::concat(ld.root.model, "layers.", L, ".mlp.experts");
      source->add_layer(L, moe_layer_options(ld.root, c, L),
                        [&](std::vector<experts::ExpertFormat> const& stored) {
                          return expert_formats(ld, stored, who, false, L, c.moe.num_experts,
                                                c.moe.expert_intermediate_size);
                        });
    }
    streamer = std::make_shared<offload::ExpertStreamer>(std::move(source), options.streaming);
  }
  if (!options.expert_store.empty()) {
    auto store =
        std::make_shared<offload::ExpertStore const>(options.expert_store, options.store_read);
    Index moe_layers = 0;
    for (Index L = 0; L < c.num_hidden_layers; ++L) moe_layers += c.moe.is_moe_layer(L) ? 1 : 0;
    offload::StoreShape const& s = store->shape();
    moe::detail::check(s.num_layers == moe_layers && s.num_experts == c.moe.num_experts &&
                           s.d_model == H && s.d_ffn == c.moe.expert_intermediate_size,
                       "models: the expert store '", options.expert_store, "' holds ", s.num_layers,
                       " MoE layers of ", s.num_experts, " experts (d_model ", s.d_model,
                       ", d_ffn ", s.d_ffn, "), and ", ckpt.source(), " has ", moe_layers, " of ",
                       c.moe.num_experts, " (d_model ", H, ", d_ffn ",
                       c.moe.expert_intermediate_size, "); the store belongs to another model");
    if (options.asks_experts(false)) {
      d.warnings.push_back(io::detail::concat(
          "the routed experts run in the formats of the expert store '", options.expert_store,
          "' (a format asked for them is ignored; write the store again to change them)"));
    }
    streamer = std::make_shared<offload::ExpertStreamer>(std::move(store), options.streaming);
  }
  std::vector<float> embedding_values;  // the embedding's floats, when converted and tied
  d.embed = read_embedding(ld, V, H, c.tie_word_embeddings ? &embedding_values : nullptr);
  CheckpointRoot const& root = ld.root;
  // Qwen3NextRMSNorm: x r (1 + w), the weight's 1 + w formed in fp32 as transformers does.
  auto norm_weight = [&](std::string const& name) {
    std::vector<float> w = read_tensor(ckpt, name, {H}, why);
    if (c.norm_one_plus) {
      for (float& v : w) v = 1.0f + v;
    }
    return w;
  };
  d.norm = norm_weight(root.model + "norm.weight");
  {  // layers the checkpoint holds past num_hidden_layers are not run: say so
    std::string const prefix = root.model + "layers.";
    Index last = -1;
    for (std::string const& name : ckpt.names()) {
      last = std::max(last, io::detail::indexed_name(name, prefix).value_or(-1));
    }
    if (last >= c.num_hidden_layers) {
      d.warnings.push_back(io::detail::concat(
          "the checkpoint holds layers up to ", last, " (", prefix, last,
          ".*) but config.json's num_hidden_layers is ", c.num_hidden_layers, ": ",
          last == c.num_hidden_layers
              ? io::detail::concat("layer ", last, " is")
              : io::detail::concat("layers ", c.num_hidden_layers, " to ", last, " are"),
          " not run; set num_hidden_layers to ", last + 1, " if the model has them"));
    }
  }
  if (c.tie_word_embeddings) {
    if (ckpt.find(root.head + "lm_head.weight") != nullptr) {
      d.warnings.push_back(
          "config.json sets tie_word_embeddings, so the checkpoint's lm_head.weight is not read "
          "(the LM head is model.embed_tokens.weight); set tie_word_embeddings to false if "
          "lm_head.weight is the model's output matrix");
    }
    // The LM head multiplies the embedding's values, packed in the LM head's format (its stored
    // blocks re-packed when that is their format).
    std::string const name = root.model + "embed_tokens.weight";
    std::vector<std::int64_t> const shape = {V, H};
    experts::WeightFormat const f =
        ld.format("lm_head (tied: " + name + ")", MatrixClass::kLmHead, c.num_hidden_layers - 1, H,
                  stored_format(ckpt, name, shape));
    if (std::optional<io::BlockTensor> const b = block_tensor(ckpt, name, shape);
        b && b->runs_as(f)) {
      d.lm_head = Linear::from_blocks(f, b->row(0), V, H, {}, pool);
    } else {
      // The values the embedding was made from: its fp32 view in place, the floats
      // read_embedding converted, or (a bf16 or block view) read here.
      if (d.embed.f32_view == nullptr && embedding_values.empty()) {
        embedding_values = read_tensor(ckpt, name, shape, why, &c.moe);
      }
      float const* w = d.embed.f32_view ? d.embed.f32_view : embedding_values.data();
      d.lm_head = Linear(ConstMatrixView<float>(w, V, H), f, {}, pool);
    }
    embedding_values = {};  // V x H floats: freed before the layers load
  } else {
    d.lm_head = ld.linear(root.head + "lm_head.weight", V, H, MatrixClass::kLmHead,
                          c.num_hidden_layers - 1);
  }
  if (d.embed.in_place()) d.mapped = mapped;
  GatedAttentionConfig ac;
  ac.d_model = H;
  ac.num_heads = nh;
  ac.num_kv_heads = kv;
  ac.head_dim = dh;
  ac.qk_norm = !c.qk_norm        ? QkNorm::kNone
               : c.norm_one_plus ? QkNorm::kRmsNormOnePlus
                                 : QkNorm::kRmsNorm;
  ac.qk_norm_scope = c.qk_norm_scope;
  ac.qkv_bias = c.qkv_bias;
  ac.o_bias = c.o_bias;
  ac.norm_eps = c.rms_norm_eps;
  ac.rope_theta = c.rope_theta;
  ac.rotary_dim = c.rotary_dim;
  ac.yarn = c.yarn;
  ac.llama3 = c.llama3;
  ac.rope_freq_factors = c.rope_freq_factors;
  ac.sinks = c.sinks;
  ac.rope_interleaved = c.rope_interleaved;
  ac.causal = true;
  std::string_view const dense = c.moe.spec().decoder.dense_module;
  for (Index L = 0; L < c.num_hidden_layers; ++L) {
    std::string const p = io::detail::concat(root.model, "layers.", L, ".");
    ac.sliding_window = c.window_of(L);
    ac.attention_chunk = c.chunk_of(L);
    ac.rope = c.rope_layer(L);
    if (c.qk_norm_unweighted) {  // Llama 4: on the RoPE layers only
      ac.qk_norm = ac.rope ? QkNorm::kRmsNormUnweighted : QkNorm::kNone;
    }
    ac.temperature_floor = ac.rope ? 0 : c.temperature_floor;
    ac.temperature_scale = c.temperature_scale;
    typename Decoder<Moe>::Block b;
    auto load_into = [&](std::span<float> dst, std::string const& name,
                         std::vector<std::int64_t> const& shape) {
      std::vector<float> const v = read_tensor(ckpt, p + name, shape, why, &c.moe);
      std::copy(v.begin(), v.end(), dst.begin());
    };
    b.input_norm = norm_weight(p + "input_layernorm.weight");
    b.post_norm = norm_weight(p + "post_attention_layernorm.weight");
    // The mixer's projections are packed in their formats (stored blocks re-packed as they are
    // where that is their format); the layer keeps only these packs (a decoder never trains).
    if (c.linear_layer(L)) {
      GatedDeltaNet& a = b.mixer.template emplace<GatedDeltaNet>(deltanet_config(c));
      std::string const s = p + "linear_attn.";
      auto const shapes = deltanet_tensors(c);
      for (ParameterRef const& g : a.parameters()) {  // conv1d, A_log, dt_bias, norm
        if (g.name.find("proj") != std::string::npos) continue;
        auto const it = std::find_if(shapes.begin(), shapes.end(),
                                     [&](auto const& t) { return t.first == g.name; });
        moe::detail::check(it != shapes.end(), "models: Gated DeltaNet parameter ", g.name,
                           " has no tensor name");  // (a bug, not a file problem)
        load_into(g.values, "linear_attn." + it->first, it->second);
      }
      // The input projections (the layout's, in parameters() order), then out_proj.
      std::vector<Linear> in;
      Linear out;
      for (auto const& [name, shape] : deltanet_tensors(c)) {
        if (name.find("proj") == std::string::npos) continue;
        bool const is_out = name == "out_proj.weight";
        Linear l = ld.linear(s + name, shape[0], shape[1],
                             is_out ? MatrixClass::kAttnO : MatrixClass::kAttnQ, L);
        if (is_out) {
          out = std::move(l);
        } else {
          in.push_back(std::move(l));
        }
      }
      a.adopt_packed_weights(in, std::move(out));
    } else if (c.mla.enabled) {
      // The projections are packed in the attention's format, one for all (resolved for every
      // depth: the gcd of them); of the fp32 weights only kv_b_proj's stays (the absorbed order
      // reads it).
      MlaAttention& a = b.mixer.template emplace<MlaAttention>(mla_config(c));
      std::vector<std::pair<std::string, std::vector<std::int64_t>>> const shapes = mla_tensors(c);
      Index depth = 0;
      for (ParameterRef const& g : a.parameters()) {
        auto const it = std::find_if(shapes.begin(), shapes.end(),
                                     [&](auto const& s) { return s.first == g.name; });
        moe::detail::check(it != shapes.end(), "models: MLA parameter ", g.name,
                           " has no tensor name");  // (a bug, not a file problem)
        load_into(g.values, "self_attn." + it->first, it->second);
        if (it->second.size() == 2) depth = std::gcd(depth, static_cast<Index>(it->second[1]));
      }
      std::string const kva = p + "self_attn.kv_a_proj_with_mqa.weight";
      std::vector<std::int64_t> const kva_shape = {c.mla.kv_lora_rank + c.mla.qk_rope_head_dim, H};
      a.pack_weights(ld.format(p + "self_attn (MLA projections)", MatrixClass::kAttnQ, L, depth,
                               stored_format(ckpt, kva, kva_shape)),
                     pool);
      a.discard_master_weights();  // a decoder never trains: only kv_b_proj's fp32 stays
    } else {
      // GQA attention; Qwen3-Next's with its sigmoid output gate packed per head in q_proj
      // ([q_h | gate_h] for each head h: twice the rows).
      auto load_attention = [&]<class Gate>(GatedAttention<Gate>& a) {
        a.adopt_packed_weights(
            ld.linear(p + "self_attn.q_proj.weight", a.q_proj_rows(), H, MatrixClass::kAttnQ, L),
            ld.linear(p + "self_attn.k_proj.weight", kv * dh, H, MatrixClass::kAttnK, L),
            ld.linear(p + "self_attn.v_proj.weight", kv * dh, H, MatrixClass::kAttnV, L),
            ld.linear(p + "self_attn.o_proj.weight", H, nh * dh, MatrixClass::kAttnO, L));
        if (c.qk_norm) {
          bool const all = c.qk_norm_scope == QkNormScope::kAllHeads;
          load_into(a.q_norm(), "self_attn.q_norm.weight", {all ? nh * dh : dh});
          load_into(a.k_norm(), "self_attn.k_norm.weight", {all ? kv * dh : dh});
        }
        if (c.qkv_bias) {
          load_into(a.q_bias(), "self_attn.q_proj.bias", {nh * dh});
          load_into(a.k_bias(), "self_attn.k_proj.bias", {kv * dh});
          load_into(a.v_bias(), "self_attn.v_proj.bias", {kv * dh});
        }
        if (c.o_bias) load_into(a.o_bias(), "self_attn.o_proj.bias", {H});
        if (c.sinks) load_into(a.sinks(), "self_attn.sinks", {nh});
      };
      if (c.attention_gate) {
        GatedAttentionConfig gc = ac;
        gc.gate_layout = GateLayout::kPackedPerHead;
        load_attention(b.mixer.template emplace<GatedAttention<gating::ElementwiseGate>>(gc));
      } else {
        load_attention(b.mixer.template emplace<GatedAttention<gating::NoGate>>(ac));
      }
    }
    if (c.moe.is_moe_layer(L)) {
      // The layer loader packs every expert straight from the checkpoint in the formats the
      // options ask (stored blocks re-packed as they are), without fp32 weights; with an expert
      // store the routed experts are left to it.
      io::HfLoadOptions lo = decoder_moe_options(ld, L);
      lo.routed_expert_weights = streamer == nullptr;
      io::HfLayer<Moe> loaded = io::load_hf_layer<Moe>(c.moe, ckpt, L, lo);
      b.moe.emplace(std::move(loaded.layer));
      Moe& m = *b.moe;
      if (streamer) {  // the store's records, in its formats
        auto const i = static_cast<Index>(moe_layer++);
        if (auto const* file = dynamic_cast<offload::ExpertStore const*>(&streamer->store())) {
          file->check_layer(i, m.experts());
        }
        m.experts().stream_records(streamer->store().layer_formats(i), streamer->records(i));
      }
      // A decoder never trains: keep only the pack (a layer loaded with its fp32 weights, GLU
      // experts of an odd width in an fp32 or bf16 pack, keeps them: inference reads them).
      if (m.can_discard_master_weights()) m.discard_master_weights();
    } else {
      Index const I = c.intermediate_size;
      auto name = [&](char const* proj) { return io::detail::concat(p, dense, proj, ".weight"); };
      b.mlp.gate = ld.linear(name("gate_proj"), I, H, MatrixClass::kDenseGateUp, L);
      b.mlp.up = ld.linear(name("up_proj"), I, H, MatrixClass::kDenseGateUp, L);
      b.mlp.down = ld.linear(name("down_proj"), H, I, MatrixClass::kDenseDown, L);
    }
    d.blocks.push_back(std::move(b));
  }
  d.streamer = std::move(streamer);
  return d;
}

/// write_expert_store in the family's MoE type.
inline std::vector<Fallback> write_any_expert_store(DecoderConfig const& c,
                                                    io::ShardedCheckpoint const& ckpt,
                                                    std::string const& path, ThreadPool* pool,
                                                    DecoderOptions const& options) {
  return io::visit_hf_layer_type(
      c.moe.family, [&]<class Moe>(std::type_identity<Moe>) -> std::vector<Fallback> {
        if constexpr (decodes_as<Moe>(static_cast<AnyDecoder*>(nullptr))) {
          return write_expert_store<Moe>(c, ckpt, path, options, pool);
        } else {
          moe::detail::fail("models: ", ckpt.source(), ": ", c.moe.model_type(),
                            " does not decode");
        }
      });
}

/// The decoder of config `c` over checkpoint `ckpt`, in the family's MoE type.
inline AnyDecoder load_any_decoder(DecoderConfig const& c,
                                   std::shared_ptr<io::ShardedCheckpoint const> const& ckpt,
                                   ThreadPool* pool, DecoderOptions const& options) {
  return io::visit_hf_layer_type(
      c.moe.family, [&]<class Moe>(std::type_identity<Moe>) -> AnyDecoder {
        if constexpr (decodes_as<Moe>(static_cast<AnyDecoder*>(nullptr))) {
          return load_decoder<Moe>(c, ckpt, options, pool);
        } else {  // parse_decoder_config refused the family (HfDecoderFacts::lacks)
          moe::detail::fail("models: ", ckpt->source(), ": ", c.moe.model_type(),
                            " does not decode");
        }
      });
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
  return detail::load_any_decoder(c, ckpt, pool, options);
}

/// Writes the routed experts of the model in `model_dir` as an expert store at `path`
/// (moe/offload/store.hpp) without loading the model: one MoE layer at a time is read, packed in
/// the formats `options` ask for (exactly as load_hf_decoder packs them) and written, so a model
/// larger than RAM can be converted (one layer's fp32 expert weights in memory at a time).
/// Returns the matrices that fell back to another format. Decoder::write_expert_store does the
/// same from a loaded decoder.
inline std::vector<Fallback> write_hf_expert_store(std::filesystem::path const& model_dir,
                                                   std::string const& path,
                                                   ThreadPool* pool = nullptr,
                                                   DecoderOptions const& options = {}) {
  io::detail::check_model_dir(model_dir);
  DecoderConfig const c = read_decoder_config(model_dir);
  io::ShardedCheckpoint const ckpt = io::open_checkpoint(model_dir);
  return detail::write_any_expert_store(c, ckpt, path, pool, options);
}

}  // namespace moe::models

// A build may compile the decoders of AnyDecoder's families once, in translation units that
// instantiate them explicitly (src/precompiled/decoders_*.cpp do for moe::precompiled),
// instead of in every unit that loads or runs a model: define MOE_EXTERN_DECODERS in every unit
// built with the same flags and link those. What is left to them: Decoder<Moe>'s members
// (forward() and its streamed parts are defined out of the class for this: inline members
// would still be instantiated), load_decoder and write_expert_store. Nothing changes without
// the macro. MOE_DECODER_INSTANTIATION(extern, Moe) declares them for one MoE type,
// MOE_DECODER_INSTANTIATION(, Moe) defines them.
#define MOE_DECODER_INSTANTIATION(EXTERN, MOE)                                                \
  namespace moe::models {                                                                     \
  EXTERN template class Decoder<MOE>;                                                         \
  namespace detail {                                                                          \
  EXTERN template Decoder<MOE> load_decoder<MOE>(                                             \
      DecoderConfig const&, std::shared_ptr<io::ShardedCheckpoint const> const&,              \
      DecoderOptions const&, ThreadPool*);                                                    \
  EXTERN template std::vector<Fallback> write_expert_store<MOE>(DecoderConfig const&,         \
                                                                io::ShardedCheckpoint const&, \
                                                                std::string const&,           \
                                                                DecoderOptions const&,        \
                                                                ThreadPool*);                 \
  }                                                                                           \
  }
#if defined(MOE_EXTERN_DECODERS)
#define MOE_DECODER_EXTERN_INSTANTIATION(MOE) MOE_DECODER_INSTANTIATION(extern, MOE)
MOE_PRESET_LAYERS(MOE_DECODER_EXTERN_INSTANTIATION)
#undef MOE_DECODER_EXTERN_INSTANTIATION
#endif
