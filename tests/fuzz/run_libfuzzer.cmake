# SPDX-License-Identifier: Apache-2.0
# The "fuzz: <name> libFuzzer" tests (tests/fuzz/CMakeLists.txt): builds SOURCE (a
# tests/fuzz/fuzz_<name>.cpp) with clang (-fsanitize=fuzzer,address,undefined, plus FLAGS, a
# '|'-separated list) unless FUZZER names a prebuilt binary, then fuzzes a fresh copy of the
# seed corpus for SECONDS seconds. Fails on any crash, leak, sanitizer report or timeout;
# prints "MOE_FUZZ_SKIPPED" (which ctest reports as skipped) when clang or its libFuzzer
# runtime is missing.
#
# cmake -DNAME=... -DCLANGXX=... -DSOURCE=... -DINCLUDE_DIR=... [-DFLAGS=...] -DCORPUS=...
#       -DDICT=... -DWORK_DIR=... -DSECONDS=30 [-DFUZZER=<binary>] -P run_libfuzzer.cmake
foreach(var NAME SOURCE INCLUDE_DIR CORPUS WORK_DIR SECONDS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_libfuzzer.cmake: -D${var}=... is required")
  endif()
endforeach()
file(MAKE_DIRECTORY "${WORK_DIR}")

if(NOT FUZZER)
  if(NOT CLANGXX)
    message("MOE_FUZZ_SKIPPED: clang++ not found; install clang-14 and libclang-rt-14-dev "
            "(Debian) and re-run cmake")
    return()
  endif()
  execute_process(COMMAND "${CLANGXX}" --print-runtime-dir
                  OUTPUT_VARIABLE runtime_dir OUTPUT_STRIP_TRAILING_WHITESPACE)
  file(GLOB runtime "${runtime_dir}/libclang_rt.fuzzer*.a" "${runtime_dir}/*/libclang_rt.fuzzer*.a")
  if(NOT runtime)
    message("MOE_FUZZ_SKIPPED: ${CLANGXX} has no libFuzzer runtime in '${runtime_dir}'; "
            "install libclang-rt-14-dev (Debian)")
    return()
  endif()
  # Rebuild only when the target, a header or this script is newer than the binary.
  set(FUZZER "${WORK_DIR}/fuzz_${NAME}")
  get_filename_component(tests_dir "${CMAKE_CURRENT_LIST_DIR}" DIRECTORY)
  file(GLOB_RECURSE inputs "${INCLUDE_DIR}/moe/*.hpp" "${tests_dir}/support/*.hpp")
  list(APPEND inputs "${SOURCE}" "${CMAKE_CURRENT_LIST_FILE}")
  string(REPLACE "|" ";" flags "${FLAGS}")
  set(stale FALSE)
  foreach(input IN LISTS inputs)
    if(NOT EXISTS "${FUZZER}" OR "${input}" IS_NEWER_THAN "${FUZZER}")
      set(stale TRUE)
    endif()
  endforeach()
  if(stale)
    message("Building ${FUZZER} with ${CLANGXX}")
    execute_process(
      COMMAND "${CLANGXX}" -std=c++20 -O1 -gline-tables-only -fno-omit-frame-pointer
              -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
              -Wall -Wextra -Werror ${flags} -I "${INCLUDE_DIR}" "${SOURCE}" -o "${FUZZER}.new"
      RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "building the libFuzzer target failed (exit ${rc})")
    endif()
    file(RENAME "${FUZZER}.new" "${FUZZER}")
  endif()
endif()

# Fuzz a copy of the corpus: libFuzzer adds the inputs it finds to its first directory.
file(REMOVE_RECURSE "${WORK_DIR}/corpus")
file(COPY "${CORPUS}/" DESTINATION "${WORK_DIR}/corpus")
file(GLOB old_artifacts "${WORK_DIR}/crash-*" "${WORK_DIR}/leak-*" "${WORK_DIR}/timeout-*"
     "${WORK_DIR}/oom-*")
if(old_artifacts)
  file(REMOVE ${old_artifacts})
endif()
set(dict_args)
if(DICT)
  set(dict_args "-dict=${DICT}")
endif()
execute_process(
  COMMAND "${FUZZER}" -max_total_time=${SECONDS} -rss_limit_mb=2048 -timeout=10 -max_len=8192
          -print_final_stats=1 ${dict_args} "-artifact_prefix=${WORK_DIR}/" "${WORK_DIR}/corpus"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  file(GLOB artifacts "${WORK_DIR}/crash-*" "${WORK_DIR}/leak-*" "${WORK_DIR}/timeout-*"
       "${WORK_DIR}/oom-*")
  message(FATAL_ERROR "libFuzzer failed (exit ${rc}); reproduce with: ${FUZZER} ${artifacts}")
endif()
