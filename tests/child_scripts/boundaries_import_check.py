"""Imports a package and every module under it (found with pkgutil) in this fresh interpreter;
prints one JSON report: the modules imported, the ones that failed (with their traceback), and
each module after whose import `sys.modules` held a forbidden package (only where that set of
offenders is new).

Usage: boundaries_import_check.py PACKAGE FORBIDDEN_JSON_LIST
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import traceback
from typing import Any


def offenders(forbidden: list[str]) -> list[str]:
    """The forbidden packages (or their sub-modules) imported so far."""
    return sorted(
        f for f in forbidden if any(name == f or name.startswith(f + ".") for name in sys.modules)
    )


def main(package_name: str, forbidden: list[str]) -> None:
    package = importlib.import_module(package_name)
    report: dict[str, Any] = {"modules": [package_name], "errors": {}, "violations": {}}
    if offenders(forbidden):
        report["violations"][package_name] = offenders(forbidden)
    for info in pkgutil.walk_packages(package.__path__, package_name + "."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            importlib.import_module(info.name)
        except Exception:
            report["errors"][info.name] = traceback.format_exc(limit=3)
            continue
        report["modules"].append(info.name)
        found = offenders(forbidden)
        if found and not any(found == v for v in report["violations"].values()):
            report["violations"][info.name] = found
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
