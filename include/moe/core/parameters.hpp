// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ParameterRef: a named flat view of one parameter (or gradient) buffer; ParameterList: a list
/// of them that keeps the storage's edit scopes open while it lives.
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace moe {

/// A named, flat view of one contiguous parameter or gradient buffer. A layer's `parameters()`
/// and its gradients' `groups()` list the same buffers in the same order with the same sizes, so
/// an optimizer can step over (parameter, gradient) pairs without knowing the layer.
struct ParameterRef {
  std::string_view name;
  std::span<float> values;
};

/// A list of named parameter (or gradient) buffers, writable through their spans. It may hold
/// the edit scopes of the storage it points into (ExpertBank::Edit): while the list, or a copy of
/// it, is alive, those weights count as being written, so a packed copy of them is not used (and
/// ExpertBank::pack refuses to run); when the last copy goes, the pack is rebuilt. Hold it only
/// as long as you write through it (an optimizer step, a load), then drop it.
class ParameterList : public std::vector<ParameterRef> {
 public:
  using std::vector<ParameterRef>::vector;
  /// Keeps `guard` (an edit scope) alive as long as this list or a copy of it.
  void keep(std::shared_ptr<void> guard) { guards_.push_back(std::move(guard)); }

 private:
  std::vector<std::shared_ptr<void>> guards_;
};

}  // namespace moe
