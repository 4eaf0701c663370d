// SPDX-License-Identifier: Apache-2.0
// ODR test, second TU: the same computation as a.cpp; both must link and agree.
#include <moe/moe.hpp>

float run_b() {
  auto layer = moe::presets::make_olmoe({16, 8, 4, 2, false});
  moe::fill_uniform(layer.experts().edit().parameters(), -0.5f, 0.5f, 1);
  float x[32];
  float y[32];
  moe::fill_uniform(x, -1.0f, 1.0f, 2);
  moe::MoeFfnWorkspace ws;
  layer.forward(moe::ConstMatrixView<float>(x, 2, 16), moe::MatrixView<float>(y, 2, 16), ws);
  return y[0];
}
