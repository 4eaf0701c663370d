// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The engine's job for one dense projection of an attention-like layer (GatedAttention,
/// GatedDeltaNet): its moe::Linear pack at inference, its fp32 parameters in place otherwise.
/// Not public API.
#pragma once

#include "moe/core/memory.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/layers/linear.hpp"
#include "moe/layers/stages/work.hpp"

namespace moe::detail {

/// The job C = A W^T (+ bias; C += with `accumulate`) for one projection: its pack when
/// `inference` and a pack was made, else its fp32 parameters w [rows_w, depth] in place (dot
/// products for fewer than kernels::kPanelMinRows rows, panels packed per call from there on).
inline ExpertJob projection_job(kernels::RowSource a, Index rows, Linear const& pack,
                                HugePageVector<float> const& w, Index rows_w, Index depth, float* c,
                                Index ldc, bool inference,
                                HugePageVector<float> const* bias = nullptr,
                                bool accumulate = false) {
  ExpertJob j = inference && !pack.empty()
                    ? linear_job(pack, a, rows, c, ldc)
                    : stages::raw_job(a.base, a.ld, rows, w.data(), depth, c, ldc, rows_w);
  j.accumulate = accumulate;
  if (bias && !bias->empty()) j.bias = bias->data();
  return j;
}

/// Does a pack read int8 activations (a GGUF block format)?
inline bool quantized_pack(Linear const& pack) {
  return !pack.empty() && experts::is_quantized(pack.format());
}

}  // namespace moe::detail
