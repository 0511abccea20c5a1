#!/usr/bin/env bash
# Builds bench_kernels from kernels/ alone against a Python's torch (libtorch inside the wheel),
# without CMake or the Debian -dev packages the full project needs: for a bare GPU machine.
#   benchmarks/build_kernels_standalone.sh [out_dir]      (env: PYTHON, LVX_CUDA=0|1, CUDA_ARCH)
# CUDA is on when nvcc exists and torch has libtorch_cuda.so (LVX_CUDA=0 turns it off).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build-standalone}
PY=${PYTHON:-python3}
TORCH=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__))")
JOBS=$(nproc)
CUDA=${LVX_CUDA:-auto}
if [[ "$CUDA" == auto ]]; then
  CUDA=0
  if command -v nvcc >/dev/null && [[ -f "$TORCH/lib/libtorch_cuda.so" ]]; then CUDA=1; fi
fi
mkdir -p "$OUT"
INC=(-I. -isystem "$TORCH/include" -isystem "$TORCH/include/torch/csrc/api/include")
DEFS=()
LIBS=(-L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -ltorch -ltorch_cpu -lc10)
if [[ "$CUDA" == 1 ]]; then
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
  DEFS+=(-DLVX_WITH_CUDA)
  LIBS+=(-ltorch_cuda -lc10_cuda -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudart)
  INC+=(-isystem "$CUDA_HOME/include")
fi
compile_cpp() {
  g++ -O3 -std=c++17 -fPIC -Wall -Wextra -Wno-unused-parameter "${DEFS[@]}" "${INC[@]}" \
    -c "$1" -o "$OUT/$(basename "$1").o"
}
compile_cu() {
  nvcc -O3 -std=c++17 -Xcompiler -fPIC -gencode "arch=compute_${CUDA_ARCH:-90},code=sm_${CUDA_ARCH:-90}" \
    "${DEFS[@]}" "${INC[@]}" -c "$1" -o "$OUT/$(basename "$1").o"
}
pids=()
for f in kernels/*.cpp src/cli/args.cpp benchmarks/bench_kernels.cpp; do compile_cpp "$f" & pids+=($!); done
if [[ "$CUDA" == 1 ]]; then
  for f in kernels/*.cu; do compile_cu "$f" & pids+=($!); done
fi
for p in "${pids[@]}"; do wait "$p"; done
g++ -o "$OUT/bench_kernels" "$OUT"/*.o "${LIBS[@]}" -lpthread
echo "built $OUT/bench_kernels (CUDA=$CUDA)"
