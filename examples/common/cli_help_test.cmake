# SPDX-License-Identifier: Apache-2.0
# ctest driver (cmake -P) of a command-line tool's --help and unknown arguments (moe_cli::Usage in
# cli.hpp). Variables: TOOL (the binary), NAME (its name as the usage spells it), SOURCE (its
# main source file), OPTIONS (the options its documentation lists, separated by ^). Checks:
#   --help  exit 0, stdout "usage: NAME ..." with a line "  OPTION ..." for every OPTIONS entry
#           and for every option the parser compares against (each "--name" string literal of
#           SOURCE), nothing on stderr; -h prints the same;
#   --no-such-option  exit 2, nothing on stdout, one line on stderr naming the argument and
#           pointing at --help.
cmake_minimum_required(VERSION 3.25)

function(run_tool)
  execute_process(COMMAND "${TOOL}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 60)
  set(rc "${rc}" PARENT_SCOPE)
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

run_tool(--help)
if(NOT rc STREQUAL "0" OR NOT err STREQUAL "" OR NOT out MATCHES "^usage: ${NAME} ")
  message(FATAL_ERROR "${NAME} --help: expected exit 0, 'usage: ${NAME} ...' on stdout and "
                      "nothing on stderr; got exit '${rc}', stdout:\n${out}\nstderr:\n${err}")
endif()
set(help "${out}")

string(REPLACE "^" ";" documented "${OPTIONS}")
file(READ "${SOURCE}" source)
string(REGEX MATCHALL "\"--[a-z0-9-]+\"" parsed "${source}")
string(REPLACE "\"" "" parsed "${parsed}")
set(options ${documented} ${parsed})
list(REMOVE_DUPLICATES options)
foreach(option IN LISTS options)
  # A line of its own: two spaces, the option (or "-h, " before --help), then its value and its
  # explanation (option names hold no regular-expression characters).
  if(NOT help MATCHES "\n  (-h, )?${option}[ ,][^\n]*[a-z]")
    message(FATAL_ERROR "${NAME} --help has no line for ${option}:\n${help}")
  endif()
endforeach()
list(LENGTH options n)
message(STATUS "${NAME} --help: exit 0, ${n} options explained (${options})")

run_tool(-h)
if(NOT rc STREQUAL "0" OR NOT out STREQUAL help)
  message(FATAL_ERROR "${NAME} -h: expected exit 0 and the --help text; got exit '${rc}':\n${out}")
endif()

run_tool(--no-such-option)
string(REGEX MATCHALL "\n" newlines "${err}")
list(LENGTH newlines lines)
if(NOT rc STREQUAL "2" OR NOT out STREQUAL "" OR NOT lines EQUAL 1
   OR NOT err MATCHES "^${NAME}: unknown argument '--no-such-option'.*--help")
  message(FATAL_ERROR "${NAME} --no-such-option: expected exit 2, nothing on stdout and one line "
                      "on stderr pointing at --help; got exit '${rc}', stdout:\n${out}\n"
                      "stderr (${lines} lines):\n${err}")
endif()
string(STRIP "${err}" err)
message(STATUS "${NAME} --no-such-option: exit 2, ${err}")
