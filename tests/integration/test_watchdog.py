"""The step watchdog (engine/bridge.py; docs/reliability.md, "Step watchdog"): an engine step
that never returns fails the requests in flight with a clear error, marks /health 503, and a
fresh engine serves again, the waiting requests included; without one the process exits."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import async_wait_until, embedded_daemon
from encoder_fixtures import make_encoder_dir
from mlxcel.daemon.engine import bridge as bridge_module

STEP_TIMEOUT_S = 1.0
# long enough that the streams still run when the hook hangs the engine, on a loaded machine too
BODY = {"prompt": "hello there", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_daemon(
        tmp_path_factory, tiny_model_dir, parallel=2, step_timeout=STEP_TIMEOUT_S
    ) as d:
        yield d


def hang_decode(bridge: Any, when: Callable[[Any], bool]) -> tuple[threading.Event, ...]:
    """The test hook: the engine's runner blocks in the first decode step for which `when(engine)`
    holds, until the first event is set; the second is set once it blocks."""
    release, blocked = threading.Event(), threading.Event()
    engine = bridge.engine
    decode: Callable[[bool], Any] = engine.runner.decode

    def hanging(hold: bool = False) -> Any:
        if not blocked.is_set() and when(engine):
            blocked.set()
            release.wait(60)
        return decode(hold)

    engine.runner.decode = hanging
    return release, blocked


async def get(daemon: Any, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(daemon.http_url + path) as resp:
        return resp.status, await resp.text()


async def complete(daemon: Any, body: dict[str, Any]) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{daemon.http_url}/v1/completions", json=body) as resp,
    ):
        return resp.status, await resp.text()


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_a_hung_step_fails_its_streams_marks_health_and_a_fresh_engine_serves(
    daemon: Any,
) -> None:
    bridge = daemon.daemon.bridge
    hung_engine = bridge.engine

    def both_streaming_one_queued(engine: Any) -> bool:
        rows = engine.running.values()
        # the streams' clients got tokens (not only the engine made them): a request whose
        # client got nothing is retried on the fresh engine instead of ending with the error
        delivered = sum(s.delivered for s in list(bridge._streams.values()))
        return (
            engine.num_waiting == 1
            and len(rows) == 2
            and all(len(r.output_ids) > 2 for r in rows)
            and delivered >= 2
        )

    # both slots have streamed a few tokens, and a third request waits in the engine's queue
    release, blocked = hang_decode(bridge, both_streaming_one_queued)
    running = [asyncio.create_task(complete(daemon, {**BODY, "stream": True})) for _ in range(2)]
    # the short one only then: sent at once, it may take a slot before a stream does
    await async_wait_until(lambda: hung_engine.num_running == 2, 30, what="both streams running")
    queued = asyncio.create_task(complete(daemon, {**BODY, "max_tokens": 5}))
    assert await asyncio.to_thread(blocked.wait, 30)
    # sent while the engine thread hangs: it waits in the inbox for the fresh engine
    waiting = asyncio.create_task(complete(daemon, {**BODY, "max_tokens": 6}))

    for status, text in await asyncio.gather(*running):
        assert status == 200
        chunks = events(text)
        assert any(c["choices"][0]["text"] for c in chunks if c.get("choices"))  # it had begun
        error = chunks[-1]["error"]
        assert "engine step ran over" in error["message"] and "restarted" in error["message"]

    async def health_degraded() -> bool:
        status, text = await get(daemon, "/health")
        return status == 503 and json.loads(text)["status"] == "degraded"

    await async_wait_until(health_degraded, timeout=20, what="/health 503 degraded")
    for task, tokens in ((queued, 5), (waiting, 6)):  # neither had sent anything: both served
        status, text = await task
        assert status == 200, text
        assert json.loads(text)["usage"]["completion_tokens"] == tokens
    status, text = await complete(daemon, {**BODY, "max_tokens": 4})  # serving again
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"
    assert bridge.engine is not hung_engine
    _, metrics = await get(daemon, "/metrics")
    assert "mlxcel_engine_restarts_total 1.0" in metrics

    release.set()  # the hung step returns: its thread ends, its outputs are dropped

    async def health_ok() -> bool:
        status, _ = await get(daemon, "/health")
        return status == 200

    await async_wait_until(health_ok, timeout=20, what="/health 200 again")
    status, text = await complete(daemon, {**BODY, "max_tokens": 3})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3


async def test_without_a_fresh_engine_the_watchdog_fails_the_streams_and_exits(
    daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(bridge_module.os, "_exit", exits.append)  # the process stays up here
    monkeypatch.setattr(bridge_module, "EXIT_GRACE_S", 0.0)
    monkeypatch.setattr(bridge_module.logging, "shutdown", lambda: None)
    bridge = daemon.daemon.bridge
    bridge.make_engine = None  # e.g. a distributed group: nothing to restart in-process
    release, _ = hang_decode(bridge, lambda e: e.num_running == 1)
    try:
        status, text = await complete(daemon, {**BODY, "stream": True})
        assert status == 200
        assert "the daemon restarts" in events(text)[-1]["error"]["message"]
        await async_wait_until(lambda: exits, timeout=20, what="the exit")
        assert exits == [bridge_module.EXIT_ENGINE_HUNG]
        status, text = await get(daemon, "/health")
        assert status == 503 and "the daemon restarts" in json.loads(text)["reason"]
    finally:
        release.set()
        await async_wait_until(lambda: bridge.problem is None, 20, what="the hung step returned")
        # The process would have exited: stop without draining. A drain would wait its whole
        # timeout (30 s), since the abandoned engine still counts the failed request as
        # running and no engine thread is left to step or abort it.
        await asyncio.to_thread(daemon.stop, False)


@pytest.fixture
def encoder_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_encoder_dir(tmp_path_factory.mktemp("enc") / "bge-tiny", "bert")
    # a 16-token step budget: a request of many short inputs takes one step per two of them
    with embedded_daemon(
        tmp_path_factory, model, prefill_chunk_size=16, step_timeout=STEP_TIMEOUT_S
    ) as d:
        yield d


async def embed(daemon: Any, inputs: list[str]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{daemon.http_url}/v1/embeddings", json={"input": inputs}) as resp,
    ):
        return resp.status, await resp.json()


@pytest.mark.parametrize("in_hand", [False, True], ids=["held-earlier", "held-this-round"])
async def test_a_hung_encoder_step_fails_its_embeddings_and_a_fresh_engine_serves(
    encoder_daemon: Any, in_hand: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An embedding model's engine (encoder/encoder_engine.py) hangs in a forward: the embedding
    requests it held, the one in that forward and one queued behind it, end with the
    watchdog's error instead of waiting for ever, and a fresh encoder engine serves the next.
    The short request was taken by the engine thread in an earlier round (only the engine can
    fail it), or in the hung round (it is also a command in hand, failed by the watchdog
    first: failing it again must not stop the watchdog)."""
    exits: list[int] = []  # without a fresh engine the watchdog would end the process
    monkeypatch.setattr(bridge_module.os, "_exit", exits.append)
    monkeypatch.setattr(bridge_module, "EXIT_GRACE_S", 0.0)
    monkeypatch.setattr(bridge_module.logging, "shutdown", lambda: None)
    bridge = encoder_daemon.daemon.bridge
    hung_engine = bridge.engine
    embedder = hung_engine.embedder
    pool: Callable[[list[list[int]]], Any] = embedder.pool
    release, blocked = threading.Event(), threading.Event()

    def hanging(rows: list[list[int]]) -> Any:
        if not blocked.is_set():
            if len(embedder.jobs) >= 2 and bool(bridge._in_hand) == in_hand:
                blocked.set()  # both requests held by the engine: hang
                release.wait(60)
            elif len(embedder.jobs) < 2:  # the long one waits for the short one to arrive
                deadline = time.monotonic() + STEP_TIMEOUT_S / 4
                while not bridge._inbox and time.monotonic() < deadline:
                    time.sleep(0.005)
        return pool(rows)

    embedder.pool = hanging
    try:
        long = asyncio.create_task(embed(encoder_daemon, ["the cat sat on the mat"] * 200))
        await async_wait_until(lambda: embedder.jobs, timeout=20, what="the long request held")
        short = asyncio.create_task(embed(encoder_daemon, ["dogs sleep"]))
        assert await asyncio.to_thread(blocked.wait, 30)
        for task in (long, short):
            status, body = await asyncio.wait_for(task, 20)  # none left waiting for ever
            assert status == 500, body
            assert body["error"]["code"] == "embedding_failed"
            assert "engine step ran over" in body["error"]["message"]
        status, body = await asyncio.wait_for(embed(encoder_daemon, ["dogs sleep"]), 20)
        assert status == 200 and len(body["data"]) == 1
        assert bridge.engine is not hung_engine and exits == []
    finally:
        release.set()
