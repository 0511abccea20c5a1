#!/usr/bin/env bash
# CI step: compile and link every target with CUDA on (LVX_CUDA=ON, architectures 80 and 90), so
# the CUDA path cannot rot on machines without a GPU (nvcc and the cu130 torch wheel suffice;
# nothing is run). Run after setup.sh: the folder sits beside `build` and compiles with the same
# ccache settings, so every C++ file without CUDA code hits the CPU build's cache objects (same
# flags, same relative paths); the time it adds is the nvcc compiles, the CUDA-specific C++
# files and the links.
#
# Usage: .ci/build_cuda.sh [TARGET ...]   (default: every target; tests/gpu/pack.sh names its own)
# Environment: LVX_VENV (as setup.sh), LVX_CUDA_BUILD_DIR (default build-cuda),
#              LVX_CUDA_ARCHITECTURES (default "80;90"), LVX_WERROR.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${LVX_VENV:-$HOME/.cache/lvx/venv}
build=${LVX_CUDA_BUILD_DIR:-build-cuda}
archs=${LVX_CUDA_ARCHITECTURES:-80;90}
log() { echo "[build_cuda] $*" >&2; }
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
command -v nvcc >/dev/null 2>&1 || { echo "[build_cuda] nvcc not found (CUDA toolkit)" >&2; exit 1; }
t0=$(date +%s)
export CCACHE_BASEDIR="$root"
export CCACHE_NOHASHDIR=1
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLVX_PYTHON="$venv/bin/python" \
  -DLVX_CUDA=ON -DLVX_CUDA_ARCHITECTURES="$archs" -DLVX_WERROR="${LVX_WERROR:-OFF}" >/dev/null
if [ $# -gt 0 ]; then
  log "compiling and linking $* with CUDA (architectures $archs) in $build"
  cmake --build "$build" -j "$(nproc)" --target "$@"
else
  log "compiling and linking every target with CUDA (architectures $archs) in $build"
  cmake --build "$build" -j "$(nproc)"
  # The link that used to fail: CUDA objects inside the Python op library must be PIC.
  test -f "$build/python/lvx/_lvx_ops.so" || { log "python/lvx/_lvx_ops.so was not linked"; exit 1; }
fi
log "CUDA build done in $(( $(date +%s) - t0 )) s"
