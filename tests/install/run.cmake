# SPDX-License-Identifier: Apache-2.0
# Packaging test, run with cmake -P:
#   MODE=find_package:     install moe to a prefix, build tests/install/consumer against it.
#   MODE=add_subdirectory: build the consumer with moe pulled in through add_subdirectory.
# Then run the consumer, which checks a small layer's output.
#   MODE=precompiled:      install this build tree (BUILD_DIR: its moe_expert_kernels and
#     moe_decoders are built, so nothing compiles but the consumer) to a prefix, then build
#     tests/install/precompiled against find_package(moe COMPONENTS precompiled) and run its two
#     programs (the decoder one on MODEL, a tiny whole model made by MAKER, when given).
#   MODE=components:       the component dist (tests/install/components, configure only but for
#     one small MPI program): find_package(moe) works with MPI unfindable; with WITH_MPI ON,
#     COMPONENTS dist gives moe::dist (and fails, saying why, with MPI unfindable); a moe
#     installed with MOE_WITH_MPI=OFF fails COMPONENTS dist and says why, and leaves
#     moe_dist_FOUND false for OPTIONAL_COMPONENTS dist.
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()
# A command that must succeed, saying `regex` (SAYS) or not (NOT_SAYS).
function(run_checked how regex)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(wanted FALSE)
  if("${out}${err}" MATCHES "${regex}")
    set(wanted TRUE)
  endif()
  if(how STREQUAL "NOT_SAYS")
    if(wanted)
      set(wanted FALSE)
    else()
      set(wanted TRUE)
    endif()
  endif()
  if(NOT rc EQUAL 0 OR NOT wanted)
    message(FATAL_ERROR "command should have succeeded, ${how} '${regex}' (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()
# A command that must fail with `regex` in its output.
function(run_fails regex)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "${regex}")
    message(FATAL_ERROR "command should have failed with '${regex}' (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "failed as it should:\n${err}")
endfunction()
function(install_moe prefix with_mpi)
  set(skip_mpi "")
  if(NOT with_mpi)  # do not even look (FindMPI takes seconds)
    set(skip_mpi -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
  endif()
  run(${CMAKE_COMMAND} -S "${MOE_SOURCE_DIR}" -B "${prefix}-build" -DMOE_BUILD_TESTS=OFF
      -DMOE_BUILD_BENCHMARKS=OFF -DMOE_BUILD_EXAMPLES=OFF -DMOE_INSTALL=ON -DMOE_VERIFY_HEADERS=OFF
      -DMOE_PRECOMPILED=OFF
      -DMOE_WITH_MPI=${with_mpi} ${skip_mpi} "-DCMAKE_INSTALL_PREFIX=${prefix}")
  run(${CMAKE_COMMAND} --install "${prefix}-build")
endfunction()
set(consumer "${MOE_SOURCE_DIR}/tests/install/consumer")
if(MODE STREQUAL "precompiled")
  run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
  foreach(lib libmoe_expert_kernels.a libmoe_decoders.a)
    if(NOT EXISTS "${WORK_DIR}/prefix/lib/${lib}" AND NOT EXISTS "${WORK_DIR}/prefix/lib64/${lib}")
      message(FATAL_ERROR "cmake --install put no ${lib} under ${WORK_DIR}/prefix")
    endif()
  endforeach()
  set(project "${MOE_SOURCE_DIR}/tests/install/precompiled")
  run(${CMAKE_COMMAND} -S "${project}" -B "${WORK_DIR}/build" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
      -DCMAKE_BUILD_TYPE=Release)
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" -j 2)
  run("${WORK_DIR}/build/ffn")
  if(MAKER)
    run("${MAKER}" "${WORK_DIR}/model" qwen3_moe --whole-model)
    run("${WORK_DIR}/build/generate" "${WORK_DIR}/model")
  endif()
  return()
endif()
if(MODE STREQUAL "components")
  set(components "${MOE_SOURCE_DIR}/tests/install/components")
  set(no_mpi -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
  install_moe("${WORK_DIR}/prefix" ${WITH_MPI})
  run(${CMAKE_COMMAND} -S "${components}" -B "${WORK_DIR}/none" -DCASE=none ${no_mpi}
      "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
  if(WITH_MPI)
    run(${CMAKE_COMMAND} -S "${components}" -B "${WORK_DIR}/dist" -DCASE=dist
        "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
    run(${CMAKE_COMMAND} --build "${WORK_DIR}/dist")
    run("${WORK_DIR}/dist/dist_consumer")
    run_fails("Component[ \n]+dist[ \n]+needs[ \n]+MPI" ${CMAKE_COMMAND} -S "${components}"
              -B "${WORK_DIR}/dist-no-mpi" -DCASE=dist ${no_mpi}
              "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
  endif()
  install_moe("${WORK_DIR}/prefix-without-mpi" OFF)
  run_fails("installed[ \n]+without[ \n]+it[ \n]+\\(MOE_PRECOMPILED=OFF\\)" ${CMAKE_COMMAND} -S "${components}"
            -B "${WORK_DIR}/precompiled-without" -DCASE=precompiled
            "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix-without-mpi")
  run_fails("built[ \n]+without[ \n]+MPI" ${CMAKE_COMMAND} -S "${components}" -B "${WORK_DIR}/dist-without"
            -DCASE=dist "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix-without-mpi")
  execute_process(COMMAND ${CMAKE_COMMAND} -S "${components}" -B "${WORK_DIR}/optional-without"
                          -DCASE=optional_dist "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix-without-mpi"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "moe_dist_FOUND=(FALSE|0|OFF|), no moe::dist")
    message(FATAL_ERROR "OPTIONAL_COMPONENTS dist on a moe without MPI: want moe found, "
                        "moe_dist_FOUND false and no moe::dist (${rc}):\n${out}\n${err}")
  endif()
  return()
endif()
if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} -S "${MOE_SOURCE_DIR}" -B "${WORK_DIR}/moe-build" -DMOE_BUILD_TESTS=OFF
      -DMOE_BUILD_BENCHMARKS=OFF -DMOE_BUILD_EXAMPLES=OFF -DMOE_INSTALL=ON -DMOE_VERIFY_HEADERS=OFF
      -DMOE_PRECOMPILED=OFF
      "-DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix")
  run(${CMAKE_COMMAND} --install "${WORK_DIR}/moe-build")
  # No -march in CMAKE_CXX_FLAGS: the package says how to get this machine's kernels (the
  # consumer links moe::native, which is what it says).
  run_checked(SAYS "link[ \n]+moe::native" ${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-build"
           "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" -DUSE_SUBDIRECTORY=OFF)
  run_checked(NOT_SAYS "moe::native" ${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-quiet"
              "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" -DUSE_SUBDIRECTORY=OFF -DMOE_NO_ARCH_WARNING=ON)
  run_checked(NOT_SAYS "moe::native" ${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-march"
              "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" -DUSE_SUBDIRECTORY=OFF
              "-DCMAKE_CXX_FLAGS=-march=x86-64-v3")
else()
  run_checked(SAYS "link[ \n]+moe::native" ${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-build"
           -DUSE_SUBDIRECTORY=ON "-DMOE_DIR_FOR_SUBDIRECTORY=${MOE_SOURCE_DIR}" -DSTRICT_BUILD=OFF)
endif()
run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer-build" -j 2)
run("${WORK_DIR}/consumer-build/consumer")
