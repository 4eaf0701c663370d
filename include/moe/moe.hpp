// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The umbrella header: everything public in moe but I/O: <moe/ffn.hpp> (MoeFfn, its policies,
/// presets, kernels, quantization, optimizers) and the attention layers (GatedAttention with its
/// SDPA output gate, MoeAttention, MLA, Gated DeltaNet). For users; moe's own headers never
/// include it.
#pragma once

#include "moe/ffn.hpp"
#include "moe/gating/sdpa_gate.hpp"
#include "moe/kernels/rms_norm.hpp"
#include "moe/kernels/rope.hpp"
#include "moe/kernels/sdpa.hpp"
#include "moe/layers/attention_options.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/gated_deltanet.hpp"
#include "moe/layers/mla_attention.hpp"
#include "moe/layers/moe_attention.hpp"
