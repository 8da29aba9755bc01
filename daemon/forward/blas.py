"""The CPU fast path: MLX's float32 matmuls on a system OpenBLAS tuned for this CPU, with a
native few-row kernel in front of it.

The Linux `mlx[cpu]` wheel links a bundled reference BLAS (~5 GFLOPS on 2 cores); preloading
the system OpenBLAS (`LD_PRELOAD`) makes its `cblas_sgemm` win symbol resolution and matmul
~20x faster. A preload only works from process start, hence the re-exec in `ensure_fast_blas`.
The same re-exec sets `OPENBLAS_CORETYPE` to the best kernel set the CPU's flags allow (an old
OpenBLAS may not know a new CPU and fall back to SSE3 or Haswell kernels; an operator's own
value wins), and preloads `libmlxcel_gemm.so` (built from `native/fewrow_sgemm.c`) in front
of OpenBLAS: it runs the few-row products of a decode step itself and forwards every other
shape. Skipped where the CUDA backend is installed (the matmuls run on the GPU). Nothing here
imports mlx, so the serving process can call this first.

Where the native libraries come from (`resolve_native`; the same order for the few-row kernel
`libmlxcel_gemm.so` and the fused ops `libmlxcel_ops.so` of native_ops.py):

1. `MLXCEL_GEMM_LIB` / `MLXCEL_OPS_LIB`: an operator's file, used as it is (no fallback when
   it is missing or refused: the operator named it).
2. The installed package, `native/_built/`: compiled by the wheel's build step (setup.py) with
   the build machine's C compiler, used when its BUILD.json names the sources beside it.
3. The per-user cache, `MLXCEL_NATIVE_CACHE` or `$XDG_CACHE_HOME/mlxcel/native` (default
   `~/.cache/mlxcel/native`), one folder per key: platform, a hash of every file under
   `native/` (and the compile flags), and the compiler (its path and `cc --version`; `CC`
   chooses it). A missing entry is built at first use (one log line; under a file lock, so two
   daemons starting at once build once; in a temp folder renamed into place whole). A build
   that fails leaves `<lib>.error` beside it and is not retried for that key. Without a
   compiler an entry of the same sources by any compiler is used. `MLXCEL_NO_NATIVE_BUILD=1`
   builds nothing (here and in the wheel step). Editable installs (scripts/setup.sh) use this
   route; setup.sh pre-builds it with `python -m mlxcel.daemon.forward.blas build`.
4. None, with the reason (no compiler, build failed: see the .error file), logged by the
   consumer ("few-row sgemm kernel not in use: ...", "native ops: not in use (...)"); the
   daemon then runs on OpenBLAS and MLX's own ops.

Each library exports its ABI version (`mlxcel_gemm_abi()`, `mlxcel_ops_abi()`); one that
reports another version than `GEMM_ABI` / `OPS_ABI`, or lacks the function, is refused with a
WARNING naming its file and both versions, before the gemm library would be preloaded (it is
loaded RTLD_LOCAL to ask). A refused package library falls through to the cache, whose key
changes with the sources, so a stale entry is never the one looked up.

Why one module: setup.py loads this file alone, by path and with the standard library only, to
build the native libraries into a wheel; the OpenBLAS setup and the native libraries' build,
cache and ABI check must therefore stay in one file that imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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
NATIVE_CACHE_ENV = "MLXCEL_NATIVE_CACHE"  # the per-user build cache's folder
NO_BUILD_ENV = "MLXCEL_NO_NATIVE_BUILD"  # build nothing (wheel step, first run): cached only
# The ABI versions the Python side speaks (mlxcel_gemm_abi() / mlxcel_ops_abi() in the C files):
# a library reporting another one is stale and refused by name. Bump with the C define.
GEMM_ABI = 1
OPS_ABI = 5

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


# --- where the native libraries come from (the module docstring gives the order) -----------


@dataclass(frozen=True)
class NativeLibrary:
    """One native library as this process finds it: its file and where it came from
    ("override", "package", "cache"), or `path` None and `why` not."""

    kind: str  # "gemm" | "ops"
    path: Path | None
    origin: str  # "override" | "package" | "cache" | "none"
    why: str = ""

    def describe(self) -> str:
        """`from the cache: /…/libmlxcel_ops.so`, for the log lines and status."""
        if self.path is None:
            return f"not in use: {self.why}"
        where = {
            "override": f"set by {_KINDS[self.kind].env}",
            "package": "in the package",
            "cache": "from the cache",
        }
        return f"{where.get(self.origin, 'preloaded by the operator')}: {self.path}"


@dataclass(frozen=True)
class _Kind:
    lib_name: str
    env: str
    sources: tuple[str, ...]
    libs: tuple[str, ...]
    abi_symbol: str
    x86_only: bool


_KINDS = {
    "gemm": _Kind(GEMM_LIB_NAME, GEMM_LIB_ENV, (GEMM_SOURCE.name,), ("-ldl",),
                  "mlxcel_gemm_abi", True),
    "ops": _Kind(OPS_LIB_NAME, OPS_LIB_ENV, (OPS_SOURCE.name,), ("-lm", "-ldl"),
                 "mlxcel_ops_abi", False),
}  # fmt: skip
# Portable flags: the kernels pick their instruction set at run time (no -march).
_CFLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
_X86 = ("x86_64", "amd64", "i686", "i386")
_STAMP = "BUILD.json"
_refused: set[str] = set()


def expected_abi(kind: str) -> int:
    """The ABI version this Python side speaks for `kind` ("gemm" or "ops")."""
    return GEMM_ABI if kind == "gemm" else OPS_ABI


def library_abi(path: Path, kind: str) -> int | None:
    """The ABI version the library at `path` reports, None when it lacks the function.

    Loaded with RTLD_LOCAL: its symbols (the gemm library's `cblas_sgemm`) stay out of this
    process's global scope, so the check can run before deciding to preload it. Raises OSError
    when the file cannot be loaded."""
    lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    try:
        func = getattr(lib, _KINDS[kind].abi_symbol)
    except AttributeError:
        return None
    func.restype = ctypes.c_int
    func.argtypes = ()
    return int(func())


def abi_problem(path: Path, kind: str) -> str | None:
    """Why the library at `path` must not be used (cannot load, no or another ABI version), or
    None. A refusal is logged once per file (WARNING), naming it and both versions."""
    want = expected_abi(kind)
    symbol = _KINDS[kind].abi_symbol
    try:
        got = library_abi(path, kind)
    except OSError as exc:
        problem = f"cannot load {path}: {exc}"
    else:
        if got == want:
            return None
        version = f"lacks {symbol}()" if got is None else f"reports ABI version {got}"
        problem = f"refused {path}: it {version}, this mlxcel speaks version {want} (a stale build)"
    if str(path) not in _refused:
        _refused.add(str(path))
        logger.warning("native kernels: %s", problem)
    return problem


def native_dir() -> Path:
    """The C sources (package data): `native/` beside this module."""
    return GEMM_SOURCE.parent


def package_lib_dir() -> Path:
    """Where a wheel's build step puts the libraries it compiled (setup.py)."""
    return native_dir() / "_built"


def source_files() -> list[Path]:
    """Every C source and header under `native/`: what the libraries are built from."""
    found = [p for p in native_dir().rglob("*") if p.suffix in (".c", ".h") and p.is_file()]
    return sorted(found, key=lambda p: p.relative_to(native_dir()).as_posix())


@cache
def source_digest() -> str:
    """sha256 over the names and bytes of `source_files()`, and the compile flags."""
    digest = hashlib.sha256(repr((_CFLAGS, {k: v.libs for k, v in _KINDS.items()})).encode())
    for path in source_files():
        digest.update(path.relative_to(native_dir()).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _platform_tag() -> str:
    return f"{sys.platform}-{platform.machine().lower() or 'unknown'}"


def find_compiler(env: Mapping[str, str] | None = None) -> tuple[list[str] | None, str]:
    """(the compiler command, "") or (None, why there is none): `CC` when set (it may carry
    arguments; a missing program is not replaced by another), else cc, gcc or clang on PATH."""
    env = os.environ if env is None else env
    search = env.get("PATH", os.defpath)
    cc = env.get("CC", "").strip()
    if cc:
        try:
            words = shlex.split(cc)
        except ValueError:
            return None, f"CC={cc!r} is not a command line"
        program = shutil.which(words[0], path=search) if words else None
        if program is None:
            return None, f"no C compiler: CC={cc} not found"
        return [program, *words[1:]], ""
    for name in ("cc", "gcc", "clang"):
        program = shutil.which(name, path=search)
        if program:
            return [program], ""
    return None, "no C compiler (cc, gcc or clang on PATH, or CC)"


@cache
def _compiler_identity(command: tuple[str, ...]) -> str:
    """The compiler's real path, arguments and `--version` banner."""
    try:
        proc = subprocess.run(
            [*command, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        banner = proc.stdout.strip() or proc.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        banner = f"(--version failed: {exc})"
    return "\n".join([os.path.realpath(command[0]), *command[1:], banner])


def cache_key(compiler: Sequence[str]) -> str:
    """The cache entry's name: platform, source hash and compiler hash (path + --version)."""
    identity = hashlib.sha256(
        "\n".join([_compiler_identity(tuple(compiler)), platform.libc_ver()[1]]).encode()
    )
    return f"{_platform_tag()}-{source_digest()[:16]}-{identity.hexdigest()[:12]}"


def native_cache_root(env: Mapping[str, str] | None = None) -> Path:
    """The per-user kernel cache: MLXCEL_NATIVE_CACHE, else $XDG_CACHE_HOME/mlxcel/native
    (~/.cache/mlxcel/native). Per user, not per MLXCEL_HOME: an entry is keyed by what it is
    built from, so every daemon of the user shares it."""
    env = os.environ if env is None else env
    if env.get(NATIVE_CACHE_ENV):
        return Path(env[NATIVE_CACHE_ENV]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlxcel" / "native"
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return (Path(xdg) if xdg else home / ".cache") / "mlxcel" / "native"


def _compile_all(outputs: Mapping[str, Path], compiler: Sequence[str]) -> dict[str, str | None]:
    """Compile the library of each kind into its output file (at once, one compiler process
    each); {kind: None when built, else the compiler's message}. Each file appears whole
    (temp + rename)."""
    running = {}
    errors: dict[str, str | None] = {}
    for kind, out in outputs.items():
        spec = _KINDS[kind]
        if spec.x86_only and platform.machine().lower() not in _X86:
            errors[kind] = f"{spec.lib_name} is for x86-64 CPUs (AVX2/AVX-512)"
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        sources = [str(native_dir() / name) for name in spec.sources]
        cmd = [*compiler, *_CFLAGS, "-o", str(tmp), *sources, *spec.libs]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as exc:
            errors[kind] = f"{' '.join(cmd)}: {exc}"
            continue
        running[kind] = (proc, cmd, tmp)
    for kind, (proc, cmd, tmp) in running.items():
        text, _ = proc.communicate()
        if proc.returncode == 0 and tmp.is_file():
            tmp.replace(outputs[kind])  # atomic: a mapped file stays intact
            errors[kind] = None
        else:
            tmp.unlink(missing_ok=True)
            message = text.decode(errors="replace").strip()[-3000:]
            errors[kind] = f"{' '.join(cmd)} failed (exit {proc.returncode}): {message}"
    return errors


def _write_stamp(dest: Path, compiler: Sequence[str], seconds: float, errors: Mapping) -> None:
    stamp = {
        "sources": source_digest(),
        "compiler": _compiler_identity(tuple(compiler)),
        "platform": _platform_tag(),
        "abi": {"gemm": GEMM_ABI, "ops": OPS_ABI},
        "seconds": round(seconds, 2),
        "built": {kind: error is None for kind, error in errors.items()},
    }
    (dest / _STAMP).write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")


def build_package_libraries(dest: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The wheel's build step (setup.py): compile both libraries into `dest` (the package's
    `native/_built/`) with the build machine's compiler. {kind: why not} for each library
    that was not built (no compiler, MLXCEL_NO_NATIVE_BUILD, a compiler error); never raises."""
    env = os.environ if env is None else env
    if env.get(NO_BUILD_ENV):
        return dict.fromkeys(_KINDS, f"not built: {NO_BUILD_ENV} is set")
    compiler, why = find_compiler(env)
    if compiler is None:
        return dict.fromkeys(_KINDS, why)
    start = time.monotonic()
    errors = _compile_all({kind: dest / spec.lib_name for kind, spec in _KINDS.items()}, compiler)
    if any(error is None for error in errors.values()):
        _write_stamp(dest, compiler, time.monotonic() - start, errors)
    return {kind: error for kind, error in errors.items() if error is not None}


def _say(level: int, message: str) -> None:
    """Log `message`; before the daemon's logging is set up (the process that re-execs
    itself with the preload) print it to stderr, where the operator or the log file sees it."""
    if logging.getLogger().hasHandlers():
        logger.log(level, "%s", message)
    else:
        print(f"mlxcel: {message}", file=sys.stderr, flush=True)


def _estimate_seconds(root: Path) -> int:
    """The last build's time in this cache, else a guess from the sources' size (2 cores)."""
    for stamp in sorted(root.glob(f"*/{_STAMP}"), key=lambda p: p.stat().st_mtime)[-1:]:
        try:
            return max(1, round(json.loads(stamp.read_text(encoding="utf-8"))["seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return max(2, round(sum(p.stat().st_size for p in source_files()) / 10000))


def _build_cache_entry(root: Path, key: str, compiler: Sequence[str]) -> None:
    """Build every library into the cache entry `root/key`, once: under a file lock (two
    daemons starting at once wait for one build), in a temp folder renamed into place whole.
    A library that fails leaves `<name>.error` with the compiler's message (the same sources
    and compiler fail again: not retried at each start)."""
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    with open(root / f".{key}.lock", "a+b") as lock:
        with contextlib.suppress(OSError):  # no locks on this filesystem: the rename suffices
            fcntl.flock(lock, fcntl.LOCK_EX)
        if entry.is_dir():
            return  # built by another process while this one waited
        _say(
            logging.INFO,
            f"building native kernels into {entry} (first run for these sources and this "
            f"compiler, ~{_estimate_seconds(root)} s)",
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            start = time.monotonic()
            outputs = {kind: tmp / spec.lib_name for kind, spec in _KINDS.items()}
            errors = _compile_all(outputs, compiler)
            for kind, error in errors.items():
                if error is not None:
                    (tmp / f"{_KINDS[kind].lib_name}.error").write_text(error + "\n")
            _write_stamp(tmp, compiler, time.monotonic() - start, errors)
            os.chmod(tmp, 0o755)
            try:
                tmp.rename(entry)
            except OSError:
                if not entry.is_dir():
                    raise  # not "another process was first": a real error
                return  # that process's entry is as good as this one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for kind, error in errors.items():
        if error is not None and not (_KINDS[kind].x86_only and "x86-64" in error):
            last = error.strip().splitlines()[-1][:300]
            _say(
                logging.WARNING,
                f"could not build {_KINDS[kind].lib_name}: {last} "
                f"(all of it in {entry / (_KINDS[kind].lib_name + '.error')}); running without it",
            )


def _cached_entry_without_compiler(root: Path) -> Path | None:
    """An entry built from these sources on this platform by any compiler (used when the
    compiler has gone since)."""
    prefix = f"{_platform_tag()}-{source_digest()[:16]}-"
    entries = sorted(p for p in root.glob(prefix + "*") if p.is_dir())
    return entries[-1] if entries else None


def _from_cache(kind: str, env: Mapping[str, str]) -> NativeLibrary:
    spec = _KINDS[kind]
    root = native_cache_root(env)
    compiler, no_compiler = find_compiler(env)
    entry = None
    if compiler is None:
        entry = _cached_entry_without_compiler(root)
        if entry is None:
            return NativeLibrary(kind, None, "none", f"not built ({no_compiler})")
    else:
        key = cache_key(compiler)
        entry = root / key
        if not entry.is_dir():
            if env.get(NO_BUILD_ENV):
                why = f"not built ({entry} missing, {NO_BUILD_ENV} set)"
                return NativeLibrary(kind, None, "none", why)
            try:
                _build_cache_entry(root, key, compiler)
            except OSError as exc:
                why = f"not built (cannot write the cache {root}: {exc})"
                return NativeLibrary(kind, None, "none", why)
    lib = entry / spec.lib_name
    if not lib.is_file():
        error = entry / f"{spec.lib_name}.error"
        text = error.read_text(errors="replace").strip() if error.is_file() else "missing"
        why = f"not built ({text.splitlines()[-1][:200] if text else 'failed'}; see {error})"
        return NativeLibrary(kind, None, "none", why)
    problem = abi_problem(lib, kind)
    if problem is not None:
        return NativeLibrary(kind, None, "none", problem)
    return NativeLibrary(kind, lib, "cache")


def _from_package(kind: str) -> NativeLibrary | None:
    """The library the wheel's build step put in the package, when it is a build of the
    sources beside it (its BUILD.json says so) and speaks this ABI."""
    lib = package_lib_dir() / _KINDS[kind].lib_name
    if not lib.is_file():
        return None
    try:
        stamp = json.loads((package_lib_dir() / _STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamp = {}
    if stamp.get("sources") != source_digest():
        logger.info("native kernels: %s is a build of other sources; not used", lib)
        return None
    return NativeLibrary(kind, lib, "package") if abi_problem(lib, kind) is None else None


@cache
def _resolve(kind: str, env_items: tuple[tuple[str, str], ...]) -> NativeLibrary:
    env = dict(env_items)
    spec = _KINDS[kind]
    override = env.get(spec.env)
    if override:
        path = Path(override)
        if not path.is_file():
            return NativeLibrary(kind, None, "none", f"not built ({path} missing, {spec.env})")
        problem = abi_problem(path, kind)
        if problem is not None:
            return NativeLibrary(kind, None, "none", f"{problem} (named by {spec.env})")
        return NativeLibrary(kind, path, "override")
    if not sys.platform.startswith("linux"):
        return NativeLibrary(kind, None, "none", "the native kernels are built on Linux only")
    found = _from_package(kind)
    return found if found is not None else _from_cache(kind, env)


_RESOLVE_ENV = (GEMM_LIB_ENV, OPS_LIB_ENV, NATIVE_CACHE_ENV, NO_BUILD_ENV, "CC", "PATH",
                "XDG_CACHE_HOME", "HOME")  # fmt: skip


def resolve_native(kind: str, env: Mapping[str, str] | None = None) -> NativeLibrary:
    """The `kind` ("gemm" or "ops") library this process uses, in the module docstring's
    order: override, package, per-user cache (built when missing), none with the reason.
    Memoized per process and environment; a refused library is logged by name."""
    env = os.environ if env is None else env
    return _resolve(kind, tuple((k, env[k]) for k in _RESOLVE_ENV if k in env))


def native_gemm_library(env: Mapping[str, str] | None = None) -> Path | None:
    """The few-row kernel library to preload (`resolve_native("gemm")`), None when none."""
    return resolve_native("gemm", env).path


def native_gemm_unavailable(env: Mapping[str, str] | None = None) -> str | None:
    """Why the few-row kernel will not be preloaded, or None when it will be."""
    env = os.environ if env is None else env
    if env.get(NO_GEMM_ENV):
        return f"turned off by {NO_GEMM_ENV}"
    if not cpu_flags() >= _GEMM_FLAGS:
        return "this CPU lacks AVX2/FMA"
    found = resolve_native("gemm", env)
    return found.why if found.path is None else None


def native_ops_library(env: Mapping[str, str] | None = None) -> Path | None:
    """The fused ops library (`resolve_native("ops")`), None when there is none."""
    return resolve_native("ops", env).path


def native_origin(path: str | Path, env: Mapping[str, str] | None = None) -> str:
    """Where a loaded library's file came from: "override", "package", "cache" or "other"
    (an LD_PRELOAD of the operator's own)."""
    env = os.environ if env is None else env
    path = Path(path)
    if any(env.get(spec.env) == str(path) for spec in _KINDS.values()):
        return "override"
    if path.parent == package_lib_dir():
        return "package"
    if native_cache_root(env) in path.parents:
        return "cache"
    return "other"


def native_libraries() -> dict[str, dict[str, str | None]]:
    """For status: each library's file and origin in this process ({"path", "origin", "why"});
    the gemm entry is the preloaded file when one is."""
    out = {}
    for kind in _KINDS:
        found = resolve_native(kind)
        entry = {"path": str(found.path) if found.path else None, "origin": found.origin,
                 "why": found.why or None}  # fmt: skip
        out[kind] = entry
    preloaded = global_sgemm_library()
    if preloaded is not None and Path(preloaded).name == GEMM_LIB_NAME:
        out["gemm"] = {"path": preloaded, "origin": native_origin(preloaded), "why": None}
    elif native_gemm_unavailable() is not None:
        out["gemm"] = {"path": None, "origin": "none", "why": native_gemm_unavailable()}
    return out


def _build_one(kind: str, dest: Path | None, compiler: str | None) -> Path:
    if dest is None:
        env = {**os.environ, "CC": compiler} if compiler else os.environ
        found = resolve_native(kind, {k: v for k, v in env.items() if k != _KINDS[kind].env})
        if found.path is None:
            raise RuntimeError(found.why)
        return found.path
    env = dict(os.environ)
    if compiler:
        env["CC"] = compiler
    command, why = find_compiler(env)
    if command is None:
        raise RuntimeError(why)
    error = _compile_all({kind: dest}, command)[kind]
    if error is not None:
        raise RuntimeError(error)
    return dest


def build_native_gemm(dest: Path | None = None, compiler: str | None = None) -> Path:
    """Compile `native/fewrow_sgemm.c` into `dest`; without `dest`, into the per-user cache
    (when not there yet). Raises RuntimeError with the reason when there is no compiler or it
    fails."""
    return _build_one("gemm", dest, compiler)


def build_native_ops(dest: Path | None = None, compiler: str | None = None) -> Path:
    """Compile `native/fused_ops.c` into `dest` (default: the per-user cache)."""
    return _build_one("ops", dest, compiler)


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
    gemm = None if native_gemm_unavailable(env) else native_gemm_library(env)
    front = [str(gemm)] if gemm is not None else []
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
        lib = global_sgemm_library() or ""
        origin = NativeLibrary("gemm", Path(lib), native_origin(lib)).describe()
        logger.info("blas: few-row sgemm kernel active, %s path%s (%s)", path, suffix, origin)
    else:
        reason = native_gemm_unavailable() or "loaded but this CPU lacks AVX2/FMA"
        logger.info("blas: few-row sgemm kernel not in use: %s", reason)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mlxcel.daemon.forward.blas build`: build the few-row kernel and the fused ops
    into the per-user cache now (scripts/setup.sh; the daemon would at its first start) and
    print where each library this install uses is; exit 1 when either is missing."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["build"]:
        print("usage: python -m mlxcel.daemon.forward.blas build", file=sys.stderr)
        return 2
    status = 0
    for kind, what in (("gemm", "few-row sgemm kernel"), ("ops", "fused ops")):
        if _KINDS[kind].x86_only and platform.machine().lower() not in _X86:
            print(f"no {what}: it is for x86-64 CPUs")  # not a failure: never preloaded here
            continue
        found = resolve_native(kind)
        if found.path is None:
            print(f"no {what}: {found.why}", file=sys.stderr)
            status = 1
        else:
            print(f"{what} {found.describe()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
