// SPDX-License-Identifier: Apache-2.0
// A downstream program: one Mixtral-style layer with identity-like experts, checked by hand.
#include <cmath>
#include <cstdio>
#include <moe/moe.hpp>
#include <vector>

int main() {
  // E = 2 experts, k = 1, D = F = 2, ReLU MLP experts: expert e computes 2^(e+1) * relu(x).
  using Layer = moe::MoeFfn<moe::routing::SoftmaxTopK, moe::experts::ReluMlp>;
  Layer layer(2, 2, moe::routing::SoftmaxTopK{2, 1, true, 1.0f});
  for (moe::Index e = 0; e < 2; ++e) {
    auto const edit = layer.experts().edit();
    auto up = edit.up_proj(e);
    auto down = edit.down_proj(e);
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
  // A SwiGLU layer through every kernel family (AVX-512 exp epilogues, bf16 panels, training):
  // built with -Wall -Wextra -Wpedantic -Werror -march=native, its instantiation is the check.
  using Glu = moe::MoeFfn<moe::routing::SoftmaxTopK, moe::experts::SwiGlu>;
  moe::Index const T = 8, D = 64;
  Glu glu(D, 64, moe::routing::SoftmaxTopK{4, 2, true, 1.0f});
  moe::fill_uniform(glu.experts().edit().parameters(), -0.1f, 0.1f, 7);
  std::vector<float> xs(T * D, 0.25f), y32(xs.size()), y16(xs.size()), dx(xs.size());
  moe::ConstMatrixView<float> xv(xs.data(), T, D);
  moe::MoeFfnWorkspace gws;
  glu.forward(xv, moe::MatrixView<float>(y32.data(), T, D), gws);
  glu.pack_weights(moe::experts::WeightFormat::kBf16);
  glu.forward(xv, moe::MatrixView<float>(y16.data(), T, D), gws);
  glu.forward_train(xv, moe::MatrixView<float>(y32.data(), T, D), gws);
  auto grads = glu.make_gradients();
  glu.backward(gws, moe::ConstMatrixView<float>(y32.data(), T, D),
               moe::MatrixView<float>(dx.data(), T, D), grads);
  for (std::size_t i = 0; i < xs.size(); ++i) {
    if (!(std::fabs(y16[i] - y32[i]) <= 1e-2f * (1.0f + std::fabs(y32[i]))) ||
        !std::isfinite(dx[i])) {
      std::printf("consumer: SwiGLU layer: y16 %g, y32 %g, dx %g at %zu\n", y16[i], y32[i], dx[i],
                  i);
      return 1;
    }
  }
  std::printf("consumer: ok\n");
  return 0;
}
