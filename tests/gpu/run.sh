#!/usr/bin/env bash
# lvx-gpu/run.sh: the GPU check, run from the unpacked archive that tests/gpu/pack.sh makes. It
# builds nothing and needs nothing but the pinned torch wheel (2.11.0+cu130) in a Python:
#     tar xf lvx-gpu.tar.gz && lvx-gpu/run.sh --out DIR
#
# Steps (each under its own timeout; each table row is printed the moment its step ends; every
# log goes under DIR, the table also to DIR/table.md):
#   libraries      every binary's shared libraries resolve (archive, torch wheel, system C/C++)
#   kernel gate    lvx_test_kernels against fp64 on the default path (ATen's fused kernels through
#                  the shared plan) and with LVX_CUDA_ATTENTION=gemm; which ATen kernel each dtype
#                  and mask reached (a row); fails if bf16/fp16 blocks without a mask missed flash
#   process group  lvx_gpu_dist on CUDA tensors at world 1-4, ranks sharing GPU 0 (Gloo, staged)
#   strategies     every strategy x mask at world 1-4 on CUDA tensors (lvx_test_attention)
#   models         each family's tiny model: forward, backward and greedy decode on the GPU
#                  against the CPU and the reference package (lvx_gpu_models through lvx-core)
#   bench_kernels  lvx's local attention against ATen's SDPA on the GPU: square and LV-XAttn
#                  shapes, fp16/bf16, forward and forward+backward
#   profile        bench_kernels --profile: where lvx's time goes against flash's (per call wall,
#                  host launch, kernel time; kernels and host operators; traces in DIR/profile)
#   two GPUs       with 2+ GPUs: the process group on NCCL (one rank per GPU, communicators made
#                  eagerly, NCCL_DEBUG=WARN, LVX_DIST_TIMEOUT_S=30) and the strategy suite with
#                  NCCL at the worlds the GPUs allow; skipped with a row on one GPU
#
# Usage: run.sh --out DIR [--device cuda|cpu]
#   --device cpu   the rehearsal (CI): every step that needs no GPU runs on the CPU, the others
#                  are skipped by name; what it checks is the archive, its paths and its harness
# Environment: LVX_PYTHON (the Python whose torch provides libtorch and CUDA; default python3),
#   LVX_STEP_TIMEOUT_S (multiplies every step's timeout; default 1).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=""
device=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift ;;
    --device) device=${2:?--device needs cuda or cpu}; shift ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (expected --out DIR [--device cuda|cpu])" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "run.sh: --out DIR is required (every log goes there)" >&2; exit 2; }
case "$device" in cuda|cpu) ;; *) echo "run.sh: --device must be cuda or cpu, got '$device'" >&2; exit 2 ;; esac
[ -d "$here/bin" ] && [ -d "$here/models" ] || {
  echo "run.sh: $here has no bin/ or models/: run it from the archive tests/gpu/pack.sh makes" >&2
  exit 2
}
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
bin=$here/bin
scale=${LVX_STEP_TIMEOUT_S:-1}

# ---- the table: a row the moment its step ends ----------------------------------------------
table=$out/table.md
failed=0
printf '| step | result | seconds | detail |\n|---|---|---|---|\n' > "$table"
row() {
  printf '%-50s %-9s %7s  %s\n' "$1" "$2" "$3" "$4"
  printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "${4//|/\\|}" >> "$table"
}
printf '%-50s %-9s %7s  %s\n' "step" "result" "seconds" "detail"
# step NAME TIMEOUT_S LOG -- command...: one row; the detail is the log's last summary line.
step() {
  local name=$1 limit=$2 logname=$3.log log=$out/$3.log; shift 4
  local t0=$SECONDS rc detail
  echo "\$ $*" > "$log"
  timeout -k 10 "$(( limit * scale ))" "$@" >> "$log" 2>&1
  rc=$?
  detail=$(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^passed|^FAILED' "$log" | tail -1)
  [ -z "$detail" ] && detail=$(grep -v '^\s*$' "$log" | tail -1)
  detail="${detail:0:100} (log: $logname)"
  if [ $rc = 0 ]; then row "$name" PASS $((SECONDS - t0)) "$detail"
  elif [ $rc = 124 ] || [ $rc = 137 ]; then row "$name" TIMEOUT $((SECONDS - t0)) "over $((limit * scale)) s; $detail"; failed=1
  else row "$name" "FAIL($rc)" $((SECONDS - t0)) "$detail"; failed=1; fi
  return $rc
}
skip() { row "$1" SKIP - "$2"; }

# ---- the machine: torch's libraries through the Python given ---------------------------------
python=${LVX_PYTHON:-python3}
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>"$out/python.log") || {
  row "torch" FAIL - "'$python' cannot import torch (set LVX_PYTHON; log: python.log)"
  exit 1
}
site=$(dirname "$torch_dir")
libpath=$torch_dir/lib
for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && libpath=$libpath:$d; done
export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
torch_info=$("$python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "gpus", torch.cuda.device_count())' 2>>"$out/python.log")
gpus=0
gpu_names=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | grep -c '^GPU')
  gpu_names=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | sort | uniq -c | sed 's/^ *//' | tr '\n' ';')
fi
row "machine" info - "device $device; GPUs $gpus ${gpu_names}torch $torch_info; $(nproc) cores"
head -3 "$here/MANIFEST" | tail -2 | tr '\n' ';' | { read -r m; row "archive" info - "$m"; }
if [ "$device" = cuda ] && [ "$gpus" = 0 ]; then
  row "GPU" FAIL - "no GPU visible (nvidia-smi): use --device cpu for the rehearsal"
  exit 1
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# fp32 on the GPU means fp32 for the comparisons: no TF32 in cuBLAS or cuDNN (driver override).
export NVIDIA_TF32_OVERRIDE=0

# ---- libraries -------------------------------------------------------------------------------
missing=""
for f in "$bin"/*; do
  m=$(ldd "$f" 2>&1 | grep 'not found' | awk '{print $1}' | tr '\n' ' ')
  [ -n "$m" ] && missing="$missing $(basename "$f"): $m;"
done
if [ -z "$missing" ]; then row "libraries (ldd of bin/*)" PASS 0 "every library resolves"
else row "libraries (ldd of bin/*)" FAIL 0 "missing:$missing"; failed=1; fi

# ---- kernel gate -----------------------------------------------------------------------------
paths_row() {  # which ATen kernel each dtype and mask reached, from the gate's [cuda path] lines
  local p
  p=$(grep -o '\[cuda path\].*' "$out/$1.log" | sed 's/\[cuda path\] [a-z]* //; s/tiles fused //; s/calls //' | tr '\n' ';')
  row "  ...kernels reached" info - "${p:-none printed}"
}
if [ "$device" = cuda ]; then
  step "kernel gate vs fp64, default (ATen fused)" 180 kernels -- "$bin/lvx_test_kernels"
  paths_row kernels
  if grep -q 'SKIPPED \] AttentionKernelCuda' "$out/kernels.log"; then
    row "  ...CUDA cases" FAIL - "skipped: the GPU was not used"; failed=1
  fi
  step "kernel gate vs fp64, LVX_CUDA_ATTENTION=gemm" 120 kernels_gemm -- \
    env LVX_CUDA_ATTENTION=gemm "$bin/lvx_test_kernels" --gtest_filter='AttentionKernelCuda.*'
  paths_row kernels_gemm
else
  step "kernel gate vs fp64 (CPU cases)" 180 kernels -- "$bin/lvx_test_kernels"
  skip "kernel gate, LVX_CUDA_ATTENTION=gemm" "needs CUDA"
fi

# ---- process group and strategies, ranks sharing one GPU -------------------------------------
dist_env=(env CUDA_VISIBLE_DEVICES=0 LVX_TEST_DEVICE="$device" LVX_DIST_TIMEOUT_S=60)
[ "$device" = cpu ] && dist_env=(env LVX_TEST_DEVICE=cpu LVX_DIST_TIMEOUT_S=60)
for n in 1 2 3 4; do
  step "process group, $device tensors, world $n$([ "$device" = cuda ] && echo ' (1 GPU)')" 60 \
    "dist_$n" -- "${dist_env[@]}" "$bin/lvx-core" launch --nproc "$n" -- "$bin/lvx_gpu_dist"
done
# The strategy suite re-executes itself as rank processes; the CLI cases need the full lvx and
# the media-mask case the reference packages (both run in the main test suite).
# The CPU rehearsal runs worlds 1 and 2 (the harness, rank processes and all; CI's own test suite
# runs every world on the CPU build), the GPU run every world (ranks sharing the GPU).
attn_filter='--gtest_filter=-*Cli*:MediaMask.MatchesTheModelsOwnMaskCode'
worlds="1-4"
if [ "$device" = cpu ]; then attn_filter="$attn_filter:*/world3:*/world4"; worlds="1-2"; fi
step "strategies x masks, world $worlds ($device tensors$([ "$device" = cuda ] && echo ', 1 GPU'))" 420 \
  attention -- "${dist_env[@]}" "$bin/lvx_test_attention" "$attn_filter"

# ---- each family's tiny model on the device --------------------------------------------------
step "models: forward, backward, greedy decode ($device vs cpu vs package)" 420 models -- \
  "$bin/lvx_gpu_models" --lvx "$bin/lvx-core" --models "$here/models" --device "$device" \
  --out "$out/models"

# ---- bench_kernels: lvx against SDPA on the same device ---------------------------------------
if [ "$device" = cuda ]; then
  step "bench_kernels (lvx vs SDPA, fp16/bf16)" 300 bench_kernels -- "$bin/bench_kernels" \
    --device cuda --dtype bf16,fp16 --shapes 4096x4096,1024x32768,256x65536 \
    --masks none,causal,mediaUpTo --heads 16 --hkv 16,4 --dim 128 --reps 5 --warmup 2
else
  step "bench_kernels (lvx vs SDPA, small, CPU)" 180 bench_kernels -- "$bin/bench_kernels" \
    --device cpu --dtype fp32 --shapes 256x1024 --masks none,causal --heads 4 --hkv 4,2 \
    --dim 32 --reps 1 --warmup 0
fi
# Where lvx's time goes against flash's on two of those shapes (benchmarks/kernel_profile.h):
# per call wall, host launch and kernel time, the kernels and host operators; traces in
# $out/profile (Chrome JSON, Perfetto opens them).
if [ "$device" = cuda ]; then
  step "bench_kernels --profile (lvx vs flash, bf16)" 240 profile -- "$bin/bench_kernels" \
    --device cuda --dtype bf16 --shapes 4096x4096,256x65536 --heads 16 --hkv 16,4 --dim 128 \
    --reps 5 --warmup 2 --profile "$out/profile"
else
  step "bench_kernels --profile (lvx vs SDPA, small, CPU)" 120 profile -- "$bin/bench_kernels" \
    --device cpu --dtype fp32 --shapes 256x1024 --heads 4 --hkv 2 --dim 32 --reps 2 \
    --warmup 1 --profile "$out/profile"
fi

# ---- two GPUs: NCCL --------------------------------------------------------------------------
if [ "$device" = cuda ] && [ "$gpus" -ge 2 ]; then
  nccl_env=(env NCCL_DEBUG=WARN LVX_DIST_TIMEOUT_S=30 LVX_TEST_DEVICE=cuda LVX_EXPECT_ENGINE=nccl)
  step "process group on NCCL, world 2 (2 GPUs)" 120 nccl_dist_2 -- \
    "${nccl_env[@]}" "$bin/lvx-core" launch --nproc 2 -- "$bin/lvx_gpu_dist"
  if [ "$gpus" -ge 4 ]; then
    step "process group on NCCL, world 4 (4 GPUs)" 120 nccl_dist_4 -- \
      "${nccl_env[@]}" "$bin/lvx-core" launch --nproc 4 -- "$bin/lvx_gpu_dist"
  fi
  step "strategies x masks on NCCL where the GPUs allow" 420 nccl_attention -- \
    env NCCL_DEBUG=WARN LVX_DIST_TIMEOUT_S=30 LVX_TEST_DEVICE=cuda "$bin/lvx_test_attention" \
    "$attn_filter"
  skip "ZeRO stage 3 on NCCL" "needs lvx finetune, which decodes video (FFmpeg): not in the archive; on a full build: tests in docs/gpu.md"
else
  skip "NCCL: process group, strategies, ZeRO stage 3" "needs 2+ GPUs ($gpus visible; NCCL refuses two ranks per GPU)"
fi

echo
cat "$table"
if [ -f "$out/bench_kernels.log" ]; then
  echo
  echo "bench_kernels ($out/bench_kernels.log):"
  grep -E '^\|' "$out/bench_kernels.log" | head -80
fi
echo
echo "run.sh: $([ $failed = 0 ] && echo 'every step passed' || echo 'some steps FAILED'); logs in $out"
exit $failed
