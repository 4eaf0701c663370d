# SPDX-License-Identifier: Apache-2.0
# The configure-time note for a consumer whose kernels would be SSE2: moe::moe's header-only
# kernels use the instruction set the consumer's flags enable, and on x86-64 without -march /
# -mavx that is SSE2, several times slower than the machine's AVX2 / AVX-512. Included by our
# CMakeLists.txt when moe is a subproject (add_subdirectory) and by the installed moeConfig.cmake
# (find_package, unless the component precompiled was asked for: it brings its own -march);
# -DMOE_NO_ARCH_WARNING=ON silences it (the macro of that name silences moe/core/config.hpp's).
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64" AND NOT CMAKE_CXX_FLAGS MATCHES "-march=|-mavx"
   AND NOT MOE_NO_ARCH_WARNING)
  message(STATUS "moe: moe::moe's kernels use the instruction set your compile flags enable, and "
                 "CMAKE_CXX_FLAGS enable none beyond SSE2: link moe::native (-march=native) or "
                 "moe::precompiled for this machine's AVX2 / AVX-512 kernels, several times faster "
                 "(or pass -march yourself; -DMOE_NO_ARCH_WARNING=ON silences this)")
endif()
