// SPDX-License-Identifier: Apache-2.0
// Catch2 main for the MPI tests: MPI_Init_thread around the session; the exit code is the worst
// over all ranks, so a failure on any rank fails the mpirun (and the ctest test).
//
// Under AddressSanitizer, Open MPI's own never-freed allocations are kept out of the leak report,
// and only those: allocations made inside MPI_Init_thread are exempted (__lsan_disable/enable:
// Open MPI loads, queries and unloads components there, so their leaks have no module name left
// to suppress), the rest of MPI's are suppressed by library name (lsan_mpi.supp), and leaks are
// checked here, before MPI_Finalize, while those libraries are still loaded. Every object of moe
// and of the tests has been destroyed by then, so a leak of ours is still reported. The exit-time
// check is off for this program (LSAN_OPTIONS leak_check_at_exit=0, tests/dist/CMakeLists.txt):
// after MPI_Finalize unloads the components, their allocations cannot be attributed any more.
#include <mpi.h>

#include <algorithm>
#include <cstdio>

#include "support/catch_session.hpp"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

int main(int argc, char** argv) {
  int provided = 0;
#if defined(__SANITIZE_ADDRESS__)
  __lsan_disable();
#endif
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
#if defined(__SANITIZE_ADDRESS__)
  __lsan_enable();
#endif
  int result = moe::test::run_catch_session(argc, argv);
#if defined(__SANITIZE_ADDRESS__)
  if (__lsan_do_recoverable_leak_check() != 0) {
    std::fprintf(stderr, "moe_dist_tests: LeakSanitizer found leaks (see above)\n");
    result = std::max(result, 1);
  }
#endif
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
