"""The console's "now" decode figure against what clients measure (docs/console.md): a fresh
burst of 4 streams on the real daemon (tiny model), each client counting the tokens it
receives (one logprob entry per token); the daemon's figure, the one mlxcel-top shows, must be
within 20 % of the clients' own rate over the same last seconds, early in the burst (a fresh
burst reads at its own pace, not diluted by the idle minute before it) and later on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import embedded_daemon, random_llama
from mlxcel.daemon.engine.stats import RATE_WINDOW_S
from mlxcel.shared.control_client import ControlClient
from mlxcel.shared.snapshot import Snapshot
from mlxcel.tui.format import fmt_rate
from mlxcel.tui.frame import render_frame

STREAMS = 4
TOLERANCE = 0.20


@pytest.fixture(scope="module")
def daemon(rates_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_daemon(tmp_path_factory, rates_model_dir, parallel=STREAMS) as d:
        yield d


@pytest.fixture(scope="module")
def rates_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random llama of ~60M parameters: a few hundred tokens a second for 4 rows on 2 cores
    (with the native decode step, docs/cpu-kernels.md), so a 2,000-token burst lasts the
    whole measurement."""
    sizes = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 16}
    return random_llama(tmp_path_factory, "rates", num_attention_heads=8, **sizes)


async def count_tokens(url: str, arrivals: list[tuple[float, int]], max_tokens: int) -> None:
    """Stream one completion; record (arrival time, tokens in the chunk) for every chunk."""
    body = {
        "prompt": "one two three four",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "logprobs": 0,  # one entry per token: the client counts tokens, not text pieces
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    if tokens:
                        arrivals.append((time.monotonic(), len(tokens)))


def client_rate(arrivals: list[tuple[float, int]], now: float) -> float:
    """Tokens per second the clients received over the daemon's window, timed like it: from
    the first arrival in the window (whose tokens were produced before it)."""
    recent = [(t, n) for t, n in arrivals if t >= now - RATE_WINDOW_S]
    if len(recent) < 2:
        return 0.0
    first_at, first = recent[0]
    return (sum(n for _, n in recent) - first) / (now - first_at)


async def test_now_decode_rate_matches_the_clients(daemon: Any) -> None:
    arrivals: list[tuple[float, int]] = []
    async with ControlClient(daemon.socket_path) as control:
        jobs = [
            asyncio.create_task(count_tokens(daemon.http_url, arrivals, 2000))
            for _ in range(STREAMS)
        ]
        try:
            checked: list[tuple[float, float, float]] = []
            submitted = time.monotonic()
            while not arrivals:  # the burst starts with its first token (the prefill before)
                assert time.monotonic() - submitted < 60, "no token in 60 s"
                await asyncio.sleep(0.01)
            started = arrivals[0][0]
            for at in (2.0, 4.0, 7.0):  # fresh (under the 5 s window) and a full window
                await asyncio.sleep(max(0.0, started + at - time.monotonic()))
                assert not any(job.done() for job in jobs), "the burst ended too early"
                snapshot = Snapshot.from_dict(await control.call("status"))
                ours = client_rate(arrivals, time.monotonic())
                daemons = snapshot.engine.latency.decode_tokens_per_s
                assert daemons is not None
                checked.append((at, daemons, ours))
                # The console shows this very figure.
                assert f"now {fmt_rate(daemons)}" in render_frame(snapshot)
            for at, daemons, ours in checked:
                waited = f"first token {started - submitted:.2f} s after the requests"
                assert ours > 0, (waited, checked)
                assert abs(daemons - ours) <= TOLERANCE * ours, (
                    f"at {at} s: daemon 'now' {daemons:.1f} tok/s, clients {ours:.1f} tok/s; "
                    f"all: {checked}"
                )
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
