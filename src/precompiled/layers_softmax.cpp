// SPDX-License-Identifier: Apache-2.0
// The preset MoE layers with a softmax router (Qwen3-MoE / OLMoE, Qwen2-MoE / Qwen3-Next,
// Mixtral, gpt-oss) and the presets' two expert banks (experts/expert_bank.hpp) compiled once for
// moe::precompiled and our own binaries (MOE_EXTERN_EXPERT_KERNELS, layers/presets.hpp).
#include "moe/layers/presets.hpp"

#define MOE_EXPERT_BANK_DEFINITION(E) MOE_EXPERT_BANK_INSTANTIATION(, E)
MOE_PRESET_EXPERT_BANKS(MOE_EXPERT_BANK_DEFINITION)

MOE_FFN_INSTANTIATION(, ::moe::presets::Qwen3Moe)
MOE_FFN_INSTANTIATION(, ::moe::presets::Qwen2Moe)
MOE_FFN_INSTANTIATION(, ::moe::presets::MixtralMoe)
MOE_FFN_INSTANTIATION(, ::moe::presets::GptOssMoe)
