// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// InUse: a workspace's guard against two overlapping calls (a layer is const and may serve
/// several threads; a workspace may not).
#pragma once

#include <atomic>
#include <utility>

#include "moe/core/error.hpp"

namespace moe {

/// Marks a workspace (or a decoder's state) busy for the duration of one call: a second call on
/// it while the first runs throws moe::Error naming the caller, instead of both writing the same
/// buffers (a heap-use-after-free when one grows them). One atomic exchange a call. Copying or
/// assigning a workspace copies no busy mark.
class InUse {
 public:
  InUse() = default;
  InUse(InUse const&) noexcept {}
  InUse& operator=(InUse const&) noexcept { return *this; }

  /// Held by a call; clears the mark when it ends (also by an exception).
  class Scope {
   public:
    explicit Scope(std::atomic<bool>* flag) noexcept : flag_(flag) {}
    Scope(Scope&& other) noexcept : flag_(std::exchange(other.flag_, nullptr)) {}
    Scope(Scope const&) = delete;
    Scope& operator=(Scope const&) = delete;
    Scope& operator=(Scope&&) = delete;
    ~Scope() {
      if (flag_) flag_->store(false, std::memory_order_release);
    }

   private:
    std::atomic<bool>* flag_;
  };

  /// Marks the workspace busy; throws moe::Error if another call holds it.
  [[nodiscard]] Scope enter(char const* who) {
    detail::check(!busy_.exchange(true, std::memory_order_acquire), who,
                  ": the workspace is in use by another call right now; give every concurrent "
                  "caller its own workspace (a layer is const and can be shared, a workspace "
                  "cannot)");
    return Scope(&busy_);
  }

 private:
  std::atomic<bool> busy_{false};
};

}  // namespace moe
