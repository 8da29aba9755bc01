"""Where the native libraries come from (daemon/forward/blas.py, `resolve_native`): a library
of another ABI version is refused by name (and the gemm one never preloaded), no compiler
means the daemon serves on the fallback and says why, and two processes building into an
empty per-user cache at once build it once, whole."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import openai_client, running_daemon
from mlxcel.daemon.forward import native_ops
from mlxcel.daemon.forward.blas import (
    DISABLE_ENV,
    GEMM_ABI,
    GEMM_LIB_ENV,
    NATIVE_CACHE_ENV,
    NO_BUILD_ENV,
    OPS_ABI,
    OPS_LIB_ENV,
    cpu_flags,
    fast_blas_env,
    find_compiler,
    find_system_openblas,
    library_abi,
    native_gemm_unavailable,
    slow_blas_env,
)
from repo_paths import TESTS

pytestmark = [
    pytest.mark.e2e,  # Python subprocesses and a daemon (docs/testing.md)
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the native kernels are built on Linux"
    ),
]

MISSING_CC = "/nonexistent/bin/cc"
CHILD_SCRIPTS = TESTS / "child_scripts"


def _compile(tmp_path: Path, name: str, code: str) -> Path:
    """A tiny shared library from `code` (the system compiler; these tests need one)."""
    compiler, why = find_compiler()
    if compiler is None:
        pytest.fail(f"{why}: scripts/setup.sh installs gcc")
    source = tmp_path / f"{name}.c"
    source.write_text(textwrap.dedent(code))
    lib = tmp_path / f"{name}.so"
    subprocess.run([*compiler, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    return lib


@pytest.fixture
def fresh_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(native_ops.DISABLE_ENV, raising=False)
    native_ops._load.cache_clear()
    yield
    native_ops._load.cache_clear()


def _refusals(caplog: pytest.LogCaptureFixture, lib: Path) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and str(lib) in r.getMessage()
    ]


@pytest.mark.parametrize("abi", [999, None])
def test_an_ops_library_of_another_abi_is_refused_by_name(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_ops: None,
    abi: int | None,
) -> None:
    """MLXCEL_OPS_LIB at a library reporting ABI 999 (or without mlxcel_ops_abi: a build from
    before the versions): not used, and one WARNING names the file and both versions."""
    version = f"int mlxcel_ops_abi(void) {{ return {abi}; }}" if abi is not None else ""
    lib = _compile(
        tmp_path,
        "libstale_ops",
        f"""
        {version}
        const char *mlxcel_ops_path(void) {{ return "avx2"; }}
        """,
    )
    assert library_abi(lib, "ops") == abi
    monkeypatch.setenv(OPS_LIB_ENV, str(lib))
    with caplog.at_level(logging.INFO):
        assert native_ops.path() is None
    _, why = native_ops._load()
    said = "reports ABI version 999" if abi else "lacks mlxcel_ops_abi()"
    assert f"refused {lib}: it {said}, this mlxcel speaks version {OPS_ABI}" in why
    [line] = _refusals(caplog, lib)
    assert said in line and f"version {OPS_ABI}" in line


@pytest.mark.skipif(
    find_system_openblas() is None or not {"avx2", "fma"} <= cpu_flags(),
    reason="the gemm library is preloaded only over a system OpenBLAS on an AVX2/FMA CPU",
)
def test_a_gemm_library_of_another_abi_is_never_preloaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checked before the preload: the preload env leaves it out, and a process that re-execs
    itself with the preload (as the daemon does) names it and runs on plain OpenBLAS."""
    lib = _compile(
        tmp_path,
        "libmlxcel_gemm",
        """
        int mlxcel_gemm_abi(void) { return 999; }
        void cblas_sgemm(void) { __builtin_trap(); }  /* must never be called */
        """,
    )
    with caplog.at_level(logging.INFO):
        env = fast_blas_env({"PATH": os.environ["PATH"], GEMM_LIB_ENV: str(lib)})
    assert env["LD_PRELOAD"].split() == [str(find_system_openblas())]
    why = native_gemm_unavailable({"PATH": os.environ["PATH"], GEMM_LIB_ENV: str(lib)})
    assert why is not None and f"refused {lib}: it reports ABI version 999" in why
    assert f"this mlxcel speaks version {GEMM_ABI}" in why
    assert len(_refusals(caplog, lib)) == 1

    base = {**slow_blas_env(), GEMM_LIB_ENV: str(lib)}
    base.pop(DISABLE_ENV)
    script = CHILD_SCRIPTS / "native_build_gemm_preload.py"
    proc = subprocess.run(
        [sys.executable, str(script)], env=base, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(find_system_openblas())]
    assert f"refused {lib}: it reports ABI version 999" in proc.stderr
    assert f"few-row sgemm kernel not in use: refused {lib}" in proc.stderr


# Resolves (and may build) both libraries; prints {kind: [path, origin, abi or why]}.
RESOLVE = CHILD_SCRIPTS / "native_build_resolve.py"


def test_two_processes_building_into_an_empty_cache_build_it_once(tmp_path: Path) -> None:
    """Both wait on one build (the lock), both get the same whole files, no temp left over."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    env[NATIVE_CACHE_ENV] = str(cache)
    procs = [
        subprocess.Popen(
            [sys.executable, str(RESOLVE)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, stderr) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, stderr
    results = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outs]
    assert results[0] == results[1]
    [entry] = [p for p in cache.iterdir() if p.is_dir()]
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.name, f".{entry.name}.lock"])
    expected = {"gemm": GEMM_ABI, "ops": OPS_ABI}
    for kind, (path, origin, abi) in results[0].items():
        assert Path(path).parent == entry and origin == "cache" and abi == expected[kind]
    built = [line for _, err in outs for line in err.splitlines() if "building native" in line]
    assert len(built) == 1, built
    assert f"building native kernels into {entry} (first run" in built[0]
    stamp = json.loads((entry / "BUILD.json").read_text())
    assert stamp["built"] == {"gemm": True, "ops": True}
    assert not list(entry.glob(".*")), "a temp file was left in the entry"
    # Warm: the next process finds the entry and builds nothing (no build line).
    again = subprocess.run(
        [sys.executable, str(RESOLVE)], env={**env, "CC": MISSING_CC},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1]) == results[0]
    assert "building native" not in again.stderr


def test_no_compiler_the_daemon_serves_on_the_fallback_and_says_why(
    tmp_path: Path, short_tmp: Path, tiny_model_dir: Path
) -> None:
    """CC names a missing program and the per-user cache is empty: the daemon starts, answers,
    and its log says the kernels are not in use because there is no compiler."""
    cache_home = tmp_path / "xdg-cache"
    with running_daemon(
        short_tmp / "home", tiny_model_dir, CC=MISSING_CC, XDG_CACHE_HOME=str(cache_home)
    ) as daemon:
        client = openai_client(daemon)
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
        assert reply.choices[0].text is not None
        log = daemon.log_text()
    reason = f"not built (no C compiler: CC={MISSING_CC} not found)"
    assert f"native ops: not in use ({reason})" in log, log[-3000:]
    if find_system_openblas() is not None and {"avx2", "fma"} <= cpu_flags():
        assert f"few-row sgemm kernel not in use: {reason}" in log, log[-3000:]
    assert not (cache_home / "mlxcel" / "native").exists() or not any(
        (cache_home / "mlxcel" / "native").iterdir()
    )


def test_no_native_build_builds_nothing_and_says_so(tmp_path: Path) -> None:
    """MLXCEL_NO_NATIVE_BUILD=1 with an empty cache: nothing is built, the reason names it."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    env[NATIVE_CACHE_ENV] = str(cache)
    empty = subprocess.run(
        [sys.executable, str(RESOLVE), "why"],
        env={**env, NO_BUILD_ENV: "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert empty.returncode == 0, empty.stderr
    for path, origin, why in json.loads(empty.stdout.strip().splitlines()[-1]).values():
        assert path == "None" and origin == "none" and f"{NO_BUILD_ENV} set" in why
    assert not cache.exists() or not any(p.is_dir() for p in cache.iterdir())
