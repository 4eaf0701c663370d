// SPDX-License-Identifier: Apache-2.0
// Must not compile: a plain MLP expert has no gate projection.
#include <moe/experts/expert_bank.hpp>
#include <moe/experts/expert_types.hpp>

moe::MatrixView<float> gate(moe::experts::ExpertBank<moe::experts::ReluMlp>& bank) {
  return bank.edit().gate_proj(0);
}
