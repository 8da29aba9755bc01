"""The prompt cache's disk tier (daemon/engine/disk_cache.py, docs/reliability.md): a hit
from disk equals a cold prefill; a corrupt, truncated or foreign file is never served; the
byte budget holds; a `kill -9` mid-write leaves nothing that is read; the writer never
holds up a decode step."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_helpers import wait_until
from engine_driver import Driver
from mlxcel.daemon.engine.disk_cache import (
    CHUNK_TOKENS,
    TMP_SUFFIX,
    DiskTier,
    forget_model,
)
from mlxcel.daemon.engine.scheduler import WAIT_DISK_READ, WaitingView, plan_admission
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest
from repo_paths import TESTS

FP = "a" * 64
OTHER_FP = "b" * 64


def rand_tokens(n: int, seed: int, lo: int = 1, hi: int = 300) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randrange(lo, hi) for _ in range(n))


def req(rid: str, prompt: tuple[int, ...], max_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, GREEDY, frozenset())


def tier(directory: Path, fingerprint: str = FP, capacity: int = 1 << 30, **kw: Any) -> DiskTier:
    t = DiskTier(directory, fingerprint, capacity, **kw)
    t.flush()  # the start scan has run
    assert t.ready
    return t


def cold(model: Any, r: GenerationRequest) -> list[int]:
    return Driver(model, prompt_cache=False, parallel=1).add(r).run().tokens[r.request_id]


def write_through(model: Any, directory: Path, prompt: tuple[int, ...], fp: str = FP) -> None:
    """One engine runs `prompt`; its KV goes to the disk tier; the tier closes."""
    t = tier(directory, fp)
    Driver(model, disk_tier=t, parallel=2, prefill_chunk_size=64).add(req("w", prompt)).run()
    assert t.flush()
    t.close()


def after_restart(model: Any, directory: Path, r: GenerationRequest, **config: Any):
    """A fresh engine (empty RAM tier) on the same folder runs `r`: (driver, tier)."""
    t = tier(directory)
    d = Driver(model, disk_tier=t, parallel=2, prefill_chunk_size=64, **config).add(r).run()
    return d, t


def chunk_files(directory: Path, fingerprint: str = FP) -> list[Path]:
    return sorted((directory / fingerprint[:16]).rglob("*.kv"))


# -- hits equal cold prefills ---------------------------------------------------------------


@pytest.mark.parametrize("length", [65, 130, 300])
def test_a_hit_from_disk_gives_the_greedy_tokens_of_a_cold_prefill(
    tiny: Any, tmp_path: Path, length: int
) -> None:
    """Block and chunk boundaries crossed (SmolLM2: test_prompt_cache_disk_daemon.py)."""
    prompt = rand_tokens(length, seed=length)
    write_through(tiny, tmp_path, prompt)
    follow = req("f", (*prompt, *rand_tokens(9, seed=1)), 8)
    d, t = after_restart(tiny, tmp_path, follow)
    cached = d.finals["f"].cached_tokens
    assert cached >= (length // CHUNK_TOKENS) * CHUNK_TOKENS > 0
    assert cached % CHUNK_TOKENS == 0
    assert t.stats.hits == 1 and t.stats.hit_tokens == cached
    assert d.tokens["f"] == cold(tiny, follow)


def test_every_hit_comes_from_disk_when_the_ram_tier_holds_nothing(
    tiny: Any, tmp_path: Path
) -> None:
    prompt = rand_tokens(300, seed=2)
    t = tier(tmp_path)
    d = Driver(tiny, disk_tier=t, parallel=2, prefill_chunk_size=64, prompt_cache_bytes=1)
    d.add(req("a", prompt)).run()
    assert t.flush()
    follow = req("b", prompt + rand_tokens(20, seed=3), 8)
    d.add(follow).run()
    assert d.engine.prefix_cache.num_entries == 0  # the RAM tier kept nothing
    assert d.finals["b"].cached_tokens == 256 == t.stats.hit_tokens
    assert d.tokens["b"] == cold(tiny, follow)
    # a request waiting for its read was shown as such in a snapshot
    reasons = {q.wait_reason for s in d.snapshots for q in s.queue}
    assert WAIT_DISK_READ in reasons


def test_a_turn_that_comes_before_the_last_one_is_written_waits_for_its_chunks(
    tiny: Any, tmp_path: Path
) -> None:
    """The RAM tier holding nothing: the next turn arrives while the writer still sleeps on
    the previous turn's chunks; they count, and the read waits for them."""
    prompt = rand_tokens(300, seed=8)
    t = tier(tmp_path, write_delay_s=1.0)
    d = Driver(tiny, disk_tier=t, parallel=2, prefill_chunk_size=64, prompt_cache_bytes=1)
    d.add(req("a", prompt)).run()
    assert t.stats.writes == 0  # still queued
    follow = req("b", (*prompt, *rand_tokens(20, seed=9)), 8)
    d.add(follow).run()
    assert d.finals["b"].cached_tokens == 256
    assert d.tokens["b"] == cold(tiny, follow)


def test_a_read_lands_in_the_ram_tier_for_the_next_turn(tiny: Any, tmp_path: Path) -> None:
    prompt = rand_tokens(200, seed=4)
    write_through(tiny, tmp_path, prompt)
    d, t = after_restart(tiny, tmp_path, req("a", (*prompt, 7, 8, 9)))
    assert d.finals["a"].cached_tokens == 192
    d.add(req("b", (*prompt, 7, 8, 9, 10, 11))).run()
    assert d.finals["b"].cached_tokens > 192  # the RAM tier: to the token
    assert t.stats.reads == 1


# -- integrity ------------------------------------------------------------------------------


def _flip_a_data_byte(path: Path, _: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path, _: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_header_token(path: Path, _: Path) -> None:
    data = path.read_bytes()
    at = data.index(b'"tokens": [') + len(b'"tokens": [')
    digit = data[at : at + 1]
    swapped = b"9" if digit != b"9" else b"8"
    path.write_bytes(data[:at] + swapped + data[at + 1 :])


def _another_models_entry(path: Path, other: Path) -> None:
    """The same tokens' chunk written by another model (fingerprint), put in its place."""
    foreign = chunk_files(other, OTHER_FP)
    index = int(path.read_bytes().split(b'"index": ')[1].split(b",")[0])
    match = next(f for f in foreign if f'"index": {index},'.encode() in f.read_bytes())
    shutil.copyfile(match, path)


@pytest.mark.parametrize(
    "damage", [_flip_a_data_byte, _truncate, _flip_a_header_token, _another_models_entry]
)
def test_a_corrupt_truncated_or_foreign_file_is_never_served(
    tiny: Any, tmp_path: Path, damage: Any
) -> None:
    prompt = rand_tokens(330, seed=5)  # 5 chunks
    write_through(tiny, tmp_path / "mine", prompt)
    write_through(tiny, tmp_path / "other", prompt, fp=OTHER_FP)
    files = chunk_files(tmp_path / "mine")
    assert len(files) == 5
    third = next(f for f in files if b'"index": 2,' in f.read_bytes())
    damage(third, tmp_path / "other")
    damaged = third.read_bytes()
    follow = req("f", (*prompt, 11, 12), 8)
    d, t = after_restart(tiny, tmp_path / "mine", follow)
    assert d.finals["f"].cached_tokens == 2 * CHUNK_TOKENS  # the chunks before it only
    assert t.stats.rejected == 1
    assert d.tokens["f"] == cold(tiny, follow)
    # deleted, and written again, soundly, from the request's own KV
    assert t.flush()
    assert not third.exists() or third.read_bytes() != damaged
    t.close()
    again, t2 = after_restart(tiny, tmp_path / "mine", req("g", (*prompt, 11, 13), 8))
    assert again.finals["g"].cached_tokens == 5 * CHUNK_TOKENS and t2.stats.rejected == 0


def test_files_of_another_model_are_not_found_and_count_in_the_budget(
    tiny: Any, tmp_path: Path
) -> None:
    prompt = rand_tokens(200, seed=6)
    write_through(tiny, tmp_path, prompt, fp=OTHER_FP)
    other_bytes = sum(f.stat().st_size for f in chunk_files(tmp_path, OTHER_FP))
    d, t = after_restart(tiny, tmp_path, req("a", (*prompt, 1)))
    assert d.finals["a"].cached_tokens == 0
    assert t.info()["other_bytes"] == other_bytes
    # a budget with no room for them: the other model's files go first
    t.close()
    small = tier(tmp_path, capacity=other_bytes // 2)
    assert small.flush()
    assert chunk_files(tmp_path, OTHER_FP) == []


def test_the_byte_budget_holds_under_a_flood_of_distinct_prompts(tiny: Any, tmp_path: Path) -> None:
    probe = tier(tmp_path / "probe")
    Driver(tiny, disk_tier=probe, parallel=1).add(req("p", rand_tokens(70, seed=0))).run()
    probe.flush()
    chunk_size = chunk_files(tmp_path / "probe")[0].stat().st_size
    capacity = 10 * chunk_size
    t = tier(tmp_path / "flood", capacity=capacity)
    d = Driver(tiny, disk_tier=t, parallel=4, prefill_chunk_size=128, prompt_cache_bytes=1)
    for i in range(12):  # 12 x 3 chunks
        d.add(req(f"r{i}", rand_tokens(200, seed=100 + i), 2))
    d.run()
    assert t.flush()
    on_disk = sum(f.stat().st_size for f in chunk_files(tmp_path / "flood"))
    assert on_disk <= capacity and t.num_bytes <= capacity
    assert t.stats.evictions > 0
    # the most recent prompt is still there, from its first chunk
    last = rand_tokens(200, seed=111)
    assert t.match((*last, 1))[0] >= CHUNK_TOKENS


# -- a kill -9 in the middle of writes ------------------------------------------------------

# Writes chain after chain (seed 0, 1, ...: expected_layers(seed) for [seed + 1] * 640),
# printing each seed once it is on disk, until killed.
WRITER = TESTS / "child_scripts" / "prompt_cache_disk_writer.py"


def expected_layers(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((1, 4, 640, 128), dtype=np.float32),
            rng.standard_normal((1, 4, 640, 128), dtype=np.float32),
        )
        for _ in range(4)
    ]


def test_a_kill_9_during_writes_leaves_nothing_corrupt_and_the_tier_still_works(
    tmp_path: Path,
) -> None:
    child = subprocess.Popen(
        [sys.executable, str(WRITER), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        for _ in range(3):  # a few chains written whole, then killed in the middle of one
            assert child.stdout is not None and child.stdout.readline()
        time.sleep(0.03)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    # and a temporary file as a kill in the middle of a write leaves it (named by the dead
    # writer's pid: a live process's temporary files are kept, they may be in flight)
    some = chunk_files(tmp_path, "c" * 64)[0]
    half = some.with_name(f"{some.name}.{child.pid}{TMP_SUFFIX}")
    half.write_bytes(some.read_bytes()[:1000])
    t = tier(tmp_path, "c" * 64, 1 << 34)
    assert list(tmp_path.rglob(f"*{TMP_SUFFIX}")) == []
    served = 0
    for seed in range(8):
        tokens = [seed + 1] * 640 + [0]
        num, keys = t.match(tokens)
        if not num:
            continue
        t.start_read(seed, tokens, keys)
        wait_until(lambda: t.has_reads, 30, what=f"the read of chain {seed}")
        (read,) = t.take_reads()
        assert read.num_tokens > 0 and read.layers is not None
        for (k, v), (ek, ev) in zip(read.layers, expected_layers(seed), strict=True):
            assert np.array_equal(np.asarray(k), ek[:, :, : read.num_tokens])
            assert np.array_equal(np.asarray(v), ev[:, :, : read.num_tokens])
        served += read.num_tokens
    assert served >= 3 * 640
    assert t.stats.rejected == 0
    # still works: a new chain goes in and comes back
    import mlx.core as mx

    layers = [(mx.array(k[:, :, :128]), mx.array(v[:, :, :128])) for k, v in expected_layers(7)]
    t.offer([4242] * 128, layers)
    assert t.flush()
    assert t.match([4242] * 129)[0] == 128


# -- the writer never holds up the engine ---------------------------------------------------


def test_a_slow_disk_never_holds_up_a_decode_step(tiny: Any, tmp_path: Path) -> None:
    t = tier(tmp_path, write_delay_s=5.0)  # every write job sleeps 5 s first
    d = Driver(tiny, disk_tier=t, parallel=4, prefill_chunk_size=64)
    d.add(*(req(f"s{i}", rand_tokens(130, seed=20 + i), 2) for i in range(3)))
    d.add(req("long", rand_tokens(40, seed=30), 60))
    started = time.monotonic()
    longest = 0.0
    while d.engine.has_work:
        step_start = time.monotonic()
        d.step()
        longest = max(longest, time.monotonic() - step_start)
    elapsed = time.monotonic() - started
    assert len(d.tokens["long"]) == 60
    assert elapsed < 4.0  # all done while the writer still sleeps on its first job
    assert t.stats.writes == 0 and t.info()["pending_bytes"] > 0
    assert longest < 1.0
    t.write_delay_s = 0.0  # the jobs behind the sleeping one go at once
    assert t.flush(timeout=60)
    assert t.stats.writes > 0


def test_offers_beyond_the_pending_bound_are_dropped_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx
    from mlxcel.daemon.engine import disk_cache

    monkeypatch.setattr(disk_cache, "MAX_PENDING_BYTES", 3 << 20)
    t = tier(tmp_path, write_delay_s=2.0)
    layer = mx.zeros((1, 4, 640, 128))  # 1.25 MiB per array
    mx.eval(layer)
    started = time.monotonic()
    for i in range(6):
        t.offer([i + 1] * 640, [(layer, layer)])
    assert time.monotonic() - started < 0.5
    assert t.stats.writes_dropped >= 4
    t.close(timeout=10)


# -- the scheduler, the cleanup -------------------------------------------------------------


def test_a_reading_head_admits_nobody_and_a_reading_row_ends_the_cohort() -> None:
    def views(*reading: bool) -> list[WaitingView]:
        return [WaitingView(10, 1, reading=r) for r in reading]

    kw = dict(free_slots=4, max_rows=4, token_cap=0, free_blocks=None, cohort_busy=False)
    plan = plan_admission(views(True, False, False), **kw)
    assert plan.num_admit == 0 and plan.wait_reasons[0] == WAIT_DISK_READ
    plan = plan_admission(views(False, False, True, False), **kw)
    assert plan.num_admit == 2 and plan.wait_reasons[0] == WAIT_DISK_READ


def test_models_rm_forgets_the_models_folders(tmp_path: Path) -> None:
    store = tmp_path / "models" / "m1"
    store.mkdir(parents=True)
    kept = tier(tmp_path / "pc", FP)
    kept.describe(tmp_path / "models" / "m2")
    gone = tier(tmp_path / "pc", OTHER_FP)
    gone.describe(store)
    assert forget_model(tmp_path / "pc", store) == [gone.dir]
    assert not gone.dir.exists() and kept.dir.exists()
