// SPDX-License-Identifier: Apache-2.0
// A downstream program: one Mixtral-style layer with identity-like experts, checked by hand.
#include <cmath>
#include <cstdio>
#include <moe/moe.hpp>

int main() {
  // E = 2 experts, k = 1, D = F = 2, ReLU MLP experts: expert e computes 2^(e+1) * relu(x).
  using Layer = moe::MoeFfn<moe::routing::SoftmaxTopK, moe::experts::ReluMlp>;
  Layer layer(2, 2, moe::routing::SoftmaxTopK{2, 1, true, 1.0f});
  for (moe::Index e = 0; e < 2; ++e) {
    auto up = layer.experts().up_proj(e);
    auto down = layer.experts().down_proj(e);
    for (moe::Index i = 0; i < 2; ++i) {
      up(i, i) = 1.0f;
      down(i, i) = static_cast<float>(2 << e);
    }
  }
  auto wr = layer.router_weight();  // token -> expert 0 when x0 > x1
  wr(0, 0) = 1.0f;
  wr(1, 1) = 1.0f;
  float x[4] = {3.0f, 1.0f, 1.0f, 2.0f};
  float y[4] = {};
  moe::MoeFfnWorkspace ws;
  layer.forward(moe::ConstMatrixView<float>(x, 2, 2), moe::MatrixView<float>(y, 2, 2), ws);
  float const expect[4] = {6.0f, 2.0f, 4.0f, 8.0f};
  for (int i = 0; i < 4; ++i) {
    if (std::fabs(y[i] - expect[i]) > 1e-6f) {
      std::printf("consumer: y[%d] = %g, expected %g\n", i, y[i], expect[i]);
      return 1;
    }
  }
  std::printf("consumer: ok\n");
  return 0;
}
