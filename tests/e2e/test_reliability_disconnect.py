"""Clients that vanish mid-request, against a real daemon subprocess (docs/reliability.md).

100 clients drop: some while queued or prefilling (long prompts, gone once the headers
arrive), some while decoding (gone after a few tokens), some before the response starts.
Witness clients keep asking greedy questions meanwhile and must get their solo answers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import (
    EventReader,
    RunningDaemon,
    busy_figures,
    chat_body,
    running_daemon,
    sse_events,
    wait_idle,
    wait_until,
)

NUM_DROPPERS = 100
DROPPER_CONCURRENCY = 8
NUM_WITNESSES = 4
WITNESS_TOKENS = 24
CLIENT_DEADLINE_S = 120.0
LONG_PROMPT = "Summarise the following notes carefully. " + "river lantern copper meadow " * 70


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("drops")
    # 64-token prefill chunks: a long prompt spends many steps in prefill, where some drop.
    with running_daemon(home, tiny_model_dir, "--parallel", "4", "--prefill-chunk-size", "64") as d:
        yield d


def counters(daemon: RunningDaemon) -> dict[str, Any]:
    return daemon.status()["engine"]["counters"]


@dataclass
class Storm:
    solo: dict[int, str]
    witness_texts: list[tuple[int, str]] = field(default_factory=list)
    streamed_drops: int = 0  # droppers whose request surely reached the engine
    last_drop: float = 0.0
    droppers_started: int = 0
    witnesses_done: asyncio.Event = field(default_factory=asyncio.Event)


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        events = sse_events(await r.read())
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == body["max_tokens"]
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])


def witness_body(i: int) -> dict[str, Any]:
    return chat_body(f"Witness {i}: describe the harbor at dawn.", WITNESS_TOKENS)


async def witness(session: aiohttp.ClientSession, url: str, storm: Storm, i: int) -> None:
    """Keep asking the same greedy question while the droppers come and go."""
    while True:
        storm.witness_texts.append((i, await stream_text(session, url, witness_body(i))))
        if storm.droppers_started >= NUM_DROPPERS - 10:
            return


async def dropper(session: aiohttp.ClientSession, url: str, storm: Storm, i: int) -> None:
    kind = i % 3
    if kind == 0:  # in the queue or in prefill: a long prompt, gone once the headers come
        # (hundreds of tokens: a short answer could end before a starved client's
        # close is seen, and a dropped request must never finish)
        body = chat_body(f"Dropper {i}. {LONG_PROMPT}", 512)
        keep_lines = 0
    else:  # in decode: a short prompt, gone after a few tokens
        body = chat_body(f"Dropper {i}: count slowly.", 1500)
        keep_lines = 3 if kind == 1 else 0
    if kind == 2:  # gone before the response even starts, at a random moment
        task = asyncio.ensure_future(session.post(url + "/v1/chat/completions", json=body))
        await asyncio.sleep(random.Random(i).uniform(0.0, 0.03))
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            storm.last_drop = time.monotonic()
            return
        resp = task.result()
    else:
        resp = await session.post(url + "/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    storm.streamed_drops += 1
    for _ in range(keep_lines):
        line = await resp.content.readline()
        while line.strip() == b"":
            line = await resp.content.readline()
        assert line.startswith(b"data: {")
    resp.close()  # drop the connection mid-stream
    storm.last_drop = time.monotonic()


async def run_storm(url: str, storm: Storm) -> None:
    sem = asyncio.Semaphore(DROPPER_CONCURRENCY)
    # force_close: a dropped connection is never reused, each dropper is its own client.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one_dropper(i: int) -> None:
            if i >= NUM_DROPPERS - 10:
                await storm.witnesses_done.wait()  # the last drops come with nobody else busy
            async with sem:
                storm.droppers_started += 1
                await asyncio.wait_for(dropper(session, url, storm, i), CLIENT_DEADLINE_S)

        async def witnesses() -> None:
            await asyncio.gather(*(witness(session, url, storm, i) for i in range(NUM_WITNESSES)))
            storm.witnesses_done.set()

        await asyncio.gather(witnesses(), *(one_dropper(i) for i in range(NUM_DROPPERS)))


async def solo_texts(url: str) -> dict[int, str]:
    async with aiohttp.ClientSession() as session:
        return {i: await stream_text(session, url, witness_body(i)) for i in range(NUM_WITNESSES)}


def test_clients_that_vanish_free_everything_and_others_are_unharmed(
    daemon: RunningDaemon,
) -> None:
    storm = Storm(solo=asyncio.run(solo_texts(daemon.http_url)))
    before = counters(daemon)
    finished = EventReader(daemon.socket)
    try:
        asyncio.run(run_storm(daemon.http_url, storm))
        idle_at = wait_idle(daemon, timeout=10.0, poll=0.01)
        after = counters(daemon)
        aborts = after["requests_by_finish_reason"].get("abort", 0) - before[
            "requests_by_finish_reason"
        ].get("abort", 0)
        # Each abort's event follows the step that counted it: wait for all of them.
        wait_until(
            lambda: (
                [e["finish_reason"] for e in finished.of("request_finished")].count("abort")
                >= aborts
            ),
            30,
            what=f"{aborts} abort events",
        )
    finally:
        finished.close()
    print(
        f"drops: {storm.streamed_drops} streamed, {len(storm.witness_texts)} witness answers, "
        f"all free {idle_at - storm.last_drop:.3f} s after the last drop"
    )
    assert idle_at - storm.last_drop < 1.0, "slots/KV not freed within 1 s of the last drop"
    # Served meanwhile, and unharmed: every witness answer equals its answer alone.
    assert len(storm.witness_texts) >= NUM_WITNESSES
    for i, text in storm.witness_texts:
        assert text == storm.solo[i], f"witness {i} differs from its solo answer"
    # Every dropped request that reached the engine ended as an abort, none finished.
    assert storm.streamed_drops <= aborts <= NUM_DROPPERS
    dropped = [e for e in finished.of("request_finished") if e["finish_reason"] == "abort"]
    assert len(dropped) == aborts
    in_prefill_or_queue = [e for e in dropped if e["completion_tokens"] == 0]
    in_decode = [e for e in dropped if e["completion_tokens"] > 0]
    print(f"aborted before a first token: {len(in_prefill_or_queue)}, in decode: {len(in_decode)}")
    assert len(in_prefill_or_queue) >= 10 and len(in_decode) >= 10, (
        len(in_prefill_or_queue),
        len(in_decode),
    )
    engine = daemon.status()["engine"]
    assert busy_figures(engine) == (0, 0, 0)
