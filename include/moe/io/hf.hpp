// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Hugging Face checkpoints: one MoE layer of a Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3,
/// OLMoE, Qwen3-Next, GLM-4.5, DeepSeek-V2, MiniMax-M2, ERNIE 4.5, Llama 4 or gpt-oss model, loaded
/// into moe's preset layers (and saved back as a tiny checkpoint). Qwen3-Next's attention layers:
/// moe/io/hf/attention.hpp (not included here: it pulls in the attention layer).
///
///   moe::io::HfMoeConfig          config.json: parse_hf_config(), read_hf_config()
///   moe::io::hf_layer_tensors()   the layer's checkpoint tensor names and shapes
///   moe::io::load_hf_layer<L>()   one layer into preset type L; load_hf_moe_layer() picks L
///   moe::io::save_hf_layer()      config.json + model.safetensors (or shards + index)
///   moe::io::add_hf_gradients()   gradients named "grad." + checkpoint name
/// See docs/hf.md.
#pragma once

#include "moe/io/hf/config.hpp"
#include "moe/io/hf/layer.hpp"
#include "moe/io/hf/names.hpp"
