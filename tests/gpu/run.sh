#!/usr/bin/env bash
# lvx on a GPU machine, one command (issue 21, "Ready for the first GPU"): builds the CUDA parts,
# runs the kernel gate against fp64 on the GPU (the default ATen fused path and lvx's GEMM path),
# the distributed suite and every attention
# strategy at world 1-4 with the ranks sharing the one GPU, `lvx forward/qa/finetune` of a tiny
# model on the GPU when the full build is possible, and bench_kernels; prints one table.
#
# Assumes torch 2.11 (the pinned cu130 wheel), nvcc, CMake and ninja; no network. Without
# FFmpeg/OpenCV/yaml-cpp/PCRE2/ICU development files it builds with -DLVX_GPU_ONLY=ON (common,
# dist, kernels, attention, their tests, bench_kernels) and skips the jobs that need the lvx binary.
# The remaining header/library dependencies (gloo headers, nlohmann_json, xxHash, GTest) can be
# brought from a machine that has them:  tests/gpu/run.sh --bring DIR  (here), copy DIR over,
# then  LVX_DEPS_PREFIX=DIR tests/gpu/run.sh  (there).
#
# Usage: tests/gpu/run.sh [--dry-run] [--bring DIR]
#   --dry-run   check the machine and print every step without building or running (works on
#               a CPU-only machine: that is how CI checks the script)
# Environment: LVX_PYTHON (python with torch; default ~/.cache/lvx/venv/bin/python, else python3),
#   LVX_GPU_BUILD_DIR (default build-gpu), LVX_CUDA_ARCHITECTURES (default: the GPU's own),
#   LVX_DEPS_PREFIX (see --bring), LVX_GPU_ONLY=ON|OFF (default: detected).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
dry=0
bring=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --bring) bring=${2:?--bring needs a folder}; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (expected --dry-run or --bring DIR)" >&2; exit 2 ;;
  esac
  shift
done
log() { echo "[gpu] $*" >&2; }

# ---- --bring: pack the header/library dependencies of the GPU-only build --------------------
if [ -n "$bring" ]; then
  # The same layout as /usr (include/, lib/<arch>/, share/), so that the packages' own CMake and
  # pkg-config files find their files relative to DIR.
  arch=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
  mkdir -p "$bring/include" "$bring/lib/$arch/pkgconfig" "$bring/lib/$arch/cmake" "$bring/share/cmake"
  for d in gloo nlohmann gtest gmock; do
    [ -d "/usr/include/$d" ] && cp -r "/usr/include/$d" "$bring/include/" || { log "missing /usr/include/$d"; exit 1; }
  done
  cp /usr/include/xxhash.h "$bring/include/" && cp -P /usr/lib/$arch/libxxhash.so* "$bring/lib/$arch/" &&
    cp /usr/lib/$arch/libgtest*.a /usr/lib/$arch/libgmock*.a "$bring/lib/$arch/" &&
    cp -r /usr/lib/$arch/cmake/GTest "$bring/lib/$arch/cmake/" &&
    cp -r /usr/share/cmake/nlohmann_json "$bring/share/cmake/" || { log "a dependency is missing here"; exit 1; }
  sed "s|^prefix=.*|prefix=$(cd "$bring" && pwd)|" /usr/lib/$arch/pkgconfig/libxxhash.pc \
    > "$bring/lib/$arch/pkgconfig/libxxhash.pc"
  log "dependencies packed in $bring ($(du -sh "$bring" | cut -f1)); on the GPU machine:"
  log "  LVX_DEPS_PREFIX=/path/to/$(basename "$bring") tests/gpu/run.sh"
  exit 0
fi

# ---- the table ------------------------------------------------------------------------------
rows=()
row() { rows+=("$(printf '%-44s %-8s %8s  %s' "$1" "$2" "$3" "$4")"); }
print_table() {
  echo
  printf '%-44s %-8s %8s  %s\n' "step" "result" "seconds" "detail"
  printf '%s\n' "--------------------------------------------------------------------------------------------"
  printf '%s\n' "${rows[@]}"
}
failed=0
# step NAME DETAIL_FILE -- command...: runs it (or only prints it with --dry-run), one table row.
step() {
  local name=$1 out=$2; shift 3
  if [ $dry = 1 ]; then
    echo "[dry-run] $name: $*"
    row "$name" "dry-run" "-" "$*"
    return 0
  fi
  log "$name"
  local t0=$(date +%s) rc
  "$@" > "$out" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 )) detail
  detail=$(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|tests? (passed|failed)' "$out" | tail -1)
  [ -z "$detail" ] && detail=$(tail -1 "$out")
  if [ $rc = 0 ]; then row "$name" "PASS" "$dt" "${detail:0:60}"; else
    row "$name" "FAIL($rc)" "$dt" "${detail:0:60} (log: $out)"; failed=1; fi
  return $rc
}
skip() { row "$1" "SKIP" "-" "$2"; }

# ---- the machine ----------------------------------------------------------------------------
python=${LVX_PYTHON:-$HOME/.cache/lvx/venv/bin/python}
[ -x "$python" ] || python=$(command -v python3)
gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | grep -c '^GPU')
fi
torch_cuda=$("$python" -c "import torch; print(int(torch.cuda.is_available()), torch.__version__, torch.version.cuda)" 2>/dev/null || echo "0 none none")
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do [ -x "$d/nvcc" ] && PATH="$d:$PATH" && break; done
fi
nvcc_v=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo "no nvcc")
archs=${LVX_CUDA_ARCHITECTURES:-}
if [ -z "$archs" ] && [ "$gpus" -gt 0 ]; then
  archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
fi
archs=${archs:-80;90}
row "machine" "info" "-" "GPUs: $gpus; torch (cuda ok, version, cuda): $torch_cuda; nvcc: $nvcc_v; arch $archs"
for t in cmake ninja "$python"; do
  command -v "$t" >/dev/null 2>&1 || { row "tool $t" "MISSING" "-" "install it"; failed=1; }
done
if [ "$gpus" = 0 ] && [ $dry = 0 ]; then
  log "no GPU visible (nvidia-smi): this script is for a GPU machine; --dry-run checks it elsewhere"
  print_table; exit 1
fi

# Full build when the system packages of the complete runtime are present, else GPU-only.
deps_arch=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
if [ -n "${LVX_DEPS_PREFIX:-}" ]; then  # the folder may sit elsewhere than where it was packed
  LVX_DEPS_PREFIX=$(cd "$LVX_DEPS_PREFIX" && pwd)
  pc=$LVX_DEPS_PREFIX/lib/$deps_arch/pkgconfig/libxxhash.pc
  [ -f "$pc" ] && [ $dry = 0 ] && sed -i "s|^prefix=.*|prefix=$LVX_DEPS_PREFIX|" "$pc"
fi
export PKG_CONFIG_PATH=${LVX_DEPS_PREFIX:+$LVX_DEPS_PREFIX/lib/$deps_arch/pkgconfig:}${PKG_CONFIG_PATH:-}
gpu_only=${LVX_GPU_ONLY:-}
if [ -z "$gpu_only" ]; then
  gpu_only=ON
  if pkg-config --exists libavformat libavcodec libswscale libpcre2-8 icu-uc 2>/dev/null &&
     [ -f /usr/include/opencv4/opencv2/core.hpp ] && [ -d /usr/include/yaml-cpp ]; then gpu_only=OFF; fi
fi
row "build mode" "info" "-" "LVX_GPU_ONLY=$gpu_only${LVX_DEPS_PREFIX:+ (deps from $LVX_DEPS_PREFIX)}"

# ---- build ------------------------------------------------------------------------------------
build=${LVX_GPU_BUILD_DIR:-build-gpu}
logs=$build/gpu-logs
[ $dry = 1 ] || mkdir -p "$logs"
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
targets=(lvx_test_kernels lvx_test_dist lvx_test_attention lvx_gpu_dist_cuda bench_kernels)
[ "$gpu_only" = OFF ] && targets+=(lvx)
step "configure (CUDA, arch $archs)" "$logs/configure.log" -- \
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLVX_PYTHON="$python" -DLVX_CUDA=ON \
  -DLVX_CUDA_ARCHITECTURES="$archs" -DLVX_GPU_ONLY="$gpu_only" -DLVX_BUILD_PYTHON=OFF \
  ${LVX_DEPS_PREFIX:+-DCMAKE_PREFIX_PATH=$LVX_DEPS_PREFIX} || { print_table; exit 1; }
step "build ${targets[*]}" "$logs/build.log" -- \
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" || { print_table; exit 1; }

# ---- the kernel gate against fp64 (CPU and CUDA twins; the CUDA cases run now) ---------------
# Twice on the GPU: the default (ATen's flash / memory-efficient attention through the shared
# plan, kernels/attention_fused.h; compiled but never run on a GPU before this script) and lvx's
# GEMM path (LVX_CUDA_ATTENTION=gemm). AttentionKernelCuda prints which path ran per dtype
# ("[cuda path] ...": tiles the fused plan computed) and fails if the default did not fuse.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
paths_row() {  # the "[cuda path]" lines of a gate log, one table row
  [ $dry = 1 ] && return 0
  row "  ...paths" "info" "-" "$(grep -o '\[cuda path\].*' "$1" | sed 's/\[cuda path\] //; s/LVX_CUDA_ATTENTION=//' | tr '\n' ';' | cut -c1-120)"
}
step "kernel gate vs fp64, default: ATen fused" "$logs/kernels.log" -- "$build/tests/lvx_test_kernels"
paths_row "$logs/kernels.log"
# A CUDA case skipped here would mean the GPU was not used: say so.
if [ $dry = 0 ] && grep -q '\[  SKIPPED \]' "$logs/kernels.log"; then
  row "  ...of which skipped" "WARN" "-" "$(grep -c '\[  SKIPPED \]' "$logs/kernels.log") cases (see log)"
fi
step "kernel gate vs fp64, LVX_CUDA_ATTENTION=gemm" "$logs/kernels_gemm.log" -- \
  env LVX_CUDA_ATTENTION=gemm "$build/tests/lvx_test_kernels" --gtest_filter='AttentionKernelCuda.*'
paths_row "$logs/kernels_gemm.log"

# ---- distributed suite and every strategy at world 1-4, ranks sharing the one GPU ------------
# NCCL refuses two ranks on one GPU, so the shared-GPU runs use Gloo (host staging). The CLI
# cases need the lvx binary (full build only).
cli_filter=""
[ "$gpu_only" = ON ] && cli_filter="--gtest_filter=-*Cli*:Launch.*"
step "process group (lvx_test_dist)" "$logs/dist.log" -- "$build/tests/lvx_test_dist" $cli_filter
for n in 1 2 3 4; do  # CUDA tensors, every rank on GPU 0 (n > 1: Gloo with host staging)
  step "process group, CUDA tensors, world $n (1 GPU)" "$logs/dist_cuda_$n.log" -- \
    env CUDA_VISIBLE_DEVICES=0 "$python" -m torch.distributed.run --standalone --no-python \
    --nproc_per_node=$n "$build/tests/lvx_gpu_dist_cuda"
done
# The strategy suite at world 1-4 with every rank's inputs on GPU 0 (LVX_TEST_DEVICE=cuda; the
# float64 references stay on the CPU). Ranks share the one GPU, so messages go through Gloo with
# host staging (NCCL refuses two ranks per GPU).
step "strategies x masks, world 1-4 (CUDA tensors, 1 GPU)" "$logs/attention.log" -- \
  env CUDA_VISIBLE_DEVICES=0 LVX_TEST_DEVICE=cuda "$build/tests/lvx_test_attention" $cli_filter

# ---- jobs of a tiny model on the GPU (full build only) --------------------------------------
# lvx demo makes a synthetic long-video task and a tiny random mPLUG-Owl3, runs lvx finetune and
# lvx qa on it (small settings here: a smoke run, not an accuracy figure).
if [ "$gpu_only" = OFF ]; then
  demo=(demo --workdir "$build/gpu-demo" --fresh --videos 16 --seconds 20 --frames 8 --steps 20)
  if [ $dry = 1 ] || "$build/lvx" demo --help 2>&1 | grep -q -- '--device'; then
    step "lvx demo --device cuda (finetune + qa, tiny)" "$logs/demo.log" -- \
      "$build/lvx" "${demo[@]}" --device cuda
  else
    step "lvx demo (no --device flag yet: on CPU)" "$logs/demo.log" -- "$build/lvx" "${demo[@]}"
  fi
  skip "lvx forward --device cuda" "needs a tiny model + batch; lvx_test_models runs it (CPU)"
else
  skip "lvx forward/qa/finetune on the GPU" "GPU-only build (no FFmpeg/OpenCV/... dev files)"
fi

# ---- bench_kernels: lvx's local attention against SDPA on the GPU -------------------------
step "bench_kernels (lvx vs SDPA)" "$logs/bench_kernels.log" -- "$build/benchmarks/bench_kernels"

print_table
if [ $dry = 0 ]; then
  echo
  echo "bench_kernels table ($logs/bench_kernels.log):"
  grep -E '\|' "$logs/bench_kernels.log" | head -80 || true
fi
exit $failed
