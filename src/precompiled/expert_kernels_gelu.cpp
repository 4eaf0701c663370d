// SPDX-License-Identifier: Apache-2.0
// The expert kernels of the GeGLU epilogues, compiled once for moe::precompiled and our own
// binaries (MOE_EXTERN_EXPERT_KERNELS, kernels/expert_gemm.hpp).
#include "moe/kernels/expert_gemm.hpp"

namespace moe::kernels {
template void expert_cols<GluEpilogue<Activation::kGeluTanh, false>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    GluEpilogue<Activation::kGeluTanh, false> const&, float*, Index, NextPanel);
template void expert_cols<GluEpilogue<Activation::kGeluErf, false>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    GluEpilogue<Activation::kGeluErf, false> const&, float*, Index, NextPanel);
}  // namespace moe::kernels
