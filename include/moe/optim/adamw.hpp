// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// moe::optim::AdamW: Adam with decoupled weight decay (Loshchilov & Hutter), as in PyTorch.
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

/// Adam with decoupled weight decay ("Decoupled Weight Decay Regularization", Loshchilov &
/// Hutter), with the update of PyTorch's torch.optim.AdamW (amsgrad and maximize off). On step t
/// (t = 1, 2, ...), for every element p of every parameter, with g its gradient:
///
///   p <- p * (1 - lr * weight_decay)                      (decoupled: not added to g)
///   m <- beta1 * m + (1 - beta1) * g                      (first moment, zero before step 1)
///   v <- beta2 * v + (1 - beta2) * g^2                    (second moment, zero before step 1)
///   p <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
///
/// The bias corrections 1 - beta^t, the step size and the decay factor are computed in double (as
/// PyTorch does with Python floats), the element updates in float (PyTorch's float32 kernels; the
/// first moment as m + (1 - beta1) (g - m), PyTorch's lerp). Results agree with PyTorch up to
/// float rounding.
///
/// | argument        | shape                                                                  |
/// |-----------------|------------------------------------------------------------------------|
/// | params          | N named flat buffers, e.g. MoeFfn::parameters()                        |
/// | grads           | N buffers with the same names and sizes, e.g. Gradients::groups()      |
/// | pool            | optional moe::ThreadPool; null: the calling thread                     |
///
/// State: m and v, one pair of buffers per parameter, allocated (zero) on the first step and bound
/// to that parameter list (later steps must pass lists of the same names and sizes); `steps()` is
/// t, the number of completed steps. The hyper-parameters are public and may change between steps
/// (learning-rate schedules).
/// Preconditions (checked by step(), moe::Error otherwise): lr, eps, weight_decay finite and
/// >= 0; beta1, beta2 in [0, 1); params and grads list the same names with the same sizes, in the
/// same order. Gradients are read only (zero them yourself, e.g. Gradients::zero()).
/// Cost: O(number of parameters) per step, on the calling thread or spread over a ThreadPool in
/// blocks of 32K elements; state = 2 floats per parameter. Not thread-safe: one optimizer per
/// parameter list, stepped from one thread at a time.
class AdamW {
 public:
  double lr = 1e-3;            ///< learning rate
  double beta1 = 0.9;          ///< decay of the first-moment average
  double beta2 = 0.999;        ///< decay of the second-moment average
  double eps = 1e-8;           ///< added to the bias-corrected sqrt(v)
  double weight_decay = 0.01;  ///< decoupled weight decay (multiplies p by 1 - lr * weight_decay)

  AdamW() = default;
  /// Checks the hyper-parameters (moe::Error if one is invalid).
  explicit AdamW(double lr_, double beta1_ = 0.9, double beta2_ = 0.999, double eps_ = 1e-8,
                 double weight_decay_ = 0.01)
      : lr(lr_), beta1(beta1_), beta2(beta2_), eps(eps_), weight_decay(weight_decay_) {
    validate();
  }

  /// Throws moe::Error if a hyper-parameter is invalid (step() calls it too).
  void validate() const {
    detail::check(std::isfinite(lr) && lr >= 0.0, "optim::AdamW: lr = ", lr,
                  "; the learning rate must be finite and >= 0");
    detail::check(beta1 >= 0.0 && beta1 < 1.0, "optim::AdamW: beta1 = ", beta1,
                  "; betas must be in [0, 1)");
    detail::check(beta2 >= 0.0 && beta2 < 1.0, "optim::AdamW: beta2 = ", beta2,
                  "; betas must be in [0, 1)");
    detail::check(std::isfinite(eps) && eps > 0.0, "optim::AdamW: eps = ", eps,
                  "; eps must be finite and > 0 (1e-8 is the usual value; 0 divides 0 by 0 where a "
                  "gradient is 0)");
    detail::check(std::isfinite(weight_decay) && weight_decay >= 0.0,
                  "optim::AdamW: weight_decay = ", weight_decay,
                  "; weight decay must be finite and >= 0");
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
    detail::check_lists("optim::AdamW", params, grads, names_, sizes_);
    if (m_.empty()) {
      m_.resize(params.size());
      v_.resize(params.size());
      for (std::size_t i = 0; i < params.size(); ++i) {
        m_[i].assign(params[i].values.size(), 0.0f);
        v_[i].assign(params[i].values.size(), 0.0f);
      }
    }
    double const t = static_cast<double>(steps_ + 1);
    double const bias_correction1 = 1.0 - std::pow(beta1, t);
    float const bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
    float const decay = static_cast<float>(1.0 - lr * weight_decay);
    float const step_size = static_cast<float>(lr / bias_correction1);
    float const one_minus_beta1 = static_cast<float>(1.0 - beta1);
    float const b2 = static_cast<float>(beta2), one_minus_beta2 = static_cast<float>(1.0 - beta2);
    float const eps_f = static_cast<float>(eps);
    detail::for_each_block(params, pool, [&](std::size_t i, std::size_t j0, std::size_t j1) {
      float* p = params[i].values.data();
      float const* g = grads[i].values.data();
      float* m = m_[i].data();
      float* v = v_[i].data();
      for (std::size_t j = j0; j < j1; ++j) {
        p[j] *= decay;
        m[j] += one_minus_beta1 * (g[j] - m[j]);
        v[j] = b2 * v[j] + one_minus_beta2 * g[j] * g[j];
        float const denom = std::sqrt(v[j]) / bc2_sqrt + eps_f;
        p[j] -= step_size * m[j] / denom;
      }
    });
    ++steps_;
  }

  /// t: the number of completed step() calls (the exponent of the bias corrections).
  std::int64_t steps() const { return steps_; }
  /// First-moment buffer m of parameter i (empty before the first step).
  std::vector<float> const& first_moment(std::size_t i) const { return state(m_, i); }
  /// Second-moment buffer v of parameter i (empty before the first step).
  std::vector<float> const& second_moment(std::size_t i) const { return state(v_, i); }
  /// Forgets the state (moments, step count, bound parameter list).
  void reset() {
    m_.clear();
    v_.clear();
    names_.clear();
    sizes_.clear();
    steps_ = 0;
  }

 private:
  static std::vector<float> const& state(std::vector<std::vector<float>> const& s, std::size_t i) {
    detail::check(i < s.size(), "optim::AdamW: no state for parameter ", i, " (", s.size(),
                  " allocated); the state exists after the first step");
    return s[i];
  }

  std::vector<std::vector<float>> m_;  ///< [N] first moments, sized like the parameters
  std::vector<std::vector<float>> v_;  ///< [N] second moments
  std::vector<std::string> names_;     ///< names of the bound parameter list
  std::vector<std::size_t> sizes_;     ///< sizes of the bound parameter list
  std::int64_t steps_ = 0;
};

}  // namespace moe::optim
