# SPDX-License-Identifier: Apache-2.0
# Expert parallelism over MPI (include/moe/dist/): the INTERFACE target moe::dist (moe::moe +
# MPI::MPI_CXX + the dist/ headers), built when MOE_WITH_MPI is ON. Included by the top
# CMakeLists.txt after the moe target, whose header set must leave out include/moe/dist/.
# Installed, it is the package component dist: find_package(moe COMPONENTS dist).
find_package(MPI COMPONENTS CXX QUIET)
if(MPI_CXX_FOUND)
  set(_moe_mpi_default ON)
else()
  set(_moe_mpi_default OFF)
endif()
option(MOE_WITH_MPI "Build moe::dist, expert parallelism over MPI (default: ON if MPI is found)"
       ${_moe_mpi_default})

if(MOE_WITH_MPI)
  if(NOT MPI_CXX_FOUND)
    message(FATAL_ERROR "MOE_WITH_MPI is ON but no MPI C++ installation was found: install one "
                        "(Debian: apt-get install libopenmpi-dev openmpi-bin) or configure with "
                        "-DMOE_WITH_MPI=OFF")
  endif()
  file(GLOB_RECURSE MOE_DIST_HEADERS CONFIGURE_DEPENDS
       "${PROJECT_SOURCE_DIR}/include/moe/dist/*.hpp")
  add_library(moe_dist INTERFACE)
  add_library(moe::dist ALIAS moe_dist)
  set_target_properties(moe_dist PROPERTIES EXPORT_NAME dist)
  target_sources(moe_dist INTERFACE FILE_SET HEADERS BASE_DIRS include FILES ${MOE_DIST_HEADERS})
  target_link_libraries(moe_dist INTERFACE moe MPI::MPI_CXX)
  if(MOE_INSTALL)
    # Its own export set (moeDistTargets.cmake, NAMESPACE moe::, installed by the top
    # CMakeLists.txt): moeConfig.cmake loads it, and finds MPI, only for COMPONENTS dist.
    install(TARGETS moe_dist EXPORT moeDistTargets FILE_SET HEADERS)
  endif()
  # How moe's tests, examples and benches launch MPI programs: Open MPI needs --oversubscribe for
  # more ranks than cores (CI has 2 cores, the tests use 4 ranks) and refuses to run as root
  # (CI does) unless told with these environment variables. Other MPIs get neither.
  set(MOE_MPIEXEC_PREFLAGS "")
  set(MOE_MPIEXEC_ENV "")
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _moe_mpiexec_version
                  ERROR_QUIET TIMEOUT 20)
  if(_moe_mpiexec_version MATCHES "Open MPI|OpenRTE")
    set(MOE_MPIEXEC_PREFLAGS --oversubscribe)
    set(MOE_MPIEXEC_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
  endif()
  message(STATUS "moe: MPI expert parallelism ON (MPI ${MPI_CXX_VERSION}, ${MPIEXEC_EXECUTABLE})")
else()
  message(STATUS "moe: MPI expert parallelism OFF (MOE_WITH_MPI)")
endif()
