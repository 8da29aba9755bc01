"""The prompt cache's disk tier under the conditions a user meets (daemon/engine/disk_cache.py,
docs/reliability.md): the LRU order survives a restart, a fine-tuned copy of a model never
shares its entries, a full or broken disk is logged once and leaves no temporary files, a reset
wins over reads and writes in flight, bfloat16 KV comes back exact, two models on one folder
keep one byte budget, and a read whose request is gone leaves the engine idle."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from daemon_helpers import wait_until
from engine_driver import Driver
from mlxcel.daemon.engine.disk_cache import (
    CHUNK_TOKENS,
    TMP_SUFFIX,
    DiskTier,
    chain_keys,
    weights_identity,
)
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest
from repo_paths import TESTS

FP = "a" * 64
OTHER_FP = "b" * 64
LAYERS, HEADS, DIM = 2, 2, 16
CHILD_SCRIPTS = TESTS / "child_scripts"


def tier(directory: Path, fingerprint: str = FP, capacity: int = 1 << 30, **kw: Any) -> DiskTier:
    t = DiskTier(directory, fingerprint, capacity, **kw)
    assert t.flush()  # the start scan has run
    return t


def tokens(n: int, seed: int, hi: int = 300) -> list[int]:
    """Token ids the tiny model has (an engine test runs them)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, hi, n)]


def layers(n: int, seed: int, dtype: Any = mx.float32) -> list[tuple[mx.array, mx.array]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(LAYERS):
        k = mx.array(rng.standard_normal((1, HEADS, n, DIM), dtype=np.float32)).astype(dtype)
        v = mx.array(rng.standard_normal((1, HEADS, n, DIM), dtype=np.float32)).astype(dtype)
        out.append((k, v))
    mx.eval(out)
    return out


def read_back(t: DiskTier, prompt: list[int]) -> Any:
    """The tier's read of `prompt` (+ one token), through match, start_read, take_reads."""
    num, keys = t.match([*prompt, 0])
    if not num:
        return None
    t.start_read("r", [*prompt, 0], keys)
    wait_until(lambda: t.has_reads, 30, 0.005, "the read done")
    (read,) = t.take_reads()
    return read


def write_and_read(directory: Path, prompt: list[int], kv: list[Any]) -> tuple[DiskTier, Any]:
    """A tier at `directory` that wrote `kv` for `prompt` (whole chunks: one entry each) and
    read all of it back."""
    t = tier(directory)
    t.offer(prompt, kv)
    assert t.flush() and t.num_entries == len(prompt) // CHUNK_TOKENS
    read = read_back(t, prompt)
    assert read is not None and read.num_tokens == len(prompt)
    return t, read


def chunk_size(directory: Path) -> int:
    return next(directory.rglob("*.kv")).stat().st_size


# -- the LRU order survives a restart ----------------------------------------------------------


def test_after_a_restart_the_budget_evicts_a_grown_chain_from_its_end(tmp_path: Path) -> None:
    """An agent's conversation grows a turn at a time: each turn writes its new chunks. After
    a restart under a smaller budget the chain must lose its end, not its first chunk (which
    would make every chunk after it unreachable)."""
    prompt, kv = tokens(5 * CHUNK_TOKENS, 1), layers(5 * CHUNK_TOKENS, 1)
    t = tier(tmp_path)
    for turn in range(1, 6):  # five turns, one new chunk each
        n = turn * CHUNK_TOKENS
        t.offer(prompt[:n], [(k[:, :, :n], v[:, :, :n]) for k, v in kv])
        assert t.flush()
        time.sleep(0.02)  # the turns are apart in time, as an agent's are
    size = chunk_size(tmp_path)
    t.close()
    small = tier(tmp_path, capacity=3 * size + size // 2)
    assert small.num_entries == 3
    read = read_back(small, prompt)
    assert read is not None and read.num_tokens == 3 * CHUNK_TOKENS


# -- a fine-tuned copy is another model ----------------------------------------------------


def test_a_model_rewritten_in_its_middle_gets_another_identity(tmp_path: Path) -> None:
    """A LoRA fused into some middle layers keeps the file's size, its first and last MiB,
    config.json and tokenizer.json: it is another model all the same."""
    base = tmp_path / "base"
    base.mkdir()
    rng = np.random.default_rng(0)
    (base / "model.safetensors").write_bytes(rng.bytes(5 << 20))
    (base / "config.json").write_text('{"model_type": "llama"}')
    tuned = tmp_path / "tuned"
    shutil.copytree(base, tuned)  # copy2: the same times too
    assert weights_identity(tuned) == weights_identity(base)  # the same bytes: the same model
    time.sleep(0.02)
    with open(tuned / "model.safetensors", "r+b") as f:  # as a fuse rewrites the file
        f.seek(5 << 19)
        f.write(rng.bytes(4096))
    assert weights_identity(tuned) != weights_identity(base)


def test_a_model_file_between_one_and_two_mib_is_hashed_whole(tmp_path: Path) -> None:
    """(Its bytes past the first MiB were never hashed.) The same name, size and time."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    data = bytearray(np.random.default_rng(1).bytes(3 << 19))  # 1.5 MiB
    base.write_bytes(bytes(data))
    data[(1 << 20) + 100] ^= 1
    other.write_bytes(bytes(data))
    stamp = base.stat().st_mtime_ns
    os.utime(other, ns=(stamp, stamp))
    assert weights_identity(base) != weights_identity(other)


def test_the_fingerprint_of_a_model_is_the_same_in_another_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Weights identity, dtype, KV layout and kernel path, as `load_engine` makes them: the
    same model in two processes (another environment of the same kind) finds its entries."""
    script = CHILD_SCRIPTS / "prompt_cache_disk_review_fingerprint.py"
    runs = []
    for extra in ({}, {"MLXCEL_LOG_LEVEL": "debug", "PYTHONHASHSEED": "7"}):
        env = {**os.environ, **extra}
        out = subprocess.run(
            [sys.executable, str(script), str(tiny_model_dir), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            check=True,
        )
        runs.append(out.stdout.strip().splitlines()[-1])
    assert runs[0] == runs[1] and len(runs[0]) == 64


# -- a full or broken disk -----------------------------------------------------------------


def test_a_broken_disk_is_logged_once_and_writing_resumes_when_it_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    shutil.rmtree(t.dir, ignore_errors=True)
    t.dir.write_bytes(b"")  # its folder is a file now: every write fails (ENOTDIR)
    caplog.set_level(logging.INFO, logger="mlxcel.engine.disk")
    for i in range(4):
        t.offer(tokens(2 * CHUNK_TOKENS, 10 + i), layers(2 * CHUNK_TOKENS, i))
    assert t.flush()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert t.num_entries == 0 and t.stats.write_errors == 4
    t.dir.unlink()
    again = tokens(2 * CHUNK_TOKENS, 99)
    t.offer(again, layers(2 * CHUNK_TOKENS, 99))
    assert t.flush()
    assert t.num_entries == 2
    assert any("again" in r.getMessage() for r in caplog.records)
    assert read_back(t, again).num_tokens == 2 * CHUNK_TOKENS


def test_a_full_disk_leaves_no_temporary_file(tmp_path: Path) -> None:
    """ENOSPC in the middle of a chunk (its temporary file is /dev/full): the temporary file
    goes at once, not at the next start (it would hold disk outside the budget)."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    t = tier(tmp_path)
    prompt = tokens(CHUNK_TOKENS, 3)
    (key,) = chain_keys(t._root_key, prompt, 1)
    path = t._path(key)
    path.parent.mkdir(parents=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    tmp.symlink_to("/dev/full")
    t.offer(prompt, layers(CHUNK_TOKENS, 3))
    assert t.flush()
    assert t.num_entries == 0 and not path.exists()
    assert not os.path.lexists(tmp)
    t.offer(prompt, layers(CHUNK_TOKENS, 3))  # the disk has room again
    assert t.flush() and t.num_entries == 1


# -- a reset wins over what is in flight -----------------------------------------------------


def test_a_read_in_flight_at_a_reset_is_not_served(tmp_path: Path) -> None:
    prompt = tokens(3 * CHUNK_TOKENS, 4)
    t = tier(tmp_path)
    t.offer(prompt, layers(3 * CHUNK_TOKENS, 4))
    assert t.flush()
    num, keys = t.match([*prompt, 0])
    assert num == 3 * CHUNK_TOKENS
    t.start_read("r", [*prompt, 0], keys)
    t.clear()  # the console's reset, while the read runs (or just after it ran)
    wait_until(lambda: t.has_reads, 30, 0.005, "the read done")
    (read,) = t.take_reads()
    assert read.layers is None and read.num_tokens == 0
    assert t.flush() and list(tmp_path.rglob("*.kv")) == []


def test_a_prompt_offered_again_after_a_reset_is_written(tmp_path: Path) -> None:
    """Its first offer was still queued at the reset (and dropped by it): the second must not
    be taken for a write already queued."""
    prompt, kv = tokens(2 * CHUNK_TOKENS, 5), layers(2 * CHUNK_TOKENS, 5)
    t = tier(tmp_path, write_delay_s=1.0)
    t.offer(prompt, kv)
    t.clear()
    t.offer(prompt, kv)
    t.write_delay_s = 0.0
    assert t.flush()
    assert t.num_entries == 2
    assert read_back(t, prompt).num_tokens == 2 * CHUNK_TOKENS


# -- bfloat16 and views --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_kv_comes_back_exact_through_offer_read_and_payload(
    tmp_path: Path, dtype: Any
) -> None:
    """Metal users' KV is bfloat16 or float16; a payload may be a view into a longer cache
    (not contiguous)."""
    n = 2 * CHUNK_TOKENS
    full = layers(n + 40, 6, dtype)
    views = [(k[:, :, :n], v[:, :, :n]) for k, v in full]
    assert not memoryview(views[0][0]).c_contiguous
    t, read = write_and_read(tmp_path, tokens(n, 6), views)
    payload = t.payload(read)
    for (k, v), (ek, ev) in zip(payload.layers, views, strict=True):
        assert k.dtype == dtype and v.dtype == dtype
        assert k.shape == ek.shape
        assert mx.array_equal(k, ek).item() and mx.array_equal(v, ev).item()


def test_a_read_writes_its_chunks_into_the_memory_of_the_arrays_it_returns() -> None:
    """On the CPU (and Metal's unified memory) a read's arrays are filled through writable
    views of their own memory: a write through the view is what the array then holds."""
    from mlxcel.daemon.engine.disk_cache import _layer_arrays

    if mx.default_device().type != mx.cpu:
        pytest.skip("the CPU's memory")
    arrays, buffers = _layer_arrays(
        [[(1, HEADS, CHUNK_TOKENS, DIM)] * 2], 2 * CHUNK_TOKENS, np.float32
    )
    assert all(a is not None for a in arrays) and len(buffers) == 2
    buffers[1][:, :, CHUNK_TOKENS:, :] = np.full(
        (1, HEADS, CHUNK_TOKENS, DIM), 1.5, np.float32
    ).view(np.uint8)
    assert mx.sum(arrays[0]).item() == 0.0
    assert mx.sum(arrays[1]).item() == 1.5 * HEADS * CHUNK_TOKENS * DIM
    assert mx.sum(arrays[1][:, :, :CHUNK_TOKENS]).item() == 0.0


@pytest.mark.parametrize("into", ["mlx memory", "numpy, then mx.array"])
def test_a_read_stopped_by_a_corrupt_chunk_serves_the_chunks_before_it_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: str
) -> None:
    """A read fills its arrays for the whole chain it asked for: all of it when every chunk
    is sound; when a later chunk is corrupt, only the sound ones before it, at their own
    length; whether the chunks were copied straight into the arrays' memory or staged in
    numpy (where mlx gives no writable view)."""
    from mlxcel.daemon.engine import disk_cache

    if into != "mlx memory":
        monkeypatch.setattr(disk_cache, "_writable_view", lambda arr: None)
    n = 3 * CHUNK_TOKENS
    kv = layers(n, 9)
    prompt = tokens(n, 9)
    t, whole = write_and_read(tmp_path, prompt, kv)
    for (k, v), (ek, ev) in zip(t.payload(whole).layers, kv, strict=True):
        assert mx.array_equal(k, ek).item() and mx.array_equal(v, ev).item()
    last = t._path(chain_keys(t._root_key, prompt, 3)[2])
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF  # the third chunk's checksum fails
    last.write_bytes(bytes(data))
    read = read_back(t, prompt)
    assert read is not None and read.num_tokens == 2 * CHUNK_TOKENS
    for (k, v), (ek, ev) in zip(t.payload(read).layers, kv, strict=True):
        assert k.shape == (1, HEADS, 2 * CHUNK_TOKENS, DIM)
        assert mx.array_equal(k, ek[:, :, : 2 * CHUNK_TOKENS]).item()
        assert mx.array_equal(v, ev[:, :, : 2 * CHUNK_TOKENS]).item()
    t.close()


# -- two models on one folder keep one budget ------------------------------------------------


def test_two_models_on_one_folder_keep_one_byte_budget(tmp_path: Path) -> None:
    """Two resident models (`max_loaded_models` > 1) each have a tier on the same folder with
    the same `--prompt-cache-disk-bytes`: together they stay within it."""
    probe = tier(tmp_path / "probe")
    probe.offer(tokens(CHUNK_TOKENS, 0), layers(CHUNK_TOKENS, 0))
    assert probe.flush()
    size = chunk_size(tmp_path / "probe")
    capacity = 8 * size
    root = tmp_path / "pc"
    a, b = tier(root, FP, capacity), tier(root, OTHER_FP, capacity)
    for i in range(6):  # 2 x 6 x 2 chunks offered
        for t in (a, b):
            t.offer(tokens(2 * CHUNK_TOKENS, 100 * i + ord(t.fingerprint[0])), layers(128, i))
            assert t.flush()
    on_disk = sum(f.stat().st_size for f in root.rglob("*.kv"))
    assert on_disk <= capacity
    assert a.num_bytes + b.num_bytes == on_disk
    assert a.num_entries > 0 and b.num_entries > 0  # neither took all of it
    # each index names exactly its files
    for t in (a, b):
        assert t.num_entries == len(list(t.dir.rglob("*.kv")))


# -- the engine with a read whose request is gone ---------------------------------------------


def _req(rid: str, prompt: tuple[int, ...], max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, GREEDY, frozenset())


def test_a_read_whose_request_was_aborted_leaves_the_engine_idle(tiny: Any, tmp_path: Path) -> None:
    prompt = tuple(tokens(3 * CHUNK_TOKENS, 7))
    t = tier(tmp_path)
    Driver(tiny, disk_tier=t, parallel=2, prefill_chunk_size=64).add(_req("w", prompt)).run()
    assert t.flush()
    t.close()
    t = tier(tmp_path)
    d = Driver(tiny, disk_tier=t, parallel=2, prefill_chunk_size=64)
    d.add(_req("a", (*prompt, 1, 2)))
    d.step()
    assert d.engine.reading_disk  # its read runs
    assert d.engine.abort("a")  # the client went away
    wait_until(lambda: t.has_reads, 30, 0.005, "the read done")
    for _ in range(3):  # what the bridge's loop does while has_work says so
        if d.engine.has_work:
            d.engine.step()
    assert not d.engine.has_work
    # and the read went to the RAM tier, for the client's retry
    assert d.engine.prefix_cache.num_entries == 1


# -- long prompts reach the disk -------------------------------------------------------------


def test_a_prompt_whose_kv_is_over_the_pending_bound_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAX_PENDING_BYTES (512 MiB) is the KV of 4k tokens of an 8B model (128 KiB a token):
    an agent's 16k-token context must reach the disk all the same when the writer is idle,
    and a turn that adds one chunk to a long cached chain counts that chunk, not the chain."""
    from mlxcel.daemon.engine import disk_cache

    n = 4 * CHUNK_TOKENS
    kv = layers(n, 8)
    whole = sum(k.nbytes + v.nbytes for k, v in kv)
    monkeypatch.setattr(disk_cache, "MAX_PENDING_BYTES", whole // 2)
    prompt = tokens(n, 8)
    t = tier(tmp_path)
    t.offer(prompt, kv)  # the writer is idle: written, however long
    assert t.flush() and t.num_entries == 4 and t.stats.writes_dropped == 0
    # the next turn: one chunk more of the same chain, while another chunk is queued
    t.write_delay_s = 0.5
    t.offer(tokens(CHUNK_TOKENS, 9), layers(CHUNK_TOKENS, 9))  # half the bound pending
    grown = layers(n + CHUNK_TOKENS, 8)
    t.offer([*prompt, *tokens(CHUNK_TOKENS, 10)], grown)  # one chunk: half the bound
    t.write_delay_s = 0.0
    assert t.flush()
    assert t.stats.writes_dropped == 0 and t.num_entries == 4 + 1 + 1
    # a backlog over the bound still drops (the existing bound, kept)
    t.write_delay_s = 0.5
    for i in range(3):
        t.offer(tokens(2 * CHUNK_TOKENS, 20 + i), layers(2 * CHUNK_TOKENS, i))
    t.write_delay_s = 0.0
    assert t.flush() and t.stats.writes_dropped == 2


def test_the_default_budget_counts_what_the_tier_holds_already(tmp_path: Path) -> None:
    """A quarter of the free disk, the tier's own files included: otherwise every restart
    shrinks the budget by a quarter of what the cache holds and evicts at start (15 GiB kept
    of 60 GiB free: the next start allows 11.25)."""
    from mlxcel.daemon.engine.disk_cache import DEFAULT_SHARE, default_disk_bytes

    held = 48 << 20
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.kv").write_bytes(np.random.default_rng(2).bytes(held))
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    got = default_disk_bytes(tmp_path)
    expected = int(min((free + held) * DEFAULT_SHARE, 32 << 30))
    assert abs(got - expected) < held * DEFAULT_SHARE / 2  # others write to this disk too


def _written(tiny: Any, directory: Path, prompt: tuple[int, ...]) -> DiskTier:
    """`prompt` run once (its KV on disk), then a fresh tier on the folder: a restart."""
    t = tier(directory)
    Driver(tiny, disk_tier=t, parallel=2, prefill_chunk_size=64).add(_req("w", prompt)).run()
    assert t.flush()
    t.close()
    return tier(directory)


def test_a_read_in_flight_when_the_prompt_cache_is_turned_off_is_not_served(
    tiny: Any, tmp_path: Path
) -> None:
    prompt = tuple(tokens(3 * CHUNK_TOKENS, 11))
    t = _written(tiny, tmp_path, prompt)
    d = Driver(tiny, disk_tier=t, parallel=2, prefill_chunk_size=64)
    d.add(_req("a", (*prompt, 1, 2)))
    d.step()
    assert d.engine.reading_disk
    (change,) = d.engine.reconfigure({"prompt_cache": False})
    assert change.applied
    d.run()
    assert d.finals["a"].cached_tokens == 0


# -- a long read holds its KV once ------------------------------------------------------------


def test_a_long_read_holds_its_kv_once_not_the_files_and_the_kv(tmp_path: Path) -> None:
    """A 50k-token agent context of an 8B model is 6 GiB of KV: a read that kept every
    file's bytes until the arrays were made held 12 GiB at its peak."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("measures with Linux's /proc/self/clear_refs")
    n, layer_shape = 32 * CHUNK_TOKENS, (1, 8, 32 * CHUNK_TOKENS, 256)
    rng = np.random.default_rng(12)
    kv = [
        (
            mx.array(rng.standard_normal(layer_shape, dtype=np.float32)),
            mx.array(rng.standard_normal(layer_shape, dtype=np.float32)),
        )
        for _ in range(4)
    ]
    total = sum(k.nbytes + v.nbytes for k, v in kv)  # 128 MiB
    t = tier(tmp_path, "e" * 64, 1 << 34)
    t.offer([(i % 250) + 1 for i in range(n)], kv)
    assert t.flush() and t.num_entries == 32
    t.close()
    del kv
    # glibc: every large block mmapped and given back when freed, so that the resident size
    # follows what is alive (its adaptive threshold keeps freed buffers otherwise)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    script = CHILD_SCRIPTS / "prompt_cache_disk_review_read.py"  # prints the peak's growth
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(n)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    )
    grew = int(out.stdout.strip().splitlines()[-1])
    # measured: 1.16x; 2.1x when the files' bytes were kept until the arrays were made
    assert grew < 1.6 * total, f"the read's peak grew {grew / 2**20:.0f} MiB for {total >> 20}"


def test_a_model_without_weight_files_it_can_name_gets_no_tier(tmp_path: Path) -> None:
    """Its identity would be config.json and tokenizer.json alone, which every fine-tune of
    a base model shares: no disk tier for it (the RAM tier serves alone)."""
    from mlxcel.daemon.engine.disk_cache import open_tier
    from mlxcel.shared.config import ServingConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "weights.npz").write_bytes(b"\0" * 1024)
    with pytest.raises(ValueError, match="no weight files"):
        weights_identity(model)
    cfg = ServingConfig(prompt_cache_dir=str(tmp_path / "pc"), prompt_cache_disk_bytes=1 << 30)
    assert open_tier(cfg, str(model), "float32", None, None) is None


def test_closing_with_reads_queued_does_not_read_them(tmp_path: Path) -> None:
    """A model unload or a stop while reads are queued (nobody will take them): close()
    does not read them all first (bridge.shutdown waits on it, 10 s at most a thread)."""
    n, shape = 32 * CHUNK_TOKENS, (1, 8, 32 * CHUNK_TOKENS, 64)
    rng = np.random.default_rng(13)
    kv = [
        (
            mx.array(rng.standard_normal(shape, dtype=np.float32)),
            mx.array(rng.standard_normal(shape, dtype=np.float32)),
        )
        for _ in range(4)
    ]  # 32 MiB: a read takes tens of ms
    prompt = tokens(n, 13)
    t = tier(tmp_path)
    t.offer(prompt, kv)
    assert t.flush()
    num, keys = t.match([*prompt, 0])
    assert num == n
    for i in range(100):
        t.start_read(i, [*prompt, 0], keys)
    started = time.monotonic()
    t.close(timeout=60)
    assert time.monotonic() - started < 2.0
    assert not t._reader.is_alive()


def test_the_start_scan_keeps_the_temporary_files_of_live_writers(tmp_path: Path) -> None:
    """Another resident model's writer (this process), or another daemon on the folder, is
    in the middle of a chunk: a tier starting now must not delete its temporary file."""
    live = tmp_path / ("d" * 16) / "ab" / f"{'ab' * 32}.kv.{os.getpid()}{TMP_SUFFIX}"
    live.parent.mkdir(parents=True)
    live.write_bytes(b"half a chunk")
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dead = live.with_name(f"{'cd' * 32}.kv.{dead_pid}{TMP_SUFFIX}")
    dead.write_bytes(b"left by a kill -9")
    tier(tmp_path)
    assert live.exists() and not dead.exists()


def test_a_model_reloaded_while_its_old_tier_closes_keeps_its_files(tmp_path: Path) -> None:
    """The model host loads a model again while its retiring instance still finishes its
    writes (two live tiers of one fingerprint): the old one's files are the new one's, not
    another model's that go first, and they count once in the budget."""
    old_prompt = tokens(4 * CHUNK_TOKENS, 14)
    a = tier(tmp_path)
    a.offer(old_prompt, layers(4 * CHUNK_TOKENS, 14))
    assert a.flush()
    size = chunk_size(tmp_path)
    files = sorted(tmp_path.rglob("*.kv"))
    b = tier(tmp_path, capacity=6 * size + size // 2)  # the reload: it finds the 4 chunks
    assert b.num_entries == 4
    a.close()  # the old instance is freed
    b.offer(tokens(2 * CHUNK_TOKENS, 15), layers(2 * CHUNK_TOKENS, 15))
    assert b.flush()
    assert all(f.exists() for f in files)
    assert b.stats.evictions == 0 and b.num_entries == 6
    assert read_back(b, old_prompt).num_tokens == 4 * CHUNK_TOKENS
