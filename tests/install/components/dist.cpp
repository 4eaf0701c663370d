// SPDX-License-Identifier: Apache-2.0
// A downstream program linking moe::dist (found with find_package(moe COMPONENTS dist)): it
// compiles against moe's MPI headers and links MPI. Run without mpiexec: no MPI_Init needed.
#include <mpi.h>

#include <cstdio>
#include <moe/dist/placement.hpp>

int main() {
  int initialized = 1;
  MPI_Initialized(&initialized);  // callable before MPI_Init
  auto const placement = moe::dist::ExpertPlacement::contiguous(8, 2);
  if (initialized != 0 || placement.num_local(0) != 4 || placement.owner(7) != 1) {
    std::printf("dist_consumer: unexpected MPI_Initialized %d or placement\n", initialized);
    return 1;
  }
  std::printf("dist_consumer: ok\n");
  return 0;
}
