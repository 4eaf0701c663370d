# SPDX-License-Identifier: Apache-2.0
# Debian 12's xsimd 8.1 package exports the target `xsimd` with INTERFACE_LINK_LIBRARIES "xtl",
# but ships no xtl package and never calls find_dependency(xtl): linking `xsimd` then adds -lxtl
# and fails with "cannot find -lxtl" (upstream xtensor-stack/xsimd#869, fixed after 8.1).
# An empty imported stand-in satisfies the link. Harmless where the bug is absent.
# Included by our own build and by the installed moeConfig.cmake, since consumers hit it too.
if(TARGET xsimd AND NOT TARGET xtl)
  get_target_property(_moe_xsimd_links xsimd INTERFACE_LINK_LIBRARIES)
  if(_moe_xsimd_links AND "xtl" IN_LIST _moe_xsimd_links)
    add_library(xtl INTERFACE IMPORTED)
  endif()
  unset(_moe_xsimd_links)
endif()
