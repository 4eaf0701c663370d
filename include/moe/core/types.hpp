// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Index type and the dimension glossary used in shape comments throughout moe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe {

/// Signed index for sizes and offsets (the same type as Eigen's default index).
///
/// Dimension glossary used in shape comments: T tokens, D model width (d_model), F expert hidden
/// width (d_ffn), E routed experts, K experts per token (top_k), S slots per token in a Selection
/// (K for token choice, E for expert choice and top-p), R routed rows (sum of per-expert counts),
/// C capacity per expert, G expert groups.
using Index = std::ptrdiff_t;

/// Expert id in a Selection; -1 marks an empty or dropped slot.
using ExpertId = std::int32_t;

}  // namespace moe
