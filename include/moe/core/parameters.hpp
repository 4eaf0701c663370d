// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ParameterRef: a named flat view of one parameter (or gradient) buffer; ParameterList: a list
/// of them that keeps the storage's edit scopes open while it lives.
#pragma once

#include <algorithm>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace moe {

class ThreadPool;

/// An edit scope a ParameterList keeps alive (ExpertBank::Edit through the layers'
/// parameters()): it ends when the last copy of the list goes, or earlier by close().
class EditScope {
 public:
  virtual ~EditScope() = default;
  /// Ends the scope now, its rebuilds (packed weights, bf16 train panels) on `pool` (null: the
  /// calling thread). Later calls, and the destructor after it, do nothing.
  virtual void close(ThreadPool* pool) = 0;
};

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
/// ExpertBank::pack refuses to run); when the last copy goes, the pack is rebuilt on the thread
/// that drops it. Hold it only as long as you write through it (an optimizer step, a load), then
/// drop it, or close(pool) it to rebuild on a pool:
///
///   auto params = layer.parameters();
///   opt.step(params, grads.groups(), &pool);
///   params.close(&pool);  // repack / bf16 train panels on the pool, not on one thread
class ParameterList : public std::vector<ParameterRef> {
 public:
  using std::vector<ParameterRef>::vector;
  /// Appends {name, v} unless v is empty: a layer's optional buffers (biases, norms) in its
  /// Parameters::groups().
  template <class Buffer>
  void add_if_present(char const* name, Buffer& v) {
    if (!v.empty()) push_back({name, std::span<float>(v)});
  }
  /// Sets every listed buffer to 0 (a gradient's reset).
  void zero() {
    for (auto& p : *this) std::fill(p.values.begin(), p.values.end(), 0.0f);
  }
  /// Keeps `scope` alive as long as this list or a copy of it (or until close()).
  void keep(std::shared_ptr<EditScope> scope) { scopes_.push_back(std::move(scope)); }
  /// Ends the edit scopes this list keeps now, for it and every copy, running their rebuilds on
  /// `pool`. Call it when the writes are done: the views stay readable, but a write through the
  /// list (or a copy) after close() is not seen by the rebuilt copies, as a write after the
  /// list's end would not be. Idempotent; a list without edit scopes ignores it.
  void close(ThreadPool* pool = nullptr) {
    for (auto& s : scopes_) s->close(pool);
    scopes_.clear();
  }

 private:
  std::vector<std::shared_ptr<EditScope>> scopes_;
};

}  // namespace moe
