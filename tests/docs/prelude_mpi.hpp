// SPDX-License-Identifier: Apache-2.0
// The prelude of the code blocks marked `mpi` (see prelude.hpp): they also see moe::dist.
#pragma once

#include <mpi.h>

#include <moe/dist/expert_parallel.hpp>

#include "prelude.hpp"

namespace docs_prelude {

extern int argc;
extern char** argv;
extern int provided;  // the thread level MPI_Init_thread granted

// The caller's own loaders, e.g. from a checkpoint.
void load_expert(moe::MatrixView<float> in_proj, moe::MatrixView<float> down_proj,
                 moe::Index expert);
void load_router(moe::MatrixView<float> router_weight);

}  // namespace docs_prelude
