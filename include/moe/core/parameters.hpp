// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ParameterRef: a named flat view of one parameter (or gradient) buffer.
#pragma once

#include <span>
#include <string_view>
#include <vector>

namespace moe {

/// A named, flat view of one contiguous parameter or gradient buffer. A layer's `parameters()`
/// and its gradients' `groups()` list the same buffers in the same order with the same sizes, so
/// an optimizer can step over (parameter, gradient) pairs without knowing the layer.
struct ParameterRef {
  std::string_view name;
  std::span<float> values;
};

using ParameterList = std::vector<ParameterRef>;

}  // namespace moe
