"""The `MLXCEL_*` switches: environment variables that are not serving options.

Serving options (shared/config.py `ServingConfig`) each have an `MLXCEL_<OPTION>` variable,
read by daemon/process/option_sources.py with the flag > env > config.toml precedence.
Everything else named `MLXCEL_*` is a switch, listed here once: its name, the value the code
sees when it is unset, its kind, who reads it and what it does. Code reads a switch through
`switch_value`, `switch_flag` or `switch_int`, which refuse an unregistered name;
tests/unit/test_switches.py checks that every `MLXCEL_*` name in the code is an option's
variable or a switch here, and that every switch here is used. docs/configuration.md,
"Switches", is `switches_table()` (scripts/gen_switches_doc.py writes it; the same test
compares). `mlxcel-daemon status --json` shows the ones set in the daemon's environment
(`daemon.switches`, `set_switches`).

Kinds: `flag` is on with any non-empty value (`0` included: the code tests the string, as it
always has), off when unset or empty; `int`, `path`, `choice`, `str` are read as they are.

Stdlib only (shared/paths.py and the CLI import it before anything heavy). One exception
reads its switches itself: daemon/forward/blas.py, which setup.py loads from the source tree
without the package (the wheel's build step), so it cannot import this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

REDACTED = "<redacted>"
KINDS = ("flag", "int", "path", "choice", "str")


@dataclass(frozen=True)
class Switch:
    name: str
    default: str | None  # what a reader gets when it is unset (None: unset)
    kind: str  # one of KINDS
    meaning: str
    read_by: str = "daemon"  # daemon | native kernels | scripts/setup.sh | tests | ...
    shown_default: str | None = None  # the docs' default when the code decides it elsewhere
    internal: bool = False  # set by mlxcel itself for a process it starts, not by an operator
    secret: bool = False  # its value never shows (status); none is today
    docs: str | None = None  # where it is described at length


_NATIVE = 'docs/platforms.md, "The native kernels"'

SWITCH_LIST: tuple[Switch, ...] = (
    # -- where mlxcel keeps its files ---------------------------------------------------------
    Switch(
        "MLXCEL_HOME",
        None,
        "path",
        "puts config, data, logs, runtime files and the cache under one folder (`config/`, "
        "`data/`, `logs/`, `run/`, `cache/`) instead of the platform's user folders; tests and "
        "benchmarks use it. `install-service` passes it into the unit",
        read_by="daemon, CLI, mlxcel-top, tests",
        shown_default="the platformdirs user folders",
    ),
    # -- the CPU fast path (daemon/forward/blas.py reads these itself: see the module doc) --
    Switch(
        "MLXCEL_NO_OPENBLAS",
        None,
        "flag",
        "no OpenBLAS preload on Linux (and so no few-row kernel in front of it): MLX's CPU "
        "matmuls run on the BLAS its wheel links",
        docs=_NATIVE,
    ),
    Switch(
        "MLXCEL_NO_NATIVE_GEMM",
        None,
        "flag",
        "OpenBLAS without the few-row sgemm kernel (`libmlxcel_gemm.so`) preloaded in front of it",
        docs="docs/tuning.md",
    ),
    Switch(
        "MLXCEL_GEMM_LIB",
        None,
        "path",
        "a `libmlxcel_gemm.so` to preload instead of the package's or the cache's; used as "
        "named (refused when missing or of another ABI version; no fallback to the others)",
        docs=_NATIVE,
    ),
    Switch(
        "MLXCEL_OPS_LIB",
        None,
        "path",
        "the same for `libmlxcel_ops.so` (the fused ops, the native decode/chunk steps, the "
        "quantized kernels)",
        docs=_NATIVE,
    ),
    Switch(
        "MLXCEL_NATIVE_CACHE",
        None,
        "path",
        "the per-user build cache of the native libraries. Per user, not per `MLXCEL_HOME`: an "
        "entry is named by what it is built from, so every daemon of the user shares it",
        shown_default="`$XDG_CACHE_HOME/mlxcel/native` (`~/.cache/mlxcel/native`)",
        docs=_NATIVE,
    ),
    Switch(
        "MLXCEL_NO_NATIVE_BUILD",
        None,
        "flag",
        "compile nothing, neither in the wheel's build step (a pure `py3-none-any` wheel) nor "
        "at first start (only an existing cache entry is used)",
        read_by="daemon, setup.py",
        docs=_NATIVE,
    ),
    # -- the native kernels (the C code reads these with getenv) ----------------------------
    Switch(
        "MLXCEL_GEMM_ISA",
        None,
        "choice",
        "`avx2` forces the kernels' AVX2 path on an AVX-512 CPU; `portable` runs the quantized "
        "kernels' plain C path (the float kernels then run AVX2): for checking, not speed. The "
        "daemon's log names a forced path",
        read_by="native kernels, daemon (log)",
        docs=_NATIVE,
    ),
    Switch(
        "MLXCEL_GEMM_THREADS",
        None,
        "int",
        "threads of the native kernels' pool (a value of 1 or more; capped at the pool's maximum)",
        read_by="native kernels",
        shown_default="the CPUs the process may run on",
        docs="docs/tuning.md",
    ),
    Switch(
        "MLXCEL_QUANT_BIG",
        None,
        "choice",
        "`direct` / `tiles`: quantized matmuls of more than 16 rows (prefill chunks) run the "
        "few-row kernel in 16-row blocks, or dequantized tiles into `cblas_sgemm`. Default on "
        "x86: 16-row blocks of the strip kernel; with the strips off or on the portable path, "
        "blocks up to 32 rows and tiles above (measured)",
        read_by="native kernels",
    ),
    Switch(
        "MLXCEL_QUANT_STRIP",
        None,
        "int",
        "quantized matmuls of this many rows or more dequantize strips of 4 output columns once "
        "into a float32 scratch and run float tiles over them; `0` turns the strips off (for "
        "comparison, not speed)",
        read_by="native kernels",
        shown_default="4 on AVX-512, 8 on AVX2",
    ),
    Switch(
        "MLXCEL_QUANT_ROW1",
        None,
        "int",
        "the one-row kernels: `0` the older tiles (AVX-512 and AVX2), `4` four columns "
        "interleaved (AVX2 4-bit); by default AVX-512 sums 16 columns at once and AVX2 4-bit "
        "interleaves two (for comparison)",
        read_by="native kernels",
        shown_default="2",
    ),
    Switch(
        "MLXCEL_QUANT_ROW1W",
        None,
        "int",
        "`0`: one 4-bit row on AVX-512 widens each byte's codes as before instead of reading "
        "whole 32-bit words of 8 codes (a shift and a permute per 16 codes; for comparison)",
        read_by="native kernels",
        shown_default="1",
    ),
    # -- which forward runs (daemon/models) -------------------------------------------------
    Switch(
        "MLXCEL_NO_FAST_FORWARD",
        None,
        "flag",
        "the model's stock MLX forward: no fused layers, no native steps (quantized weights are "
        "then dequantized on the CPU). Ranks of a distributed group run with it set",
        docs='docs/models.md, "The forward plan"',
    ),
    Switch(
        "MLXCEL_NO_NATIVE_OPS",
        None,
        "flag",
        "MLX ops instead of the native library's (attention, SwiGLU, RMSNorm/RoPE, the "
        "quantized kernels); the native decode and chunk steps are off too, and quantized "
        "weights are dequantized on the CPU",
        docs='docs/models.md, "The forward plan"',
    ),
    Switch(
        "MLXCEL_PORTABLE_DECODE",
        None,
        "flag",
        "run the native decode step on the portable C path too (off by default there: on an "
        "x86 proxy it was slower than MLX's ops with BLAS, while its prefill was faster), and "
        "keep quantized weights quantized for it",
        docs='docs/platforms.md, "Quantized weights on the CPU"',
    ),
    Switch(
        "MLXCEL_NO_NATIVE_DECODE",
        None,
        "flag",
        "no native decode step (every layer of a step in one C call), nor the chunk step it "
        "carries: the steps run the fused MLX forward, and quantized weights are dequantized "
        "on the CPU",
        docs='docs/models.md, "The forward plan"',
    ),
    Switch(
        "MLXCEL_QUANT_F32_SCALES",
        None,
        "flag",
        "quantized layers on the native kernels keep their scales and biases in float32, not "
        "in float16 / bfloat16 when those hold every value exactly (the same results, more "
        "bytes read a token: for comparison)",
        docs=_NATIVE,
    ),
    Switch(
        "MLXCEL_NO_NATIVE_CHUNK",
        None,
        "flag",
        "the prefill chunk step alone off the native path (decode steps keep it)",
    ),
    Switch(
        "MLXCEL_NATIVE_MIN_ROWS",
        "8",
        "int",
        "query rows x batch (attention) or token rows (SwiGLU) from which the native ops run "
        "instead of MLX's (for measurements). Read once, when daemon/forward/native_ops.py is "
        "imported",
    ),
    Switch(
        "MLXCEL_NATIVE_ELEMENTWISE_MIN",
        "16384",
        "int",
        "floats from which RMSNorm and RoPE take the native path (for measurements). Read "
        "once, when daemon/forward/native_ops.py is imported",
    ),
    # -- the engine and the process ----------------------------------------------------------
    Switch(
        "MLXCEL_NO_PACKED_STEP",
        None,
        "flag",
        "two forwards per engine step (the decode rows, then the prefill chunk) instead of one "
        "packed forward, with the same token budget (A/B comparisons)",
        docs="docs/tuning.md",
    ),
    Switch(
        "MLXCEL_NO_MALLOPT",
        None,
        "flag",
        "once a model is loaded, keep glibc's mmap threshold at the load's 1 MiB instead of "
        "serving buffers up to 32 MiB from the heap",
        docs="docs/platforms.md",
    ),
    Switch(
        "MLXCEL_DISTRIBUTED_BACKEND",
        "ring",
        "choice",
        "the MLX distributed backend of a group: `ring` (TCP sockets), `mpi` or `jaccl`; passed "
        "on to every rank",
        docs="docs/distributed.md",
    ),
    # -- set by mlxcel for the processes it starts ------------------------------------------
    Switch(
        "MLXCEL_DETACHED",
        None,
        "flag",
        "set for the daemon a detached `start` spawns: it logs to its log file only, not stderr",
        internal=True,
    ),
    Switch(
        "MLXCEL_SERVICE",
        None,
        "choice",
        "`systemd` / `launchd`: set by the unit `install-service` writes, so the daemon and "
        "`status` tell that a service manager runs it",
        read_by="daemon, status",
        internal=True,
    ),
    Switch(
        "MLXCEL_BLAS_REEXEC",
        None,
        "flag",
        "set in the process the OpenBLAS re-exec starts, so that it does not re-exec again",
        internal=True,
    ),
    Switch(
        "MLXCEL_BLAS_CORETYPE_SOURCE",
        None,
        "choice",
        "who set `OPENBLAS_CORETYPE` for the re-exec: `operator` (it was in the environment) or "
        "`cpu flags` (mlxcel's pick from the CPU's flags); the log's `blas:` line says which",
        internal=True,
    ),
    # -- setup and the test suite ------------------------------------------------------------
    Switch(
        "MLXCEL_BACKEND",
        "cpu",
        "choice",
        "the MLX backend scripts/setup.sh installs on Linux: `cpu`, `cuda` (CUDA 12) or `cuda13`",
        read_by="scripts/setup.sh",
        docs="docs/platforms.md",
    ),
    Switch(
        "MLXCEL_TEST_BACKEND",
        "cpu",
        "choice",
        "`metal` / `cuda`: a CPU run of the tests skips the CPU-only ones too, to check the marks",
        read_by="tests",
    ),
    Switch(
        "MLXCEL_TEST_CACHE",
        None,
        "path",
        "where the tests install the agent CLIs they drive (npm)",
        read_by="tests",
        shown_default="`~/.cache/mlxcel-tests`",
        docs="docs/agents.md",
    ),
    Switch(
        "MLXCEL_TEST_MODEL_DIR",
        None,
        "path",
        "the default model's folder for the tests, instead of the store's (looked up once, "
        "when the suite starts)",
        read_by="tests",
        shown_default="the store's `smollm2-135m-instruct`",
    ),
)

SWITCHES: dict[str, Switch] = {s.name: s for s in SWITCH_LIST}


def switch(name: str) -> Switch:
    """The registered switch `name`; KeyError names it otherwise (register it above)."""
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered switch (shared/switches.py)") from None


def switch_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The switch's value in `environ` (default: this process's), its registered default when
    unset. An empty value is returned as it is (a flag reads it as off)."""
    env = os.environ if environ is None else environ
    return env.get(name, switch(name).default)


def switch_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the switch is on: any non-empty value, `0` included."""
    return bool(switch_value(name, environ))


def switch_int(name: str, environ: Mapping[str, str] | None = None) -> int:
    """The switch as an integer (its default when unset); ValueError for another value."""
    value = switch_value(name, environ)
    if value is None:
        raise ValueError(f"{name} is unset and has no default")
    return int(value)


def set_switches(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The registered switches present in `environ` (default: this process's), by name, with
    their values (a secret one's shown as REDACTED): what `status --json` reports."""
    env = os.environ if environ is None else environ
    return {s.name: REDACTED if s.secret else env[s.name] for s in SWITCH_LIST if s.name in env}


# --- docs/configuration.md, "Switches" ---------------------------------------------------

TABLE_BEGIN = (
    "<!-- switches table: generated from shared/switches.py by scripts/gen_switches_doc.py -->"
)
TABLE_END = "<!-- end of the switches table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(s: Switch) -> str:
    if s.shown_default is not None:
        return s.shown_default
    return "unset" if s.default is None else f"`{s.default}`"


def switches_table(switches: tuple[Switch, ...] = SWITCH_LIST) -> str:
    """The markdown table of docs/configuration.md, "Switches" (without the markers)."""
    lines = [
        "| variable | kind | default | read by | what it does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in switches:
        what = s.meaning + (f" ({s.docs})" if s.docs else "")
        by = s.read_by + (" (set by mlxcel)" if s.internal else "")
        lines.append(
            f"| `{s.name}` | {s.kind} | {_cell(_default(s))} | {_cell(by)} | {_cell(what)} |"
        )
    return "\n".join(lines) + "\n"


def render_doc(text: str, switches: tuple[Switch, ...] = SWITCH_LIST) -> str:
    """`text` (docs/configuration.md) with the table between the markers regenerated;
    ValueError when the markers are missing."""
    start = text.find(TABLE_BEGIN)
    end = text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"the markers {TABLE_BEGIN!r} ... {TABLE_END!r} are missing")
    head = text[: start + len(TABLE_BEGIN)]
    return f"{head}\n{switches_table(switches)}{text[end:]}"
