"""Import boundaries (tui -> shared <- daemon), checked in fresh interpreters.

Every module of each package is imported (found with pkgutil, so new modules are covered);
after each import `sys.modules` must hold none of that package's forbidden imports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

FORBIDDEN = {
    "mlxcel.shared": ["textual", "mlx", "mlx_lm", "mlxcel.daemon", "mlxcel.tui"],
    "mlxcel.tui": ["mlx", "mlx_lm", "mlxcel.daemon"],
    "mlxcel.daemon": ["textual", "mlxcel.tui"],
}

CHECK_SCRIPT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys, traceback

    package_name, forbidden = sys.argv[1], json.loads(sys.argv[2])

    def offenders():
        return sorted(
            f for f in forbidden
            if any(name == f or name.startswith(f + ".") for name in sys.modules)
        )

    package = importlib.import_module(package_name)
    report = {"modules": [package_name], "errors": {}, "violations": {}}
    if offenders():
        report["violations"][package_name] = offenders()
    for info in pkgutil.walk_packages(package.__path__, package_name + "."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            importlib.import_module(info.name)
        except Exception:
            report["errors"][info.name] = traceback.format_exc(limit=3)
            continue
        report["modules"].append(info.name)
        found = offenders()
        if found and not any(found == v for v in report["violations"].values()):
            report["violations"][info.name] = found
    print(json.dumps(report))
    """
)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_boundaries(package: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_SCRIPT, package, json.dumps(FORBIDDEN[package])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}, "modules that fail to import:\n" + "\n".join(
        report["errors"].values()
    )
    assert report["violations"] == {}, f"{package} must not import {FORBIDDEN[package]}"
    assert len(report["modules"]) > 1 or package != "mlxcel.daemon"
