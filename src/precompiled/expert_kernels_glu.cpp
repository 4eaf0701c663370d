// SPDX-License-Identifier: Apache-2.0
// The expert kernels of the SwiGLU and clamped-GLU epilogues and the store epilogue, compiled
// once for moe::precompiled and our own binaries (MOE_EXTERN_EXPERT_KERNELS,
// kernels/expert_gemm.hpp).
#include "moe/kernels/expert_gemm.hpp"

namespace moe::kernels {
template void expert_cols<StoreEpilogue>(RowSource, Index, Index, WeightPanels const&, Index, Index,
                                         StoreEpilogue const&, float*, Index, NextPanel);
template void expert_cols<GluEpilogue<Activation::kSilu, false>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    GluEpilogue<Activation::kSilu, false> const&, float*, Index, NextPanel);
template void expert_cols<GluEpilogue<Activation::kSilu, true>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    GluEpilogue<Activation::kSilu, true> const&, float*, Index, NextPanel);
}  // namespace moe::kernels
