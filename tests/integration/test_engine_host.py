"""Host time per token: outputs reach the loop once per engine step (not once per token), a
slow reader takes every ready output at once, and batching never changes what is generated."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from daemon_helpers import async_wait_until
from engine_driver import Driver
from mlxcel.daemon.engine.bridge import EngineBridge
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest
from mlxcel.daemon.server.generation import Generation
from mlxcel.shared.config import ServingConfig
from mlxcel.shared.snapshot import SlotInfo
from platform_marks import cpu_only


def make_bridge(tiny: Any, **overrides: Any) -> EngineBridge:
    cfg = ServingConfig(**{"parallel": 16, "prefill_chunk_size": 64, **overrides})
    return EngineBridge(Engine(tiny.model, cfg, context_length=2048, available_bytes=1 << 30))


def prompt(i: int) -> tuple[int, ...]:
    return tuple(10 + (i * 7 + j) % 290 for j in range(20 + i))


def req(rid: str, ids: tuple[int, ...], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, ids, max_tokens, GREEDY)


async def collect(stream: Any) -> list[Any]:
    return [out async for out in stream]


async def test_outputs_reach_the_loop_once_per_step_not_once_per_token(tiny: Any) -> None:
    bridge = make_bridge(tiny)
    loop = asyncio.get_running_loop()
    calls = 0
    real = loop.call_soon_threadsafe

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    bridge.start()
    try:
        streams = [bridge.submit(req(f"r{i}", prompt(i), 24)) for i in range(16)]
        results = await asyncio.wait_for(asyncio.gather(*map(collect, streams)), 120)
    finally:
        await bridge.shutdown(drain=False)
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    for outputs in results:
        assert [o.finish_reason for o in outputs] == [None] * 23 + ["length"]
    tokens = sum(len(outputs) for outputs in results)
    steps = bridge.snapshot().counters.steps
    assert tokens == 16 * 24
    # one hand-over per step (two when a step finishes rows), plus the shutdown's own
    assert calls <= 2 * steps + 4
    assert calls < tokens / 4


async def test_a_slow_reader_takes_every_ready_output_at_once(tiny: Any) -> None:
    bridge = make_bridge(tiny)
    bridge.start()
    try:
        stream = bridge.submit(req("slow", prompt(3), 30))
        await async_wait_until(lambda: bridge.snapshot().counters.generation_tokens >= 30, 60)
        await async_wait_until(lambda: bridge.num_running == 0, 60)
        await asyncio.sleep(0.05)  # the last hand-over reaches the loop
        batch = await asyncio.wait_for(stream.next_batch(), 10)
        assert [o.finish_reason for o in batch] == [None] * 29 + ["length"]
        assert await stream.next_batch() == []  # finished: nothing more, no wait
        assert stream.finished
    finally:
        await bridge.shutdown(drain=False)


@cpu_only  # bit-exact batched == alone: a CPU guarantee (docs/platforms.md)
async def test_batched_delivery_equals_each_request_alone(tiny: Any) -> None:
    requests = [req(f"p{i}", prompt(i), 16) for i in range(8)]
    bridge = make_bridge(tiny, parallel=8)
    bridge.start()
    try:
        together = await asyncio.wait_for(
            asyncio.gather(*(collect(bridge.submit(r)) for r in requests)), 120
        )
    finally:
        await bridge.shutdown(drain=False)
    for r, outputs in zip(requests, together, strict=True):
        alone = make_bridge(tiny, parallel=1, prompt_cache=False)
        alone.start()
        try:
            solo = await asyncio.wait_for(collect(alone.submit(r)), 60)
        finally:
            await alone.shutdown(drain=False)
        assert [o.token_id for o in outputs] == [o.token_id for o in solo]


async def test_a_stop_string_inside_a_batch_ends_the_text_and_the_usage_there(tiny: Any) -> None:
    detok = tiny.tokenizer.detokenizer
    bridge = make_bridge(tiny)
    bridge.start()
    try:
        ids = prompt(5)
        gen = Generation(bridge, req("full", ids, 40), detok, (), frozenset())
        full = "".join([piece async for piece in gen.pieces()])
        assert gen.usage.completion_tokens == 40 and len(full) > 10
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        expected = full[: full.find(stop)]
        # a slow reader: the whole answer is ready before the first read (one batch)
        gen = Generation(bridge, req("stopped", ids, 40), tiny.tokenizer.detokenizer, (stop,), ())
        await async_wait_until(lambda: bridge.num_running == 0 and bridge.num_waiting == 0, 60)
        await asyncio.sleep(0.05)
        text = "".join([piece async for piece in gen.pieces()])
    finally:
        await bridge.shutdown(drain=False)
    assert text == expected
    assert gen.finish_reason == "stop"
    # the tokens sampled after the one that completed the stop string are not counted
    assert 0 < gen.usage.completion_tokens < 40
    assert gen.usage.prompt_tokens == len(ids)


async def test_stream_interval_groups_tokens_per_piece_without_changing_the_text(
    tiny: Any,
) -> None:
    pieces: dict[int, list[str]] = {}
    usage = {}
    for interval in (1, 4):
        bridge = make_bridge(tiny, stream_interval=interval)
        assert bridge.stream_interval == interval
        bridge.start()
        try:
            gen = Generation(bridge, req("g", prompt(2), 30), tiny.tokenizer.detokenizer, (), ())
            pieces[interval] = [piece async for piece in gen.pieces()]
            usage[interval] = gen.usage.completion_tokens
        finally:
            await bridge.shutdown(drain=False)
    assert "".join(pieces[1]) == "".join(pieces[4]) and usage == {1: 30, 4: 30}
    # 30 tokens in pieces of at least 4 (the last may be shorter): at most 8 pieces. (At
    # interval 1 the count depends on the reader's pace: one that falls behind takes every
    # token ready in one piece, so it is not compared.)
    assert len(pieces[4]) <= 8, pieces[4]


def test_snapshot_slots_are_the_records_the_plain_constructor_builds(tiny: Any) -> None:
    """The snapshot's running slots are built without the frozen dataclass's __init__ (host
    time per step): every field, equality, hashing and the dict round trip stay those of
    SlotInfo(...)."""
    driver = Driver(tiny, parallel=4, prefill_chunk_size=64)
    driver.add(*(req(f"s{i}", prompt(i), 6) for i in range(3)))
    snaps = [driver.step() for _ in range(4)]
    engine = driver.engine
    by_slot = {seq.slot: seq for seq in engine.running.values()}
    assert len(by_slot) == 3
    snap = snaps[-1]
    for info in snap.slots:
        seq = by_slot.get(info.id)
        if seq is None:
            assert info == SlotInfo(id=info.id)
            continue
        expected = SlotInfo(
            id=seq.slot,
            state=seq.state,
            request_id=seq.request_id,
            prompt_tokens=seq.prompt_len,
            cached_tokens=seq.cached_tokens,
            prefilled_tokens=seq.cached_tokens + seq.prefilled_tokens,
            generated_tokens=seq.generated,
            max_tokens=seq.request.max_tokens,
            kv_blocks=seq.kv_blocks,
            ttft_s=seq.first_token_at - seq.arrival,
            tokens_per_s=info.tokens_per_s,  # from the step times, checked below
            age_s=snap.time - seq.arrival,
        )
        assert info == expected and hash(info) == hash(expected)
        assert SlotInfo.from_dict(info.to_dict()) == info
        assert repr(info) == repr(expected)
        assert info.generated_tokens >= 1 and info.state == "decode"
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.slots[0].state = "idle"  # type: ignore[misc]
