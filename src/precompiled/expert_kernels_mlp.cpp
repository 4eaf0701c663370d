// SPDX-License-Identifier: Apache-2.0
// The expert kernels of the plain-MLP epilogues, compiled once for moe::precompiled and our own
// binaries (MOE_EXTERN_EXPERT_KERNELS, kernels/expert_gemm.hpp).
#include "moe/kernels/expert_gemm.hpp"

namespace moe::kernels {
template void expert_cols<ActEpilogue<Activation::kSilu>>(RowSource, Index, Index,
                                                          WeightPanels const&, Index, Index,
                                                          ActEpilogue<Activation::kSilu> const&,
                                                          float*, Index, NextPanel);
template void expert_cols<ActEpilogue<Activation::kRelu>>(RowSource, Index, Index,
                                                          WeightPanels const&, Index, Index,
                                                          ActEpilogue<Activation::kRelu> const&,
                                                          float*, Index, NextPanel);
template void expert_cols<ActEpilogue<Activation::kGeluErf>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    ActEpilogue<Activation::kGeluErf> const&, float*, Index, NextPanel);
template void expert_cols<ActEpilogue<Activation::kGeluTanh>>(
    RowSource, Index, Index, WeightPanels const&, Index, Index,
    ActEpilogue<Activation::kGeluTanh> const&, float*, Index, NextPanel);
}  // namespace moe::kernels
