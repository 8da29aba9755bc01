"""A module a reader can hold: one of the product's modules past ~500 lines says, in its
docstring, why it is one module (a line starting `Why one module:`)."""

from __future__ import annotations

import ast

from repo_paths import ROOT

LIMIT = 520  # ~500: a module just past it is not worth a split
PACKAGES = ("daemon", "shared", "tui")


def long_modules_without_a_reason() -> list[str]:
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if len(text.splitlines()) <= LIMIT:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why one module:" not in doc:
                missing.append(f"{path.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return missing


def test_every_long_module_says_why_it_is_one() -> None:
    assert long_modules_without_a_reason() == []
