# SPDX-License-Identifier: Apache-2.0
# Warning flags for moe's own targets (tests, benches, examples). Never put on the exported target.
add_library(moe_warnings INTERFACE)
# The flags every compiler gets (the header check passes them to clang++ too: tests/CMakeLists.txt).
set(MOE_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wshadow -Werror)
target_compile_options(moe_warnings INTERFACE ${MOE_WARNING_FLAGS})
# Our SSE2 builds (the portable preset, the *_sse2 tests) are SSE2 on purpose: no compile-time
# note about it (moe/core/config.hpp says it to consumers that forgot -march).
target_compile_definitions(moe_warnings INTERFACE MOE_NO_ARCH_WARNING)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers when Eigen's
  # GEMM packing is inlined with -march=native (GCC PR 105593, a false positive in system
  # headers, fixed in GCC 13). Nothing of ours is silenced by this.
  target_compile_options(moe_warnings INTERFACE -Wno-maybe-uninitialized)
endif()

# moe_arch: MOE_ARCH_FLAGS (top CMakeLists.txt: -march=native -mtune=generic unless MOE_NATIVE is
# OFF) for our tests, benches and examples.
add_library(moe_arch INTERFACE)
if(MOE_NATIVE)
  target_compile_options(moe_arch INTERFACE ${MOE_ARCH_FLAGS})
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    # The same PR 105593 false positive as -Wuninitialized once xsimd's AVX-512 exp (used by the
    # activation epilogues of kernels/expert_gemm.hpp) is instantiated out of line. Only in
    # -march=native builds; the asan preset (AVX2) keeps -Wuninitialized on for our code.
    target_compile_options(moe_warnings INTERFACE -Wno-uninitialized)
  endif()
endif()
# Note: the `asan` preset builds with -march=x86-64-v3 (AVX2) rather than native: at -O1, GCC 12
# turns the same PR 105593 false positive into -Wuninitialized inside avx512fintrin.h. The
# AVX-512 kernels are covered by the release build, SSE2 by moe_tests_sse2.
