"""mlx-lm behind one seam (daemon/mlx_lm_compat.py): every private mlx-lm name the product
uses is listed in `PRIVATE_NAMES`, no other module spells one, the seam's accessors read what
mlx-lm keeps, and pyproject.toml's requirement is the tested range. That the installed mlx-lm
still has each name (on real objects of the tiny model) is
tests/integration/test_mlx_lm_compat.py's."""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from mlx_lm_samples import batch_kv_cache
from mlx_lm_samples import rope as rope_sample
from mlxcel.daemon import mlx_lm_compat as compat
from mlxcel.daemon.mlx_lm_compat import (
    MLX_LM_RANGE,
    PRIVATE_NAMES,
    untested_version_warning,
)
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from repo_paths import ROOT

SEAM = ROOT / "daemon" / "mlx_lm_compat.py"
SCANNED = ("daemon", "shared", "tui", "scripts")
ACCESSORS = {"getattr", "hasattr", "setattr", "delattr"}


def test_generation_batch_still_steps_through_step() -> None:
    """RowBatch's step runs only while mlx-lm's `next()` (and `__init__`) call `_step`."""
    from mlx_lm.generate import GenerationBatch
    from mlxcel.daemon.engine.runner import RowBatch

    for method in ("next", "__init__"):
        names = getattr(GenerationBatch, method).__code__.co_names
        assert "_step" in names, f"GenerationBatch.{method} no longer calls _step"
    assert RowBatch._step is compat.GenerationStep._step
    assert RowBatch.decode_step is not compat.GenerationStep.decode_step


# --- the source scan ---


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _defined_names(tree: ast.AST, *, module_level: ast.Module | None = None) -> set[str]:
    """Private names a source defines: functions, classes, `self.`/`cls.` attributes it
    assigns, module-level assignments."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    for node in module_level.body if module_level is not None else ():
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if _is_private(n)}


def _mlx_lm_private_names() -> set[str]:
    """Every private name the installed mlx-lm's source defines."""
    import mlx_lm

    names = set()
    for path in Path(mlx_lm.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text(errors="replace"))
        names |= _defined_names(tree, module_level=tree)
    return names


def _product_files() -> list[Path]:
    return [
        path
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != SEAM and "__pycache__" not in path.parts
    ]


def _from_mlx_lm(module: str | None) -> bool:
    return module is not None and (module == "mlx_lm" or module.startswith("mlx_lm."))


def _private_uses(tree: ast.Module, flagged: set[str], mlx_names: set[str]) -> list[tuple]:
    """(line, name) of each private mlx-lm name `tree` uses: imported from mlx_lm, read off an
    object other than self (a call's string included), or overridden / read on self in a
    subclass of an mlx-lm class."""
    mlx_bound = set()  # names this file binds to something of mlx_lm
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _from_mlx_lm(node.module):
            mlx_bound.update(a.asname or a.name for a in node.names)
            uses += [(node.lineno, p) for p in node.module.split(".") if _is_private(p)]
            uses += [(node.lineno, a.name) for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _from_mlx_lm(a.name):
                    mlx_bound.add(a.asname or a.name.split(".")[0])
                    uses += [(node.lineno, p) for p in a.name.split(".") if _is_private(p)]
        elif isinstance(node, ast.Attribute) and node.attr in flagged:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                uses.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ACCESSORS
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in flagged
        ):
            uses.append((node.lineno, node.args[1].value))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases}
        if not any(b in mlx_bound or b.startswith("mlx_lm.") for b in bases):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                inner.name in mlx_names
            ):
                uses.append((inner.lineno, inner.name))
            elif (
                isinstance(inner, ast.Attribute)
                and isinstance(inner.value, ast.Name)
                and inner.value.id in ("self", "cls")
                and inner.attr in mlx_names
            ):
                uses.append((inner.lineno, inner.attr))
    return sorted(set(uses))


def _seam_names() -> set[str]:
    """Every private name daemon/mlx_lm_compat.py reads, writes, calls or imports."""
    tree = ast.parse(SEAM.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and _from_mlx_lm(node.module):
            names.update(a.name for a in node.names if _is_private(a.name))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ACCESSORS
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            names.add(node.args[1].value)
    return names


def test_the_table_lists_every_private_name_the_seam_uses() -> None:
    listed = {name for names in PRIVATE_NAMES.values() for name in names}
    used = _seam_names()
    unlisted, unused = sorted(used - listed), sorted(listed - used)
    assert unlisted == [], f"used in daemon/mlx_lm_compat.py, not in PRIVATE_NAMES: {unlisted}"
    assert unused == [], f"in PRIVATE_NAMES, no longer used (drop them): {unused}"


def test_no_other_module_uses_a_private_mlx_lm_name() -> None:
    """A private mlx-lm name outside the seam is named by file:line. Names our own code
    defines (a `_prefill` of ours) are not mlx-lm's, unless the seam lists them."""
    listed = {name for names in PRIVATE_NAMES.values() for name in names}
    mlx_names = _mlx_lm_private_names() | listed
    trees = {path: ast.parse(path.read_text(), str(path)) for path in _product_files()}
    ours = set().union(*(_defined_names(t, module_level=t) for t in trees.values()))
    flagged = (mlx_names - ours) | listed
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path, tree in trees.items()
        for line, name in _private_uses(tree, flagged, mlx_names)
    ]
    assert found == [], "private mlx-lm names outside daemon/mlx_lm_compat.py:\n" + "\n".join(found)


def test_the_scan_finds_a_private_use() -> None:
    """The scan is not blind: each kind of use it must catch, caught."""
    source = (
        "from mlx_lm.utils import _get_classes\n"
        "from mlx_lm.generate import GenerationBatch\n"
        "import mlx_lm.utils\n"
        "x = cache._idx\n"
        "y = getattr(tokenizer, '_tokenizer', tokenizer)\n"
        "z = mlx_lm.utils._download('r')\n"
        "class B(GenerationBatch):\n"
        "    def _step(self):\n"
        "        return self._next_tokens\n"
        "class Ours:\n"
        "    def _step(self):\n"
        "        return self._idx\n"
    )
    names = {"_get_classes", "_idx", "_tokenizer", "_download", "_step", "_next_tokens"}
    uses = _private_uses(ast.parse(source), names, names)
    assert uses == [
        (1, "_get_classes"),
        (4, "_idx"),
        (5, "_tokenizer"),
        (6, "_download"),
        (8, "_step"),
        (9, "_next_tokens"),
    ]


# --- the seam's accessors ---


def test_the_accessors_read_what_mlx_lm_keeps() -> None:
    import mlx.core as mx

    cache = batch_kv_cache(None)  # type: ignore[arg-type]
    assert compat.cache_index(cache) == 3 and compat.right_padding(cache) is None
    compat.shift_cache_index(cache, -1)
    assert compat.cache_index(cache) == 2
    cache.prepare(lengths=[1, 2], right_padding=[1, 0])
    assert compat.right_padding(cache).tolist() == [1, 0]
    rope = rope_sample("longrope")(None)  # type: ignore[arg-type]
    assert compat.longrope_scale(rope) > 1.0
    assert mx.array_equal(compat.rope_frequencies(rope), rope._freqs).item()
    plain = object()
    assert compat.wrapped_tokenizer(plain) is plain


# --- versions ---


def _pyproject() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads((ROOT / "pyproject.toml").read_text())
    import tomlkit

    return tomlkit.parse((ROOT / "pyproject.toml").read_text())


def test_pyproject_requires_the_tested_range() -> None:
    [text] = [r for r in _pyproject()["project"]["dependencies"] if Requirement(r).name == "mlx-lm"]
    assert Requirement(text).specifier == SpecifierSet(MLX_LM_RANGE), text
    assert metadata.version("mlx-lm") in SpecifierSet(MLX_LM_RANGE)  # what this suite runs on
    assert untested_version_warning() is None


def test_an_untested_version_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MLX_LM_RANGE == ">=0.32.2,<0.33"
    for tested in ("0.32.2", "0.32.10", "0.32.3.dev1"):
        assert untested_version_warning(tested) is None, tested
    assert untested_version_warning("0.34.0") == (
        "mlx-lm 0.34.0 is outside the tested range >=0.32.2,<0.33; serving may break: "
        "pin mlx-lm to that range (pip install 'mlx-lm>=0.32.2,<0.33')"
    )
    for untested in ("0.33.0", "0.33.0rc1", "1.0", "0.31.9"):
        line = untested_version_warning(untested)
        assert line is not None and line.startswith(f"mlx-lm {untested} is outside"), untested
    monkeypatch.setattr(compat, "installed_mlx_lm", lambda: "0.33.1")
    assert untested_version_warning().startswith("mlx-lm 0.33.1 is outside")
    monkeypatch.setattr(compat, "installed_mlx_lm", lambda: None)
    assert untested_version_warning() is None  # not installed: platform_check says so


def test_merge_with_room_is_mlx_lm_s_merge_with_room_for_the_rest_of_the_prompt() -> None:
    """Rows of 70, 0 and 300 cached tokens: the same keys, values, offsets and padding as
    `BatchKVCache.merge`, and the next 199 tokens written without the cache growing (mlx-lm's
    merge sizes it to the prefix, so its first append copies the whole of it)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    rows = []
    for i, n in enumerate((70, 0, 300)):
        cache = KVCache()
        if n:
            k = mx.random.normal((1, 3, n, 64), key=mx.random.key(i))
            cache.update_and_fetch(k, k * 2)
        rows.append(cache)
    ours, theirs = compat.merge_with_room(rows, 199), BatchKVCache.merge(rows)
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values(), strict=True):
        assert mx.array_equal(a, b).item()
    for name in ("offset", "left_padding"):
        assert mx.array_equal(getattr(ours, name), getattr(theirs, name)).item()
    assert compat.cache_index(ours) == compat.cache_index(theirs) == 300
    columns = ours.keys.shape[2]
    new = mx.ones((3, 3, 199, 64))
    ours.update_and_fetch(new, new)
    theirs.update_and_fetch(new, new)
    assert ours.keys.shape[2] == columns >= 499  # written in place
    assert theirs.keys.shape[2] > 300  # grown: a copy of everything before
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values(), strict=True):
        assert mx.array_equal(a, b).item()


def test_a_small_batch_cache_grows_by_64_columns_and_a_large_one_by_mlx_lm_s_step() -> None:
    """A short request's rows hold at most 63 unused columns while the cache is under 256 (a
    fresh cohort's first write, a merge, the decode's growths); from 256 columns on it grows by
    mlx-lm's 256, as before. The keys written are the same either way."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    fresh = compat.merge_with_room([KVCache(), KVCache()], 47)
    k = mx.random.normal((2, 3, 47, 64), key=mx.random.key(0))
    fresh.update_and_fetch(k, k)
    assert fresh.keys.shape[2] == 64  # mlx-lm's step would allocate 256

    cache, reference = compat.merge_with_room([KVCache()], 0), BatchKVCache([0])
    cache.update_and_fetch(k[:1], k[:1])
    reference.update_and_fetch(k[:1], k[:1])
    sizes = set()
    for i in range(300):
        compat.fit_growth_step([cache])
        one = mx.full((1, 3, 1, 64), float(i))
        cache.update_and_fetch(one, one)
        reference.update_and_fetch(one, one)
        sizes.add(cache.keys.shape[2])
    assert sorted(sizes) == [64, 128, 192, 256, 512]
    for a, b in zip(cache.keys_and_values(), reference.keys_and_values(), strict=True):
        assert mx.array_equal(a, b).item()
    assert compat.growth_step(255) == 64 and compat.growth_step(256) == BatchKVCache.step


def test_append_columns_leaves_the_cache_as_update_and_fetch_does() -> None:
    """Two left-padded rows, 300 single columns then a 5-column chunk: the same keys, values,
    offsets and written columns as `update_and_fetch` after every append, through the appends
    with room (in place, no returned slices) and those that grow the buffers (its own method)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    ours, theirs = BatchKVCache([2, 0]), BatchKVCache([2, 0])
    grown = set()
    for i in range(301):
        width = 5 if i == 300 else 1
        k = mx.random.normal((2, 3, width, 16), key=mx.random.key(i))
        compat.append_columns(ours, k, k * 3)
        theirs.update_and_fetch(k, k * 3)
        assert compat.cache_index(ours) == compat.cache_index(theirs) == i + width
        assert mx.array_equal(ours.offset, theirs.offset).item()
        grown.add(ours.keys.shape[2])
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values(), strict=True):
        assert mx.array_equal(a, b).item()
    assert len(grown) == 2  # 256 columns, then grown to 512 by the cache's own method
