# SPDX-License-Identifier: Apache-2.0
# ctest driver of examples/01_train_moe (cmake -P). Variables: TRAIN (the moe_train_example
# binary), WORK_DIR (scratch, emptied first). Runs it with --small --out WORK_DIR; it must exit 0,
# print a summary table whose legend says what each column is, and write train_load.csv and a
# well-formed train_load.svg with a background, a title, axis and tick labels and a colour bar.
cmake_minimum_required(VERSION 3.25)
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND "${TRAIN}" --small --out "${WORK_DIR}" RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "moe_train_example --small failed (${rc}):\n${out}\n${err}")
endif()
function(expect what text)
  foreach(re IN LISTS ARGN)
    if(NOT text MATCHES "${re}")
      message(FATAL_ERROR "moe_train_example --small: ${what} has nothing matching\n  ${re}\n"
                          "in:\n${text}")
    endif()
  endforeach()
endfunction()
expect("the table" "${out}"
       "final loss = mean loss over the last 10% of steps \\(steps [0-9]+-[0-9]+\\)"
       "initial loss = MSE at step 0"
       "imbalance = max / mean tokens per expert"
       "variant +initial loss +final loss \\(last 10%\\) +final/initial +imbalance \\(last 10%\\)\n"
       "\naux-free +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+\n")
if(NOT EXISTS "${WORK_DIR}/train_load.csv")
  message(FATAL_ERROR "no ${WORK_DIR}/train_load.csv")
endif()
file(READ "${WORK_DIR}/train_load.svg" svg)
# Well-formed enough: one svg root, every element closed or self-closing, tags balanced.
expect("train_load.svg" "${svg}" "^<\\?xml [^>]*\\?>\n<svg xmlns='http://www.w3.org/2000/svg'"
       "</svg>\n$")
foreach(tag svg g text)
  string(REGEX MATCHALL "<${tag}[ >]" open "${svg}")
  string(REGEX MATCHALL "</${tag}>" close "${svg}")
  list(LENGTH open n_open)
  list(LENGTH close n_close)
  if(NOT n_open EQUAL n_close OR n_open EQUAL 0)
    message(FATAL_ERROR "train_load.svg: ${n_open} <${tag}> but ${n_close} </${tag}>")
  endif()
endforeach()
string(REGEX MATCHALL "<(rect|line)[^>]*[^/]>" unclosed "${svg}")
if(unclosed)
  message(FATAL_ERROR "train_load.svg: rect/line elements not self-closed: ${unclosed}")
endif()
expect("train_load.svg" "${svg}"
       "<rect id='background' x='0' y='0' width='[0-9]+' height='[0-9]+' fill='white'/>"
       "<text id='title'[^>]*>Expert load during training[^<]*</text>"
       ">training step</text>" ">expert</text>"
       "<text class='x-tick'[^>]*>0</text>" "<text class='x-tick'[^>]*>10</text>"
       "<text class='y-tick'[^>]*>0</text>" "<text class='y-tick'[^>]*>3</text>"
       "<g class='colour-bar'>" "<text class='bar-tick'[^>]*>1 \\(balanced\\)</text>"
       "<text class='bar-tick'[^>]*>2 \\(every token\\)</text>"
       "<text class='bar-tick'[^>]*>&lt;= 0.5 \\(0: idle\\)</text>"
       "<text class='bar-label'[^>]*>load share x E \\(log scale\\)</text>"
       "<text class='bar-range'[^>]*>this run: min [0-9.]+, max [0-9.]+</text>")
message(STATUS "${out}")
