# SPDX-License-Identifier: Apache-2.0
# ctest driver of examples/03_hf_layer (cmake -P). Variables: MAKER (moe_hf_make_tiny_checkpoint),
# RUNNER (moe_run_hf_layer), WORK_DIR (scratch), MODE (cases below: "what|arg^arg^..."):
#   ok   a tiny checkpoint per family (sharded, BF16 and fused variants among them); the runner's
#        forward and --grad runs must exit 0, write the output file, print nothing on stdout and
#        end stderr with the line saying what they wrote (the maker prints one such line too);
#   bad  bad inputs: each run must exit 1 (2 for an unknown argument, a usage error) with exactly
#        one line on stderr naming the problem;
#   whole whole models (--whole-model) of every decoder family, run by moe_generate (GENERATE;
#        with a chat prompt when TEXT), moe_run_hf_layer and moe_run_hf_attention (ATTENTION),
#        and the maker's refusals of bad sizes and option mixes.
cmake_minimum_required(VERSION 3.25)
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(make_checkpoint dir type)
  execute_process(COMMAND "${MAKER}" "${dir}" ${type} ${ARGN} RESULT_VARIABLE rc
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${MAKER} ${dir} ${type} ${ARGN} failed (${rc}): ${err}")
  endif()
  if(NOT err MATCHES "^moe_hf_make_tiny_checkpoint: wrote [^\n]*: ${type}, MoE layer 1 of 2 [^\n]* tensors [^\n]*\n$")
    message(FATAL_ERROR "${MAKER} ${dir} ${type} ${ARGN}: expected one line saying what it wrote, got:\n${err}")
  endif()
endfunction()

# Each case "what|arg^arg^...[|regex]": `tool` must exit 1 (2 for "unknown flag") with one line on
# stderr that starts with the tool's name and matches regex, and `must_not_exist` (when given)
# must not exist afterwards (a refused run writes nothing).
function(expect_refusals tool must_not_exist)
  get_filename_component(name "${tool}" NAME)
  foreach(case IN LISTS ARGN)
    string(REPLACE "|" ";" parts "${case}")
    list(POP_FRONT parts what args)
    set(expect "")
    if(parts)
      list(GET parts 0 expect)
    endif()
    string(REPLACE "^" ";" args "${args}")
    set(want 1)
    if(what STREQUAL "unknown flag")
      set(want 2)
    endif()
    execute_process(COMMAND "${tool}" ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                    ERROR_VARIABLE err)
    string(REGEX MATCHALL "\n" newlines "${err}")
    list(LENGTH newlines lines)
    if(NOT rc EQUAL want OR NOT lines EQUAL 1 OR NOT err MATCHES "^${name}: "
       OR NOT err MATCHES "${expect}" OR (must_not_exist AND EXISTS "${must_not_exist}"))
      message(FATAL_ERROR "${what}: expected exit ${want}, one line on stderr with '${expect}' "
                          "and nothing written; got exit ${rc} and:\n${err}")
    endif()
    string(STRIP "${err}" err)
    message(STATUS "${what}: exit ${rc}, ${err}")
  endforeach()
endfunction()

if(MODE STREQUAL "ok")
  set(cases "mixtral --fused" "qwen2_moe --shards 2" "qwen3_moe" "deepseek_v3 --bf16" "olmoe"
            "qwen3_next" "glm4_moe --shards 3" "deepseek_v2 --fused" "minimax_m2 --bf16"
            "ernie4_5_moe" "ernie4_5_moe --use-bias" "llama4_text" "gpt_oss --bf16"
            "gpt_oss --mxfp4")
  foreach(case IN LISTS cases)
    separate_arguments(args UNIX_COMMAND "${case}")
    list(GET args 0 type)
    string(REPLACE " " "" dir_name "${case}")
    set(dir "${WORK_DIR}/${dir_name}")
    make_checkpoint("${dir}" ${args})
    foreach(grad IN ITEMS "" "--grad;${dir}/dy.safetensors;--threads;2")
      file(REMOVE "${dir}/y.safetensors")
      execute_process(COMMAND "${RUNNER}" --model "${dir}" --layer 1 --input "${dir}/x.safetensors"
                              --output "${dir}/y.safetensors" ${grad}
                      RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
      if(NOT rc EQUAL 0 OR NOT EXISTS "${dir}/y.safetensors")
        message(FATAL_ERROR "moe_run_hf_layer on ${case} ${grad} failed (${rc}): ${err}")
      endif()
      set(want "moe_run_hf_layer: wrote ${dir}/y.safetensors: layer 1 \\(${type}\\), 5 tokens: y \\[5, [0-9]+\\], router_logits \\[5, 8\\], topk_ids and topk_weights \\[5, [0-9]+\\]")
      if(grad)
        string(APPEND want ", dx and [0-9]+ grad\\.\\*")
      endif()
      if(NOT out STREQUAL "" OR NOT "\n${err}" MATCHES "\n${want}\n$")
        message(FATAL_ERROR "moe_run_hf_layer on ${case} ${grad}: expected nothing on stdout and "
                            "stderr ending with '${want}'; got stdout:\n${out}\nstderr:\n${err}")
      endif()
      file(SIZE "${dir}/y.safetensors" size)
      message(STATUS "${case} ${grad}: ok, ${size} bytes of output")
    endforeach()
  endforeach()
elseif(MODE STREQUAL "bad")
  set(dir "${WORK_DIR}/deepseek_v3")
  make_checkpoint("${dir}" deepseek_v3)
  file(MAKE_DIRECTORY "${WORK_DIR}/broken")
  file(WRITE "${WORK_DIR}/broken/config.json" "{\"model_type\": \"mixtral\",}")
  set(x "${dir}/x.safetensors")
  set(y "${WORK_DIR}/y.safetensors")
  set(cases
      "no arguments|"
      "dense layer|--model^${dir}^--layer^0^--input^${x}^--output^${y}"
      "layer out of range|--model^${dir}^--layer^7^--input^${x}^--output^${y}"
      "no such model|--model^${WORK_DIR}/nothing^--layer^1^--input^${x}^--output^${y}"
      "invalid config.json|--model^${WORK_DIR}/broken^--layer^1^--input^${x}^--output^${y}"
      "input without x|--model^${dir}^--layer^1^--input^${dir}/dy.safetensors^--output^${y}"
      "no such input|--model^${dir}^--layer^1^--input^${dir}/none.safetensors^--output^${y}"
      "grad without dy|--model^${dir}^--layer^1^--input^${x}^--output^${y}^--grad^${x}"
      "bad layer number|--model^${dir}^--layer^one^--input^${x}^--output^${y}"
      "zero threads|--model^${dir}^--layer^1^--input^${x}^--output^${y}^--threads^0"
      "unknown flag|--model^${dir}^--layer^1^--input^${x}^--output^${y}^--fast^1"
      "missing value|--model^${dir}^--layer^1^--input^${x}^--output")
  expect_refusals("${RUNNER}" "" ${cases})
elseif(MODE STREQUAL "whole")
  # Every family's --whole-model (sizes, BF16 among the cases): moe_generate runs it (a chat
  # prompt through its tokenizer when TEXT, else ids), moe_run_hf_layer runs its first MoE layer,
  # moe_run_hf_attention (ATTENTION) a Qwen3-Next full-attention layer; the defaults stream their
# experts, and moe_quantize (QUANTIZE) refuses gpt_oss's GGUF (llama.cpp has no swiglu_limit key).
  set(cases "qwen3_moe" "glm4_moe --experts 3" "deepseek_v3 --experts 4 --top-k 4"
            "qwen3_moe --hidden 64 --expert-ffn 32 --dense-ffn 48 --layers 5 --vocab 300"
            "qwen2_moe --bf16" "mixtral --experts 8 --top-k 3" "olmoe" "glm4_moe"
            "minimax_m2 --heads 8 --kv-heads 4 --head-dim 4" "gpt_oss" "ernie4_5_moe"
            "deepseek_v2" "qwen3_next" "qwen3_5_moe_text" "llama4_text --layers 6")
  foreach(case IN LISTS cases)
    separate_arguments(args UNIX_COMMAND "${case}")
    list(GET args 0 type)
    string(REPLACE " " "" dir_name "${case}")
    set(dir "${WORK_DIR}/${dir_name}")
    execute_process(COMMAND "${MAKER}" "${dir}" ${args} --whole-model RESULT_VARIABLE rc
                    ERROR_VARIABLE err)
    if(NOT rc EQUAL 0 OR NOT err MATCHES "^moe_hf_make_tiny_checkpoint: wrote [^\n]*: ${type}, whole model of [0-9]+ layers \\(MoE: ([0-9]+)[^\n]*\n$")
      message(FATAL_ERROR "${MAKER} ${dir} ${case} --whole-model (${rc}): expected one line "
                          "saying what it wrote, got:\n${err}")
    endif()
    set(moe_layer ${CMAKE_MATCH_1})
    foreach(f config.json model.safetensors tokenizer.json tokenizer_config.json x.safetensors
              dy.safetensors)
      if(NOT EXISTS "${dir}/${f}")
        message(FATAL_ERROR "${case} --whole-model wrote no ${f}")
      endif()
    endforeach()
    if(TEXT)
      set(prompt --prompt "Why is the sky blue?" --chat)
    else()
      set(prompt --prompt-ids 1,2,3)
    endif()
    execute_process(COMMAND "${GENERATE}" --model "${dir}" ${prompt} --max-new-tokens 4 --ignore-eos
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0 OR NOT err MATCHES "decode 3 steps")
      message(FATAL_ERROR "moe_generate on ${case} (${rc}):\n${out}\n${err}")
    endif()
    execute_process(COMMAND "${RUNNER}" --model "${dir}" --layer ${moe_layer} --input
                            "${dir}/x.safetensors" --output "${dir}/y.safetensors" --grad
                            "${dir}/dy.safetensors" RESULT_VARIABLE rc ERROR_VARIABLE err)
    if(NOT rc EQUAL 0 OR NOT EXISTS "${dir}/y.safetensors")
      message(FATAL_ERROR "moe_run_hf_layer on ${case}, layer ${moe_layer} (${rc}): ${err}")
    endif()
    if(case STREQUAL "qwen3_moe")  # the defaults stream: experts 32 wide
      execute_process(COMMAND "${GENERATE}" --model "${dir}" --prompt-ids 1,2,3 --max-new-tokens 2
                              --stream-experts --expert-cache 1MiB RESULT_VARIABLE rc
                              ERROR_VARIABLE err)
      if(NOT rc EQUAL 0)
        message(FATAL_ERROR "moe_generate --stream-experts on ${case} (${rc}):\n${err}")
      endif()
    endif()
    if(type STREQUAL "gpt_oss")  # llama.cpp's GGUF cannot hold its swiglu_limit 0.5: refused
      execute_process(COMMAND "${QUANTIZE}" --model "${dir}" --out "${dir}/model.gguf"
                      RESULT_VARIABLE rc ERROR_VARIABLE err)
      if(NOT rc EQUAL 1 OR NOT err MATCHES "swiglu_limit 0.5" OR EXISTS "${dir}/model.gguf")
        message(FATAL_ERROR "moe_quantize --out FILE.gguf on gpt_oss (${rc}):\n${err}")
      endif()
    endif()
    if(type STREQUAL "qwen3_next")
      execute_process(COMMAND "${ATTENTION}" --model "${dir}" --layer 1 --input
                              "${dir}/x.safetensors" --output "${dir}/attention.safetensors"
                              --grad "${dir}/dy.safetensors" RESULT_VARIABLE rc ERROR_VARIABLE err)
      if(NOT rc EQUAL 0 OR NOT EXISTS "${dir}/attention.safetensors")
        message(FATAL_ERROR "moe_run_hf_attention on ${case}, layer 1 (${rc}): ${err}")
      endif()
    endif()
    message(STATUS "${case} --whole-model: generates, layer ${moe_layer} runs")
  endforeach()
  # The maker's own refusals: exit 1 (2 for an unknown argument), one line on stderr.
  set(d "${WORK_DIR}/refused")
  set(cases
      "vocabulary below the tokenizer's|${d}^qwen3_moe^--whole-model^--vocab^100|below the tokenizer's 259"
      "top-k above the experts|${d}^qwen3_moe^--whole-model^--experts^4^--top-k^5|exceeds the 4 experts"
      "kv heads not dividing|${d}^qwen3_moe^--whole-model^--kv-heads^3|does not divide"
      "odd head size|${d}^qwen3_moe^--whole-model^--head-dim^6|multiple of 4"
      "one layer|${d}^qwen3_moe^--whole-model^--layers^1|--layers .1. is not an integer in"
      "too large|${d}^qwen3_moe^--whole-model^--hidden^16384^--vocab^1048576|GiB of weights"
      "not a family|${d}^llama^--whole-model|MODEL_TYPE 'llama' is not one of"
      "layer option|${d}^qwen3_moe^--whole-model^--shards^2|--shards is for a layer checkpoint"
      "whole-model size|${d}^qwen3_moe^--vocab^400|add --whole-model"
      "mxfp4 width|${d}^gpt_oss^--mxfp4^--hidden^48|multiples of 32"
      "unknown flag|${d}^qwen3_moe^--whole|unknown argument '--whole'"
      "MLA head size|${d}^deepseek_v3^--whole-model^--head-dim^16|drop --head-dim and --kv-heads"
      "biases and fused|${d}^ernie4_5_moe^--use-bias^--fused|fused expert tensors have no biases"
      "not empty|${WORK_DIR}/qwen3_moe^qwen3_moe|is not empty; pass a new or empty directory")
  expect_refusals("${MAKER}" "${d}" ${cases})
else()
  message(FATAL_ERROR "MODE must be ok, bad or whole")
endif()
