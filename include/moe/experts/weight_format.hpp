// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// WeightFormat: how a layer's packed weights are stored (the enum alone; its names, parsing and
/// block formats are in moe/experts/expert_bank.hpp).
#pragma once

namespace moe::experts {

/// Storage of packed weights (ExpertBank::pack per projection of each expert;
/// GatedAttention::pack_weights for the attention projections, kF32 and kBf16 only).
enum class WeightFormat {
  kF32,   ///< fp32 panels: exact
  kBf16,  ///< bf16 panels: half the bytes; inference only (forward_train uses fp32)
  kQ8_0,  ///< GGUF Q8_0 blocks (8.5 bits a weight); inference only, like every quantized format
  kQ6_K,  ///< GGUF Q6_K (6.5625 bits, in bit planes in the kernel layout: kernels/quant_gemm.hpp)
  kQ4_K,  ///< GGUF Q4_K (4.5 bits)
  kQ4_0,  ///< GGUF Q4_0 (4.5 bits)
  kQ3_K,  ///< GGUF Q3_K (3.4375 bits; the kernel layout's int8 sub-block scales make it 3.5625)
  kQ2_K,  ///< GGUF Q2_K (2.625 bits, in the kernel layout too)
};

/// The arithmetic of training forwards and backwards over an expert bank
/// (ExpertBank::set_train_compute, FfnLayerBase::set_train_compute).
enum class TrainCompute {
  kF32,   ///< fp32 operands and accumulation (the default): exact
  kBf16,  ///< bf16 operands, fp32 accumulation, fp32 master weights and gradients (opt-in)
};

}  // namespace moe::experts
