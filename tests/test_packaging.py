"""The built wheel holds every package, module, .tcss and asset, under `mlxcel/` only.

The `packages` list in pyproject.toml is explicit, so it is compared with the folders that
have an `__init__.py` on disk: a forgotten sub-package fails here, not on a user's machine.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging  # docs/testing.md

ROOT = Path(__file__).resolve().parent.parent


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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("build") is None:
        pytest.fail("the `build` package is missing: pip install -e .[dev] provides it")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", src)
    readme = _pyproject()["project"].get("readme")
    if isinstance(readme, str):
        shutil.copy(ROOT / readme, src)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [built] = out.glob("mlxcel-*.whl")
    return built


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
