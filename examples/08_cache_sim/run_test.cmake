# SPDX-License-Identifier: Apache-2.0
# ctest driver (cmake -P) of moe_cache_sim: TOOL (the binary), WORK_DIR (scratch).
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run)
  execute_process(COMMAND "${TOOL}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 300)
  set(rc "${rc}" PARENT_SCOPE)
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

# A preset, its trace and predictor written.
run(--layers 4 --tokens 400 --warmup 50 --budgets 25%,64MiB --write-trace ${WORK_DIR}/t.trace
    --train-predictor ${WORK_DIR}/p.txt)
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "moe_cache_sim preset run: exit ${rc}\n${out}\n${err}")
endif()
foreach(policy lru lfu layer-lru learned oracle belady)
  if(NOT out MATCHES "\n25% \\([0-9.]+ GiB\\) +${policy} +0\\.[0-9]+ ")
    message(FATAL_ERROR "moe_cache_sim: no 25% row for ${policy}:\n${out}")
  endif()
endforeach()
if(NOT EXISTS ${WORK_DIR}/t.trace OR NOT EXISTS ${WORK_DIR}/p.txt)
  message(FATAL_ERROR "moe_cache_sim did not write the trace or the predictor")
endif()

# The written trace replayed with the saved predictor.
run(--trace ${WORK_DIR}/t.trace --predictor ${WORK_DIR}/p.txt --warmup 50 --budgets 10%)
if(NOT rc STREQUAL "0" OR NOT out MATCHES "loaded from")
  message(FATAL_ERROR "moe_cache_sim --trace --predictor: exit ${rc}\n${out}\n${err}")
endif()

# Bad arguments: exit 2, one line naming the problem; a malformed trace file: exit 1.
run(--budgets 25)
if(NOT rc STREQUAL "2" OR NOT err MATCHES "--budgets '25' is neither")
  message(FATAL_ERROR "moe_cache_sim --budgets 25: exit ${rc}\n${err}")
endif()
file(WRITE ${WORK_DIR}/bad.trace "MOETRACX")
run(--trace ${WORK_DIR}/bad.trace)
if(NOT rc STREQUAL "1" OR NOT err MATCHES "shorter than the 40-byte trace header")
  message(FATAL_ERROR "moe_cache_sim bad trace: exit ${rc}\n${err}")
endif()
# An output that is an input, or the other output, or an input that is a directory: exit 1, one
# line, the input unchanged.
file(SHA256 ${WORK_DIR}/t.trace before)
foreach(case "--trace^${WORK_DIR}/t.trace^--warmup^50^--train-predictor^${WORK_DIR}/t.trace|is the input"
             "--train-trace^${WORK_DIR}/t.trace^--warmup^50^--train-predictor^${WORK_DIR}/t.trace|is the input"
             "--tokens^100^--warmup^10^--write-trace^${WORK_DIR}/o.x^--train-predictor^${WORK_DIR}/o.x|name the same file"
             "--trace^${WORK_DIR}|is a directory")
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 1 want)
  list(GET parts 0 args)
  string(REPLACE "^" ";" args "${args}")
  run(${args})
  string(REGEX MATCHALL "\n" newlines "${err}")
  list(LENGTH newlines lines)
  if(NOT rc STREQUAL "1" OR NOT lines EQUAL 1 OR NOT err MATCHES "${want}")
    message(FATAL_ERROR "moe_cache_sim ${args}: want exit 1 and one line with '${want}', got "
                        "exit ${rc}:\n${err}")
  endif()
endforeach()
file(SHA256 ${WORK_DIR}/t.trace after)
if(NOT before STREQUAL after OR EXISTS ${WORK_DIR}/o.x)
  message(FATAL_ERROR "moe_cache_sim: a refused run wrote a file")
endif()
message(STATUS "moe_cache_sim: preset run, trace replay and errors as expected")
