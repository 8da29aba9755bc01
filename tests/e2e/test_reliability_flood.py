"""Floods and vanishing clients against a real daemon subprocess (docs/reliability.md, tiny model).

One daemon serves the module: `--parallel 4 --max-queue-depth 16`, prefill in 64-token chunks.
Every test ends with the engine idle, so they share it without interfering.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import (
    RunningDaemon,
    busy_figures,
    chat_body,
    running_daemon,
    sse_events,
    wait_idle,
)

NUM_FLOOD_CLIENTS = 64
FLOOD_TOKENS = 32
CLIENT_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("flood")
    flags = ("--parallel", "4", "--max-queue-depth", "16", "--prefill-chunk-size", "64")
    with running_daemon(home, tiny_model_dir, *flags) as d:
        yield d


def counters(daemon: RunningDaemon) -> dict[str, Any]:
    return daemon.status()["engine"]["counters"]


def delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


# --- flood ------------------------------------------------------------------------------------


async def flood_client(session: aiohttp.ClientSession, url: str, i: int) -> str:
    body = chat_body(f"Flood client {i}: say something.", FLOOD_TOKENS)
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status == 503:
            # Refused before any stream opened: a plain JSON error, never a cut SSE stream.
            assert r.headers["Content-Type"].startswith("application/json")
            assert int(r.headers["Retry-After"]) >= 1
            err = (await r.json())["error"]
            assert err["code"] == "queue_full" and err["type"] and err["message"]
            return "rejected"
        assert r.status == 200, await r.text()
        events = sse_events(await r.read())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["usage"]["completion_tokens"] == FLOOD_TOKENS
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    return "completed"


async def flood(url: str) -> list[str]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [
            asyncio.wait_for(flood_client(session, url, i), CLIENT_DEADLINE_S)
            for i in range(NUM_FLOOD_CLIENTS)
        ]
        return await asyncio.gather(*tasks)


def test_a_flood_beyond_the_queue_gets_full_answers_or_503(daemon: RunningDaemon) -> None:
    before = counters(daemon)
    outcomes = asyncio.run(flood(daemon.http_url))  # a hang fails through wait_for
    completed, rejected = outcomes.count("completed"), outcomes.count("rejected")
    print(f"flood: {completed} completed in full, {rejected} refused with 503")
    assert completed + rejected == NUM_FLOOD_CLIENTS
    assert rejected > 0, "64 clients against 4 slots + 16 queue places: some must get 503"
    assert completed >= 16
    wait_idle(daemon)
    after = counters(daemon)
    # The engine saw exactly what the clients saw: no lost, doubled or half-counted request.
    assert delta(after["rejections_by_reason"], before["rejections_by_reason"], "queue_full") == (
        rejected
    )
    assert delta(
        after["requests_by_finish_reason"], before["requests_by_finish_reason"], "length"
    ) == (completed)
    engine = daemon.status()["engine"]
    assert busy_figures(engine) == (0, 0, 0)
    assert engine["kv"]["blocks_used"] == 0 and engine["queue"] == []
    slots = asyncio.run(get_json(daemon.http_url + "/slots"))
    assert [s["state"] for s in slots] == ["idle"] * 4
    assert all(s["kv_blocks"] == 0 for s in slots)


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        assert r.status == 200
        return await r.json()
