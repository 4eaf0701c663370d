// SPDX-License-Identifier: Apache-2.0
// An independent double-precision transcription of the transformers forward of one MoE block
// (modeling_<family>.py) for the families whose blocks moe loads, read tensor by tensor from a
// safetensors file under the Hugging Face names: the oracle of the per-family layer tests and of
// the whole-model decoder tests.
#pragma once

#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "moe/io/hf.hpp"
#include "moe/io/safetensors.hpp"

namespace hfref {

using moe::Index;
using moe::io::HfFamily;
using moe::io::HfMoeConfig;
namespace fs = std::filesystem;

/// The tensors of a checkpoint by name, as doubles, with their shapes checked.
class Checkpoint {
 public:
  explicit Checkpoint(fs::path const& file) : file_(file) {}
  std::vector<double> get(std::string const& name, std::vector<std::int64_t> const& shape) const {
    INFO("tensor " << name);
    moe::io::TensorView const* t = file_.find(name);
    REQUIRE(t != nullptr);
    REQUIRE(t->shape == shape);
    std::vector<float> const f = moe::io::to_float(*t);
    return {f.begin(), f.end()};
  }
  bool has(std::string const& name) const { return file_.find(name) != nullptr; }

 private:
  moe::io::SafetensorsFile file_;
};

inline double dot(double const* a, double const* b, Index n) {
  double s = 0.0;
  for (Index i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
inline double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }
inline double silu(double z) { return z * sigmoid(z); }

/// nn.Linear-style MLP: down(silu(gate x + bg) * (up x + bu)) + bd, weights [I, H], [I, H],
/// [H, I], biases (empty: none) [I], [I], [H].
inline std::vector<double> mlp(std::vector<double> const& gate, std::vector<double> const& up,
                               std::vector<double> const& down, double const* x, Index H, Index I,
                               std::vector<double> const* biases = nullptr) {
  std::vector<double> m(static_cast<std::size_t>(I)), y(static_cast<std::size_t>(H));
  for (Index i = 0; i < I; ++i) {
    double const g = dot(&gate[i * H], x, H) + (biases ? biases[0][i] : 0.0);
    double const u = dot(&up[i * H], x, H) + (biases ? biases[1][i] : 0.0);
    m[i] = silu(g) * u;
  }
  for (Index h = 0; h < H; ++h)
    y[h] = dot(&down[h * I], m.data(), I) + (biases ? biases[2][h] : 0.0);
  return y;
}

/// Indices of the k largest values (torch.topk; the inputs here have no ties).
inline std::vector<int> topk(std::vector<double> const& v, Index k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(static_cast<std::size_t>(k));
  return idx;
}

inline std::vector<double> softmax(std::vector<double> z) {
  double const m = *std::max_element(z.begin(), z.end());
  double s = 0.0;
  for (double& v : z) s += (v = std::exp(v - m));
  for (double& v : z) v /= s;
  return z;
}

/// Keeps the topk_group best groups of `key` (scored by `score` of each group's values) and
/// sets every other expert to `fill`, as the DeepSeek / GLM gates do.
inline void mask_groups(std::vector<double>& key, Index n_group, Index topk_group, double fill,
                        std::function<double(std::vector<double>)> const& score) {
  Index const gs = static_cast<Index>(key.size()) / n_group;
  std::vector<double> gscore(static_cast<std::size_t>(n_group));
  for (Index g = 0; g < n_group; ++g) {
    gscore[g] = score(std::vector<double>(key.begin() + g * gs, key.begin() + (g + 1) * gs));
  }
  std::vector<int> const keep = topk(gscore, topk_group);
  for (Index g = 0; g < n_group; ++g) {
    if (std::find(keep.begin(), keep.end(), g) != keep.end()) continue;
    for (Index e = g * gs; e < (g + 1) * gs; ++e) key[e] = fill;
  }
}

inline double top_two_sum(std::vector<double> v) {
  std::sort(v.begin(), v.end(), std::greater<>());
  return v[0] + v[1];
}
inline double group_max(std::vector<double> v) { return *std::max_element(v.begin(), v.end()); }

struct Reference {
  std::vector<double> y;                 // [T, H]
  std::vector<std::vector<int>> chosen;  // [T][k], in torch.topk order
};

/// GptOssMLP.forward (transformers v4.5x CPU/training branch of GptOssExperts) on x [T, H]:
/// logits = x W_r^T + b_r; top-k of them, softmax over the k; per chosen expert gate_up = x @
/// gate_up_proj[e] + gate_up_proj_bias[e] (gate = even columns, up = odd), gate.clamp(max=L),
/// up.clamp(-L, L), glu = gate sigmoid(alpha gate), out = ((up + 1) glu) @ down_proj[e] +
/// down_proj_bias[e], y += w out. gate_up [E, H, 2I] and down [E, I, H] in the x @ W layout.
inline Reference gpt_oss_forward(HfMoeConfig const& c, std::vector<double> const& wr,
                                 std::vector<double> const& br, std::vector<double> const& gu,
                                 std::vector<double> const& gub, std::vector<double> const& dn,
                                 std::vector<double> const& dnb, std::vector<float> const& x) {
  Index const H = c.hidden_size, E = c.num_experts, I = c.expert_intermediate_size,
              k = c.num_experts_per_tok, T = static_cast<Index>(x.size()) / H;
  double const L = c.swiglu_limit, alpha = c.swiglu_alpha;
  Reference out;
  out.y.assign(static_cast<std::size_t>(T * H), 0.0);
  for (Index t = 0; t < T; ++t) {
    std::vector<double> z(static_cast<std::size_t>(E));
    for (Index e = 0; e < E; ++e) {
      z[e] = br[e];
      for (Index h = 0; h < H; ++h) z[e] += wr[e * H + h] * x[t * H + h];
    }
    std::vector<int> const idx = topk(z, k);
    std::vector<double> top;
    for (int e : idx) top.push_back(z[e]);
    std::vector<double> const w = softmax(top);
    out.chosen.push_back(idx);
    for (std::size_t j = 0; j < idx.size(); ++j) {
      Index const e = idx[j];
      std::vector<double> m(static_cast<std::size_t>(I));
      for (Index i = 0; i < I; ++i) {
        double g = gub[e * 2 * I + 2 * i], u = gub[e * 2 * I + 2 * i + 1];
        for (Index h = 0; h < H; ++h) {
          g += x[t * H + h] * gu[(e * H + h) * 2 * I + 2 * i];
          u += x[t * H + h] * gu[(e * H + h) * 2 * I + 2 * i + 1];
        }
        g = std::min(g, L);
        u = std::clamp(u, -L, L);
        m[i] = (u + 1.0) * (g * sigmoid(g * alpha));
      }
      for (Index h = 0; h < H; ++h) {
        double o = dnb[e * H + h];
        for (Index i = 0; i < I; ++i) o += m[i] * dn[(e * I + i) * H + h];
        out.y[t * H + h] += w[j] * o;
      }
    }
  }
  return out;
}

/// Llama4TextMoe.forward on x [T, H]: logits = x W_r^T, top-k of them; routed_in = x *
/// sigmoid(chosen logit); gate_up = routed_in @ gate_up_proj[e] (gate = first I columns, up =
/// the rest), out = (up * silu(gate)) @ down_proj[e]; y = sum of the outs + shared_expert(x).
/// gate_up [E, H, 2I] and down [E, I, H] in the x @ W layout; the shared expert has width I.
inline Reference llama4_forward(HfMoeConfig const& c, Checkpoint const& ck, std::string const& p,
                                std::vector<float> const& x) {
  Index const H = c.hidden_size, E = c.num_experts, I = c.expert_intermediate_size,
              k = c.num_experts_per_tok, T = static_cast<Index>(x.size()) / H;
  std::vector<double> const wr = ck.get(p + "router.weight", {E, H});
  std::vector<double> const gu = ck.get(p + "experts.gate_up_proj", {E, H, 2 * I});
  std::vector<double> const dn = ck.get(p + "experts.down_proj", {E, I, H});
  std::string const s = p + "shared_expert.";
  std::vector<double> const sg = ck.get(s + "gate_proj.weight", {I, H}),
                            su = ck.get(s + "up_proj.weight", {I, H}),
                            sd = ck.get(s + "down_proj.weight", {H, I});
  Reference out;
  out.y.assign(static_cast<std::size_t>(T * H), 0.0);
  for (Index t = 0; t < T; ++t) {
    std::vector<double> z(static_cast<std::size_t>(E));
    for (Index e = 0; e < E; ++e) {
      z[e] = 0.0;
      for (Index h = 0; h < H; ++h) z[e] += wr[e * H + h] * x[t * H + h];
    }
    std::vector<int> const idx = topk(z, k);
    out.chosen.push_back(idx);
    double* y = &out.y[static_cast<std::size_t>(t * H)];
    for (int e : idx) {
      double const score = sigmoid(z[e]);
      std::vector<double> m(static_cast<std::size_t>(I));
      for (Index i = 0; i < I; ++i) {
        double g = 0.0, u = 0.0;
        for (Index h = 0; h < H; ++h) {
          double const xin = x[t * H + h] * score;
          g += xin * gu[(e * H + h) * 2 * I + i];
          u += xin * gu[(e * H + h) * 2 * I + I + i];
        }
        m[i] = u * silu(g);
      }
      for (Index h = 0; h < H; ++h) {
        for (Index i = 0; i < I; ++i) y[h] += m[i] * dn[(e * I + i) * H + h];
      }
    }
    std::vector<double> const xt(x.begin() + t * H, x.begin() + (t + 1) * H);
    std::vector<double> const ys = mlp(sg, su, sd, xt.data(), H, I);
    for (Index h = 0; h < H; ++h) y[h] += ys[h];
  }
  return out;
}

/// The transformers forward of one MoE block of `c` on x [T, H], from the checkpoint's tensors
/// under `prefix` (per-expert layout; gpt-oss's and Llama 4's fused ones).
inline Reference hf_forward(HfMoeConfig const& c, Checkpoint const& ck, std::string const& p,
                            std::vector<float> const& xf) {
  Index const H = c.hidden_size, E = c.num_experts, I = c.expert_intermediate_size,
              k = c.num_experts_per_tok;
  Index const T = static_cast<Index>(xf.size()) / H;
  if (c.family == HfFamily::kGptOss) {  // fused, biased, interleaved gate_up (x @ W layout)
    return gpt_oss_forward(c, ck.get(p + "router.weight", {E, H}), ck.get(p + "router.bias", {E}),
                           ck.get(p + "experts.gate_up_proj", {E, H, 2 * I}),
                           ck.get(p + "experts.gate_up_proj_bias", {E, 2 * I}),
                           ck.get(p + "experts.down_proj", {E, I, H}),
                           ck.get(p + "experts.down_proj_bias", {E, H}), xf);
  }
  if (c.family == HfFamily::kLlama4) return llama4_forward(c, ck, p, xf);
  bool const mixtral_names = c.family == HfFamily::kMinimaxM2 || c.family == HfFamily::kMixtral;
  bool const qwen2_shared = c.family == HfFamily::kQwen3Next || c.family == HfFamily::kQwen2Moe ||
                            c.family == HfFamily::kQwen35Moe;
  std::vector<double> const wr = ck.get(p + "gate.weight", {E, H});
  std::vector<double> bias;
  if (c.family == HfFamily::kGlm4Moe || c.family == HfFamily::kDeepseekV3) {
    bias = ck.get(p + "gate.e_score_correction_bias", {E});
  }
  if (c.family == HfFamily::kMinimaxM2) bias = ck.get(p + "e_score_correction_bias", {E});
  if (c.family == HfFamily::kErnie45Moe) {
    bias = ck.get(p + "moe_statics.e_score_correction_bias", {1, E});
  }
  std::vector<std::vector<double>> gate(E), up(E), down(E);
  std::vector<std::array<std::vector<double>, 3>> biases(static_cast<std::size_t>(E));
  for (Index e = 0; e < E; ++e) {
    std::string const b = moe::io::detail::concat(p, "experts.", e, ".");
    gate[e] = ck.get(b + (mixtral_names ? "w1.weight" : "gate_proj.weight"), {I, H});
    up[e] = ck.get(b + (mixtral_names ? "w3.weight" : "up_proj.weight"), {I, H});
    down[e] = ck.get(b + (mixtral_names ? "w2.weight" : "down_proj.weight"), {H, I});
    if (c.use_bias) {  // ERNIE 4.5: nn.Linear(..., bias=config.use_bias)
      biases[e] = {ck.get(b + "gate_proj.bias", {I}), ck.get(b + "up_proj.bias", {I}),
                   ck.get(b + "down_proj.bias", {H})};
    } else {
      REQUIRE_FALSE(ck.has(b + "gate_proj.bias"));
    }
  }
  Reference out;
  out.y.assign(static_cast<std::size_t>(T * H), 0.0);
  for (Index t = 0; t < T; ++t) {
    std::vector<double> const x(xf.begin() + t * H, xf.begin() + (t + 1) * H);
    std::vector<double> logits(static_cast<std::size_t>(E));
    for (Index e = 0; e < E; ++e) logits[e] = dot(&wr[e * H], x.data(), H);
    std::vector<int> idx;
    std::vector<double> w;
    switch (c.family) {
      case HfFamily::kMixtral:      // MixtralSparseMoeBlock: top-k logits, softmax over them
      case HfFamily::kQwen3Moe:     // Qwen3MoeSparseMoeBlock: softmax, top-k, norm_topk_prob
      case HfFamily::kOlmoe:        // OlmoeSparseMoeBlock: the same
      case HfFamily::kQwen2Moe:     // Qwen2MoeSparseMoeBlock: the same, plus the shared expert
      case HfFamily::kQwen3Next:    // Qwen3NextTopKRouter
      case HfFamily::kQwen35Moe: {  // Qwen3VLMoeTextTopKRouter: always renormalised
        std::vector<double> const prob = softmax(logits);
        idx = topk(prob, k);
        for (int e : idx) w.push_back(prob[e]);
        double const sum = std::accumulate(w.begin(), w.end(), 0.0);
        if (c.norm_topk_prob || c.family == HfFamily::kMixtral ||
            c.family == HfFamily::kQwen35Moe) {
          for (double& v : w) v /= sum;
        }
        break;
      }
      case HfFamily::kDeepseekV3:  // DeepseekV3TopkRouter: the same as GLM-4.5's
      case HfFamily::kGlm4Moe: {   // Glm4MoeTopkRouter (newest: -inf fill)
        std::vector<double> s(logits.size()), key(logits.size());
        for (Index e = 0; e < E; ++e) key[e] = (s[e] = sigmoid(logits[e])) + bias[e];
        mask_groups(key, c.n_group, c.topk_group, -INFINITY, top_two_sum);
        idx = topk(key, k);
        for (int e : idx) w.push_back(s[e]);
        double const sum = std::accumulate(w.begin(), w.end(), 0.0) + 1e-20;
        for (double& v : w) v = (c.norm_topk_prob ? v / sum : v) * c.routed_scaling_factor;
        break;
      }
      case HfFamily::kDeepseekV2: {  // DeepseekV2Moe.route_tokens_to_experts
        std::vector<double> const prob = softmax(logits);
        std::vector<double> key = prob;
        if (c.topk_method == "group_limited_greedy") {
          mask_groups(key, c.n_group, c.topk_group, 0.0, group_max);
        }
        idx = topk(key, k);
        for (int e : idx) w.push_back(key[e] * c.routed_scaling_factor);
        break;
      }
      case HfFamily::kMinimaxM2: {  // MiniMaxM2TopKRouter
        std::vector<double> s(logits.size()), key(logits.size());
        for (Index e = 0; e < E; ++e) key[e] = (s[e] = sigmoid(logits[e])) + bias[e];
        idx = topk(key, k);
        for (int e : idx) w.push_back(s[e]);
        double const sum = std::accumulate(w.begin(), w.end(), 0.0);
        for (double& v : w) v /= sum;
        break;
      }
      case HfFamily::kErnie45Moe: {  // Ernie4_5_MoeTopKRouter + Ernie4_5_MoeStatics
        std::vector<double> const prob = softmax(logits);
        std::vector<double> key(prob.size());
        for (Index e = 0; e < E; ++e) key[e] = prob[e] + bias[e];
        idx = topk(key, k);
        for (int e : idx) w.push_back(prob[e]);
        double const sum = std::accumulate(w.begin(), w.end(), 0.0);
        for (double& v : w) v /= std::max(sum, static_cast<double>(c.moe_norm_min));
        break;
      }
      default:
        FAIL("not a family of this test");
    }
    out.chosen.push_back(idx);
    double* y = &out.y[static_cast<std::size_t>(t * H)];
    for (std::size_t j = 0; j < idx.size(); ++j) {
      std::vector<double> const ye = mlp(gate[idx[j]], up[idx[j]], down[idx[j]], x.data(), H, I,
                                         c.use_bias ? biases[idx[j]].data() : nullptr);
      for (Index h = 0; h < H; ++h) y[h] += w[j] * ye[h];
    }
    Index const Is = c.shared_intermediate_size();
    if (Is > 0) {
      std::string const s = p + (qwen2_shared ? "shared_expert." : "shared_experts.");
      std::vector<double> sb[3];
      if (c.use_bias) {
        sb[0] = ck.get(s + "gate_proj.bias", {Is});
        sb[1] = ck.get(s + "up_proj.bias", {Is});
        sb[2] = ck.get(s + "down_proj.bias", {H});
      }
      std::vector<double> const ys =
          mlp(ck.get(s + "gate_proj.weight", {Is, H}), ck.get(s + "up_proj.weight", {Is, H}),
              ck.get(s + "down_proj.weight", {H, Is}), x.data(), H, Is, c.use_bias ? sb : nullptr);
      double g = 1.0;
      if (qwen2_shared) {
        g = sigmoid(dot(ck.get(p + "shared_expert_gate.weight", {1, H}).data(), x.data(), H));
      }
      for (Index h = 0; h < H; ++h) y[h] += g * ys[h];
    }
  }
  return out;
}

}  // namespace hfref
