// SPDX-License-Identifier: Apache-2.0
// ODR test, first TU: uses the same inline functions and templates as b.cpp.
#include <moe/moe.hpp>

float run_b();

float run_a() {
  auto layer = moe::presets::make_olmoe({16, 8, 4, 2, false});
  moe::fill_uniform(layer.experts().edit().parameters(), -0.5f, 0.5f, 1);
  float x[32];
  float y[32];
  moe::fill_uniform(x, -1.0f, 1.0f, 2);
  moe::MoeFfnWorkspace ws;
  layer.forward(moe::ConstMatrixView<float>(x, 2, 16), moe::MatrixView<float>(y, 2, 16), ws);
  return y[0];
}

int main() { return run_a() == run_b() ? 0 : 1; }
