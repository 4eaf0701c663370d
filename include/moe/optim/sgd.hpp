// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// moe::optim::Sgd: stochastic gradient descent with momentum, Nesterov and weight decay.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/optim/detail/check_lists.hpp"

namespace moe::optim {

/// Stochastic gradient descent with the update of PyTorch's torch.optim.SGD (dampening 0,
/// maximize off). For every element p of every parameter, with g its gradient:
///
///   g <- g + weight_decay * p                              (L2 weight decay, coupled)
///   if momentum != 0:
///     b <- g                   on the first step           (momentum buffer, one per element)
///     b <- momentum * b + g    on later steps
///     g <- g + momentum * b    if nesterov, else  g <- b
///   p <- p - lr * g
///
/// | argument        | shape                                                                  |
/// |-----------------|------------------------------------------------------------------------|
/// | params          | N named flat buffers, e.g. MoeFfn::parameters()                        |
/// | grads           | N buffers with the same names and sizes, e.g. Gradients::groups()      |
/// | pool            | optional moe::ThreadPool; null: the calling thread                     |
///
/// State: with momentum != 0, one buffer per parameter, allocated on the first step and bound to
/// that parameter list (later steps must pass lists of the same names and sizes). `steps()`
/// counts the calls to step(). The hyper-parameters are public and may change between steps
/// (learning-rate schedules); they are doubles, like the Python floats of PyTorch, and every
/// element update is computed in float as PyTorch does for float32 tensors.
/// Preconditions (checked by step(), moe::Error otherwise): lr, momentum and weight_decay finite
/// and >= 0; nesterov needs momentum > 0; params and grads list the same names with the same sizes,
/// in the same order. Gradients are read only (zero them yourself, e.g. Gradients::zero()).
/// Cost: O(number of parameters) per step, on the calling thread or spread over a ThreadPool in
/// blocks of 32K elements. Not thread-safe: one optimizer per parameter list, stepped from one
/// thread at a time.
class Sgd {
 public:
  double lr = 1e-3;           ///< learning rate
  double momentum = 0.0;      ///< momentum factor (0: plain SGD)
  double weight_decay = 0.0;  ///< L2 penalty, added to the gradient
  bool nesterov = false;      ///< Nesterov momentum (Sutskever et al., 2013, as in PyTorch)

  Sgd() = default;
  /// Checks the hyper-parameters (moe::Error if one is invalid).
  explicit Sgd(double lr_, double momentum_ = 0.0, double weight_decay_ = 0.0,
               bool nesterov_ = false)
      : lr(lr_), momentum(momentum_), weight_decay(weight_decay_), nesterov(nesterov_) {
    validate();
  }

  /// Throws moe::Error if a hyper-parameter is invalid (step() calls it too).
  void validate() const {
    detail::check(std::isfinite(lr) && lr >= 0.0, "optim::Sgd: lr = ", lr,
                  "; the learning rate must be finite and >= 0");
    detail::check(std::isfinite(momentum) && momentum >= 0.0, "optim::Sgd: momentum = ", momentum,
                  "; momentum must be finite and >= 0");
    detail::check(std::isfinite(weight_decay) && weight_decay >= 0.0,
                  "optim::Sgd: weight_decay = ", weight_decay,
                  "; weight decay must be finite and >= 0");
    detail::check(!nesterov || momentum > 0.0,
                  "optim::Sgd: nesterov = true with momentum = 0; Nesterov momentum needs "
                  "momentum > 0");
  }

  /// The same with a list handed over (`opt.step(layer.parameters(), grads.groups(), &pool)`):
  /// nothing can write through it afterwards, so its edit scopes end here and the weights' packed
  /// copies and bf16 train panels are rebuilt on `pool` (ParameterList::close), not on the
  /// thread that would drop the temporary.
  void step(ParameterList&& params, ParameterList const& grads, ThreadPool* pool = nullptr) {
    step(static_cast<ParameterList const&>(params), grads, pool);
    params.close(pool);
  }

  /// One update of every parameter from its gradient (see the class comment), on `pool` if given
  /// (the result is bitwise the same for any pool: the update is elementwise).
  void step(ParameterList const& params, ParameterList const& grads, ThreadPool* pool = nullptr) {
    validate();
    detail::check_lists("optim::Sgd", params, grads, names_, sizes_);
    bool const use_momentum = momentum != 0.0;
    if (use_momentum && buffers_.empty()) {
      buffers_.resize(params.size());
      for (std::size_t i = 0; i < params.size(); ++i) buffers_[i].resize(params[i].values.size());
    }
    // A momentum switched on after the first step starts its buffer then, as PyTorch does for a
    // parameter without a "momentum_buffer" state.
    bool const first = use_momentum && !buffer_started_;
    float const lr_f = static_cast<float>(lr), mu = static_cast<float>(momentum);
    float const wd = static_cast<float>(weight_decay);
    bool const nest = nesterov;
    detail::for_each_block(params, pool, [&](std::size_t i, std::size_t j0, std::size_t j1) {
      float* p = params[i].values.data();
      float const* g = grads[i].values.data();
      float* b = use_momentum ? buffers_[i].data() : nullptr;
      for (std::size_t j = j0; j < j1; ++j) {
        float d = g[j];
        if (wd != 0.0f) d += wd * p[j];
        if (use_momentum) {
          b[j] = first ? d : mu * b[j] + d;
          d = nest ? d + mu * b[j] : b[j];
        }
        p[j] -= lr_f * d;
      }
    });
    if (use_momentum) buffer_started_ = true;
    ++steps_;
  }

  /// Number of completed step() calls.
  std::int64_t steps() const { return steps_; }
  /// The momentum buffer of parameter i (empty before the first step with momentum).
  std::vector<float> const& momentum_buffer(std::size_t i) const {
    detail::check(i < buffers_.size(), "optim::Sgd: no momentum buffer ", i, " (", buffers_.size(),
                  " allocated); buffers exist after the first step with momentum != 0");
    return buffers_[i];
  }
  /// Forgets the state (momentum buffers, step count, bound parameter list).
  void reset() {
    buffers_.clear();
    names_.clear();
    sizes_.clear();
    buffer_started_ = false;
    steps_ = 0;
  }

 private:
  std::vector<std::vector<float>> buffers_;  ///< [N] momentum buffers, sized like the parameters
  std::vector<std::string> names_;           ///< names of the bound parameter list
  std::vector<std::size_t> sizes_;           ///< sizes of the bound parameter list
  bool buffer_started_ = false;
  std::int64_t steps_ = 0;
};

}  // namespace moe::optim
