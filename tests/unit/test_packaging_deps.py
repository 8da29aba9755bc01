"""Every third-party module the product imports comes with a plain `pip install`: it is a
runtime dependency in pyproject.toml, or a dependency of one (the `gguf` reader once sat in
the dev extra only, so a user's install could not read the default model's file)."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata

import tomlkit
from repo_paths import ROOT

PRODUCT = ("daemon", "shared", "tui")
# imported only inside `try: ... except ImportError` where present (the code says why)
OPTIONAL = {"torch", "sentence_transformers"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def runtime_closure() -> set[str]:
    """The distributions a plain install brings: pyproject's dependencies (and the CPU extra,
    what scripts/setup.sh installs on Linux), then theirs, without their extras."""
    project = tomlkit.parse((ROOT / "pyproject.toml").read_text())["project"]
    todo = [str(r) for r in project["dependencies"]]
    todo += [str(r) for r in project["optional-dependencies"].get("cpu", [])]
    seen: set[str] = set()
    while todo:
        name = _name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [r for r in requires if "extra ==" not in r]
    return seen


def imported_top_modules() -> set[str]:
    names: set[str] = set()
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"mlxcel", "__future__"} - OPTIONAL


def test_every_imported_module_comes_with_a_plain_install() -> None:
    closure = runtime_closure()
    dists = metadata.packages_distributions()
    missing = {}
    for module in sorted(imported_top_modules()):
        owners = {d.lower().replace("_", "-") for d in dists.get(module, [])}
        if not owners:
            missing[module] = "no installed distribution provides it"
        elif not owners & closure:
            missing[module] = f"from {sorted(owners)}, not a runtime dependency"
    assert missing == {}


def test_the_checkers_target_the_oldest_python_claimed() -> None:
    """`requires-python` claims 3.10 while this machine may run a newer Python: the type
    checker reads the product as that oldest version (typeshed then refuses a module or name
    it lacks, as `import tomllib` in shared/alerts.py was) and ruff writes no newer syntax."""
    doc = tomlkit.parse((ROOT / "pyproject.toml").read_text()).unwrap()
    oldest = re.fullmatch(r">=\s*3\.(\d+)", doc["project"]["requires-python"].strip())
    assert oldest is not None, doc["project"]["requires-python"]
    minor = int(oldest.group(1))
    assert doc["tool"]["mypy"]["python_version"] == f"3.{minor}"
    assert doc["tool"]["ruff"]["target-version"] == f"py3{minor}"
