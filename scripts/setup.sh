#!/usr/bin/env bash
# Set up mlxcel in ./.venv from a fresh clone: python3 and the package registries only.
#   scripts/setup.sh          runtime install
#   scripts/setup.sh --dev    also the test tools (pytest, ruff, openai, ...) and test system packages
# MLX backend on Linux: MLXCEL_BACKEND=cpu (default), cuda (CUDA 12) or cuda13; exactly one.
# On Linux it also installs the system OpenBLAS (apt, when run as root or with sudo): the MLX
# CPU wheel's bundled BLAS is a slow reference one, OpenBLAS makes serving ~12x faster.
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0
[ "${1:-}" = "--dev" ] && dev=1

apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 0
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo"; else
      echo "setup: please install with apt: ${missing[*]}" >&2; return 0; fi
  fi
  echo "setup: apt-get install ${missing[*]}" >&2
  $sudo apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || echo "setup: could not install ${missing[*]} (continuing)" >&2
}

if [ "$(uname -s)" = Linux ]; then
  apt_install libopenblas0-pthread
  [ $dev = 1 ] && apt_install tmux systemd uidmap  # uidmap: the non-root cross-uid test
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=.venv/setup-pip.log
extras=()
[ $dev = 1 ] && extras+=(dev)
if [ "$(uname -s)" = Linux ]; then
  backend=${MLXCEL_BACKEND:-cpu}
  case $backend in cpu|cuda|cuda13) extras+=("$backend") ;;
    *) echo "setup: MLXCEL_BACKEND must be cpu, cuda or cuda13 (got $backend)" >&2; exit 2 ;; esac
fi
target=.
[ ${#extras[@]} -gt 0 ] && target=".[$(IFS=,; echo "${extras[*]}")]"
echo "setup: installing mlxcel into .venv (pip output in $log)" >&2
# Build-backend chatter goes to the log; it is shown only when the install fails.
if ! { .venv/bin/python -m pip install -q --upgrade pip &&
       .venv/bin/python -m pip install -q -e "$target"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup: pip install failed (log above, also in $log)" >&2
  exit 1
fi
if [ "$(uname -s)" = Linux ]; then
  # The few-row sgemm kernel and the fused prefill ops (daemon/forward/native/): built now into
  # the per-user cache (~/.cache/mlxcel/native/, keyed by the sources' hash and the compiler),
  # by the code the daemon would run at its first start; without them it runs on OpenBLAS and
  # MLX's own ops. (A non-editable `pip install` builds them into the wheel instead.)
  command -v cc >/dev/null 2>&1 || apt_install gcc libc6-dev
  rm -f .venv/lib/mlxcel/libmlxcel_gemm.so .venv/lib/mlxcel/libmlxcel_ops.so  # the old place
  rmdir .venv/lib/mlxcel 2>/dev/null || true
  .venv/bin/python -m mlxcel.daemon.forward.blas build >/dev/null 2>>"$log" \
    || echo "setup: native kernels not (all) built, running without them (see $log)" >&2
fi
echo "setup: ready (.venv/bin/mlxcel-daemon, .venv/bin/mlxcel-top)" >&2
