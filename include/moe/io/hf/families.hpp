// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The registry of model families: one description a family (moe/io/hf/families/), in
/// HfFamily order. hf_family() is how every other part of moe learns a family's facts.
#pragma once

#include <cstddef>

#include "moe/io/hf/families/deepseek_v2.hpp"
#include "moe/io/hf/families/deepseek_v3.hpp"
#include "moe/io/hf/families/ernie4_5_moe.hpp"
#include "moe/io/hf/families/glm4_moe.hpp"
#include "moe/io/hf/families/gpt_oss.hpp"
#include "moe/io/hf/families/llama4.hpp"
#include "moe/io/hf/families/minimax_m2.hpp"
#include "moe/io/hf/families/mixtral.hpp"
#include "moe/io/hf/families/olmoe.hpp"
#include "moe/io/hf/families/qwen2_moe.hpp"
#include "moe/io/hf/families/qwen3_5_moe.hpp"
#include "moe/io/hf/families/qwen3_moe.hpp"
#include "moe/io/hf/families/qwen3_next.hpp"
#include "moe/io/hf/family.hpp"

namespace moe::io {

/// Every family's description, indexed by HfFamily.
inline constexpr HfFamilySpec const* kHfFamilySpecs[] = {
    &families::kMixtral,   &families::kQwen2Moe,   &families::kQwen3Moe, &families::kDeepseekV3,
    &families::kOlmoe,     &families::kQwen3Next,  &families::kGlm4Moe,  &families::kDeepseekV2,
    &families::kMinimaxM2, &families::kErnie45Moe, &families::kLlama4,   &families::kGptOss,
    &families::kQwen35Moe};

static_assert(std::size(kHfFamilySpecs) == std::size(kHfFamilies),
              "every HfFamily needs its description in kHfFamilySpecs");

/// The description of `family`.
constexpr HfFamilySpec const& hf_family(HfFamily family) noexcept {
  return *kHfFamilySpecs[static_cast<std::size_t>(family)];
}

namespace detail {
/// kHfFamilySpecs[i] describes family i.
constexpr bool hf_registry_in_order() {
  for (std::size_t i = 0; i < std::size(kHfFamilySpecs); ++i) {
    if (kHfFamilySpecs[i]->family != kHfFamilies[i]) return false;
  }
  return true;
}
static_assert(hf_registry_in_order(), "kHfFamilySpecs must list the families in HfFamily order");
}  // namespace detail

}  // namespace moe::io
