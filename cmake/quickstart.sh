#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# README Quick start, command (a): install the Debian packages, build Release, run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install_deps.sh
cmake --preset release
cmake --build --preset release --target moe_quickstart
./build/release/examples/moe_quickstart
