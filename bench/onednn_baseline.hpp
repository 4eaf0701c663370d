// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// The oneDNN baseline of moe_bench_hotpath's bf16 rows (built when CMake finds Debian's
// libdnnl-dev; MOE_BENCH_ONEDNN). What a careful user of oneDNN would write for the same layer:
//   - the router and the routing plan are ours (layer.route), as in the naive baseline;
//   - x rounded to bf16 once; per expert with rows: its rows gathered (a copy), then
//       g = SiLU(x_e W_gate^T)             one bf16 matmul, eltwise_swish post-op, bf16 out
//       m = (x_e W_up^T) * g               one bf16 matmul, binary_mul post-op,    bf16 out
//       o = m W_down^T                     one bf16 matmul, fp32 out
//     and w_row * o scatter-added into y (index_add_; oneDNN 2.6 runs a matmul with a per-row
//     binary_mul post-op in its reference kernel, 100x slower, so the routing weight is applied
//     here); shared experts as one more expert over every token with weight 1;
//   - the weights in bf16, reordered once at construction into the layout oneDNN's matmul
//     picks (format_tag::any: on a CPU with AMX, its AMX brgemm kernels, "brg:avx512_core_amx");
//     primitives created once per row count and cached, outside the timed loop after warm-up.
// oneDNN runs its matmuls on its own OpenMP threads (OMP_NUM_THREADS, default: every core).
#pragma once

#include <cstdint>
#include <cstring>
#include <dnnl.hpp>
#include <map>
#include <moe/moe.hpp>
#include <string>
#include <vector>

namespace bench {

class OnednnMoe {
 public:
  using Index = moe::Index;

  /// Copies the routed (and shared, if any) experts of `layer` (fp32 weights) to bf16 in
  /// oneDNN's layout. D: hidden size, F: expert width, shared_f: the shared experts' width (0:
  /// none).
  template <class Layer>
  OnednnMoe(Layer const& layer, Index D, Index F, Index shared_f) : D_(D), F_(F) {
    auto const& bank = layer.experts();
    for (Index e = 0; e < bank.num_experts(); ++e) {
      experts_.push_back(make_expert(bank.in_proj(e), bank.down_proj(e), F));
    }
    if (shared_f > 0) {
      auto const& sb = layer.shared_experts().bank();
      shared_ = make_expert(sb.in_proj(0), sb.down_proj(0), shared_f);
      has_shared_ = true;
    }
  }

  /// The implementations oneDNN chose for the gate, up and down matmuls (e.g.
  /// "brg:avx512_core_amx_bf16" each).
  std::string implementation() {
    auto& p = prims(experts_[0], 32);
    return std::string(p.gate_pd.impl_info_str()) + " / " + p.up_pd.impl_info_str() + " / " +
           p.down_pd.impl_info_str();
  }

  /// y = sum over the plan's rows of w_row * expert(x[token]) (+ shared experts), [T, D].
  void forward(moe::RoutingPlan const& plan, float const* x, Index T, float* y) {
    xb_.resize(static_cast<std::size_t>(T * D_));
    for (Index i = 0; i < T * D_; ++i)
      xb_[static_cast<std::size_t>(i)] = moe::kernels::float_to_bf16(x[i]);
    std::memset(y, 0, static_cast<std::size_t>(T * D_) * sizeof(float));
    for (std::size_t e = 0; e < experts_.size(); ++e) {
      Index const n = plan.expert_rows(static_cast<Index>(e));
      if (n == 0) continue;
      Index const r0 = plan.expert_offsets[e];
      run(experts_[e], n, plan.row_token.data() + r0, plan.row_weight.data() + r0, y);
    }
    if (has_shared_) {
      tokens_.resize(static_cast<std::size_t>(T));
      ones_.assign(static_cast<std::size_t>(T), 1.0f);
      for (Index t = 0; t < T; ++t) tokens_[static_cast<std::size_t>(t)] = t;
      run(shared_, T, tokens_.data(), ones_.data(), y);
    }
  }

 private:
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;

  struct Expert {
    Index F = 0;
    dnnl::memory gate, up, down;  // weights, K x N in oneDNN's layout
  };
  struct Prims {
    dnnl::matmul::primitive_desc gate_pd, up_pd, down_pd;
    dnnl::matmul gate, up, down;
  };

  dnnl::memory::desc weights_desc(Index K, Index N) {
    dnnl::memory::desc const src({32, K}, dt::bf16, tag::ab), dst({32, N}, dt::bf16, tag::ab);
    dnnl::memory::desc const any({K, N}, dt::bf16, tag::any);
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, any, dst), eng_).weights_desc();
  }

  /// W [N, K] fp32 row-major (a Hugging Face Linear weight) as a K x N bf16 matmul operand.
  dnnl::memory to_weights(float const* w, Index N, Index K) {
    std::vector<std::uint16_t> b(static_cast<std::size_t>(N * K));
    for (Index i = 0; i < N * K; ++i)
      b[static_cast<std::size_t>(i)] = moe::kernels::float_to_bf16(w[i]);
    dnnl::memory plain({{K, N}, dt::bf16, tag::ba}, eng_, b.data());
    dnnl::memory out(weights_desc(K, N), eng_);
    dnnl::reorder(plain, out).execute(strm_, plain, out);
    strm_.wait();
    return out;
  }

  template <class View>
  Expert make_expert(View const& in, View const& down, Index F) {
    Index const D = in.cols;
    Expert x;
    x.F = F;
    x.gate = to_weights(in.data, F, D);
    x.up = to_weights(in.data + F * D, F, D);
    x.down = to_weights(down.data, D, F);
    return x;
  }

  Prims& prims(Expert const& x, Index n) {
    auto const key = std::make_pair(x.F, n);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    Index const F = x.F;
    dnnl::memory::desc const xs({n, D_}, dt::bf16, tag::ab), hs({n, F}, dt::bf16, tag::ab);
    dnnl::memory::desc const os({n, D_}, dt::f32, tag::ab);
    Prims p;
    dnnl::post_ops silu, mul_g;
    silu.append_eltwise(1.0f, dnnl::algorithm::eltwise_swish, 1.0f, 0.0f);
    mul_g.append_binary(dnnl::algorithm::binary_mul, hs);
    auto attr = [](dnnl::post_ops const& po) {
      dnnl::primitive_attr a;
      a.set_post_ops(po);
      return a;
    };
    p.gate_pd = {dnnl::matmul::desc(xs, x.gate.get_desc(), hs), attr(silu), eng_};
    p.up_pd = {dnnl::matmul::desc(xs, x.up.get_desc(), hs), attr(mul_g), eng_};
    p.down_pd = {dnnl::matmul::desc(hs, x.down.get_desc(), os), eng_};
    p.gate = dnnl::matmul(p.gate_pd);
    p.up = dnnl::matmul(p.up_pd);
    p.down = dnnl::matmul(p.down_pd);
    return cache_.emplace(key, std::move(p)).first->second;
  }

  void run(Expert const& x, Index n, Index const* token, float const* weight, float* y) {
    Index const F = x.F;
    xe_.resize(static_cast<std::size_t>(n * D_));
    g_.resize(static_cast<std::size_t>(n * F));
    m_.resize(static_cast<std::size_t>(n * F));
    o_.resize(static_cast<std::size_t>(n * D_));
    for (Index i = 0; i < n; ++i) {  // index_select
      std::memcpy(xe_.data() + i * D_, xb_.data() + token[i] * D_,
                  static_cast<std::size_t>(D_) * sizeof(std::uint16_t));
    }
    Prims& p = prims(x, n);
    dnnl::memory const xm({{n, D_}, dt::bf16, tag::ab}, eng_, xe_.data());
    dnnl::memory const gm({{n, F}, dt::bf16, tag::ab}, eng_, g_.data());
    dnnl::memory const mm({{n, F}, dt::bf16, tag::ab}, eng_, m_.data());
    dnnl::memory const om({{n, D_}, dt::f32, tag::ab}, eng_, o_.data());
    auto const bin = DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1;
    p.gate.execute(strm_, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, x.gate}, {DNNL_ARG_DST, gm}});
    p.up.execute(strm_,
                 {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, x.up}, {DNNL_ARG_DST, mm}, {bin, gm}});
    p.down.execute(strm_, {{DNNL_ARG_SRC, mm}, {DNNL_ARG_WEIGHTS, x.down}, {DNNL_ARG_DST, om}});
    strm_.wait();
    for (Index i = 0; i < n; ++i) {  // index_add_
      float* dst = y + token[i] * D_;
      float const* src = o_.data() + i * D_;
      float const w = weight[i];
      for (Index d = 0; d < D_; ++d) dst[d] += w * src[d];
    }
  }

  Index D_, F_;
  dnnl::engine eng_{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm_{eng_};
  std::vector<Expert> experts_;
  Expert shared_;
  bool has_shared_ = false;
  std::map<std::pair<Index, Index>, Prims> cache_;
  std::vector<std::uint16_t> xb_, xe_, g_, m_;
  std::vector<float> o_, ones_;
  std::vector<Index> tokens_;
};

}  // namespace bench
