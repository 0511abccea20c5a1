#!/usr/bin/env bash
# CTest gpu_rehearsal: tests/gpu/rehearse.sh on ARCHIVE when it exists (.ci/run packs it from the
# CUDA build before the tests), else exit 77, which CTest reports as skipped.
set -euo pipefail
archive=${1:?usage: tests/gpu/rehearse_if_packed.sh ARCHIVE.tar.gz}
if [ ! -f "$archive" ]; then
  echo "no GPU archive at $archive (packed by .ci/run: .ci/build_cuda.sh, tests/gpu/pack.sh)"
  exit 77
fi
exec bash "$(dirname "$0")/rehearse.sh" "$archive"
