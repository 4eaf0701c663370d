// SPDX-License-Identifier: Apache-2.0
// One preset MoeFfn forward through moe::precompiled's kernels, against a naive loop over the
// same weights (softmax over the experts, top-k, renormalised, SwiGLU experts).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <moe/moe.hpp>
#include <numeric>
#include <vector>

int main() {
  constexpr moe::Index D = 64, F = 32, E = 8, K = 2, T = 5;
  auto layer = moe::presets::make_qwen3_moe(
      {.hidden_size = D, .moe_intermediate_size = F, .num_experts = E, .num_experts_per_tok = K});
  std::uint64_t seed = 1;
  for (moe::ParameterRef p : layer.parameters()) moe::fill_uniform(p.values, -0.2f, 0.2f, seed++);
  moe::RowMatrixX<float> x = moe::RowMatrixX<float>::Random(T, D), y(T, D);
  moe::ThreadPool pool(2);
  moe::MoeFfnWorkspace ws;
  layer.forward(moe::view(x), moe::view(y), ws, {.pool = &pool});
  auto const r = layer.router_weight();
  double worst = 0.0;
  for (moe::Index t = 0; t < T; ++t) {
    std::vector<double> logit(E);
    for (moe::Index e = 0; e < E; ++e) {
      for (moe::Index d = 0; d < D; ++d) logit[e] += double(r.data[e * D + d]) * x(t, d);
    }
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logit[a] > logit[b]; });
    double sum = 0.0;
    for (int j = 0; j < K; ++j) sum += std::exp(logit[order[j]] - logit[order[0]]);
    for (moe::Index d = 0; d < D; ++d) {
      double out = 0.0;
      for (int j = 0; j < K; ++j) {
        auto const in = layer.experts().edit().in_proj(order[j]);  // [2F, D]: gate rows, up rows
        auto const down = layer.experts().edit().down_proj(order[j]);  // [D, F]
        double acc = 0.0;
        for (moe::Index f = 0; f < F; ++f) {
          double g = 0.0, u = 0.0;
          for (moe::Index i = 0; i < D; ++i) {
            g += double(in.row(f)[i]) * x(t, i);
            u += double(in.row(F + f)[i]) * x(t, i);
          }
          acc += double(down.row(d)[f]) * g / (1.0 + std::exp(-g)) * u;
        }
        out += std::exp(logit[order[j]] - logit[order[0]]) / sum * acc;
      }
      worst = std::max(worst, std::abs(out - y(t, d)));
    }
  }
  std::printf("ffn: max |y - naive| = %.3g\n", worst);
  return worst < 1e-4 ? 0 : 1;
}
