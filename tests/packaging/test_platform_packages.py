"""Issue 17 items 1-2: one MLX backend per install, floors at the tested versions, and a
one-line startup refusal naming what is missing (docs/platforms.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest
from daemon_helpers import cli
from mlxcel.daemon.process.platform_check import (
    LINUX_BACKENDS,
    MIN_VERSIONS,
    check_apis,
    check_packages,
    check_runtime,
)
from packaging.requirements import Requirement
from repo_paths import ROOT

BACKENDS = {*LINUX_BACKENDS, "mlx-metal"}
NETWORK_ERRORS = ("NewConnectionError", "Temporary failure in name resolution", "Network is")


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads((ROOT / "pyproject.toml").read_text())
    import tomlkit

    return tomlkit.parse((ROOT / "pyproject.toml").read_text()).unwrap()


def _mlx_extras() -> list[Requirement]:
    """mlx's own requirements (which backend wheel each of its extras pulls, per platform)."""
    return [Requirement(r) for r in metadata.requires("mlx") or []]


def _backends_for(platform_system: str, sys_platform: str, extras: set[str]) -> set[str]:
    """The backend packages `pip install .[extras]` gets on a platform (markers evaluated)."""
    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    env = {"platform_system": platform_system, "sys_platform": sys_platform, "extra": ""}
    mlx_extras: set[str] = set()
    found: set[str] = set()
    for req in reqs:
        if req.marker is None or req.marker.evaluate(env):
            if req.name == "mlx":
                mlx_extras |= req.extras
            elif req.name in BACKENDS:
                found.add(req.name)
    for req in _mlx_extras():
        if req.name not in BACKENDS:
            continue
        wanted = [
            e
            for e in ["", *mlx_extras]
            if req.marker is None or req.marker.evaluate({**env, "extra": e})
        ]
        if wanted:
            found.add(req.name)
    return found


@pytest.mark.parametrize(
    ("system", "platform", "extras", "expected"),
    [
        ("Darwin", "darwin", set(), {"mlx-metal"}),
        ("Darwin", "darwin", {"cpu"}, {"mlx-metal"}),
        ("Linux", "linux", {"cpu"}, {"mlx-cpu"}),
        ("Linux", "linux", {"cuda"}, {"mlx-cuda-12"}),
        ("Linux", "linux", {"cuda13"}, {"mlx-cuda-13"}),
        ("Linux", "linux", {"cpu", "dev"}, {"mlx-cpu"}),
        ("Linux", "linux", set(), set()),  # no silent default: the startup check names it
    ],
)
def test_each_install_gets_exactly_the_backend_asked_for(
    system: str, platform: str, extras: set[str], expected: set[str]
) -> None:
    assert _backends_for(system, platform, extras) == expected


def _dry_run(extra: str, tmp: Path) -> tuple[str, list[str]]:
    report = tmp / f"{extra}.json"
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    # fast-deps: pip reads each wheel's metadata by range requests instead of downloading it
    # (the CUDA extra's nvidia wheels are ~2.5 GB: 28 s against 10 s here), same resolution
    pip.append("--use-feature=fast-deps")
    proc = subprocess.run(
        [*pip, "--report", str(report), f"{ROOT}[{extra}]"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        if any(e in proc.stderr for e in NETWORK_ERRORS):
            pytest.skip(f"the package index is not reachable: {proc.stderr.strip()[-200:]}")
        raise AssertionError(proc.stderr[-3000:])
    installs = json.loads(report.read_text())["install"]
    return extra, [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installs]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux backend wheels")
def test_pip_resolves_each_linux_extra_to_one_backend(tmp_path: Path) -> None:
    """A real resolver run against the package index (PyPI), both extras at once (~10 s)."""
    with ThreadPoolExecutor(2) as pool:
        results = dict(pool.map(lambda e: _dry_run(e, tmp_path), ["cpu", "cuda"]))
    for extra, backend in (("cpu", "mlx-cpu"), ("cuda", "mlx-cuda-12")):
        names = {pin.split("==")[0].lower() for pin in results[extra]}
        assert names & BACKENDS == {backend}, (extra, sorted(names & BACKENDS))
        assert {"mlx", "mlx-lm", "mlxcel"} <= names


def test_floors_are_the_tested_versions() -> None:
    floors = {}
    for text in _pyproject()["project"]["dependencies"]:
        req = Requirement(text)
        if req.name in MIN_VERSIONS:  # mlx-lm also has a ceiling (test_mlx_lm_compat.py)
            [spec] = [s for s in req.specifier if s.operator != "<"]
            assert spec.operator == ">="
            floors[req.name] = tuple(int(p) for p in spec.version.split("."))
    assert floors == MIN_VERSIONS
    for dist, floor in MIN_VERSIONS.items():  # and what this suite runs on meets them
        installed = tuple(int(p) for p in metadata.version(dist).split(".")[:3])
        assert installed >= floor, dist


def _versions(**present: str):
    table = {"mlx": "0.32.4", "mlx-lm": "0.32.2", **present}
    return lambda dist: table.get(dist)


def test_package_problems_are_one_line() -> None:
    assert check_packages(_versions(**{"mlx-cpu": "0.32.4"}), "linux") is None
    assert check_packages(_versions(**{"mlx-metal": "0.32.4"}), "darwin") is None
    cases = {
        "no MLX backend package is installed": _versions(),
        "several MLX backends are installed (mlx-cpu, mlx-cuda-12)": _versions(
            **{"mlx-cpu": "0.32.4", "mlx-cuda-12": "0.32.4"}
        ),
        "mlx 0.31.0 is too old (need >= 0.32.4)": _versions(mlx="0.31.0"),
        "mlx-lm 0.30.5 is too old (need >= 0.32.2)": _versions(**{"mlx-lm": "0.30.5"}),
    }
    for message, version_of in cases.items():
        problem = check_packages(version_of, "linux")
        assert problem is not None and problem.startswith(message), problem
        assert "\n" not in problem
    assert check_runtime() is None  # this machine's install is a good one
    if sys.platform.startswith("linux"):  # an MLX built from source: no backend package
        assert check_runtime(_versions()) is None


def test_a_missing_api_is_named() -> None:
    problem = check_apis((("mlx.core", "new_thread_local_stream"), ("mlx_lm.generate", "Nope")))
    assert problem == (
        "mlx_lm.generate.Nope is missing: mlx-lm "
        f"{metadata.version('mlx-lm')} is not the tested 0.32.2 or newer"
    )


def test_daemon_start_refuses_an_old_mlx_lm_in_one_line(tmp_path: Path) -> None:
    """An mlx-lm without PromptProcessingBatch (older than the floor), shadowed on PYTHONPATH."""
    fake = tmp_path / "fake"
    (fake / "mlx_lm").mkdir(parents=True)
    (fake / "mlx_lm" / "__init__.py").write_text("")
    (fake / "mlx_lm" / "generate.py").write_text(
        textwrap.dedent(
            """
            class GenerationBatch: ...
            class StopSequences: ...
            """
        )
    )
    done = cli(tmp_path / "home", "start", "--foreground", "--port", "0", PYTHONPATH=str(fake))
    assert done.returncode == 1
    fatal = [line for line in done.stderr.splitlines() if "FATAL" in line]
    assert len(fatal) == 1 and "Traceback" not in done.stderr, done.stderr
    assert fatal[0].endswith(
        "mlx_lm.generate.PromptProcessingBatch is missing: mlx-lm "
        f"{metadata.version('mlx-lm')} is not the tested 0.32.2 or newer"
    )
