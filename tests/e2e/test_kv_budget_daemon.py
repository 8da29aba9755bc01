"""The KV budget on a real daemon subprocess (docs/internals.md, "KV budget and prompt
cache"): with a `--kv-cache-budget` of 7 blocks, 8 concurrent requests of 3 blocks each all
succeed, the ones that do not fit yet wait with the reason `kv_budget` (never an error), the
reserved plus cached blocks never exceed the budget, and every answer equals its solo answer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import RunningDaemon, control, running_daemon, wait_idle

BUDGET_BLOCKS = 7
NUM_REQUESTS = 8
MAX_TOKENS = 40  # with a ~40-token prompt: 3 blocks of 32 tokens per request


def bytes_per_block(model_dir: Path) -> int:
    from mlxcel.daemon.engine.mlx_support import probe_model
    from mlxcel.daemon.models import load_model
    from mlxcel.shared.config import KV_BLOCK_SIZE

    return probe_model(load_model(str(model_dir)).model).kv_bytes_per_token * KV_BLOCK_SIZE


# The ~42M-parameter random llama: its decode steps take milliseconds, so the requests that
# wait for KV wait long enough for the status poller to see them, on a loaded machine too.
@pytest.fixture(scope="module")
def daemon(slow_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    budget = BUDGET_BLOCKS * bytes_per_block(slow_model_dir)
    flags = ("--parallel", "8", "--kv-cache-budget", str(budget), "--prefill-chunk-size", "64")
    with running_daemon(tmp_path_factory.mktemp("kv-budget"), slow_model_dir, *flags) as d:
        yield d


def body(i: int) -> dict[str, Any]:
    words = " ".join(f"w{i}x{j}" for j in range(6))
    return {"prompt": f"Request {i}: {words}", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


async def complete(session: aiohttp.ClientSession, url: str, i: int) -> dict[str, Any]:
    async with session.post(url + "/v1/completions", json=body(i)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


class EngineWatcher:
    """Polls the control socket's status on a thread: queue wait reasons and KV figures."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self.daemon = daemon
        self.reasons: set[str] = set()
        self.kv: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            engine = control(self.daemon.socket, "status")["result"]["engine"]
            self.reasons |= {q["wait_reason"] for q in engine["queue"]}
            self.kv.append(engine["kv"])
            self._stop.wait(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_requests_that_fit_alone_all_succeed_under_a_small_budget(daemon: RunningDaemon) -> None:
    url = daemon.http_url
    kv = daemon.status()["engine"]["kv"]
    assert kv["blocks_total"] == BUDGET_BLOCKS

    async def solo() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            return [await complete(s, url, i) for i in range(NUM_REQUESTS)]

    async def together() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            tasks = [complete(s, url, i) for i in range(NUM_REQUESTS)]
            return await asyncio.wait_for(asyncio.gather(*tasks), 300)

    alone = asyncio.run(solo())
    for answer in alone:  # each needs 3 blocks: it fits alone, 3 of them never fit at once
        total = answer["usage"]["prompt_tokens"] + MAX_TOKENS
        assert 64 < total <= 96, answer["usage"]
    wait_idle(daemon)
    control(daemon.socket, "cache.reset")  # the solo runs' prompt-cache entries: start cold
    watcher = EngineWatcher(daemon)
    try:
        concurrent = asyncio.run(together())
    finally:
        watcher.stop()
    assert [a["choices"][0]["finish_reason"] for a in concurrent] == ["length"] * NUM_REQUESTS
    assert [a["choices"][0]["text"] for a in concurrent] == [a["choices"][0]["text"] for a in alone]
    assert "kv_budget" in watcher.reasons, watcher.reasons
    assert all(k["blocks_used"] + k["blocks_cached"] <= BUDGET_BLOCKS for k in watcher.kv)
    assert max(k["blocks_used"] for k in watcher.kv) > 3  # more than one ran at a time
    counters = daemon.status()["engine"]["counters"]
    assert counters["rejections_by_reason"] == {}
