#!/usr/bin/env bash
# Download the optional public benchmark providers as pure-Python wheels into .wheels/, on a
# machine that can reach the package index, for one that cannot (the GPU machine): carry the
# folder along and scripts/gpu_run.sh installs what is in it (--no-deps --no-index) after
# building the package. .wheels/ is ignored by git: nothing downloaded is ever committed.
#
#   bash scripts/fetch_wheels.sh                                  # the default set below
#   WHEELS="liger-kernel==0.8.5 other-pkg==1.2" bash scripts/fetch_wheels.sh
#
# liger-kernel 0.8.5 requires torch>=2.1.2 and triton>=2.3.1 (its wheel's metadata), so it
# fits the GPU machine's torch 2.11 / triton 3.6; it imports with triton 3.6.0. It also
# imports `packaging` without declaring it; the GPU image has packaging. QuACK needs the
# binary nvidia-cutlass-dsl wheels, and Apex and flash-attn are CUDA extensions built for one
# torch: none of them is pure Python, so they are measured where installed, not fetched here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-liger-kernel==0.8.5}
mkdir -p .wheels
# shellcheck disable=SC2086  # WHEELS is a list of requirements
$PY -m pip download --no-deps --only-binary=:all: -d .wheels $WHEELS
ls -l .wheels
