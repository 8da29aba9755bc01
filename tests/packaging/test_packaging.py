"""The built wheel holds every package, module, .tcss and asset, under `mlxcel/` only, and the
native kernels: their C sources always, the libraries compiled from them when the build
machine has a C compiler (setup.py); a plain install of it finds them in the package.

The `packages` list in pyproject.toml is explicit, so it is compared with the folders that
have an `__init__.py` on disk: a forgotten sub-package fails here, not on a user's machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from mlxcel.daemon.forward.blas import (
    GEMM_LIB_NAME,
    NATIVE_CACHE_ENV,
    NO_BUILD_ENV,
    OPS_LIB_NAME,
    cpu_flags,
    find_compiler,
    find_system_openblas,
)
from repo_paths import ROOT, TESTS


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads((ROOT / "pyproject.toml").read_text())
    import tomlkit

    return tomlkit.parse((ROOT / "pyproject.toml").read_text()).unwrap()


SETUPTOOLS = _pyproject()["tool"]["setuptools"]
PACKAGE_DIRS: dict[str, str] = SETUPTOOLS["package-dir"]


def _packages_on_disk() -> dict[str, Path]:
    """Dotted package name -> folder, for every folder with an __init__.py under a mapping."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join([package, *rel.parts])] = init.parent
    return found


def _wheel_path(package: str, file: Path) -> str:
    folder = _packages_on_disk()[package]
    return "/".join([*package.split("."), *file.relative_to(folder).parts])


def test_packages_list_matches_folders_on_disk() -> None:
    on_disk = set(_packages_on_disk())
    listed = set(SETUPTOOLS["packages"])
    assert on_disk - listed == set(), "sub-packages missing from pyproject.toml [packages]"
    assert listed - on_disk == set(), "pyproject.toml lists packages that do not exist"


NATIVE = ROOT / "daemon" / "forward" / "native"
BUILT = "mlxcel/daemon/forward/native/_built"
HAVE_CC = find_compiler()[0] is not None


def _build(tmp_path_factory: pytest.TempPathFactory, *how: str, **env: str) -> tuple[Path, str]:
    """`python -m build HOW` on a copy of the tree's package files; (the output folder, the
    log). No HOW: an sdist, then a wheel built from that sdist (what pip does with one)."""
    if importlib.util.find_spec("build") is None:
        pytest.fail("the `build` package is missing: pip install -e .[dev] provides it")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_built")
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "setup.py", src)  # the build step that compiles the native kernels
    readme = _pyproject()["project"].get("readme")
    if isinstance(readme, str):
        shutil.copy(ROOT / readme, src)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", *how, "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    [built] = dist.glob("mlxcel-*.whl")
    return built


def test_the_sdist_holds_the_native_sources_and_the_build_step(dist: Path) -> None:
    """pip builds the wheel from it where no wheel fits (pipx, a PyPI sdist): it needs both."""
    [sdist] = dist.glob("mlxcel-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {name.split("/", 1)[1] for name in tf.getnames() if "/" in name}
    sources = {"daemon/forward/native/" + p.relative_to(NATIVE).as_posix() for p in _sources()}
    assert sources - names == set()
    assert {"setup.py", "pyproject.toml"} <= names


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_every_package_and_module_is_in_the_wheel(wheel_names: set[str]) -> None:
    missing = []
    for package, folder in _packages_on_disk().items():
        for module in sorted(folder.glob("*.py")):
            name = _wheel_path(package, module)
            if name not in wheel_names:
                missing.append(name)
    assert missing == []


def test_styles_and_assets_are_in_the_wheel(wheel_names: set[str]) -> None:
    data_files = []
    for package, folder in _packages_on_disk().items():
        data_files += [(package, f) for f in folder.rglob("*.tcss")]
        if package == "mlxcel.daemon" and (folder / "assets").is_dir():
            data_files += [(package, f) for f in (folder / "assets").rglob("*") if f.is_file()]
    assert any(f.suffix == ".tcss" for _, f in data_files), "expected the console's .tcss"
    deepest = {}
    for package, file in data_files:
        # A file belongs to the deepest package folder that contains it.
        owner = max(
            (p for p, d in _packages_on_disk().items() if d in file.parents),
            key=lambda p: p.count("."),
            default=package,
        )
        deepest[file] = _wheel_path(owner, file)
    missing = sorted(name for name in deepest.values() if name not in wheel_names)
    assert missing == []


def test_no_top_level_folders_and_entry_points(wheel: Path, wheel_names: set[str]) -> None:
    tops = {name.split("/", 1)[0] for name in wheel_names}
    assert all(top == "mlxcel" or top.endswith(".dist-info") for top in tops), tops
    [dist_info] = [t for t in tops if t.endswith(".dist-info")]
    with zipfile.ZipFile(wheel) as zf:
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    for script, target in _pyproject()["project"]["scripts"].items():
        assert f"{script} = {target}" in entry_points


def _sources() -> list[Path]:
    return [p for p in NATIVE.rglob("*") if p.suffix in (".c", ".h")]


def _wheel_tag(wheel: Path) -> tuple[str, str]:
    """(the Tag line of the wheel's WHEEL file, its Root-Is-Purelib)."""
    with zipfile.ZipFile(wheel) as zf:
        [name] = [n for n in zf.namelist() if n.endswith(".dist-info/WHEEL")]
        fields = dict(line.split(": ", 1) for line in zf.read(name).decode().splitlines() if line)
    return fields["Tag"], fields["Root-Is-Purelib"]


def test_native_sources_and_libraries_are_in_the_wheel(wheel: Path, wheel_names: set[str]) -> None:
    """Every file under daemon/forward/native/; the two libraries and their BUILD.json where a
    compiler is (then the wheel is platform-tagged: it carries shared libraries)."""
    sources = _sources()
    assert {p.name for p in sources} >= {"fewrow_sgemm.c", "fused_ops.c", "pool.h"}
    missing = [
        name
        for p in sources
        if (name := "mlxcel/daemon/forward/native/" + p.relative_to(NATIVE).as_posix())
        not in wheel_names
    ]
    assert missing == []
    libs = {f"{BUILT}/{GEMM_LIB_NAME}", f"{BUILT}/{OPS_LIB_NAME}", f"{BUILT}/BUILD.json"}
    tag, pure = _wheel_tag(wheel)
    if HAVE_CC:
        assert libs <= wheel_names
        assert tag.startswith("py3-none-linux_") and pure == "false", (tag, pure)
    else:
        assert not libs & wheel_names and tag == "py3-none-any"


@pytest.mark.skipif(not HAVE_CC or sys.platform != "linux", reason="no native libraries to tag")
def test_auditwheel_retags_the_wheel_manylinux_with_its_libraries_unchanged(
    wheel: Path, tmp_path: Path
) -> None:
    """scripts/build_wheel.sh's step: `auditwheel repair` finds the libraries linked only to
    the manylinux policy's system libraries (nothing grafted in) and writes the same wheel
    tagged manylinux_2_N, on x86-64 manylinux_2_17 whatever glibc built it (native/
    glibc_versions.h binds the libraries to the oldest symbol versions); the libraries and
    BUILD.json are the built ones, byte for byte (the installed package's check reads them)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-m", "auditwheel", "repair", "-w", str(tmp_path), str(wheel)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [fixed] = tmp_path.glob("mlxcel-*.whl")
    tag, pure = _wheel_tag(fixed)
    machine = platform.machine()
    platforms = tag.removeprefix("py3-none-").split(".")  # e.g. manylinux2014_x, manylinux_2_17_x
    assert all(re.fullmatch(rf"manylinux(_2_\d+|2014|2010|1)_{machine}", p) for p in platforms), tag
    if machine == "x86_64":  # manylinux2014 is manylinux_2_17's older name
        assert {f"manylinux_2_17_{machine}", f"manylinux2014_{machine}"} & set(platforms), tag
    assert pure == "false"
    with zipfile.ZipFile(wheel) as before, zipfile.ZipFile(fixed) as after:
        assert not [n for n in after.namelist() if ".libs/" in n]  # nothing grafted
        for name in (f"{BUILT}/{GEMM_LIB_NAME}", f"{BUILT}/{OPS_LIB_NAME}", f"{BUILT}/BUILD.json"):
            assert after.read(name) == before.read(name), name


def test_without_a_compiler_the_wheel_builds_and_is_pure(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """CC names a missing program: the build still succeeds (a warning says why), the wheel
    holds the sources but no libraries and is py3-none-any (the daemon's cache route)."""
    out, log = _build(tmp_path_factory, "--wheel", CC="/nonexistent/bin/cc")
    [built] = out.glob("mlxcel-*.whl")
    with zipfile.ZipFile(built) as zf:
        names = set(zf.namelist())
    assert "mlxcel/daemon/forward/native/fused_ops.c" in names
    assert not [n for n in names if n.startswith(BUILT)]
    assert _wheel_tag(built) == ("py3-none-any", "true")
    assert "the native ops library is not in this wheel" in log
    assert "CC=/nonexistent/bin/cc not found" in log


# Prints where the installed process found mlxcel and its native libraries, as JSON.
INSTALLED_SCRIPT = TESTS / "child_scripts" / "packaging_installed.py"


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain (non-editable) pip install of the wheel, no setup script, into a folder."""
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return target


def _run_installed(target: Path, cache: Path, **env: str) -> tuple[dict, str]:
    """INSTALLED_SCRIPT in a process that imports mlxcel from `target` (ahead of this
    checkout's editable install), with an empty per-user cache."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    base.pop("LD_PRELOAD", None)
    full = {**base, "PYTHONPATH": str(target), NATIVE_CACHE_ENV: str(cache), **env}
    proc = subprocess.run(
        [sys.executable, str(INSTALLED_SCRIPT)], env=full, capture_output=True, text=True,
        timeout=300, cwd=target,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_plain_install_runs_the_libraries_from_the_package(
    installed: Path, tmp_path: Path
) -> None:
    """The fresh install's process loads the fused ops and preloads the few-row kernel from
    the installed package, not from the source tree or a cache (which stays empty)."""
    if not HAVE_CC:
        pytest.fail("no C compiler: the wheel carries no libraries (scripts/setup.sh installs gcc)")
    out, _ = _run_installed(installed, tmp_path / "cache")
    assert Path(out["package"]).is_relative_to(installed)
    built = installed / BUILT
    assert out["libs"]["ops"] == {"path": str(built / OPS_LIB_NAME), "origin": "package",
                                  "why": None}  # fmt: skip
    if {"avx2", "fma"} <= cpu_flags():
        assert out["ops"] in ("avx512", "avx2")
    if find_system_openblas() is not None and {"avx2", "fma"} <= cpu_flags():
        assert out["sgemm"] == str(built / GEMM_LIB_NAME)  # preloaded, in front of OpenBLAS
        assert out["gemm"] in ("avx512", "avx2")
        assert out["libs"]["gemm"]["origin"] == "package"
    assert not (tmp_path / "cache").exists()


def test_a_stale_library_in_the_package_is_refused_by_name(installed: Path, tmp_path: Path) -> None:
    """The package's ops library replaced by one of another ABI version: refused with a
    warning naming it, then the cache route (here MLXCEL_NO_NATIVE_BUILD: nothing built)."""
    if not HAVE_CC:
        pytest.fail("no C compiler (scripts/setup.sh installs gcc)")
    copy = tmp_path / "site"
    shutil.copytree(installed, copy)
    source = tmp_path / "stale.c"
    source.write_text("int mlxcel_ops_abi(void) { return 999; }\n")
    stale = copy / BUILT / OPS_LIB_NAME
    compiler = find_compiler()[0]
    assert compiler is not None
    subprocess.run([*compiler, "-shared", "-fPIC", "-o", str(stale), str(source)], check=True)
    out, log = _run_installed(copy, tmp_path / "cache", **{NO_BUILD_ENV: "1"})
    assert out["ops"] is None and out["libs"]["ops"]["path"] is None
    assert f"refused {stale}: it reports ABI version 999" in log
    assert f"{NO_BUILD_ENV} set" in out["libs"]["ops"]["why"]


def test_a_plain_install_starts_a_daemon_with_the_native_steps_active(
    installed: Path, tmp_path: Path, short_tmp: Path, tiny_model_dir: Path
) -> None:
    """`mlxcel-daemon start` from the plain install (its package on PYTHONPATH, no setup
    script, an empty per-user cache): the log says the kernels came from the package and the
    native steps are on; it answers a completion."""
    if not HAVE_CC:
        pytest.fail("no C compiler: the wheel carries no libraries (scripts/setup.sh installs gcc)")
    from daemon_helpers import openai_client, running_daemon

    cache = tmp_path / "cache"
    env = {"PYTHONPATH": str(installed), NATIVE_CACHE_ENV: str(cache)}
    with running_daemon(short_tmp / "home", tiny_model_dir, **env) as daemon:
        client = openai_client(daemon)
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0)
        assert reply.choices[0].text is not None
        log = daemon.log_text()
    built = installed / BUILT
    assert f"native ops: {OPS_LIB_NAME} in the package: {built / OPS_LIB_NAME}" in log, log
    if find_system_openblas() is not None and {"avx2", "fma"} <= cpu_flags():
        assert f"path (in the package: {built / GEMM_LIB_NAME})" in log, log
        assert "native decode step: active" in log, log
    assert "building native kernels" not in log and not cache.exists()
