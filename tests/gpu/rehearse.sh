#!/usr/bin/env bash
# tests/gpu/rehearse.sh ARCHIVE: the GPU archive's rehearsal on a CPU machine (CI runs it after
# tests/gpu/pack.sh), so that a missing library, a wrong path or a harness that compares tensors
# across devices fails here and not in a GPU session's few minutes:
#   1. unpacks ARCHIVE in a scratch folder;
#   2. checks with ldd that every binary and packed library resolves only into the archive, the
#      torch wheel's library folders, or the system's C and C++ runtime, zlib and the CUDA driver
#      (what the GPU machine has);
#   3. runs lvx-gpu/run.sh --device cpu in a stripped environment (env -i: PATH=/usr/bin:/bin,
#      LVX_PYTHON the wheel's Python, nothing else) and, where this user may make a mount
#      namespace (root), with the checkout hidden under an empty tmpfs, so nothing of the build
#      tree or the sources is reachable: every step that needs no GPU must pass.
# Environment: LVX_VENV (as setup.sh). Exit code: run.sh's, or 1 when the ldd check fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
archive=${1:?usage: tests/gpu/rehearse.sh ARCHIVE.tar.gz}
case "$archive" in /*) ;; *) archive="$root/$archive" ;; esac
venv=${LVX_VENV:-$HOME/.cache/lvx/venv}
python="$venv/bin/python"
log() { echo "[rehearse] $*" >&2; }
t0=$(date +%s)

scratch=$(mktemp -d "${TMPDIR:-/tmp}/lvx-rehearse.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
tar -C "$scratch" -xzf "$archive"
top=$scratch/lvx-gpu

# ---- ldd: nothing outside the archive, the wheel and the allowed system libraries -----------
torch_dir=$("$python" -c "import os, torch; print(os.path.dirname(torch.__file__))")
site=$(dirname "$torch_dir")
wheel_path=$torch_dir/lib
for d in "$site"/nvidia/*/lib; do wheel_path=$wheel_path:$d; done
allowed='^(linux-vdso\.so|ld-linux-x86-64\.so|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libutil\.so|libresolv\.so|libstdc\+\+\.so|libgcc_s\.so|libz\.so|libcuda\.so|libnvidia-)'
bad=0
for f in "$top"/bin/* "$top"/lib/*; do
  while IFS= read -r line; do
    name=$(echo "$line" | awk '{print $1}')
    path=$(echo "$line" | awk '$2 == "=>" {print $3}')
    if echo "$line" | grep -q "not found"; then
      log "$(basename "$f"): $name is not found"; bad=1; continue
    fi
    [ -z "$path" ] && continue
    case "$path" in "$top"/*|"$site"/*) continue ;; esac
    [[ "$(basename "$name")" =~ $allowed ]] && continue
    log "$(basename "$f"): $name resolves outside the archive and the wheel: $path"
    bad=1
  done < <(env -i LD_LIBRARY_PATH="$wheel_path" ldd "$f")
done
[ $bad = 0 ] || { log "the archive is not self-contained"; exit 1; }
log "ldd: $(ls "$top/bin" | wc -l) binaries and $(ls "$top/lib" | wc -l) libraries resolve inside the archive, the wheel and the system's C/C++ runtime"

# ---- run.sh --device cpu, stripped ----------------------------------------------------------
cmd=(env -i PATH=/usr/bin:/bin HOME="$scratch" LVX_PYTHON="$python" "$top/run.sh" --device cpu
     --out "$scratch/out")
rc=0
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  log "running lvx-gpu/run.sh --device cpu with $root hidden (mount namespace)"
  unshare -m sh -c 'mount -t tmpfs -o size=1m lvx-hidden "$0" && exec "$@"' "$root" "${cmd[@]}" || rc=$?
else
  log "running lvx-gpu/run.sh --device cpu (no mount namespace here: the checkout stays visible)"
  "${cmd[@]}" || rc=$?
fi
log "rehearsal $([ $rc = 0 ] && echo passed || echo "FAILED ($rc)") in $(( $(date +%s) - t0 )) s"
exit $rc
