"""docs/ARCHITECTURE.md, docs/internals.md and docs/cpu-kernels.md name only what exists: every
function they call `name()` is defined in the product, every other code name they quote appears
in the source, every file they cite is in the tree. (What each one does is for the reader to
check; that it is there is checked here.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repo_paths import ROOT

DOC = ROOT / "docs" / "ARCHITECTURE.md"
# the architecture and the two documents its detail moved to; (doc, at least so many calls,
# code names and cited files it quotes: the patterns still find them)
DOCS = [
    (DOC, 15, 50, 30),
    (ROOT / "docs" / "internals.md", 15, 50, 30),
    (ROOT / "docs" / "cpu-kernels.md", 1, 10, 5),
]
PRODUCT = ("daemon", "shared", "tui")
NOT_OURS = {"min", "ceil", "tanh", "cb", "next", "dlsym"}  # arithmetic, a placeholder, mlx-lm, libc


def quoted(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"```python\n(.*?)```", text, re.S)


def source(*folders: str, suffixes: tuple[str, ...] = (".py",)) -> str:
    return "\n".join(
        path.read_text(errors="replace")
        for folder in folders
        for path in (ROOT / folder).rglob("*")
        if path.suffix in suffixes and "__pycache__" not in path.parts
    )


@pytest.mark.parametrize(("doc", "calls", "names", "files"), DOCS, ids=lambda v: str(v)[-20:])
def test_every_called_name_is_defined_in_the_product(
    doc: Path, calls: int, names: int, files: int
) -> None:
    code = source(*PRODUCT)
    defined = set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", code, re.M))
    called = {
        name.split(".")[-1]
        for span in quoted(doc.read_text())
        for name in re.findall(r"([A-Za-z_][\w.]*)\(", span)
    }
    assert len(called) > calls  # the doc does quote calls: the pattern still finds them
    assert sorted(called - defined - NOT_OURS) == []


@pytest.mark.parametrize(("doc", "calls", "names", "files"), DOCS, ids=lambda v: str(v)[-20:])
def test_every_quoted_code_name_exists(doc: Path, calls: int, names: int, files: int) -> None:
    least = names
    words = set(re.findall(r"\w+", source(*PRODUCT, "tests", "scripts", suffixes=(".py", ".c"))))
    names = set()
    for span in quoted(doc.read_text()):
        for token in re.findall(r"[A-Za-z_][\w.]*", span):
            last = token.split(".")[-1]
            if "_" in last.strip("_") or re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", last):
                names.add(last)  # snake_case or CamelCase: a code name, not prose
    assert len(names) > least
    assert sorted(names - words) == []


@pytest.mark.parametrize(("doc", "calls", "names", "files"), DOCS, ids=lambda v: str(v)[-20:])
def test_every_cited_file_is_in_the_tree(doc: Path, calls: int, names: int, files: int) -> None:
    tree = {
        p.relative_to(ROOT).as_posix() for d in (*PRODUCT, "tests") for p in (ROOT / d).rglob("*")
    }
    cited = set(re.findall(r"`([\w/]+\.(?:py|c|tcss))`", doc.read_text()))
    assert len(cited) > files
    missing = [c for c in sorted(cited) if not any(t == c or t.endswith("/" + c) for t in tree)]
    assert missing == []


def test_nothing_cites_a_document_outside_the_repository() -> None:
    """The contract lives in docs/: no code, test, script or doc points at the old spec."""
    files = [p for f in (*PRODUCT, "tests", "scripts", "docs") for p in (ROOT / f).rglob("*")]
    cited = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted([*files, *ROOT.glob("*.md"), *ROOT.glob("*.toml")])
        if path.suffix in (".py", ".md", ".c", ".sh", ".toml") and "__pycache__" not in path.parts
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if re.search(r"\bSPEC(\s*§|\.md|'s)", line)
    ]
    assert cited == []
