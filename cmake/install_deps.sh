#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the Debian 12 packages moe needs to build its tests, benches and examples.
# Idempotent: does nothing when everything is already installed. Run as root (or via sudo).
set -euo pipefail
packages=(g++ cmake make ninja-build libeigen3-dev libxsimd-dev catch2 libbenchmark-dev clang-format clang-14
          libclang-rt-14-dev libopenmpi-dev openmpi-bin python3
          libpcre2-dev libicu-dev)
# node and npm run the tokenizer's oracle test (tests/text/oracle); Debian's, unless a node is
# already on the PATH.
command -v node >/dev/null 2>&1 || packages+=(nodejs)
command -v npm >/dev/null 2>&1 || packages+=(npm)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all of ${packages[*]} already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_deps: missing ${missing[*]}; run as root or with sudo" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
