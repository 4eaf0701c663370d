// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GatedDeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5 (transformers'
/// Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet): input projections, a causal depthwise
/// convolution, the gated delta rule (kernels/delta_rule.hpp) with a fixed-size state per
/// sequence, a gated RMSNorm and the output projection; forward (chunked for prompts, recurrent
/// for decode steps), decoding with per-sequence states, and backward.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/in_use.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/kernels/delta_rule.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/rms_norm.hpp"
#include "moe/layers/attention_options.hpp"
#include "moe/layers/linear.hpp"
#include "moe/layers/stages/work.hpp"

namespace moe {

/// How the input projections are stored (both give the same layer for permuted rows):
///
/// - kQwen3Next: in_proj_qkvz [2 K + 2 V, D] and in_proj_ba [2 H_v, D], head-grouped as
///   transformers' fix_query_key_value_ordering reads them: per key head g, the rows of
///   in_proj_qkvz are [q_g (d_k) | k_g (d_k) | v of value heads gR .. gR+R-1 (R d_v) | their z
///   (R d_v)] and those of in_proj_ba [b of those R heads | their a] (R = H_v / H_k).
/// - kQwen35: in_proj_qkv [2 K + V, D] (all q heads, all k heads, all v heads), in_proj_z [V, D],
///   in_proj_b [H_v, D], in_proj_a [H_v, D] (Qwen3_5GatedDeltaNet, Qwen3.5-MoE).
///
/// K = H_k d_k, V = H_v d_v. conv1d.weight has the same layout in both (channels q | k | v).
enum class DeltaNetLayout { kQwen3Next, kQwen35 };

/// Which form of the delta rule a forward runs. kAuto: recurrent for one token a sequence,
/// chunked from two tokens on. Both compute the same function (they differ by rounding, ~1e-6
/// relative); the recurrent form does 4 d_k d_v FLOP a token and head, the chunked one about
/// twice that, most of it small matrix products (docs/attention.md, "Gated DeltaNet").
enum class DeltaRule { kAuto, kRecurrent, kChunked };

/// Sizes of a GatedDeltaNet layer (transformers' config keys in the comments).
struct GatedDeltaNetConfig {
  Index d_model = 0;          ///< D (hidden_size)
  Index num_key_heads = 1;    ///< H_k (linear_num_key_heads)
  Index num_value_heads = 1;  ///< H_v (linear_num_value_heads): a multiple of H_k
  Index key_head_dim = 0;     ///< d_k (linear_key_head_dim)
  Index value_head_dim = 0;   ///< d_v (linear_value_head_dim)
  Index conv_kernel = 4;      ///< (linear_conv_kernel_dim) >= 1
  float norm_eps = 1e-6f;     ///< the gated RMSNorm's epsilon (rms_norm_eps), finite and > 0
  DeltaNetLayout layout = DeltaNetLayout::kQwen3Next;
  DeltaNetHeadOrder head_order = DeltaNetHeadOrder::kGrouped;  ///< kTiled: GGUF Qwen3.5 files
  Index chunk_size = 64;  ///< tokens per chunk of the chunked form and of backward's checkpoints
};

/// The state of one sequence for decoding with a GatedDeltaNet (GatedDeltaNet::make_state): a
/// fixed size whatever the context length, (conv_kernel - 1) C + H_v d_k d_v floats
/// (C = 2 H_k d_k + H_v d_v, the convolution's channels).
struct DeltaNetState {
  /// [conv_kernel - 1, C]: the convolution's last inputs, oldest first (zeros at the start).
  std::vector<float> conv;
  /// [H_v, d_k, d_v]: the delta rule's state S of every value head.
  std::vector<float> recurrent;
  Index tokens = 0;  ///< tokens seen so far
  std::size_t bytes() const { return (conv.size() + recurrent.size()) * sizeof(float); }
  /// Back to the start of a sequence (zeros), keeping the memory.
  void reset() {
    std::fill(conv.begin(), conv.end(), 0.0f);
    std::fill(recurrent.begin(), recurrent.end(), 0.0f);
    tokens = 0;
  }
};

/// What a GatedDeltaNet call writes besides its output, and what forward_train keeps for
/// backward. Reused across calls: it grows to the largest call, then allocates nothing.
struct GatedDeltaNetWorkspace {
  std::vector<float> proj;      ///< [T, P] input projections (P = 2 K + 2 V + 2 H_v), layout order
  std::vector<float> conv_in;   ///< per sequence [conv_kernel - 1 + n, C]: state rows, new rows
  std::vector<float> conv_pre;  ///< [T, C] convolution output before SiLU
  std::vector<float> conv_wt;   ///< [conv_kernel, C] conv1d.weight transposed
  std::vector<float> act;       ///< [T, C] after SiLU: q | k | v
  std::vector<float> qn, kn;    ///< [T, K] q (L2-normalised, scaled), k (L2-normalised)
  std::vector<float> rq, rk;    ///< [T, H_k] their 1 / norm
  std::vector<float> beta, g;   ///< [T, H_v] write strength, log decay
  std::vector<float> core;      ///< [T, V] delta-rule output
  std::vector<float> rstd;      ///< [T, H_v] the gated norm's 1/rms
  std::vector<float> gated;     ///< [T, V] norm(core) * silu(z): out_proj's input
  std::vector<float> scratch;   ///< per thread
  std::vector<Index> seg_row0;  ///< [sequences + 1]
  std::vector<DeltaNetState*> seg_state;
  DeltaNetState own;  ///< the zero state of a stateless forward
  stages::ProjectionQueue queue;
  LinearInput input;
  InUse in_use;  ///< a call holds it: a second, overlapping call on this workspace throws
  stages::GradTasks grad_tasks;
  stages::ThreadScratch grad_scratch;

  // Training only (forward_train fills, backward reads).
  std::vector<float> x;            ///< [T, D] copy of the input
  std::vector<float> checkpoints;  ///< [H_v, chunks, d_k, d_v] the state every chunk_size tokens
  stages::Stamp stamp;
  std::vector<float> dgated, dcore;       ///< [T, V]
  std::vector<float> dq_heads, dk_heads;  ///< [T, H_v d_k]
  std::vector<float> dbeta, dg;           ///< [T, H_v]
  std::vector<float> dact;                ///< [T, C]
  std::vector<float> dproj;               ///< [T, P]
  std::vector<float> dpre_row;            ///< [token tiles, C] one input-gradient row a tile
  std::vector<float> partial;             ///< per token tile: [d_v + 2 H_v] (norm, A_log, dt_bias)
  std::vector<float> dstate;              ///< [H_v, d_k, d_v]
};

/// Gated DeltaNet (Yang et al. 2024) as Qwen3-Next / Qwen3.5 use it. For one sequence x [T, D]:
///
///   [q k v | z | b | a] = x W_in^T            (W_in: the layout's projections, DeltaNetLayout)
///   [q k v] <- silu(causal depthwise conv1d over time, kernel conv_kernel, no bias)
///   q_h <- q_h / sqrt(|q_h|^2 + 1e-6) / sqrt(d_k),  k_h <- k_h / sqrt(|k_h|^2 + 1e-6)
///   beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)           (per value head)
///   per value head h (key head h / R, R = H_v / H_k; h mod H_k in DeltaNetHeadOrder::kTiled),
///   from the state S_h:
///     S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
///   o_h <- rmsnorm(o_h) * norm.weight * silu(z_h)                          (over d_v, eps)
///   y = o W_out^T
///
/// | parameter                     | shape                   | HF name                       |
/// |-------------------------------|-------------------------|-------------------------------|
/// | kQwen3Next: in_proj_qkvz      | [2 K + 2 V, D]          | in_proj_qkvz.weight           |
/// |             in_proj_ba        | [2 H_v, D]              | in_proj_ba.weight             |
/// | kQwen35: in_proj_qkv, _z      | [2 K + V, D], [V, D]    | in_proj_qkv / in_proj_z.weight|
/// |          in_proj_b, _a        | [H_v, D] each           | in_proj_b / in_proj_a.weight  |
/// | conv1d                        | [C, 1, conv_kernel]     | conv1d.weight                 |
/// | A_log, dt_bias                | [H_v]                   | A_log, dt_bias                |
/// | norm                          | [d_v]                   | norm.weight                   |
/// | out_proj                      | [D, V]                  | out_proj.weight               |
///
/// K = H_k d_k, V = H_v d_v, C = 2 K + V. A new layer has zero projections and convolution,
/// A_log = 0, dt_bias = 1 and norm.weight = 1 (transformers' init for the last two).
/// Preconditions (moe::Error otherwise): sizes >= 1, H_k divides H_v, x [T, D], y [T, D] (y may
/// be x), states made by make_state().
///
/// Decoding: a DeltaNetState per sequence (make_state) holds everything the layer needs of the
/// past, (conv_kernel - 1) C + H_v d_k d_v floats whatever the context; forward(x, y, state, ws)
/// continues the sequence (a prompt, then 1-token steps) and equals the stateless forward of the
/// whole sequence up to rounding; forward_cached runs one call over several sequences.
///
/// Threads: projections by output columns (the experts' engine), convolution and elementwise
/// work by 64-token tiles, the delta rule by (sequence, value head); backward's parameter sums
/// in fixed order: bitwise identical results for any pool size.
///
/// Training: forward_train keeps the input, the projections, the convolution's input and
/// output, q, k, beta, g, the delta-rule output, the norm factors and the state every chunk_size
/// tokens ([H_v, T / chunk_size, d_k, d_v]); backward runs the recurrence backwards chunk by chunk
/// from those checkpoints (recomputing the states inside a chunk) and returns dx and every
/// parameter's gradient (accumulated, laid out like parameters()).
class GatedDeltaNet {
 public:
  static constexpr Index kTileRows = 64;  ///< token rows per elementwise work item

  /// Every trainable buffer (and, as Gradients, of its gradient); the projections of the other
  /// layout are empty.
  struct Parameters {
    HugePageVector<float> in_proj_qkvz, in_proj_ba;                      // kQwen3Next
    HugePageVector<float> in_proj_qkv, in_proj_z, in_proj_b, in_proj_a;  // kQwen35
    HugePageVector<float> conv1d, A_log, dt_bias, norm, out_proj;
    /// The named buffers in parameters() order (empty ones omitted).
    ParameterList groups() {
      using Member = HugePageVector<float> Parameters::*;
      static constexpr std::pair<char const*, Member> kNamed[] = {
          {"in_proj_qkvz.weight", &Parameters::in_proj_qkvz},
          {"in_proj_ba.weight", &Parameters::in_proj_ba},
          {"in_proj_qkv.weight", &Parameters::in_proj_qkv},
          {"in_proj_z.weight", &Parameters::in_proj_z},
          {"in_proj_b.weight", &Parameters::in_proj_b},
          {"in_proj_a.weight", &Parameters::in_proj_a},
          {"conv1d.weight", &Parameters::conv1d},
          {"A_log", &Parameters::A_log},
          {"dt_bias", &Parameters::dt_bias},
          {"norm.weight", &Parameters::norm},
          {"out_proj.weight", &Parameters::out_proj}};
      ParameterList list;
      for (auto const& [name, member] : kNamed) list.add_if_present(name, this->*member);
      return list;
    }
    void zero() { groups().zero(); }
  };
  using Gradients = Parameters;

  GatedDeltaNet() = default;
  /// Throws moe::Error on a bad config (see the class comment).
  explicit GatedDeltaNet(GatedDeltaNetConfig const& config) : c_(config) {
    auto const& c = c_;
    detail::check(c.d_model >= 1 && c.num_key_heads >= 1 && c.num_value_heads >= 1 &&
                      c.key_head_dim >= 1 && c.value_head_dim >= 1 && c.conv_kernel >= 1 &&
                      c.chunk_size >= 1,
                  "GatedDeltaNet: d_model = ", c.d_model, ", num_key_heads = ", c.num_key_heads,
                  ", num_value_heads = ", c.num_value_heads, ", key_head_dim = ", c.key_head_dim,
                  ", value_head_dim = ", c.value_head_dim, ", conv_kernel = ", c.conv_kernel,
                  ", chunk_size = ", c.chunk_size, "; all must be >= 1");
    detail::check(c.num_value_heads % c.num_key_heads == 0,
                  "GatedDeltaNet: num_key_heads = ", c.num_key_heads,
                  " does not divide num_value_heads = ", c.num_value_heads,
                  "; each key head serves num_value_heads / num_key_heads value heads (Qwen3-Next: "
                  "16 key heads, 32 value heads)");
    detail::check(c.norm_eps > 0.0f && std::isfinite(c.norm_eps),
                  "GatedDeltaNet: norm_eps = ", c.norm_eps, "; it must be finite and > 0");
    Index const D = c.d_model, K = key_dim(), V = value_dim(), Hv = c.num_value_heads;
    auto sized = [](Index n, float v = 0.0f) {
      return HugePageVector<float>(static_cast<std::size_t>(n), v);
    };
    if (c.layout == DeltaNetLayout::kQwen3Next) {
      p_.in_proj_qkvz = sized((2 * K + 2 * V) * D);
      p_.in_proj_ba = sized(2 * Hv * D);
    } else {
      p_.in_proj_qkv = sized((2 * K + V) * D);
      p_.in_proj_z = sized(V * D);
      p_.in_proj_b = sized(Hv * D);
      p_.in_proj_a = sized(Hv * D);
    }
    p_.conv1d = sized(conv_dim() * c.conv_kernel);
    p_.A_log = sized(Hv);
    p_.dt_bias = sized(Hv, 1.0f);
    p_.norm = sized(c.value_head_dim, 1.0f);
    p_.out_proj = sized(D * V);
  }

  GatedDeltaNetConfig const& config() const { return c_; }
  Index d_model() const { return c_.d_model; }
  Index key_dim() const { return c_.num_key_heads * c_.key_head_dim; }        ///< K
  Index value_dim() const { return c_.num_value_heads * c_.value_head_dim; }  ///< V
  Index conv_dim() const { return 2 * key_dim() + value_dim(); }              ///< C
  /// Columns of the input projections' output: 2 K + 2 V + 2 H_v.
  Index proj_cols() const { return 2 * key_dim() + 2 * value_dim() + 2 * c_.num_value_heads; }

  /// Every trainable parameter as named flat buffers, HF names (see the class comment).
  ParameterList parameters() {
    unpack();
    return p_.groups();
  }
  /// Zero gradients shaped like parameters().
  Gradients make_gradients() const {
    check_master("make_gradients");
    Gradients g = p_;
    g.zero();
    return g;
  }

  /// Packs the input and output projections as moe::Linear matrices in `format` (kF32, kBf16 or
  /// a GGUF block format, with its fallback chain) for forward() and forward_cached();
  /// forward_train and backward use the fp32 parameters. parameters() drops the packs.
  void pack_weights(experts::WeightFormat format, ThreadPool* pool = nullptr) {
    unpack();
    auto const in = inputs();
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (in[i].w->empty()) continue;
      packs_.in[i] =
          Linear(ConstMatrixView<float>(in[i].w->data(), in[i].rows, c_.d_model), format, {}, pool);
    }
    packs_.out = Linear(ConstMatrixView<float>(p_.out_proj.data(), c_.d_model, value_dim()), format,
                        {}, pool);
  }
  bool packed() const { return !packs_.out.empty(); }
  /// Frees the projections' fp32 weights (the input projections and out_proj), keeping their
  /// packs: an inference-only layer, as a decoder keeps it (conv1d, A_log, dt_bias and norm
  /// stay). forward() and forward_cached() give the same results; afterwards forward_train,
  /// parameters(), make_gradients() and pack_weights() throw moe::Error. Irreversible.
  /// Precondition (checked): packed().
  void discard_master_weights() {
    detail::check(packed(),
                  "GatedDeltaNet::discard_master_weights: the projections are not packed; "
                  "pack_weights() first (the packs are what inference then reads)");
    for (auto* w : {&p_.in_proj_qkvz, &p_.in_proj_ba, &p_.in_proj_qkv, &p_.in_proj_z, &p_.in_proj_b,
                    &p_.in_proj_a, &p_.out_proj}) {
      *w = {};
    }
    discarded_ = true;
  }
  /// Makes the layer inference-only with projections packed elsewhere (a loader building them
  /// with Linear::from_blocks or the Linear constructor): `in` the layout's input projections in
  /// parameters() order (kQwen3Next: in_proj_qkvz [2 K + 2 V, D], in_proj_ba [2 H_v, D];
  /// kQwen35: in_proj_qkv [C, D], in_proj_z [V, D], in_proj_b, in_proj_a [H_v, D]), `out`
  /// out_proj [D, V]; none with a bias. The fp32 projections are freed as by
  /// discard_master_weights(). Throws moe::Error for a wrong count, shape or a bias.
  void adopt_packed_weights(std::span<Linear> in, Linear out) {
    auto const want = inputs();
    Index const n = next() ? 2 : 4;
    detail::check(static_cast<Index>(in.size()) == n,
                  "GatedDeltaNet::adopt_packed_weights: ", in.size(),
                  " input projections but this layout has ", n);
    auto check = [&](Linear const& l, Index rows, Index depth, std::size_t i) {
      detail::check(l.rows() == rows && l.depth() == depth && l.bias().empty(),
                    "GatedDeltaNet::adopt_packed_weights: projection ", i, " is [", l.rows(), ", ",
                    l.depth(), "]", l.bias().empty() ? "" : " with a bias",
                    " but this layer needs [", rows, ", ", depth, "] without a bias");
    };
    for (std::size_t i = 0; i < in.size(); ++i) check(in[i], want[i].rows, c_.d_model, i);
    check(out, c_.d_model, value_dim(), in.size());
    Packs p;
    for (std::size_t i = 0; i < in.size(); ++i) p.in[i] = std::move(in[i]);
    p.out = std::move(out);
    packs_ = std::move(p);
    discard_master_weights();
  }
  /// Were the fp32 projection weights discarded?
  bool master_weights_discarded() const { return discarded_; }
  /// The format of the packed input projections (the first's; kF32 when not packed).
  experts::WeightFormat weight_format() const {
    return packed() ? packs_.in[0].format() : experts::WeightFormat::kF32;
  }
  /// Bytes of the projections a call streams: the packs, or the fp32 weights when not packed.
  std::size_t projection_bytes() const {
    if (packed()) {
      std::size_t n = packs_.out.bytes();
      for (Linear const& l : packs_.in) n += l.bytes();
      return n;
    }
    std::size_t n = p_.out_proj.size();
    for (Input const& in : inputs()) n += in.w->size();
    return n * sizeof(float);
  }

  /// A zero state for one sequence (see DeltaNetState).
  DeltaNetState make_state() const {
    DeltaNetState s;
    s.conv.assign(state_conv_floats(), 0.0f);
    s.recurrent.assign(state_recurrent_floats(), 0.0f);
    return s;
  }
  /// Bytes of one sequence's state (the same for any context length).
  std::size_t state_bytes() const {
    return (state_conv_floats() + state_recurrent_floats()) * sizeof(float);
  }

  /// y = GatedDeltaNet(x) for one sequence x [T, D] from the zero state.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, GatedDeltaNetWorkspace& ws,
               ThreadPool* pool = nullptr, DeltaRule rule = DeltaRule::kAuto) const {
    auto const busy = ws.in_use.enter("GatedDeltaNet::forward");
    check_xy(x, y);
    reset_own(ws);
    Index const n = x.rows;
    DeltaNetState* s = &ws.own;
    run(x, y, ws, {&s, 1}, {&n, 1}, pool, rule, false, false);
    ws.stamp = {};
  }

  /// Continues the sequence of `state` with the tokens x [T, D] (a prompt, a decode step with
  /// T = 1, or any number): y [T, D] gets their outputs and `state` moves past them. A prompt
  /// followed by steps equals forward() of the whole sequence up to rounding.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, DeltaNetState& state,
               GatedDeltaNetWorkspace& ws, ThreadPool* pool = nullptr,
               DeltaRule rule = DeltaRule::kAuto) const {
    DeltaNetState* s = &state;
    Index const n = x.rows;
    forward_cached(x, y, {&s, 1}, {&n, 1}, ws, pool, rule);
  }

  /// Several sequences in one call: x [T, D] holds new_tokens[s] rows of sequence s in order
  /// (sum = T, any may be 0), each continuing states[s]; y [T, D] (y may be x; with
  /// `accumulate`, y += the outputs, y must not be x). The projections run once for all rows.
  /// Throws moe::Error for states of another shape, counts that do not add up to T.
  void forward_cached(ConstMatrixView<float> x, MatrixView<float> y,
                      std::span<DeltaNetState* const> states, std::span<Index const> new_tokens,
                      GatedDeltaNetWorkspace& ws, ThreadPool* pool = nullptr,
                      DeltaRule rule = DeltaRule::kAuto, bool accumulate = false) const {
    auto const busy = ws.in_use.enter("GatedDeltaNet::forward_cached");
    check_xy(x, y);
    detail::check(!accumulate || x.data != y.data || x.rows == 0,
                  "GatedDeltaNet::forward_cached: accumulate adds the output to y, so y must not "
                  "be x");
    detail::check(states.size() == new_tokens.size(),
                  "GatedDeltaNet::forward_cached: ", states.size(), " states but ",
                  new_tokens.size(), " token counts; pass one count per sequence");
    Index sum = 0;
    std::size_t const conv_floats = state_conv_floats(), rec_floats = state_recurrent_floats();
    for (std::size_t s = 0; s < states.size(); ++s) {
      detail::check(new_tokens[s] >= 0, "GatedDeltaNet::forward_cached: new_tokens[", s,
                    "] = ", new_tokens[s], " is negative");
      sum += new_tokens[s];
      detail::check(states[s] != nullptr && states[s]->conv.size() == conv_floats &&
                        states[s]->recurrent.size() == rec_floats,
                    "GatedDeltaNet::forward_cached: state ", s, " does not fit this layer (conv ",
                    states[s] ? states[s]->conv.size() : 0, ", recurrent ",
                    states[s] ? states[s]->recurrent.size() : 0, " floats; this layer needs ",
                    conv_floats, " and ", rec_floats, "); make it with make_state()");
    }
    detail::check(sum == x.rows, "GatedDeltaNet::forward_cached: new_tokens sum to ", sum,
                  " but x has ", x.rows, " rows");
    run(x, y, ws, states, new_tokens, pool, rule, false, accumulate);
    ws.stamp = {};
  }

  /// forward() (zero state, one sequence) that also keeps in `ws` what backward needs.
  void forward_train(ConstMatrixView<float> x, MatrixView<float> y, GatedDeltaNetWorkspace& ws,
                     ThreadPool* pool = nullptr, DeltaRule rule = DeltaRule::kAuto) const {
    auto const busy = ws.in_use.enter("GatedDeltaNet::forward_train");
    check_xy(x, y);
    check_master("forward_train");
    Index const T = x.rows, D = c_.d_model;
    ws.x.resize(static_cast<std::size_t>(T * D));
    for (Index t = 0; t < T; ++t) std::copy(x.row(t), x.row(t) + D, ws.x.data() + t * D);
    reset_own(ws);
    DeltaNetState* s = &ws.own;
    run(ConstMatrixView<float>(ws.x.data(), T, D), y, ws, {&s, 1}, {&T, 1}, pool, rule, true,
        false);
    ws.stamp = {this, T, D, c_.num_value_heads, c_.value_head_dim};
  }

  /// Backward of the last forward_train on `ws`: dx [T, D] = dL/dx (overwritten) and every
  /// parameter gradient accumulated (+=) into `grads`, given dy [T, D]. Bitwise identical for
  /// any pool size. Call once per forward_train.
  void backward(GatedDeltaNetWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                Gradients& grads, ThreadPool* pool = nullptr) const {
    auto const busy = ws.in_use.enter("GatedDeltaNet::backward");
    detail::check(ws.stamp.filled() && ws.stamp.layer == this,
                  "GatedDeltaNet::backward: the workspace holds no training forward of this "
                  "layer; call its forward_train first (and backward once per forward)");
    Index const D = c_.d_model, T = static_cast<Index>(ws.x.size()) / D;
    detail::check(dy.rows == T && dy.cols == D && dx.rows == T && dx.cols == D,
                  "GatedDeltaNet::backward: dy and dx must be [", T, ", ", D,
                  "] like the forward's x; got dy [", dy.rows, ", ", dy.cols, "], dx [", dx.rows,
                  ", ", dx.cols, "]");
    auto mine = const_cast<Parameters&>(p_).groups();
    auto theirs = grads.groups();
    bool same = mine.size() == theirs.size();
    for (std::size_t i = 0; same && i < mine.size(); ++i) {
      same = mine[i].name == theirs[i].name && mine[i].values.size() == theirs[i].values.size();
    }
    detail::check(same,
                  "GatedDeltaNet::backward: gradients do not match this layer; use "
                  "make_gradients()");
    ws.stamp = {};
    run_backward(ws, dy, dx, grads, pool);
  }

  /// Column of the projections' output [T, P] holding q (key head kh, entry i), k, v and z
  /// (value head h, entry i), b and a (value head h), in the layer's layout.
  Index q_col(Index kh, Index i) const {
    return next() ? kh * group_width() + i : kh * c_.key_head_dim + i;
  }
  Index k_col(Index kh, Index i) const {
    return next() ? kh * group_width() + c_.key_head_dim + i : key_dim() + kh * c_.key_head_dim + i;
  }
  Index v_col(Index h, Index i) const {
    Index const R = ratio(), dk = c_.key_head_dim, dv = c_.value_head_dim;
    return next() ? (h / R) * group_width() + 2 * dk + (h % R) * dv + i
                  : 2 * key_dim() + h * dv + i;
  }
  Index z_col(Index h, Index i) const {
    Index const R = ratio(), dk = c_.key_head_dim, dv = c_.value_head_dim;
    return next() ? (h / R) * group_width() + 2 * dk + R * dv + (h % R) * dv + i
                  : 2 * key_dim() + value_dim() + h * dv + i;
  }
  Index b_col(Index h) const {
    Index const R = ratio(), base = 2 * key_dim() + 2 * value_dim();
    return next() ? base + (h / R) * 2 * R + h % R : base + h;
  }
  Index a_col(Index h) const {
    Index const R = ratio(), base = 2 * key_dim() + 2 * value_dim();
    return next() ? base + (h / R) * 2 * R + R + h % R : base + c_.num_value_heads + h;
  }

 private:
  bool next() const { return c_.layout == DeltaNetLayout::kQwen3Next; }
  std::size_t state_conv_floats() const {
    return static_cast<std::size_t>((c_.conv_kernel - 1) * conv_dim());
  }
  std::size_t state_recurrent_floats() const {
    return static_cast<std::size_t>(c_.num_value_heads * c_.key_head_dim * c_.value_head_dim);
  }
  Index ratio() const { return c_.num_value_heads / c_.num_key_heads; }
  /// The key head value head h reads (DeltaNetHeadOrder), and the j-th value head of key head kh.
  Index key_head(Index h) const {
    return c_.head_order == DeltaNetHeadOrder::kTiled ? h % c_.num_key_heads : h / ratio();
  }
  Index value_head(Index kh, Index j) const {
    return c_.head_order == DeltaNetHeadOrder::kTiled ? j * c_.num_key_heads + kh
                                                      : kh * ratio() + j;
  }
  Index group_width() const { return 2 * c_.key_head_dim + 2 * ratio() * c_.value_head_dim; }
  /// Calls f(channel, column, n) for each run of n convolution channels (q | k | v order) fed by
  /// the n consecutive columns of the projections' output from `column` on: one run a head.
  template <class F>
  void for_each_conv_run(F&& f) const {
    Index const K = key_dim(), dk = c_.key_head_dim, dv = c_.value_head_dim;
    for (Index kh = 0; kh < c_.num_key_heads; ++kh) {
      f(kh * dk, q_col(kh, 0), dk);
      f(K + kh * dk, k_col(kh, 0), dk);
    }
    for (Index h = 0; h < c_.num_value_heads; ++h) f(2 * K + h * dv, v_col(h, 0), dv);
  }
  static int threads_of(ThreadPool* pool) { return pool ? pool->size() : 1; }

  /// The input projections of the layout: weights, rows, first output column (unused slots have
  /// an empty weight).
  struct Input {
    HugePageVector<float> const* w;
    Index rows, col;
  };
  std::array<Input, 4> inputs() const {
    Index const K = key_dim(), V = value_dim(), Hv = c_.num_value_heads;
    if (next()) {
      return {{{&p_.in_proj_qkvz, 2 * K + 2 * V, 0},
               {&p_.in_proj_ba, 2 * Hv, 2 * K + 2 * V},
               {&p_.in_proj_z, 0, 0},
               {&p_.in_proj_b, 0, 0}}};
    }
    return {{{&p_.in_proj_qkv, 2 * K + V, 0},
             {&p_.in_proj_z, V, 2 * K + V},
             {&p_.in_proj_b, Hv, 2 * K + 2 * V},
             {&p_.in_proj_a, Hv, 2 * K + 2 * V + Hv}}};
  }
  /// The same buffers of a gradient (for the weight-gradient items).
  std::array<HugePageVector<float>*, 4> input_grads(Gradients& g) const {
    if (next()) return {&g.in_proj_qkvz, &g.in_proj_ba, &g.in_proj_z, &g.in_proj_b};
    return {&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a};
  }

  void check_xy(ConstMatrixView<float> x, MatrixView<float> y) const {
    detail::check(!p_.out_proj.empty() || discarded_,
                  "GatedDeltaNet: the layer was default-constructed; construct it from a "
                  "GatedDeltaNetConfig first");
    detail::check_attention_call(x, y, c_.d_model, {}, "GatedDeltaNet");
  }
  void reset_own(GatedDeltaNetWorkspace& ws) const {
    if (ws.own.conv.size() != state_conv_floats() ||
        ws.own.recurrent.size() != state_recurrent_floats()) {
      ws.own = make_state();
    } else {
      ws.own.reset();
    }
  }

  /// Drops the packs before a write (throws once the weights are discarded).
  void unpack() {
    check_master("parameters() / pack_weights()");
    packs_ = {};
  }
  void check_master(char const* what) const {
    detail::check(!discarded_, "GatedDeltaNet: ", what,
                  ": the projections' fp32 weights were discarded (discard_master_weights); this "
                  "layer is inference-only and cannot be written, repacked or trained");
  }

  static float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
  static float silu(float x) { return x * sigmoid(x); }
  /// torch.nn.functional.softplus (beta 1, threshold 20).
  static float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

  Index scratch_floats() const {
    Index const C = c_.chunk_size, dk = c_.key_head_dim, dv = c_.value_head_dim;
    Index n = std::max(kernels::delta_rule_chunked_scratch(C, dk, dv),
                       kernels::delta_rule_backward_scratch(C, dk, dv));
    n = std::max(n, dv);
    return (n + 15) / 16 * 16;
  }

  /// Value head h's view of the rows [r0, r0 + n) of the workspace (one sequence).
  kernels::DeltaRuleHead head(GatedDeltaNetWorkspace& ws, Index h, Index r0, Index n) const {
    Index const K = key_dim(), V = value_dim(), C = conv_dim(), Hv = c_.num_value_heads;
    Index const dk = c_.key_head_dim, dv = c_.value_head_dim, kh = key_head(h);
    kernels::DeltaRuleHead p;
    p.q = ws.qn.data() + r0 * K + kh * dk;
    p.k = ws.kn.data() + r0 * K + kh * dk;
    p.v = ws.act.data() + r0 * C + 2 * K + h * dv;
    p.g = ws.g.data() + r0 * Hv + h;
    p.beta = ws.beta.data() + r0 * Hv + h;
    p.o = ws.core.data() + r0 * V + h * dv;
    p.ldq = p.ldk = K;
    p.ldv = C;
    p.ldg = p.ldbeta = Hv;
    p.ldo = V;
    p.tokens = n;
    p.dk = dk;
    p.dv = dv;
    return p;
  }

  /// The forward of `states.size()` sequences, new_tokens[s] rows each.
  void run(ConstMatrixView<float> x, MatrixView<float> y, GatedDeltaNetWorkspace& ws,
           std::span<DeltaNetState* const> states, std::span<Index const> new_tokens,
           ThreadPool* pool, DeltaRule rule, bool train, bool accumulate) const {
    Index const T = x.rows, D = c_.d_model, P = proj_cols(), C = conv_dim(), K = key_dim();
    Index const V = value_dim(), Hk = c_.num_key_heads, Hv = c_.num_value_heads;
    Index const dk = c_.key_head_dim, dv = c_.value_head_dim, KW = c_.conv_kernel;
    Index const B = static_cast<Index>(states.size());
    Index const per = scratch_floats();
    std::pair<std::vector<float>*, Index> const sizes[] = {
        {&ws.proj, T * P},     {&ws.conv_in, (T + B * (KW - 1)) * C},
        {&ws.conv_pre, T * C}, {&ws.act, T * C},
        {&ws.qn, T * K},       {&ws.kn, T * K},
        {&ws.rq, T * Hk},      {&ws.rk, T * Hk},
        {&ws.beta, T * Hv},    {&ws.g, T * Hv},
        {&ws.core, T * V},     {&ws.rstd, T * Hv},
        {&ws.gated, T * V},    {&ws.scratch, threads_of(pool) * per}};
    for (auto const& [v, n] : sizes) v->resize(static_cast<std::size_t>(n));
    auto grow = [](std::vector<float>& v, Index n) { v.resize(static_cast<std::size_t>(n)); };
    ws.seg_row0.assign(static_cast<std::size_t>(B + 1), 0);
    for (Index s = 0; s < B; ++s) ws.seg_row0[s + 1] = ws.seg_row0[s] + new_tokens[s];
    Index const chunks = train ? (T + c_.chunk_size - 1) / c_.chunk_size : 0;
    grow(ws.checkpoints, Hv * chunks * dk * dv);
    if (T == 0) return;

    // 1. Input projections.
    bool const inference = !train && packed();
    auto const in = inputs();
    bool q8 = false;
    for (auto const& l : packs_.in) q8 = q8 || (inference && l.quantized());
    kernels::RowSource const a = ws.input.prepare(x, q8, pool);
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (in[i].rows == 0) continue;
      ws.queue.add(detail::projection_job(a, T, packs_.in[i], in[i].w->data(), in[i].rows, D,
                                          ws.proj.data() + in[i].col, P, inference));
    }
    ws.queue.run<experts::SwiGlu, experts::SwiGlu>(pool);

    // 2. Convolution inputs: per sequence, its state's rows then its new rows.
    auto conv_base = [&](Index s) {
      return ws.conv_in.data() + (ws.seg_row0[s] + s * (KW - 1)) * C;
    };
    for (Index s = 0; s < B; ++s) {
      std::copy(states[s]->conv.begin(), states[s]->conv.end(), conv_base(s));
    }
    Index const tiles = (T + kTileRows - 1) / kTileRows;
    std::vector<Index> const& row0 = ws.seg_row0;
    auto seq_of = [&](Index t) {
      return static_cast<Index>(std::upper_bound(row0.begin(), row0.end(), t) - row0.begin()) - 1;
    };
    parallel_for(pool, tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        Index const s = seq_of(t);
        float* dst = conv_base(s) + (KW - 1 + t - row0[s]) * C;
        float const* src = ws.proj.data() + t * P;
        for_each_conv_run(
            [&](Index ch, Index col, Index n) { std::copy_n(src + col, n, dst + ch); });
      }
    });
    // 3. Convolution (weights transposed to [KW, C]: vectors over channels), SiLU, q/k L2
    //    norms, beta and g.
    grow(ws.conv_wt, KW * C);
    for (Index ch = 0; ch < C; ++ch) {
      for (Index j = 0; j < KW; ++j) ws.conv_wt[j * C + ch] = p_.conv1d[ch * KW + j];
    }
    float const scale = 1.0f / std::sqrt(static_cast<float>(dk));
    parallel_for(pool, tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        Index const s = seq_of(t);
        float const* win = conv_base(s) + (t - row0[s]) * C;  // rows t - KW + 1 .. t
        float* pre = ws.conv_pre.data() + t * C;
        float* act = ws.act.data() + t * C;
        std::fill(pre, pre + C, 0.0f);  // per channel one chain over j ascending
        for (Index j = 0; j < KW; ++j) {
          float const* w = ws.conv_wt.data() + j * C;
          float const* row = win + j * C;
          for (Index ch = 0; ch < C; ++ch) pre[ch] = std::fma(w[ch], row[ch], pre[ch]);
        }
        for (Index ch = 0; ch < C; ++ch) act[ch] = silu(pre[ch]);
        for (Index h = 0; h < Hk; ++h) {
          ws.rq[t * Hk + h] = l2_normalize(act + h * dk, dk, scale, ws.qn.data() + t * K + h * dk);
          ws.rk[t * Hk + h] =
              l2_normalize(act + K + h * dk, dk, 1.0f, ws.kn.data() + t * K + h * dk);
        }
        float const* pr = ws.proj.data() + t * P;
        for (Index h = 0; h < Hv; ++h) {
          ws.beta[t * Hv + h] = sigmoid(pr[b_col(h)]);
          ws.g[t * Hv + h] = -std::exp(p_.A_log[h]) * softplus(pr[a_col(h)] + p_.dt_bias[h]);
        }
      }
    });
    // New convolution states: the last KW - 1 rows of each sequence's inputs.
    for (Index s = 0; s < B; ++s) {
      float const* end = conv_base(s) + (KW - 1 + new_tokens[s]) * C;
      std::copy(end - (KW - 1) * C, end, states[s]->conv.begin());
    }

    // 4. The delta rule per (sequence, value head).
    parallel_for(pool, B * Hv, [&](Index item, int thread) {
      Index const s = item / Hv, h = item % Hv, n = new_tokens[s], r0 = row0[s];
      if (n == 0) return;
      kernels::DeltaRuleHead const p = head(ws, h, r0, n);
      float* S = states[s]->recurrent.data() + h * dk * dv;
      float* scratch = ws.scratch.data() + thread * per;
      float* ck = train ? ws.checkpoints.data() + h * chunks * dk * dv : nullptr;
      bool const chunked = rule == DeltaRule::kChunked || (rule == DeltaRule::kAuto && n > 1);
      if (chunked) {
        kernels::delta_rule_chunked(p, S, scratch, c_.chunk_size, ck);
      } else {
        kernels::delta_rule_recurrent(p, S, scratch, ck, c_.chunk_size);
      }
    });
    for (Index s = 0; s < B; ++s) states[s]->tokens += new_tokens[s];

    // 5. Gated RMSNorm: rmsnorm(o) * w * silu(z).
    parallel_for(pool, tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        float const* pr = ws.proj.data() + t * P;
        for (Index h = 0; h < Hv; ++h) {
          float* out = ws.gated.data() + t * V + h * dv;
          ws.rstd[t * Hv + h] = kernels::rms_norm(ws.core.data() + t * V + h * dv, p_.norm.data(),
                                                  false, c_.norm_eps, dv, out);
          float const* z = pr + z_col(h, 0);  // a head's z: consecutive columns
          for (Index j = 0; j < dv; ++j) out[j] *= silu(z[j]);
        }
      }
    });

    // 6. y = o W_out^T.
    kernels::RowSource const ao = ws.input.prepare(ConstMatrixView<float>(ws.gated.data(), T, V),
                                                   inference && packs_.out.quantized(), pool);
    ws.queue.add(detail::projection_job(ao, T, packs_.out, p_.out_proj.data(), D, V, y.data,
                                        y.row_stride, inference, nullptr, accumulate));
    ws.queue.run<experts::SwiGlu, experts::SwiGlu>(pool);
  }

  /// y = scale * x / sqrt(|x|^2 + 1e-6) over n entries (transformers' l2norm); returns the
  /// 1 / sqrt(...) factor.
  static float l2_normalize(float const* x, Index n, float scale, float* y) {
    float ss = 0.0f;
    for (Index i = 0; i < n; ++i) ss = std::fma(x[i], x[i], ss);
    float const r = 1.0f / std::sqrt(ss + 1e-6f);
    for (Index i = 0; i < n; ++i) y[i] = x[i] * r * scale;
    return r;
  }
  /// Backward of l2_normalize at x with its factor r: dx = r (dy' - xhat (xhat . dy')),
  /// xhat = x r, dy' = scale dy.
  static void l2_normalize_backward(float const* x, float r, Index n, float scale, float const* dy,
                                    float* dx) {
    float dot = 0.0f;
    for (Index i = 0; i < n; ++i) dot = std::fma(x[i] * r, dy[i] * scale, dot);
    for (Index i = 0; i < n; ++i) dx[i] = r * (dy[i] * scale - x[i] * r * dot);
  }

  void run_backward(GatedDeltaNetWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                    Gradients& grads, ThreadPool* pool) const {
    Index const D = c_.d_model, T = static_cast<Index>(ws.x.size()) / D, P = proj_cols();
    Index const C = conv_dim(), K = key_dim(), V = value_dim(), Hk = c_.num_key_heads;
    Index const Hv = c_.num_value_heads, dk = c_.key_head_dim, dv = c_.value_head_dim;
    Index const R = ratio(), KW = c_.conv_kernel, CS = c_.chunk_size;
    auto sized = [](std::vector<float>& v, Index n) { v.resize(static_cast<std::size_t>(n)); };
    sized(ws.dgated, T * V);
    sized(ws.dcore, T * V);
    sized(ws.dq_heads, T * Hv * dk);
    sized(ws.dk_heads, T * Hv * dk);
    sized(ws.dbeta, T * Hv);
    sized(ws.dg, T * Hv);
    sized(ws.dact, T * C);
    sized(ws.dpre_row, ((T + kTileRows - 1) / kTileRows) * C);
    ws.dproj.resize(static_cast<std::size_t>(T * P));  // every column written below
    Index const tiles = (T + kTileRows - 1) / kTileRows, np = dv + 2 * Hv;
    ws.partial.assign(static_cast<std::size_t>(tiles * np), 0.0f);
    Index const per = scratch_floats();
    sized(ws.scratch, threads_of(pool) * per);
    ws.dstate.assign(static_cast<std::size_t>(Hv * dk * dv), 0.0f);
    if (T == 0) return;
    ConstMatrixView<float> x(ws.x.data(), T, D);

    // 1. dO = dy W_out; gated norm backward: d(core), dz, d(norm.weight) partials.
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, n = std::min(kTileRows, T - t0);
      kernels::gemm_strided(n, V, D, dy.data + t0 * dy.row_stride, dy.row_stride, 1,
                            p_.out_proj.data(), V, ws.dgated.data() + t0 * V, V, false);
      float* part = ws.partial.data() + i * np;
      for (Index t = t0; t < t0 + n; ++t) {
        float const* pr = ws.proj.data() + t * P;
        float* dpr = ws.dproj.data() + t * P;
        for (Index h = 0; h < Hv; ++h) {
          float const* o = ws.core.data() + t * V + h * dv;
          float* dgo = ws.dgated.data() + t * V + h * dv;
          float const r = ws.rstd[t * Hv + h];
          Index const z0 = z_col(h, 0);
          for (Index j = 0; j < dv; ++j) {
            float const z = pr[z0 + j], sz = sigmoid(z);
            float const normed = o[j] * r * p_.norm[j];
            dpr[z0 + j] = dgo[j] * normed * sz * (1.0f + z * (1.0f - sz));
            dgo[j] *= z * sz;  // d(normed)
          }
          kernels::rms_norm_backward(o, p_.norm.data(), false, r, dv, dgo,
                                     ws.dcore.data() + t * V + h * dv, part);
        }
      }
    });

    // 2. The delta rule backwards per value head.
    Index const chunks = (T + CS - 1) / CS;
    parallel_for(pool, Hv, [&](Index h, int thread) {
      kernels::DeltaRuleHead const p = head(ws, h, 0, T);
      kernels::delta_rule_backward(
          p, ws.checkpoints.data() + h * chunks * dk * dv, CS, ws.dcore.data() + h * dv, V,
          ws.dstate.data() + h * dk * dv, ws.dq_heads.data() + h * dk, Hv * dk,
          ws.dk_heads.data() + h * dk, Hv * dk, ws.dact.data() + 2 * K + h * dv, C,
          ws.dg.data() + h, ws.dbeta.data() + h, ws.scratch.data() + thread * per);
    });

    // 3. Per token: sum the value heads' dq, dk per key head, L2-norm backward; beta and g
    //    backward (A_log, dt_bias partials); SiLU backward; scatter b, a into dproj.
    float const scale = 1.0f / std::sqrt(static_cast<float>(dk));
    parallel_for(pool, tiles, [&](Index i, int) {
      float* part = ws.partial.data() + i * np;
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        float* dact = ws.dact.data() + t * C;
        float const* act = ws.act.data() + t * C;
        for (Index kh = 0; kh < Hk; ++kh) {
          float* dq = dact + kh * dk;  // summed here, then normalised in place
          float* dkk = dact + K + kh * dk;
          std::fill(dq, dq + dk, 0.0f);
          std::fill(dkk, dkk + dk, 0.0f);
          for (Index j = 0; j < R; ++j) {
            Index const h = value_head(kh, j);
            float const* sq = ws.dq_heads.data() + t * Hv * dk + h * dk;
            float const* sk = ws.dk_heads.data() + t * Hv * dk + h * dk;
            for (Index c = 0; c < dk; ++c) {
              dq[c] += sq[c];
              dkk[c] += sk[c];
            }
          }
          l2_normalize_backward(act + kh * dk, ws.rq[t * Hk + kh], dk, scale, dq, dq);
          l2_normalize_backward(act + K + kh * dk, ws.rk[t * Hk + kh], dk, 1.0f, dkk, dkk);
        }
        float const* pre = ws.conv_pre.data() + t * C;
        for (Index ch = 0; ch < C; ++ch) {
          float const sp = sigmoid(pre[ch]);
          dact[ch] *= sp * (1.0f + pre[ch] * (1.0f - sp));  // now d(conv output)
        }
        float const* pr = ws.proj.data() + t * P;
        float* dpr = ws.dproj.data() + t * P;
        for (Index h = 0; h < Hv; ++h) {
          float const b = ws.beta[t * Hv + h], dgv = ws.dg[t * Hv + h];
          dpr[b_col(h)] = ws.dbeta[t * Hv + h] * b * (1.0f - b);
          float const da = -dgv * std::exp(p_.A_log[h]) * sigmoid(pr[a_col(h)] + p_.dt_bias[h]);
          dpr[a_col(h)] = da;
          part[dv + h] += dgv * ws.g[t * Hv + h];  // d A_log = dg g
          part[dv + Hv + h] += da;
        }
      }
    });

    // 4. Convolution backward: d(input) into dproj (by token tiles), d(weight) by channel blocks.
    //    Input row t feeds outputs t .. t + KW - 1 through w[KW - 1] .. w[0].
    Index const KW1 = KW - 1;
    parallel_for(pool, tiles, [&](Index i, int) {
      for (Index t = i * kTileRows; t < std::min(T, (i + 1) * kTileRows); ++t) {
        float* du = ws.dpre_row.data() + i * C;  // this tile's row buffer
        std::fill(du, du + C, 0.0f);
        for (Index j = KW1; j >= 0 && t + KW1 - j < T; --j) {
          float const* w = ws.conv_wt.data() + j * C;
          float const* d = ws.dact.data() + (t + KW1 - j) * C;
          for (Index ch = 0; ch < C; ++ch) du[ch] = std::fma(w[ch], d[ch], du[ch]);
        }
        float* dpr = ws.dproj.data() + t * P;
        for_each_conv_run(
            [&](Index ch, Index col, Index n) { std::copy_n(du + ch, n, dpr + col); });
      }
    });
    constexpr Index kChannels = 64;
    parallel_for(pool, (C + kChannels - 1) / kChannels, [&](Index i, int) {
      for (Index ch = i * kChannels; ch < std::min(C, (i + 1) * kChannels); ++ch) {
        float* dw = grads.conv1d.data() + ch * KW;
        for (Index t = 0; t < T; ++t) {
          float const d = ws.dact[t * C + ch];
          float const* win = ws.conv_in.data() + t * C;  // rows t - KW + 1 .. t (one sequence)
          for (Index j = 0; j < KW; ++j) dw[j] = std::fma(d, win[j * C + ch], dw[j]);
        }
      }
    });
    for (Index i = 0; i < tiles; ++i) {  // tile partials in tile order
      float const* part = ws.partial.data() + i * np;
      for (Index j = 0; j < dv; ++j) grads.norm[j] += part[j];
      for (Index h = 0; h < Hv; ++h) {
        grads.A_log[h] += part[dv + h];
        grads.dt_bias[h] += part[dv + Hv + h];
      }
    }

    // 5. Weight gradients and dx = dproj W_in.
    auto const in = inputs();
    auto const gin = input_grads(grads);
    auto& items = ws.grad_tasks;
    items.clear();
    std::array<stages::DxTerm, 4> terms{};
    for (std::size_t j = 0; j < in.size(); ++j) {
      if (in[j].rows == 0) continue;
      ConstMatrixView<float> d(ws.dproj.data() + in[j].col, T, in[j].rows, P);
      items.add(x, d, MatrixView<float>(gin[j]->data(), in[j].rows, D));
      terms[j] = {ws.dproj.data() + in[j].col, P, in[j].rows, in[j].w->data(), D};
    }
    items.add(ConstMatrixView<float>(ws.gated.data(), T, V), dy,
              MatrixView<float>(grads.out_proj.data(), D, V));
    items.run(pool, ws.grad_scratch);
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, n = std::min(kTileRows, T - t0);
      for (Index r = t0; r < t0 + n; ++r) std::fill(dx.row(r), dx.row(r) + D, 0.0f);
      stages::add_dx_terms(terms, t0, n, dx);
    });
  }

  GatedDeltaNetConfig c_{};
  Parameters p_;
  struct Packs {
    std::array<Linear, 4> in;
    Linear out;
  } packs_;
  bool discarded_ = false;  ///< discard_master_weights() was called
};

}  // namespace moe
