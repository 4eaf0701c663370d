// SPDX-License-Identifier: Apache-2.0
// The preset MoE layers with a sigmoid router (DeepSeek-V3 and the families that share its
// layer, Llama 4) compiled once for moe::precompiled and our own binaries
// (MOE_EXTERN_EXPERT_KERNELS, layers/presets.hpp).
#include "moe/layers/presets.hpp"

MOE_FFN_INSTANTIATION(, ::moe::presets::DeepseekV3Moe)
MOE_FFN_INSTANTIATION(, ::moe::presets::Llama4Moe)
