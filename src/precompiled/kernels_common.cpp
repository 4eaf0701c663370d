// SPDX-License-Identifier: Apache-2.0
// The attention, strided-GEMM and bf16-packing kernels of this build's instruction set and every
// quantized format's block codec, compiled once for moe::precompiled and our test, bench and
// example binaries (MOE_EXTERN_EXPERT_KERNELS declares them extern in the headers).
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/sdpa.hpp"
#include "moe/quant/blocks.hpp"

MOE_SDPA_INSTANTIATION(, moe::kernels::simd::DefaultArch);
MOE_GEMM_STRIDED_INSTANTIATION(, moe::kernels::simd::DefaultArch);
MOE_GEMM_BF16_INSTANTIATION(, moe::kernels::simd::DefaultArch);
MOE_QUANT_CODECS_INSTANTIATION();
