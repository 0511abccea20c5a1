#!/usr/bin/env bash
# tests/gpu/pack.sh OUT.tar.gz: builds here, with CUDA on (sm_80, sm_90; nvcc is needed, no GPU),
# everything the GPU check runs, and packs it into one relocatable archive whose top folder is
# lvx-gpu/. On the GPU machine, which needs nothing but the pinned torch wheel in its Python:
#     tar xf OUT.tar.gz && lvx-gpu/run.sh --out DIR
#
# Inside the archive:
#   run.sh            the check (tests/gpu/run.sh)
#   bin/              lvx-core (the CLI without video decoding or HTTP), the kernel and strategy
#                     test binaries, lvx_gpu_dist, lvx_gpu_models, bench_kernels; stripped, RPATH
#                     $ORIGIN/../lib
#   lib/              every shared library they need except glibc's, libstdc++, libgcc_s, libz,
#                     the CUDA driver and what the torch wheel ships (libtorch*, libc10*, and the
#                     CUDA runtime and NCCL of its nvidia packages): run.sh finds those through
#                     the Python it is given (LVX_PYTHON)
#   models/<family>/  each family's tiny model, a batch, and the reference package's outputs
#                     (tests/reference/*_ref.py: forward+backward and a greedy loop)
#   MANIFEST          what was packed, from which commit, with which torch
# The archive must stay under 50 MiB; the script fails when it does not, or when a binary needs
# a library it cannot place (tests/gpu/rehearse.sh checks the result with ldd).
#
# Environment: LVX_VENV (as setup.sh; its Python makes the reference models), LVX_CUDA_BUILD_DIR
# (default build-cuda, shared with .ci/build_cuda.sh), LVX_CUDA_ARCHITECTURES (default "80;90").
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
out=${1:?usage: tests/gpu/pack.sh OUT.tar.gz}
case "$out" in /*) ;; *) out="$root/$out" ;; esac
venv=${LVX_VENV:-$HOME/.cache/lvx/venv}
python="$venv/bin/python"
build=${LVX_CUDA_BUILD_DIR:-build-cuda}
log() { echo "[pack] $*" >&2; }
die() { echo "[pack] error: $*" >&2; exit 1; }
command -v patchelf >/dev/null || die "patchelf is missing (setup.sh installs it)"
t0=$(date +%s)

# ---- 1. build the archive's targets with CUDA (the folder .ci/build_cuda.sh uses) ------------
bins=(lvx_core lvx_test_kernels lvx_test_attention lvx_gpu_dist lvx_gpu_models bench_kernels)
LVX_CUDA_BUILD_DIR="$build" bash .ci/build_cuda.sh "${bins[@]}"
files=("$build/lvx-core" "$build/tests/lvx_test_kernels" "$build/tests/lvx_test_attention"
       "$build/tests/lvx_gpu_dist" "$build/tests/lvx_gpu_models" "$build/benchmarks/bench_kernels")

# ---- 2. stage -------------------------------------------------------------------------------
stage=$(mktemp -d "${TMPDIR:-/tmp}/lvx-pack.XXXXXX")
trap 'rm -rf "$stage"' EXIT
top="$stage/lvx-gpu"
mkdir -p "$top/bin" "$top/lib" "$top/models"
cp tests/gpu/run.sh "$top/run.sh"
chmod +x "$top/run.sh"
for f in "${files[@]}"; do
  [ -x "$f" ] || die "$f was not built"
  cp "$f" "$top/bin/"
done

# The torch wheel's library folders: resolved there, never packed.
torch_dir=$("$python" -c "import os, torch; print(os.path.dirname(torch.__file__))")
site=$(dirname "$torch_dir")
wheel_path="$torch_dir/lib"
for d in "$site"/nvidia/*/lib; do wheel_path="$wheel_path:$d"; done
# What may resolve outside the archive and the wheel: glibc, the C++ runtime, zlib, the driver.
allowed='^(linux-vdso\.so|ld-linux-x86-64\.so|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libutil\.so|libresolv\.so|libstdc\+\+\.so|libgcc_s\.so|libz\.so|libcuda\.so|libnvidia-)'

# Copies every library `ldd` resolves for $1 that is neither allowed nor the wheel's into lib/.
place_libs() {
  local line name path
  while IFS= read -r line; do
    name=$(echo "$line" | awk '{print $1}')
    path=$(echo "$line" | awk '$2 == "=>" {print $3}')
    [ -n "$name" ] || continue
    if echo "$line" | grep -q "not found"; then die "$1 needs $name, which is not found here"; fi
    [[ "$(basename "$name")" =~ $allowed ]] && continue
    [ -z "$path" ] && continue
    case "$path" in "$site"/*) continue ;; esac
    if [ ! -e "$top/lib/$name" ]; then
      cp -L "$path" "$top/lib/$name"
      chmod u+w "$top/lib/$name"
    fi
  done < <(LD_LIBRARY_PATH="$wheel_path" ldd "$1")
}
for f in "$top"/bin/*; do
  strip --strip-unneeded "$f"
  patchelf --set-rpath '$ORIGIN/../lib' "$f"
  place_libs "$f"
done
# ldd lists the whole closure, so one pass places everything; the placed libraries find each
# other through their own RPATH.
for f in "$top"/lib/*; do
  strip --strip-unneeded "$f" 2>/dev/null || true
  patchelf --set-rpath '$ORIGIN' "$f"
done
log "binaries: $(ls "$top/bin" | tr '\n' ' ')"
log "libraries packed: $(ls "$top/lib" | tr '\n' ' ')"

# ---- 3. the tiny models and the reference packages' outputs --------------------------------
# name | script | make-model arguments | make-batch arguments
models=(
  "mplug_owl3|mplug_owl3_ref.py|--variant 240728|--layout video_qa"
  "openflamingo|openflamingo_ref.py|--lm mpt|"
  "mllama|mllama_ref.py||--length 24"
)
# Each family's model, batch and reference outputs: the families at once (each step is mostly a
# Python start and a package import; one after another they took ~70 s of CI's time).
make_family() {
  local name=$1 script=$2 margs=$3 bargs=$4
  local d="$top/models/$name" s="tests/reference/$script"
  mkdir -p "$d"
  # shellcheck disable=SC2086
  "$python" "$s" make-model "$d/model" $margs &&
    "$python" "$s" make-batch "$d/model" "$d/batch.safetensors" $bargs &&
    "$python" "$s" run "$d/model" "$d/batch.safetensors" "$d/expected.safetensors" --backward &&
    "$python" "$s" generate "$d/model" "$d/batch.safetensors" "$d/generate.safetensors" --tokens 6
}
pids=()
for m in "${models[@]}"; do
  IFS='|' read -r name script margs bargs <<< "$m"
  make_family "$name" "$script" "$margs" "$bargs" > "$stage/$name.log" 2>&1 &
  pids+=("$!")
done
for i in "${!models[@]}"; do
  name=${models[$i]%%|*}
  wait "${pids[$i]}" || { cat "$stage/$name.log" >&2; die "reference model $name"; }
done
log "models: $(ls "$top/models" | tr '\n' ' ')"

# ---- 4. manifest and archive ----------------------------------------------------------------
{
  echo "lvx GPU check archive"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), CUDA architectures ${LVX_CUDA_ARCHITECTURES:-80;90}"
  echo "torch: $("$python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
  echo "files:"
  (cd "$top" && find . -type f | sort | xargs ls -l | awk '{print "  " $5 "\t" $9}')
} > "$top/MANIFEST"
mkdir -p "$(dirname "$out")"
tar -C "$stage" -czf "$out.tmp" lvx-gpu
mv "$out.tmp" "$out"
bytes=$(stat -c %s "$out")
limit=$((50 * 1024 * 1024))
log "archive $out: $((bytes / 1024 / 1024)) MiB ($bytes bytes) in $(( $(date +%s) - t0 )) s"
[ "$bytes" -le "$limit" ] || die "the archive is $bytes bytes, over the 50 MiB limit"
