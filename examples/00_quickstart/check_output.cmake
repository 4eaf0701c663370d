# SPDX-License-Identifier: Apache-2.0
# ctest driver of examples/00_quickstart (cmake -P). Variable: QUICKSTART (the moe_quickstart
# binary). Runs it with --small; it must exit 0 and print the progress of its long phases (the
# weight fill, slice by slice, and the pack) and its measured peak memory.
cmake_minimum_required(VERSION 3.25)
execute_process(COMMAND "${QUICKSTART}" --small RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "moe_quickstart --small failed (${rc}):\n${out}\n${err}")
endif()
set(expected
    "cpu: +[^\n]*; L1d [0-9]+ KiB, L2 [0-9]+ KiB, L[0-9] [0-9]+ KiB \\((sysfs|cpuid|none)\\)\n"
    "kernels: +[a-z0-9]+ \\("
    "weights: +[0-9.]+ [MG]B of fp32 expert weights: allocating, filling: 10% 20%[^\n]* 100%  \\([0-9.]+ s\\)\n"
    "pack: +fp32 panels [^\n]* [0-9.]+ [MG]B more \\([0-9.]+ s\\)\n"
    "forward: +[0-9.]+ ms"
    "output: +all [0-9]+ values finite"
    "peak memory: +[0-9.]+ [MG]B resident \\(getrusage ru_maxrss\\) = fp32 weights [0-9.]+ [MG]B \\+ packed panels [0-9.]+ [MG]B")
foreach(re IN LISTS expected)
  if(NOT out MATCHES "${re}")
    message(FATAL_ERROR "moe_quickstart --small: no line matching\n  ${re}\nin its output:\n${out}")
  endif()
endforeach()
message(STATUS "${out}")
