// SPDX-License-Identifier: Apache-2.0
// A double-precision twin of an MoeFfn layer's forward, for central finite differences: the
// layer's parameters copied to double (same flat layouts), routed by a reference routing
// function evaluated on double logits.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "moe/experts/expert_types.hpp"
#include "moe/kernels/activations.hpp"
#include "support/finite_difference.hpp"
#include "support/reference.hpp"

namespace ref {

struct DoubleBank {
  // ExpertBank layout: all in_proj [P, D] blocks, then down [D, F], then (biases) all in_bias
  // [P], then all down_bias [D].
  std::vector<double> params;
  Index E = 0, D = 0, F = 0;
  bool gated = true;
  moe::kernels::Activation act = moe::kernels::Activation::kSilu;
  bool biases = false;
  bool clamped = false;  // gpt-oss: min(g, L) sigmoid(alpha min(g, L)) (clamp(u, -L, L) + 1)
  double alpha = 1.702, limit = 7.0;

  Index P() const { return gated ? 2 * F : F; }
  std::vector<double> run(Index e, double const* x) const {
    double const* in = params.data() + e * P() * D;
    double const* down = params.data() + E * P() * D + e * D * F;
    double const* bin = biases ? params.data() + E * (P() + F) * D + e * P() : nullptr;
    double const* bdown = biases ? params.data() + E * (P() + F) * D + E * P() + e * D : nullptr;
    std::vector<double> m(static_cast<std::size_t>(F)), y(static_cast<std::size_t>(D), 0.0);
    for (Index f = 0; f < F; ++f) {
      double g = bin ? bin[f] : 0.0, u = bin && gated ? bin[F + f] : 0.0;
      for (Index d = 0; d < D; ++d) {
        g += in[f * D + d] * x[d];
        if (gated) u += in[(F + f) * D + d] * x[d];
      }
      if (clamped) {
        double const gc = std::min(g, limit), uc = std::clamp(u, -limit, limit);
        m[f] = gc * sigmoid(alpha * gc) * (uc + 1.0);
      } else {
        m[f] = gated ? activate(act, g) * u : activate(act, g);
      }
    }
    for (Index d = 0; d < D; ++d) {
      if (bdown) y[d] = bdown[d];
      for (Index f = 0; f < F; ++f) y[d] += down[d * F + f] * m[f];
    }
    return y;
  }
};

template <class Bank>
DoubleBank to_double(Bank const& bank) {
  DoubleBank b;
  auto p = bank.parameters();
  b.params.assign(p.begin(), p.end());
  b.E = bank.num_experts();
  b.D = bank.d_model();
  b.F = bank.d_ffn();
  b.gated = Bank::Expert::gated;
  b.act = Bank::Expert::activation;
  b.biases = bank.has_biases();
  b.clamped = moe::experts::is_clamped_glu<typename Bank::Expert>;
  b.alpha = bank.glu_clamp().alpha;
  b.limit = bank.glu_clamp().limit;
  return b;
}

/// y = routed experts (+ shared experts, + Default-MoE forward term) in double.
struct DoubleModel {
  Index D = 0, E = 0;
  std::vector<double> router;       // [E, D]
  std::vector<double> router_bias;  // [E] or empty
  DoubleBank experts;
  DoubleBank shared;             // E = number of shared experts (0: none)
  std::vector<double> gate;      // [S, D] (empty: ungated)
  std::vector<double> defaults;  // [E, D] Default-MoE outputs (empty: off)
  bool default_forward = false;
  bool scale_input = false;  ///< y_t = sum E_i(w_i x_t) (Llama 4) instead of sum w_i E_i(x_t)
  /// Routing from double logits [T, E] (row-major) and, for scores, the router's score function.
  std::function<Routing(moe::ConstMatrixView<double>)> route;
  std::function<std::vector<double>(std::vector<double> const&)> scores;  // z_t -> p_t

  /// sum_t <dy_t, y_t> for x [T, D].
  double objective(std::vector<double> const& x, std::vector<double> const& dy, Index T) const {
    std::vector<double> z(static_cast<std::size_t>(T * E), 0.0);
    for (Index t = 0; t < T; ++t) {
      for (Index e = 0; e < E; ++e) {
        for (Index d = 0; d < D; ++d) z[t * E + e] += router[e * D + d] * x[t * D + d];
        if (!router_bias.empty()) z[t * E + e] += router_bias[e];
      }
    }
    Routing r = route(moe::ConstMatrixView<double>(z.data(), T, E));
    double total = 0.0;
    for (Index t = 0; t < T; ++t) {
      std::vector<double> y(static_cast<std::size_t>(D), 0.0);
      std::vector<bool> chosen(static_cast<std::size_t>(E), false);
      for (auto [e, w] : r[t]) {
        chosen[e] = true;
        if (scale_input) {
          std::vector<double> xs(x.begin() + t * D, x.begin() + (t + 1) * D);
          for (double& v : xs) v *= w;
          auto o = experts.run(e, xs.data());
          for (Index d = 0; d < D; ++d) y[d] += o[d];
          continue;
        }
        auto o = experts.run(e, x.data() + t * D);
        for (Index d = 0; d < D; ++d) y[d] += w * o[d];
      }
      for (Index s = 0; s < shared.E; ++s) {
        auto o = shared.run(s, x.data() + t * D);
        double g = 1.0;
        if (!gate.empty()) {
          double a = 0.0;
          for (Index d = 0; d < D; ++d) a += gate[s * D + d] * x[t * D + d];
          g = sigmoid(a);
        }
        for (Index d = 0; d < D; ++d) y[d] += g * o[d];
      }
      if (!defaults.empty()) {
        // kGradOnly has the same gradient as kForward; its value differs by a constant in p only
        // through stop-gradient, so the objective uses the forward form for both and the test
        // compares gradients (and, for kGradOnly, the layer's output against the sparse value).
        auto p = scores(std::vector<double>(z.begin() + t * E, z.begin() + (t + 1) * E));
        for (Index e = 0; e < E; ++e) {
          if (chosen[e]) continue;
          for (Index d = 0; d < D; ++d) y[d] += p[e] * defaults[e * D + d];
        }
      }
      for (Index d = 0; d < D; ++d) total += dy[t * D + d] * y[d];
    }
    return total;
  }
};

}  // namespace ref
