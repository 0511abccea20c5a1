#!/usr/bin/env bash
# lvx set-up for a fresh Debian 12 machine (no GPU needed): installs what lvx needs (apt and pip,
# pinned), configures and builds with CMake + Ninja + ccache, then runs the main job on a small
# built-in default. Re-running is fast and safe: nothing is re-installed or rebuilt without cause.
#
# Environment knobs:
#   LVX_VENV      Python virtual environment holding the pinned torch wheel
#                 (default ~/.cache/lvx/venv; outside the checkout so fresh clones reuse it)
#   LVX_CUDA      AUTO | ON | OFF. Default: AUTO when a GPU is visible (nvidia-smi), else OFF,
#                 so a CPU machine builds the complete CPU runtime quickly.
#   LVX_WERROR    ON to treat warnings as errors (CI sets it)
#   LVX_BUILD_DIR build directory (default ./build)
#   LVX_SKIP_DEMO 1 to skip the main job at the end
set -euo pipefail
cd "$(dirname "$0")"
root=$(pwd)
log() { echo "[setup] $*" >&2; }
t_start=$(date +%s)

# ---- 1. system packages (Debian 12 "bookworm" versions; apt resolves the exact patch level) --
apt_packages=(
  build-essential cmake ninja-build ccache pkg-config git
  python3 python3-venv
  ffmpeg libavformat-dev libavcodec-dev libavutil-dev libswscale-dev
  libopencv-core-dev libopencv-imgproc-dev
  libyaml-cpp-dev nlohmann-json3-dev libgtest-dev libgloo-dev libpcre2-dev libicu-dev libxxhash-dev
  libcpp-httplib-dev
  patchelf iproute2
)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing apt packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  log "apt packages present"
fi

# ---- 2. Python packages, pinned in requirements.txt (torch 2.11.0 carries libtorch) --------
# requirements-nodeps.txt: reference packages installed without their dependencies (their own
# pins are older than ours); the hash covers both files.
venv=${LVX_VENV:-$HOME/.cache/lvx/venv}
if [ ! -x "$venv/bin/python" ]; then
  base_python=/usr/bin/python3
  [ -x "$base_python" ] || base_python=$(command -v python3)
  log "creating virtual environment $venv"
  "$base_python" -m venv "$venv"
fi
req_hash=$(cat requirements.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.lvx-requirements" 2>/dev/null || true)" != "$req_hash" ]; then
  log "installing pinned Python packages (requirements.txt, requirements-nodeps.txt)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    -r requirements-nodeps.txt
  echo "$req_hash" > "$venv/.lvx-requirements"
else
  log "Python packages present"
fi

# ---- 3. configure and build --------------------------------------------------------------
build=${LVX_BUILD_DIR:-build}
cuda=${LVX_CUDA:-}
if [ -z "$cuda" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=AUTO; else cuda=OFF; fi
fi
export CCACHE_BASEDIR="$root"          # fresh clones in other folders still hit the cache
export CCACHE_NOHASHDIR=1
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLVX_PYTHON="$venv/bin/python" -DLVX_CUDA="$cuda" -DLVX_WERROR="${LVX_WERROR:-OFF}" >/dev/null
log "building in $build (CUDA: $cuda)"
cmake --build "$build" -j "$(nproc)"
# The Python package (`import lvx`), built from the same build folder: one target, then a copy.
log "installing the Python package (python/) into $venv"
LVX_BUILD_DIR="$(cd "$build" && pwd)" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps "$root/python"
log "set-up done in $(( $(date +%s) - t_start )) s"

# ---- 4. the main job on a small built-in default -----------------------------------------
if [ "${LVX_SKIP_DEMO:-0}" != "1" ]; then
  "$build/lvx" demo
fi
