"""The CPU fast path: run MLX's float32 matmuls on a system OpenBLAS instead of its own BLAS.

The Linux `mlx[cpu]` wheel links a bundled reference BLAS (~5 GFLOPS on 2 cores); preloading
the system OpenBLAS (`LD_PRELOAD`) makes its `cblas_sgemm` win symbol resolution and matmul
~20x faster. A preload only works from process start, hence the re-exec in `ensure_fast_blas`.
Nothing here imports mlx at module level, so the serving process can call this first.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

DISABLE_ENV = "MLXCEL_NO_OPENBLAS"
# Set in the re-executed process so a failed preload never loops.
REEXEC_MARK_ENV = "MLXCEL_BLAS_REEXEC"

# Debian/Ubuntu (libopenblas0-pthread), Fedora, Alpine/Arch locations, then ldconfig.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@cache
def find_system_openblas() -> Path | None:
    """The path of a system OpenBLAS shared library, or None (always None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    for candidate in _CANDIDATES:
        if Path(candidate).is_file():
            return Path(candidate)
    return _ldconfig_openblas()


def _ldconfig_openblas() -> Path | None:
    try:
        out = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        name, _, target = line.partition("=>")
        if "libopenblas" in name and target.strip():
            return Path(target.strip())
    return None


def _mapped_libraries() -> list[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return [line.split()[-1] for line in maps if "/" in line]
    except OSError:
        return []


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


def global_sgemm_library() -> str | None:
    """The file that provides `cblas_sgemm` in the global symbol scope, which is the one MLX
    calls; None when no global library has it (MLX then uses its own bundled BLAS).

    Name checks alone mislead: numpy maps its own `libscipy_openblas` with prefixed symbols.
    """
    try:
        process = ctypes.CDLL(None)
        func = process.cblas_sgemm
        dladdr = process.dladdr
    except (AttributeError, OSError):
        return None
    dladdr.argtypes = (ctypes.c_void_p, ctypes.POINTER(_DlInfo))
    info = _DlInfo()
    if not dladdr(ctypes.cast(func, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def openblas_loaded() -> bool:
    """True when an OpenBLAS provides the global `cblas_sgemm` (preloaded or linked)."""
    lib = global_sgemm_library()
    return lib is not None and Path(lib).name.startswith("libopenblas")


def _preload_entries(env: Mapping[str, str]) -> list[str]:
    return [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]


def fast_blas_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default os.environ) whose LD_PRELOAD includes the system OpenBLAS.

    Unchanged when there is none, off Linux, or when MLXCEL_NO_OPENBLAS is set.
    """
    env = dict(os.environ if base is None else base)
    lib = find_system_openblas()
    if lib is None or env.get(DISABLE_ENV):
        return env
    entries = _preload_entries(env)
    if str(lib) not in entries:
        env["LD_PRELOAD"] = " ".join([str(lib), *entries])
    return env


def slow_blas_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` with the OpenBLAS preload removed and the fast path disabled."""
    env = dict(os.environ if base is None else base)
    kept = [p for p in _preload_entries(env) if "openblas" not in Path(p).name]
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    else:
        env.pop("LD_PRELOAD", None)
    env[DISABLE_ENV] = "1"
    return env


def ensure_fast_blas(argv: Sequence[str] | None = None) -> None:
    """Re-exec this process with the system OpenBLAS preloaded, when that helps.

    Call it first thing in the serving process, before mlx is imported. It returns (doing
    nothing) off Linux, when MLXCEL_NO_OPENBLAS is set, when no system OpenBLAS exists, when
    one is already loaded, or in the re-executed process itself. `argv` defaults to this
    interpreter's own arguments (`sys.orig_argv[1:]`, so `python -m pkg` survives).
    """
    if os.environ.get(DISABLE_ENV) or os.environ.get(REEXEC_MARK_ENV):
        return
    if find_system_openblas() is None or openblas_loaded():
        return
    args = list(sys.orig_argv[1:] if argv is None else argv)
    env = fast_blas_env()
    env[REEXEC_MARK_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)


def blas_name() -> str:
    """Which BLAS MLX's CPU matmuls use here: openblas, mkl, blis, accelerate, reference, ..."""
    if sys.platform == "darwin":
        return "accelerate"
    lib = global_sgemm_library()
    if lib is not None:
        name = Path(lib).name
        for marker in ("openblas", "mkl", "blis"):
            if marker in name:
                return marker
        return name.split(".so")[0].removeprefix("lib")
    # No global provider: MLX uses the BLAS it links privately (a bundled reference BLAS in
    # the Linux wheel, OpenBLAS in some source builds).
    names = [Path(lib).name for lib in _mapped_libraries()]
    for prefix, name in (("libopenblas", "openblas"), ("libmkl", "mkl"), ("libblas", "reference")):
        if any(n.startswith(prefix) for n in names):
            return name
    return "unknown"
