# SPDX-License-Identifier: Apache-2.0
# Packaging test, run with cmake -P:
#   MODE=find_package:     install moe to a prefix, build tests/install/consumer against it.
#   MODE=add_subdirectory: build the consumer with moe pulled in through add_subdirectory.
# Then run the consumer, which checks a small layer's output.
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()
set(consumer "${MOE_SOURCE_DIR}/tests/install/consumer")
if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} -S "${MOE_SOURCE_DIR}" -B "${WORK_DIR}/moe-build" -DMOE_BUILD_TESTS=OFF
      -DMOE_BUILD_BENCHMARKS=OFF -DMOE_BUILD_EXAMPLES=OFF -DMOE_INSTALL=ON -DMOE_VERIFY_HEADERS=OFF
      "-DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix")
  run(${CMAKE_COMMAND} --install "${WORK_DIR}/moe-build")
  run(${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-build"
      "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" -DUSE_SUBDIRECTORY=OFF)
else()
  run(${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-build"
      -DUSE_SUBDIRECTORY=ON "-DMOE_DIR_FOR_SUBDIRECTORY=${MOE_SOURCE_DIR}")
endif()
run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer-build" -j 2)
run("${WORK_DIR}/consumer-build/consumer")
