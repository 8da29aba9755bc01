"""EngineBridge on a real engine and a tiny random-weight model: threads, streams, events."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import async_wait_until
from mlxcel.daemon.engine.bridge import EngineBridge
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import GREEDY, AdmissionRejected, GenerationRequest
from mlxcel.shared.config import ServingConfig

PROMPT = tuple(range(10, 60))


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Any:
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
    return model


def make_bridge(model: Any, **overrides: Any) -> EngineBridge:
    cfg = ServingConfig(**{"parallel": 4, "prefill_chunk_size": 32, **overrides})
    return EngineBridge(Engine(model, cfg, context_length=2048, available_bytes=1 << 30))


def request(rid: str, prompt: tuple[int, ...] = PROMPT, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, GREEDY)


async def collect(stream) -> list:
    return [out async for out in stream]


async def test_streams_tokens_then_a_final_output_with_usage(tiny_model: Any) -> None:
    bridge = make_bridge(tiny_model)
    bridge.start()
    try:
        outputs = await asyncio.wait_for(collect(bridge.submit(request("a"))), 60)
    finally:
        await bridge.shutdown(drain=False)
    assert [o.finish_reason for o in outputs] == [None] * 7 + ["length"]
    assert all(o.token_id is not None for o in outputs)
    final = outputs[-1]
    assert (final.prompt_tokens, final.completion_tokens) == (len(PROMPT), 8)


async def test_engine_runs_on_its_own_thread_and_events_reach_the_loop(tiny_model: Any) -> None:
    bridge = make_bridge(tiny_model)
    events: list[tuple[str, dict, str]] = []
    bridge.add_listener(
        lambda name, data: events.append((name, data, threading.current_thread().name))
    )
    bridge.start()
    try:
        streams = [bridge.submit(request(f"r{i}", PROMPT[i:])) for i in range(6)]
        results = await asyncio.wait_for(asyncio.gather(*map(collect, streams)), 60)
        assert [r[-1].finish_reason for r in results] == ["length"] * 6
        assert "mlxcel-engine" in [t.name for t in threading.enumerate()]

        def finished_ids() -> list[str]:
            return [d["request_id"] for name, d, _ in events if name == "request_finished"]

        await async_wait_until(lambda: len(finished_ids()) >= 6, 30, what="6 finished events")
    finally:
        await bridge.shutdown(drain=False)
    finished = finished_ids()
    assert sorted(finished) == [f"r{i}" for i in range(6)]
    assert {thread for *_, thread in events} == {threading.current_thread().name}
    assert "mlxcel-engine" not in [t.name for t in threading.enumerate()]


async def test_rejections_are_synchronous_and_counted(tiny_model: Any) -> None:
    bridge = make_bridge(tiny_model, max_queue_depth=0)
    events: list[str] = []
    bridge.add_listener(lambda name, data: events.append(data.get("reason", name)))
    bridge.start()
    try:
        with pytest.raises(AdmissionRejected) as too_long:
            bridge.submit(request("long", (5,) * 2040, 100))
        with pytest.raises(AdmissionRejected) as full:
            bridge.submit(request("x"))
        await async_wait_until(lambda: len(events) >= 2, 30, what="2 rejection events")
    finally:
        await bridge.shutdown(drain=False)
    assert (too_long.value.reason, too_long.value.http_status) == ("too_long", 400)
    assert (full.value.reason, full.value.http_status) == ("queue_full", 503)
    assert events == ["too_long", "queue_full"]
    with pytest.raises(AdmissionRejected) as closed:
        bridge.submit(request("late"))
    assert (closed.value.reason, closed.value.http_status) == ("shutting_down", 503)
    assert bridge.snapshot().counters.rejections_by_reason == {"too_long": 1, "queue_full": 1}


async def test_abort_ends_the_stream_and_frees_the_slot(tiny_model: Any) -> None:
    bridge = make_bridge(tiny_model)
    bridge.start()
    try:
        stream = bridge.submit(request("long-run", max_tokens=1000))
        first = await asyncio.wait_for(stream.__anext__(), 60)
        assert first.token_id is not None
        stream.abort()
        rest = await asyncio.wait_for(collect(stream), 60)
        assert rest[-1].finish_reason == "abort"
        # the final output follows a snapshot that already shows the freed slot
        snap = bridge.snapshot()
        assert bridge.num_running == 0
        assert snap.kv.blocks_used == 0
        assert all(slot.state == "idle" for slot in snap.slots)
    finally:
        await bridge.shutdown(drain=False)


async def test_reconfigure_and_cache_reset_run_between_steps(tiny_model: Any) -> None:
    bridge = make_bridge(tiny_model)
    events: list[str] = []
    bridge.add_listener(lambda name, data: events.append(name))
    bridge.start()
    try:
        await asyncio.wait_for(collect(bridge.submit(request("warm", max_tokens=40))), 60)
        assert bridge.snapshot().prompt_cache.entries == 1
        changes = await bridge.reconfigure({"parallel": 2, "max_batch_prefill_tokens": "x"})
        assert [(c.key, c.applied, c.effective) for c in changes] == [
            ("parallel", True, 2),
            ("max_batch_prefill_tokens", False, 256),  # derived: 2 x 4 x 32
        ]
        reset = await bridge.reset_prompt_cache()
        assert reset["entries_freed"] == 1 and reset["bytes_freed"] > 0
        await async_wait_until(lambda: "cache_reset" in events, 30, what="cache_reset event")
    finally:
        await bridge.shutdown(drain=False)
    assert bridge.snapshot().config.parallel == 2
    assert bridge.snapshot().prompt_cache.entries == 0
    assert events.count("config_changed") == 2 and "cache_reset" in events


async def test_shutdown_with_drain_finishes_queued_requests(tiny_model: Any) -> None:
    bridge = make_bridge(tiny_model, parallel=1)
    bridge.start()
    streams = [bridge.submit(request(f"d{i}", max_tokens=5)) for i in range(3)]
    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    await bridge.shutdown(drain=True, timeout=60)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [r[-1].finish_reason for r in results] == ["length"] * 3


async def test_shutdown_drain_timeout_aborts_the_rest(tiny_model: Any) -> None:
    bridge = make_bridge(tiny_model, parallel=1)
    bridge.start()
    streams = [bridge.submit(request(f"t{i}", max_tokens=1500)) for i in range(3)]
    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    await bridge.shutdown(drain=True, timeout=0.2)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [r[-1].finish_reason for r in results] == ["abort"] * 3
    assert bridge.num_running == 0 and bridge.num_waiting == 0


async def test_an_idle_engine_gives_memory_back_once_per_idle_period(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After work, IDLE_RELEASE_S of idling gives MLX's buffer cache and glibc's freed heap
    back, once (not again every idle second); the next work arms it again. A submit during
    the idle period is served as ever."""
    import mlxcel.daemon.engine.bridge as bridge_module

    monkeypatch.setattr(bridge_module, "IDLE_RELEASE_S", 0.2)
    monkeypatch.setattr(bridge_module, "IDLE_REFRESH_S", 0.05)
    caplog.set_level(logging.DEBUG, logger="mlxcel.engine")

    def releases() -> list[str]:
        return [r.getMessage() for r in caplog.records if "given back" in r.getMessage()]

    bridge = make_bridge(tiny_model)
    bridge.start()
    try:
        await asyncio.sleep(0.5)
        assert releases() == []  # nothing worked yet: nothing to give back
        for round_ in (1, 2):
            outputs = await asyncio.wait_for(collect(bridge.submit(request(f"r{round_}"))), 60)
            assert outputs[-1].finish_reason == "length"
            await async_wait_until(lambda n=round_: len(releases()) == n, timeout=10)
            await asyncio.sleep(0.5)  # ten more idle wakes: no second release
            assert len(releases()) == round_, releases()
    finally:
        await bridge.shutdown(drain=False)
    assert releases()[0].startswith("idle 0 s: ") and "MiB given back (resident " in releases()[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap, /proc")
def test_release_idle_memory_returns_freed_heap_pages() -> None:
    """Freed heap pages below a live block stay resident (glibc trims only its heap top) until
    `release_idle_memory` trims them."""
    from mlxcel.daemon.engine.memory import release_idle_memory
    from mlxcel.daemon.models.loader import serve_from_heap

    if not serve_from_heap():  # buffers up to 32 MiB from the heap, as while serving
        pytest.skip("malloc's threshold cannot be set here")
    blocks = [bytearray(1 << 20) for _ in range(256)]  # 256 MiB, every page written
    keep = blocks.pop()  # the heap top stays in use: free() cannot give the rest back
    blocks.clear()
    before, after = release_idle_memory()
    assert before - after >= 128 << 20, (before >> 20, after >> 20)
    del keep
