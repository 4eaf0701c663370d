# SPDX-License-Identifier: Apache-2.0
# ctest driver (cmake -P) of the command-line tools' argument and file handling. Variables:
# MAKER (moe_hf_make_tiny_checkpoint), RUN_HF_LAYER, RUN_HF_ATTENTION, QUANTIZE, GENERATE (the
# tools), WORK_DIR (scratch), MODE (cases below):
#   fifo    a FIFO as config.json, model.safetensors or --input: each run must exit 1 at once
#           (every run has a 20 s timeout, the test 120 s) with one line on stderr naming the path;
#   logits  moe_generate --logits naming a file of the model (also through a hard link), a
#           directory or a file in a missing directory: refused (exit 1, one line) before the
#           model is loaded (the tiny checkpoint is a single MoE layer, not a loadable decoder:
#           a run that got as far as loading would fail with another message), model unchanged;
#           and, on a whole model, its tokenizer files, the prompt file or the other output
#           (--trace-out) as --logits, an empty --logits and a directory as --prompt-file; cache
#           options without a cache, --top-p while greedy, a hexadecimal --temperature; and a
#           config.json whose num_hidden_layers leaves a layer unread: a warning; an empty .gguf
#           file and a symbolic link loop as --model, each said as such;
#   integers  out-of-range or malformed integer options of moe_generate, moe_run_hf_layer,
#           moe_run_hf_attention, moe_quantize and moe_hf_make_tiny_checkpoint: exit 1, one line
#           naming option, value, range.
cmake_minimum_required(VERSION 3.25)
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(make_checkpoint dir type)
  execute_process(COMMAND "${MAKER}" "${dir}" ${type} ${ARGN} RESULT_VARIABLE rc
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${MAKER} ${dir} ${type} ${ARGN} failed (${rc}): ${err}")
  endif()
endfunction()

function(make_fifo path)
  file(REMOVE "${path}")
  execute_process(COMMAND mkfifo "${path}" RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "mkfifo ${path} failed (${rc}): ${err}")
  endif()
endfunction()

# Runs `tool` with the arguments after `what`; expects exit status `want_rc` within 20 s, and
# stderr matching `want_err` (a regular expression) in exactly `want_lines` lines (0: any).
function(expect what want_rc want_lines want_err tool)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND "${tool}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 20)
  string(TIMESTAMP t1 "%s")
  math(EXPR seconds "${t1} - ${t0}")
  string(REGEX MATCHALL "\n" newlines "${err}")
  list(LENGTH newlines lines)
  if(NOT rc STREQUAL want_rc OR (want_lines GREATER 0 AND NOT lines EQUAL want_lines)
     OR NOT err MATCHES "${want_err}")
    message(FATAL_ERROR "${what}: expected exit ${want_rc}, ${want_lines} line(s) on stderr "
                        "matching '${want_err}'; got exit '${rc}' after ${seconds} s and "
                        "${lines} line(s):\n${err}")
  endif()
  string(STRIP "${err}" err)
  string(REGEX REPLACE "\n.*" " ..." first "${err}")
  message(STATUS "${what}: exit ${rc} in ${seconds} s, ${first}")
  set(last_out "${out}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "fifo")
  set(dir "${WORK_DIR}/qwen3_moe")
  make_checkpoint("${dir}" qwen3_moe)
  set(x "${dir}/x.safetensors")
  set(y "${WORK_DIR}/y.safetensors")
  set(gen --prompt-ids 1 --max-new-tokens 1)
  set(layer --layer 1 --input "${x}" --output "${y}")
  # --input a FIFO.
  make_fifo("${WORK_DIR}/x.fifo")
  expect("moe_run_hf_layer --input FIFO" 1 1 "x.fifo' is not a regular file \\(a FIFO"
         "${RUN_HF_LAYER}" --model "${dir}" --layer 1 --input "${WORK_DIR}/x.fifo" --output "${y}")
  # config.json a FIFO.
  file(RENAME "${dir}/config.json" "${WORK_DIR}/config.json")
  make_fifo("${dir}/config.json")
  set(want "config.json' is not a regular file \\(a FIFO.*config.json is a regular file")
  expect("moe_run_hf_layer, config.json FIFO" 1 1 "${want}" "${RUN_HF_LAYER}" --model "${dir}"
         ${layer})
  expect("moe_run_hf_attention, config.json FIFO" 1 1 "${want}" "${RUN_HF_ATTENTION}" --model
         "${dir}" ${layer})
  expect("moe_generate, config.json FIFO" 1 1 "${want}" "${GENERATE}" --model "${dir}" ${gen})
  expect("moe_quantize, config.json FIFO" 1 1 "${want}" "${QUANTIZE}" --model "${dir}" --layer 1
         --bits 4.5 --method uniform --out "${WORK_DIR}/quantized")
  # model.safetensors a FIFO (config.json back in place).
  file(REMOVE "${dir}/config.json")
  file(RENAME "${WORK_DIR}/config.json" "${dir}/config.json")
  file(RENAME "${dir}/model.safetensors" "${WORK_DIR}/model.safetensors")
  make_fifo("${dir}/model.safetensors")
  set(want "model.safetensors' is not a regular file \\(a FIFO")
  expect("moe_run_hf_layer, model.safetensors FIFO" 1 1 "${want}" "${RUN_HF_LAYER}" --model
         "${dir}" ${layer})
  # (moe_generate reads config.json first: this tiny checkpoint's stops it before the weights.)
elseif(MODE STREQUAL "logits")
  foreach(shards 1 2)
    set(dir "${WORK_DIR}/qwen3_moe_${shards}")
    make_checkpoint("${dir}" qwen3_moe --shards ${shards})
    file(GLOB model_files "${dir}/config.json" "${dir}/model*.safetensors*")
    list(LENGTH model_files n)
    if(n LESS 2)
      message(FATAL_ERROR "expected config.json and weights in ${dir}, got ${model_files}")
    endif()
    set(hashes "")
    foreach(f IN LISTS model_files)
      file(SHA256 "${f}" h)
      list(APPEND hashes "${h}")
    endforeach()
    file(CREATE_LINK "${dir}/config.json" "${WORK_DIR}/link_${shards}.json")
    set(gen "${GENERATE}" --model "${dir}" --prompt-ids 1 --max-new-tokens 1 --logits)
    foreach(f IN LISTS model_files)
      get_filename_component(name "${f}" NAME)
      expect("--logits ${name} (${shards} shard(s))" 1 1
             "^moe_generate: moe: --logits: the output '.*' is the input" ${gen} "${f}")
    endforeach()
    expect("--logits a hard link to config.json" 1 1 "--logits: the output '.*' is the input" ${gen}
           "${WORK_DIR}/link_${shards}.json")
    expect("--logits the model directory" 1 1 "--logits: the output '.*' exists and is a directory"
           ${gen} "${dir}")
    expect("--logits in a missing directory" 1 1
           "--logits: the directory of the output '.*' cannot be used \\(No such file" ${gen}
           "${WORK_DIR}/missing/logits.safetensors")
    set(i 0)
    foreach(f IN LISTS model_files)
      file(SHA256 "${f}" h)
      list(GET hashes ${i} want)
      math(EXPR i "${i} + 1")
      if(NOT h STREQUAL want)
        message(FATAL_ERROR "${f} changed")
      endif()
    endforeach()
  endforeach()
  # A whole model: its tokenizer files, the prompt file and the other output are inputs too.
  set(dir "${WORK_DIR}/whole")
  make_checkpoint("${dir}" qwen3_moe --whole-model)
  file(WRITE "${WORK_DIR}/prompt.txt" "hello\n")
  file(SHA256 "${dir}/tokenizer.json" tokenizer_hash)
  set(gen "${GENERATE}" --model "${dir}" --prompt-ids 1 --max-new-tokens 1)
  foreach(f tokenizer.json tokenizer_config.json generation_config.json)
    expect("--logits ${f}" 1 1 "--logits: the output '.*' is the input" ${gen} --logits
           "${dir}/${f}")
  endforeach()
  expect("--logits the prompt file" 1 1 "--logits: the output '.*' is the input" "${GENERATE}"
         --model "${dir}" --prompt-file "${WORK_DIR}/prompt.txt" --max-new-tokens 1 --logits
         "${WORK_DIR}/prompt.txt")
  expect("--trace-out the --logits file" 1 1 "--trace-out '.*' is also another output" ${gen}
         --logits "${WORK_DIR}/o.st" --trace-out "${WORK_DIR}/o.st")
  # (through bash: CMake drops an empty argument)
  expect("--logits empty" 1 1 "--logits needs a file name" bash -c
         "'${GENERATE}' --model '${dir}' --prompt-ids 1 --max-new-tokens 1 --logits ''")
  expect("--expert-cache without a store" 1 1 "--expert-cache sizes or drives the expert cache"
         ${gen} --expert-cache 1GiB)
  expect("--top-p while greedy" 1 1 "--top-p restricts sampling: give --temperature" ${gen}
         --top-p 0.5)
  expect("--temperature in hexadecimal" 1 1 "--temperature needs a number in .*got '0x10'" ${gen}
         --temperature 0x10)
  expect("--prompt-file a directory" 1 1 "--prompt-file: '.*' is a directory" "${GENERATE}"
         --model "${dir}" --prompt-file "${WORK_DIR}" --max-new-tokens 1)
  # A model path that is an empty .gguf file, or a symbolic link loop: said as such.
  file(WRITE "${WORK_DIR}/empty.gguf" "")
  expect("--model an empty .gguf" 1 1 "'.*empty.gguf' is named .gguf but is not a GGUF file \\(0 bytes"
         "${GENERATE}" --model "${WORK_DIR}/empty.gguf" --prompt-ids 1 --max-new-tokens 1)
  file(CREATE_LINK "${WORK_DIR}/loop_b" "${WORK_DIR}/loop_a" SYMBOLIC)
  file(CREATE_LINK "${WORK_DIR}/loop_a" "${WORK_DIR}/loop_b" SYMBOLIC)
  expect("--model a symbolic link loop" 1 1 "is a symbolic link that leads nowhere" "${GENERATE}"
         --model "${WORK_DIR}/loop_a" --prompt-ids 1 --max-new-tokens 1)
  # Fewer num_hidden_layers in config.json than the checkpoint's layers: a warning names them.
  set(short "${WORK_DIR}/short")
  make_checkpoint("${short}" qwen3_moe --whole-model)
  file(READ "${short}/config.json" config)
  string(REPLACE "\"num_hidden_layers\": 3" "\"num_hidden_layers\": 2" config "${config}")
  file(WRITE "${short}/config.json" "${config}")
  expect("num_hidden_layers below the checkpoint's layers" 0 0
         "warning: the checkpoint holds layers up to 2 \\(model\\.layers\\.2\\.\\*\\) but config\\.json's num_hidden_layers is 2: layer 2 is not run"
         "${GENERATE}" --model "${short}" --prompt-ids 1 --max-new-tokens 1)
  file(SHA256 "${dir}/tokenizer.json" h)
  file(READ "${WORK_DIR}/prompt.txt" p)
  if(NOT h STREQUAL tokenizer_hash OR NOT p STREQUAL "hello\n" OR EXISTS "${WORK_DIR}/o.st")
    message(FATAL_ERROR "a refused moe_generate run wrote a file")
  endif()
elseif(MODE STREQUAL "integers")
  # Integer options are read as typed (no wrap-around to a small value) and range-checked before
  # the model is read; the message names the option, the value and the range.
  set(dir "${WORK_DIR}/qwen3_moe")
  make_checkpoint("${dir}" qwen3_moe)
  set(x "${dir}/x.safetensors")
  set(y "${WORK_DIR}/y.safetensors")
  set(layer "--model^${dir}^--input^${x}^--output^${y}")
  set(gen "--model^${dir}^--prompt-ids^1^--max-new-tokens^1")
  set(cases
      "GENERATE|--threads '4294967298' is not an integer in \\[1, 1024\\]|${gen}^--threads^4294967298"
      "GENERATE|--threads '2147483648' is not an integer in \\[1, 1024\\]|${gen}^--threads^2147483648"
      "GENERATE|--threads '0' is not an integer in \\[1, 1024\\]|${gen}^--threads^0"
      "GENERATE|--max-new-tokens '9223372036854775807' is not an integer in \\[0, 1048576\\]. at most 2\\^20|--model^${dir}^--prompt-ids^1^--max-new-tokens^9223372036854775807"
      "GENERATE|--max-new-tokens '18446744073709551617' is not an integer|--model^${dir}^--prompt-ids^1^--max-new-tokens^18446744073709551617"
      "GENERATE|--max-new-tokens '1048577' is not an integer in \\[0, 1048576\\]|--model^${dir}^--prompt-ids^1^--max-new-tokens^1048577"
      "GENERATE|--max-new-tokens '-1' is not an integer|--model^${dir}^--prompt-ids^1^--max-new-tokens^-1"
      "GENERATE|--seed '18446744073709551616' is not an integer in \\[0, 18446744073709551615\\]|${gen}^--seed^18446744073709551616"
      "GENERATE|--seed '-1' is not an integer|${gen}^--seed^-1"
      "GENERATE|--prompt-ids '99999999999999999999' is not an integer|--model^${dir}^--prompt-ids^1,99999999999999999999^--max-new-tokens^1"
      "GENERATE|--prompt-ids ' 2' is not an integer|--model^${dir}^--prompt-ids^1, 2^--max-new-tokens^1"
      "RUN_HF_LAYER|--threads '4294967298' is not an integer in \\[1, 1024\\]|${layer}^--layer^1^--threads^4294967298"
      "RUN_HF_LAYER|--layer '4294967297' is not an integer in \\[0, 2147483647\\]|${layer}^--layer^4294967297"
      "RUN_HF_LAYER|--layer '\\+1' is not an integer|${layer}^--layer^+1"
      "RUN_HF_ATTENTION|--threads '2147483648' is not an integer in \\[1, 1024\\]|${layer}^--layer^1^--threads^2147483648"
      "RUN_HF_ATTENTION|--layer '1e3' is not an integer|${layer}^--layer^1e3"
      "QUANTIZE|--threads '4294967298' is not an integer in \\[1, 1024\\]|--model^${dir}^--layer^1^--bits^4^--method^uniform^--out^${WORK_DIR}/q^--threads^4294967298"
      "QUANTIZE|--layer '4294967297' is not an integer in \\[0, 1048576\\]|--model^${dir}^--layer^4294967297^--bits^4^--method^uniform^--out^${WORK_DIR}/q"
      "MAKER|--shards '4294967298' is not an integer in \\[1, 1024\\]|${WORK_DIR}/m^qwen3_moe^--shards^4294967298"
      "MAKER|--shards '2x' is not an integer in \\[1, 1024\\]|${WORK_DIR}/m^qwen3_moe^--shards^2x")
  foreach(case IN LISTS cases)
    string(REPLACE "|" ";" parts "${case}")
    list(POP_FRONT parts tool want)
    string(REPLACE "^" ";" parts "${parts}")
    expect("${tool} ${parts}" 1 1 "^[a-z_]+: moe: ${want}" "${${tool}}" ${parts})
  endforeach()
else()
  message(FATAL_ERROR "MODE must be fifo, logits or integers")
endif()
