#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# How long a consumer's program takes to compile against moe (issue 40's targets): three programs,
# each compiled on its own with one job, as a user would build them.
#   ffn       one preset MoeFfn forward (README "A taste"), with <moe/ffn.hpp>
#   ffn_all   the same with the umbrella header <moe/moe.hpp> (attention layers too)
#   generate  load a whole Hugging Face model and generate (docs/decoding.md)
# Each is compiled --reps times (default 3) with `g++ -std=c++20 -O2 -march=native -c`; the
# script prints the fastest and the median wall time. Run it on a quiet machine (nothing else
# building): compile times on a shared host vary by tens of percent.
#
#   bash bench/compile_time.sh [--reps N] [--cxx g++] [--flags "-O2 -march=native"]
#                              [--precompiled BUILD_DIR]
#
# --precompiled BUILD_DIR also compiles each program the way this repository's own binaries are
# built: the expert, attention and quantization kernels and the six decoders declared extern
# (MOE_EXTERN_EXPERT_KERNELS, MOE_EXTERN_DECODERS) and taken from BUILD_DIR's
# libmoe_expert_kernels.a and libmoe_decoders.a (a release build of this repository; the flags
# must match the ones those were built with, -O3 -march=native there), and links the result.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
reps=3
cxx=g++
flags="-O2 -march=native"
precompiled=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --reps) reps="$2"; shift 2 ;;
    --cxx) cxx="$2"; shift 2 ;;
    --flags) flags="$2"; shift 2 ;;
    --precompiled) precompiled="$2"; shift 2 ;;
    -h|--help) sed -n '3,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compile_time.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$reps" =~ ^[1-9][0-9]*$ ]] || { echo "compile_time.sh: --reps must be a positive integer" >&2; exit 2; }
if [[ -n "$precompiled" ]]; then
  for lib in libmoe_expert_kernels.a libmoe_decoders.a; do
    [[ -f "$precompiled/$lib" ]] || {
      echo "compile_time.sh: $precompiled/$lib not found; build it first" \
           "(cmake --build --preset release --target moe_decoders)" >&2; exit 2; }
  done
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cat > "$work/ffn.cpp" <<'EOF'
#include <moe/ffn.hpp>

int main() {
  auto layer = moe::presets::make_qwen3_moe({.hidden_size = 256, .moe_intermediate_size = 128});
  std::uint64_t seed = 1;
  for (moe::ParameterRef p : layer.parameters()) moe::fill_uniform(p.values, -0.02f, 0.02f, seed++);
  moe::RowMatrixX<float> x = moe::RowMatrixX<float>::Random(16, 256), y(16, 256);
  moe::ThreadPool pool(2);
  moe::MoeFfnWorkspace ws;
  layer.forward(moe::view(x), moe::view(y), ws, {.pool = &pool});
  return y.allFinite() ? 0 : 1;
}
EOF

sed 's|<moe/ffn.hpp>|<moe/moe.hpp>|' "$work/ffn.cpp" > "$work/ffn_all.cpp"

cat > "$work/generate.cpp" <<'EOF'
#include <moe/models/decoder.hpp>
#include <moe/models/generate.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  moe::ThreadPool pool(2);
  moe::models::AnyDecoder const model = moe::models::load_hf_decoder(argv[1], &pool);
  moe::models::GenerateOptions o;
  o.max_new_tokens = 8;
  o.pool = &pool;
  std::vector<std::int64_t> const prompt = {1, 2, 3};
  moe::models::GenerateResult const r = moe::models::generate(model, prompt, o);
  for (std::int64_t id : r.ids) std::printf("%lld\n", static_cast<long long>(id));
}
EOF

# Prints "fastest median" of `reps` timed runs of the command.
time_it() {
  local times=()
  for ((i = 0; i < reps; ++i)); do
    local t0=$EPOCHREALTIME
    "$@"
    times+=("$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {print b - a}')")
  done
  printf '%s\n' "${times[@]}" | sort -g | awk '{a[NR] = $1} END {printf "%.1f %.1f\n", a[1], a[int((NR + 1) / 2)]}'
}

common=(-std=c++20 $flags -I"$root/include" -isystem /usr/include/eigen3)
echo "compiler: $($cxx --version | head -1); flags: $flags; $reps runs each; CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
printf '%-10s %-44s %8s %8s\n' program mode "fastest" "median"
for prog in ffn ffn_all generate; do
  read -r best median < <(time_it "$cxx" "${common[@]}" -c "$work/$prog.cpp" -o "$work/$prog.o")
  printf '%-10s %-44s %7ss %7ss\n' "$prog" "header-only (-c)" "$best" "$median"
  if [[ -n "$precompiled" ]]; then
    read -r best median < <(time_it "$cxx" "${common[@]}" -DMOE_EXTERN_EXPERT_KERNELS \
        -DMOE_EXTERN_DECODERS -c "$work/$prog.cpp" -o "$work/$prog.pre.o")
    printf '%-10s %-44s %7ss %7ss\n' "$prog" "kernels, decoders precompiled (-c)" "$best" "$median"
    "$cxx" "$work/$prog.pre.o" -o "$work/$prog" "$precompiled/libmoe_decoders.a" \
        "$precompiled/libmoe_expert_kernels.a" -pthread
  fi
done
