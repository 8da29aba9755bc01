"""Vanishing clients on the real default model (SmolLM2), where prefill takes real time: a
client that drops while its long prompt is being prefilled frees its slot within a step, and
a greedy question asked meanwhile gets exactly its solo answer ("... Paris.").
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from daemon_helpers import (
    RunningDaemon,
    async_wait_until,
    chat_body,
    sse_events,
    wait_idle,
)

QUESTION = "What is the capital of France?"
LONG = "Read these notes and summarise them. " + "The harbor was quiet at dawn. " * 90


@pytest.fixture(scope="module")
def daemon(smollm2_daemon: RunningDaemon) -> RunningDaemon:
    """The session's shared SmolLM2 daemon (conftest.py): 4 slots, 128-token prefill chunks,
    so a drop is noticed within one chunk."""
    return smollm2_daemon


async def answer(session: aiohttp.ClientSession, url: str) -> str:
    body = chat_body(QUESTION, 12, stream=True)
    body.pop("ignore_eos")
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        events = sse_events(await r.read())
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])


async def drop_in_prefill(session: aiohttp.ClientSession, url: str, i: int) -> float:
    async with session.post(url + "/v1/chat/completions", json=chat_body(f"{i}. {LONG}", 32)) as r:
        assert r.status == 200
        role_chunk = sse_events(await r.content.readline())  # sent before any token
        request_id = role_chunk[0]["id"]

        async def prefilling() -> bool:
            async with session.get(url + "/slots") as s:
                slots = await s.json()
            states = [x["state"] for x in slots if x["request_id"] == request_id]
            assert states != ["decode"], "the prefill ended before the drop"
            return states == ["prefill"]

        await async_wait_until(prefilling, 120, what=f"{request_id} prefilling")
    return time.monotonic()  # the connection is closed on leaving the block


def aborts(daemon: RunningDaemon) -> int:
    """The requests the daemon has ended as aborted so far (it is shared: compare two reads)."""
    counters = daemon.status()["engine"]["counters"]
    return int(counters["requests_by_finish_reason"].get("abort", 0))


async def drop_in_decode(session: aiohttp.ClientSession, url: str, i: int) -> float:
    async with session.post(url + "/v1/chat/completions", json=chat_body(f"Count {i}", 500)) as r:
        assert r.status == 200
        for _ in range(4):
            await r.content.readline()
    return time.monotonic()


def test_drops_in_prefill_free_the_slots_and_the_answer_is_unchanged(
    daemon: RunningDaemon,
) -> None:
    url = daemon.http_url
    aborts_before = aborts(daemon)

    async def main() -> tuple[str, list[str], float]:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            solo = await answer(session, url)
            drops = [drop_in_prefill(session, url, i) for i in range(6)]
            drops += [drop_in_decode(session, url, i) for i in range(2)]
            results = await asyncio.gather(answer(session, url), answer(session, url), *drops)
            return solo, list(results[:2]), max(results[2:])

    solo, during, last_drop = asyncio.run(main())
    idle_at = wait_idle(daemon, timeout=30, poll=0.01)
    assert "Paris" in solo
    assert during == [solo, solo]
    freed_s = idle_at - last_drop
    print(f"last drop to all slots free: {freed_s:.2f} s")
    assert freed_s < 5.0  # one prefill chunk of SmolLM2 on 2 shared cores, with room
    assert aborts(daemon) - aborts_before == 8
