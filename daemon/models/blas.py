"""The CPU fast path: MLX's float32 matmuls on a system OpenBLAS tuned for this CPU, with a
native few-row kernel in front of it.

The Linux `mlx[cpu]` wheel links a bundled reference BLAS (~5 GFLOPS on 2 cores); preloading
the system OpenBLAS (`LD_PRELOAD`) makes its `cblas_sgemm` win symbol resolution and matmul
~20x faster. A preload only works from process start, hence the re-exec in `ensure_fast_blas`.
The same re-exec sets `OPENBLAS_CORETYPE` to the best kernel set the CPU's flags allow (an old
OpenBLAS may not know a new CPU and fall back to SSE3 or Haswell kernels; an operator's own
value wins), and preloads `libmlxcel_gemm.so` (built from `native/fewrow_sgemm.c` by
scripts/setup.sh) in front of OpenBLAS: it runs the few-row products of a decode step itself
and forwards every other shape. Skipped where the CUDA backend is installed (the matmuls run
on the GPU). Nothing here imports mlx, so the serving process can call this first.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

DISABLE_ENV = "MLXCEL_NO_OPENBLAS"
# Set in the re-executed process so a failed preload never loops.
REEXEC_MARK_ENV = "MLXCEL_BLAS_REEXEC"
CORETYPE_ENV = "OPENBLAS_CORETYPE"
# Where the core type came from ("cpu flags" or "operator"), for the log of the child process.
CORETYPE_SOURCE_ENV = "MLXCEL_BLAS_CORETYPE_SOURCE"
NO_GEMM_ENV = "MLXCEL_NO_NATIVE_GEMM"  # run without the few-row kernel
GEMM_ISA_ENV = "MLXCEL_GEMM_ISA"  # read by the kernel: "avx2" forces its AVX2 path
GEMM_LIB_ENV = "MLXCEL_GEMM_LIB"  # a prebuilt kernel library elsewhere than the default
GEMM_SOURCE = Path(__file__).parent / "native" / "fewrow_sgemm.c"
GEMM_LIB_NAME = "libmlxcel_gemm.so"
# The fused prefill ops (attention, SwiGLU), loaded with ctypes by native_ops.py (not preloaded).
OPS_SOURCE = Path(__file__).parent / "native" / "fused_ops.c"
OPS_LIB_NAME = "libmlxcel_ops.so"
OPS_LIB_ENV = "MLXCEL_OPS_LIB"  # a prebuilt ops library elsewhere than the default
# The ABI versions the Python side speaks (mlxcel_gemm_abi() / mlxcel_ops_abi() in the C files):
# a library reporting another one is stale and refused by name. Bump with the C define.
GEMM_ABI = 1
OPS_ABI = 2

# Kernel sets of OpenBLAS's DYNAMIC_ARCH builds, best first, with the CPU flags each needs
# (an unsupported one crashes with SIGILL, so only flags the kernel reports count).
_CORETYPES = (
    ("SkylakeX", frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"})),
    ("Haswell", frozenset({"avx2", "fma"})),
    ("Sandybridge", frozenset({"avx"})),
)
_GEMM_FLAGS = frozenset({"avx2", "fma"})

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
    """True when an OpenBLAS provides the global `cblas_sgemm` (preloaded or linked), directly
    or behind the few-row kernel (which forwards to the next `cblas_sgemm`: OpenBLAS)."""
    lib = global_sgemm_library()
    if lib is not None and Path(lib).name == GEMM_LIB_NAME:
        return any(Path(m).name.startswith("libopenblas") for m in _mapped_libraries())
    return lib is not None and Path(lib).name.startswith("libopenblas")


def _preload_entries(env: Mapping[str, str]) -> list[str]:
    return [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as the kernel reports them (/proc/cpuinfo); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            return parse_cpu_flags(info.read())
    except OSError:
        return frozenset()


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The `flags` (x86) or `Features` (arm) of the first processor in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def best_coretype(flags: Iterable[str]) -> str | None:
    """The fastest OpenBLAS core type these CPU flags can run, or None (OpenBLAS decides)."""
    have = set(flags)
    for name, needs in _CORETYPES:
        if needs <= have:
            return name
    return None


def native_gemm_library(env: Mapping[str, str] | None = None) -> Path:
    """Where the few-row kernel library is (MLXCEL_GEMM_LIB, else in the virtualenv)."""
    override = (os.environ if env is None else env).get(GEMM_LIB_ENV)
    if override:
        return Path(override)
    return Path(sys.prefix) / "lib" / "mlxcel" / GEMM_LIB_NAME


def native_gemm_unavailable(env: Mapping[str, str] | None = None) -> str | None:
    """Why the few-row kernel will not be preloaded, or None when it will be."""
    env = os.environ if env is None else env
    if env.get(NO_GEMM_ENV):
        return f"turned off by {NO_GEMM_ENV}"
    if not cpu_flags() >= _GEMM_FLAGS:
        return "this CPU lacks AVX2/FMA"
    lib = native_gemm_library(env)
    if not lib.is_file():
        return f"not built ({lib} missing; scripts/setup.sh builds it)"
    return None


def native_ops_library(env: Mapping[str, str] | None = None) -> Path:
    """Where the fused ops library is (MLXCEL_OPS_LIB, else beside the few-row kernel)."""
    override = (os.environ if env is None else env).get(OPS_LIB_ENV)
    if override:
        return Path(override)
    return Path(sys.prefix) / "lib" / "mlxcel" / OPS_LIB_NAME


def _compile(source: Path, dest: Path, compiler: str | None, libs: Sequence[str]) -> Path:
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) found")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    cmd = [cc, "-O3", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(source), *libs]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
    tmp.replace(dest)  # atomic: a running daemon keeps the file it mapped
    return dest


def build_native_gemm(dest: Path | None = None, compiler: str | None = None) -> Path:
    """Compile `native/fewrow_sgemm.c` into `dest` (default: `native_gemm_library()`).

    Raises RuntimeError with the compiler's message when there is no compiler or it fails.
    """
    dest = native_gemm_library() if dest is None else dest
    return _compile(GEMM_SOURCE, dest, compiler, ["-ldl"])


def build_native_ops(dest: Path | None = None, compiler: str | None = None) -> Path:
    """Compile `native/fused_ops.c` into `dest` (default: `native_ops_library()`)."""
    dest = native_ops_library() if dest is None else dest
    return _compile(OPS_SOURCE, dest, compiler, ["-lm", "-ldl"])


def cuda_backend_installed() -> bool:
    """True when an `mlx-cuda*` distribution is installed (package metadata; mlx not imported)."""
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mlx-cuda"):
            return True
    return False


def fast_blas_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default os.environ) whose LD_PRELOAD includes the system OpenBLAS,
    the few-row kernel in front of it when it is built and the CPU has AVX2/FMA, and
    OPENBLAS_CORETYPE from the CPU flags unless the operator set one.

    Unchanged when there is no OpenBLAS, off Linux, or when MLXCEL_NO_OPENBLAS is set.
    """
    env = dict(os.environ if base is None else base)
    lib = find_system_openblas()
    if lib is None or env.get(DISABLE_ENV):
        return env
    entries = _preload_entries(env)
    front = [] if native_gemm_unavailable(env) else [str(native_gemm_library(env))]
    wanted = [*front, str(lib)]
    if not all(p in entries for p in wanted):
        env["LD_PRELOAD"] = " ".join([*wanted, *(p for p in entries if p not in wanted)])
    if CORETYPE_ENV in env:
        env.setdefault(CORETYPE_SOURCE_ENV, "operator")
    else:
        coretype = best_coretype(cpu_flags())
        if coretype is not None:
            env[CORETYPE_ENV] = coretype
            env[CORETYPE_SOURCE_ENV] = "cpu flags"
    return env


def slow_blas_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` with the OpenBLAS and kernel preloads removed and the fast path off."""
    env = dict(os.environ if base is None else base)
    kept = [
        p
        for p in _preload_entries(env)
        if "openblas" not in Path(p).name and Path(p).name != GEMM_LIB_NAME
    ]
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    else:
        env.pop("LD_PRELOAD", None)
    env[DISABLE_ENV] = "1"
    return env


def ensure_fast_blas(argv: Sequence[str] | None = None) -> None:
    """Re-exec this process with the system OpenBLAS preloaded, when that helps.

    Call it first thing in the serving process, before mlx is imported. It returns (doing
    nothing) off Linux, when MLXCEL_NO_OPENBLAS is set, when the CUDA backend is installed,
    when no system OpenBLAS exists, when one is already loaded, or in the re-executed process
    itself. `argv` defaults to this interpreter's own arguments (`sys.orig_argv[1:]`, so
    `python -m pkg` survives).
    """
    if os.environ.get(DISABLE_ENV) or os.environ.get(REEXEC_MARK_ENV):
        return
    if find_system_openblas() is None or cuda_backend_installed() or openblas_loaded():
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
    if lib is not None and Path(lib).name == GEMM_LIB_NAME and openblas_loaded():
        return "openblas"
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


def openblas_coretype() -> str | None:
    """The core type (kernel set) of the OpenBLAS that MLX calls, or None when it is not one."""
    if not openblas_loaded():
        return None
    try:
        corename = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return None
    corename.restype = ctypes.c_char_p
    name = corename()
    return name.decode() if name else None


def native_gemm_path() -> str | None:
    """The few-row kernel's path in this process ("avx512", "avx2"), or None when not loaded
    (or loaded on a CPU it cannot run on: it then forwards everything)."""
    try:
        path_fn = ctypes.CDLL(None).mlxcel_gemm_path
    except (AttributeError, OSError):
        return None
    path_fn.restype = ctypes.c_char_p
    path = (path_fn() or b"").decode()
    return path if path in ("avx512", "avx2") else None


def native_gemm_counts() -> tuple[int, int]:
    """(products the kernel ran, products it forwarded to the BLAS) so far in this process."""
    try:
        counts = ctypes.CDLL(None).mlxcel_gemm_counts
    except (AttributeError, OSError):
        return 0, 0
    native, forwarded = ctypes.c_long(), ctypes.c_long()
    counts(ctypes.byref(native), ctypes.byref(forwarded))
    return native.value, forwarded.value


def blas_label(backend: str = "cpu") -> str:
    """The matmul backend in use, for status, /v1/models and the console header:
    "metal", "cuda", "accelerate", "openblas SkylakeX + sgemm avx512", "reference", ..."""
    if backend in ("metal", "cuda"):
        return backend
    name = blas_name()
    if name != "openblas":
        return name
    label = " ".join(p for p in ("openblas", openblas_coretype()) if p)
    path = native_gemm_path()
    return f"{label} + sgemm {path}" if path else label


_logged = False


def log_blas_choice() -> None:
    """Log once per process what the CPU matmuls run on and why (core type, kernel path)."""
    global _logged
    if _logged or sys.platform == "darwin":
        return
    _logged = True
    name = blas_name()
    if name != "openblas":
        logger.info("blas: %s (no system OpenBLAS in use)", name)
        return
    coretype = openblas_coretype()
    source = os.environ.get(CORETYPE_SOURCE_ENV)
    if os.environ.get(CORETYPE_ENV) and source != "cpu flags":
        why = f"{CORETYPE_ENV} set by the operator"
    elif source == "cpu flags":
        needs = dict(_CORETYPES).get(coretype or "", frozenset())
        why = f"from the CPU flags: {' '.join(sorted(needs))}"
    else:
        why = "OpenBLAS's own choice"
    logger.info("blas: OpenBLAS core type %s (%s)", coretype, why)
    path = native_gemm_path()
    if path is not None:
        forced = os.environ.get(GEMM_ISA_ENV)
        suffix = f", forced by {GEMM_ISA_ENV}={forced}" if forced else ""
        logger.info("blas: few-row sgemm kernel active, %s path%s", path, suffix)
    else:
        reason = native_gemm_unavailable() or "loaded but this CPU lacks AVX2/FMA"
        logger.info("blas: few-row sgemm kernel not in use: %s", reason)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mlxcel.daemon.models.blas build`: compile the few-row kernel and the fused
    ops (setup.sh); exit 1 when either fails (the other is still built)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["build"]:
        print("usage: python -m mlxcel.daemon.models.blas build", file=sys.stderr)
        return 2
    status = 0
    builds = (("few-row sgemm kernel", build_native_gemm), ("fused ops", build_native_ops))
    for what, build in builds:
        try:
            print(f"built {build()}")
        except RuntimeError as exc:
            print(f"could not build the {what}: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
