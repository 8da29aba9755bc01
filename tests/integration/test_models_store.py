"""`models pull / list / rm / show` and the alias tables, on tiny random-weight models
(docs/models.md): a local directory copied or referenced, a .gguf converted, the Hugging Face
cache listed, user aliases from config.toml, half-pulled and corrupt directories refused with
one line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.daemon.models.loader import load_model
from mlxcel.daemon.models.pull import pull, remove
from mlxcel.daemon.models.registry import (
    DEFAULT_MODEL,
    MANIFEST_NAME,
    check_model_files,
    list_models,
    local_model_dir,
    model_dir,
    resolve_alias,
    shipped_aliases,
)
from mlxcel.daemon.process.option_sources import read_config_file

CLI = [sys.executable, "-m", "mlxcel.daemon.cli.model_commands"]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


def _logits(spec: str) -> np.ndarray:
    import mlx.core as mx

    loaded = load_model(spec)
    ids = loaded.tokenizer.encode("The capital of France is")
    return np.array(loaded.model(mx.array([ids]))[0, -1])


def test_pull_directory_copies_it_into_the_store(tiny_model_dir: Path, mlxcel_home: Path) -> None:
    result = pull(str(tiny_model_dir), name="tiny-b", progress=None)
    assert result.how == "imported" and result.name == "tiny-b"
    assert result.path == model_dir("tiny-b") and result.path != tiny_model_dir
    copied = (result.path / "model.safetensors").read_bytes()
    assert copied == (tiny_model_dir / "model.safetensors").read_bytes()
    manifest = json.loads((result.path / MANIFEST_NAME).read_text())
    assert manifest["kind"] == "dir" and manifest["source"] == f"dir:{tiny_model_dir.resolve()}"
    loaded = load_model("tiny-b")
    assert loaded.info.source == "store" and loaded.info.path == str(result.path)
    assert np.array_equal(_logits("tiny-b"), _logits(str(tiny_model_dir)))
    (entry,) = [m for m in list_models() if m.name == "tiny-b"]
    assert (entry.family, entry.context_length, entry.complete) == ("llama", 2048, True)
    assert entry.size_bytes > len(copied) and entry.quantization
    # Pulling the same name again is refused without --force, replaced with it.
    with pytest.raises(ModelLoadError, match="already in the store"):
        pull(str(tiny_model_dir), name="tiny-b", progress=None)
    assert pull(str(tiny_model_dir), name="tiny-b", force=True, progress=None).how == "imported"


def test_pull_link_references_in_place_and_rm_keeps_the_original(
    tiny_model_dir: Path, mlxcel_home: Path
) -> None:
    result = pull(str(tiny_model_dir), name="tiny-ref", link=True, progress=None)
    assert result.how == "referenced" and "referenced in place" in result.describe()
    assert local_model_dir("tiny-ref") == tiny_model_dir.resolve()
    assert sorted(p.name for p in model_dir("tiny-ref").iterdir()) == [MANIFEST_NAME]
    assert load_model("tiny-ref").info.path == str(tiny_model_dir.resolve())
    assert remove("tiny-ref") == [model_dir("tiny-ref")]
    assert not model_dir("tiny-ref").exists()
    assert (tiny_model_dir / "model.safetensors").is_file()  # the original is untouched
    assert all(m.name != "tiny-ref" for m in list_models())


def test_pull_gguf_converts_it(tiny_model_dir: Path, mlxcel_home: Path, tmp_path: Path) -> None:
    from tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "Tiny-Model.F32.gguf")
    result = pull(str(gguf), progress=None)
    assert result.how == "converted" and result.name == "tiny-model.f32"
    assert (result.path / "config.json").is_file()
    assert json.loads((result.path / MANIFEST_NAME).read_text())["kind"] == "gguf"
    np.testing.assert_allclose(_logits("tiny-model.f32"), _logits(str(gguf)), atol=1e-4)


def test_rm_removes_files_and_entry(tiny_model_dir: Path, mlxcel_home: Path) -> None:
    pull(str(tiny_model_dir), name="gone", progress=None)
    assert model_dir("gone").is_dir()
    done = _cli("rm", "gone")
    assert done.returncode == 0, done.stderr
    assert "removed gone" in done.stdout
    assert not model_dir("gone").exists()
    assert all(m.name != "gone" for m in list_models())
    with pytest.raises(ModelLoadError, match=r"not available|unknown model|no local model"):
        load_model("gone")
    again = _cli("rm", "gone")
    assert again.returncode == 1 and again.stderr.startswith("error: no local model 'gone'")


def test_half_pulled_and_truncated_directories_are_refused(
    tiny_model_dir: Path, mlxcel_home: Path
) -> None:
    # A folder with the files but no manifest: a pull that stopped before its last step.
    half = model_dir("half")
    half.parent.mkdir(parents=True, exist_ok=True)
    pull(str(tiny_model_dir), name="whole", progress=None)
    os.rename(model_dir("whole"), half)
    (half / MANIFEST_NAME).unlink()
    with pytest.raises(ModelLoadError, match="'half' in the store is incomplete") as info:
        load_model("half")
    assert "\n" not in str(info.value)
    (entry,) = [m for m in list_models() if m.name == "half"]
    assert not entry.complete and entry.source == "incomplete"
    listing = _cli("list", "--no-hf-cache")
    assert "half" in listing.stdout and "broken" in listing.stdout
    # A weights file cut short: a clear line at load, before mlx sees it.
    pull(str(tiny_model_dir), name="cut", progress=None)
    weights = model_dir("cut") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cannot load model 'cut': .* is truncated") as info:
        load_model("cut")
    assert "\n" not in str(info.value)
    with pytest.raises(ModelLoadError, match="truncated"):
        check_model_files(model_dir("cut"))
    assert _cli("rm", "half").returncode == 0 and not half.exists()


def test_user_aliases_from_config_toml(tiny_model_dir: Path, mlxcel_home: Path) -> None:
    pull(str(tiny_model_dir), name="tiny-c", progress=None)
    config = mlxcel_home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('parallel = 2\n\n[aliases]\n"mine" = "tiny-c"\n"smollm2" = "tiny-c"\n')
    assert read_config_file(config) == {"parallel": 2}  # the table is no serving option
    assert resolve_alias("mine") == "tiny-c" and resolve_alias("mine:latest") == "tiny-c"
    assert resolve_alias("smollm2") == "tiny-c"  # the operator's table wins over the shipped
    assert load_model("mine").info.path == str(model_dir("tiny-c"))
    assert remove("mine") == [model_dir("tiny-c")]  # rm through an alias removes its target
    config.write_text('[aliases]\n"a" = "b"\n"b" = "a"\n')
    with pytest.raises(ModelLoadError, match="alias loop: a -> b -> a"):
        resolve_alias("a")
    config.write_text("[aliases]\nbad = 3\n")
    with pytest.raises(ModelLoadError, match=r"\[aliases\] must map names to non-empty strings"):
        resolve_alias("x")


def test_shipped_aliases_name_the_default_model_and_repo_ids() -> None:
    table = shipped_aliases()
    assert table["smollm2"] == DEFAULT_MODEL
    assert resolve_alias("smollm2:135m", table) == DEFAULT_MODEL
    assert all("/" in v or v == DEFAULT_MODEL for v in table.values())


def test_pull_without_hub_access_is_one_line(mlxcel_home: Path) -> None:
    done = _cli("pull", "someone/model-x", HF_HUB_OFFLINE="1", HF_HOME=str(mlxcel_home / "hf"))
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        "error: cannot reach the Hugging Face hub to fetch 'someone/model-x'"
    )


def _fake_hf_cache(hf_home: Path, repo: str, model: Path) -> Path:
    """The layout huggingface_hub writes: blobs by hash, a snapshot of links, refs/main."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    revision = "0" * 40
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    for file in model.iterdir():
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_list_and_load_from_the_hugging_face_cache(
    tiny_model_dir: Path, mlxcel_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_home = mlxcel_home / "hf"
    snapshot = _fake_hf_cache(hf_home, "someone/tiny-llama", tiny_model_dir)
    import huggingface_hub.constants
    import huggingface_hub.utils._cache_manager  # copies HF_HUB_CACHE when imported

    # huggingface_hub reads HF_HOME at import: point this process's cache there too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    done = _cli("list", "--json", HF_HOME=str(hf_home))
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads(done.stdout)
    assert entry["name"] == "someone/tiny-llama" and entry["source"] == "hf-cache"
    assert (entry["family"], entry["context_length"], entry["loaded"]) == ("llama", 2048, False)
    assert load_model("someone/tiny-llama").info.path == str(snapshot)
    # Pulling it again is offline work: it is already in the cache.
    assert pull("someone/tiny-llama", progress=None).how == "hf-cache"
    assert remove("someone/tiny-llama")
    assert json.loads(_cli("list", "--json", HF_HOME=str(hf_home)).stdout) == []


def test_show_reports_config_template_and_capabilities(
    tiny_model_dir: Path, tiny_nobatch_model_dir: Path, mlxcel_home: Path
) -> None:
    pull(str(tiny_model_dir), name="tiny-s", progress=None)
    pull(str(tiny_nobatch_model_dir), name="tiny-lfm", progress=None)
    done = _cli("show", "tiny-s", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["family"] == "llama" and info["config"]["num_hidden_layers"] == 2
    assert "im_start" in info["template"] and info["loaded"] is False
    caps = info["capabilities"]
    assert caps["can_batch"] is True and caps["chat"] is True and caps["tools"] is False
    lfm = json.loads(_cli("show", "tiny-lfm", "--json").stdout)
    assert lfm["capabilities"]["can_batch"] is False
    assert "cannot batch" in lfm["capabilities"]["batch_reason"]
    text = _cli("show", "tiny-s").stdout
    assert "can batch:     yes" in text and "tool calling:  no" in text
    missing = _cli("show", "nothing-here")
    assert missing.returncode == 1 and missing.stderr.startswith("error: no local model")
