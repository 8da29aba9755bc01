"""One rejection counter: every refusal reason, whether the HTTP layer or the engine refused
it, reads the same in `/metrics`, the control socket's snapshot and `mlxcel-top --once --json`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import control, wait_until
from embedded import EmbeddedDaemon, paths_under
from mlxcel.shared.config import build_config
from mlxcel.shared.snapshot import Snapshot
from prometheus_client.parser import text_string_to_metric_families

# Each reason, how many times it is provoked, and who refuses it.
EXPECTED = {"invalid_request": 2, "too_long": 1, "kv_never_fits": 1, "queue_full": 2}


@pytest.fixture(scope="module")
def daemon(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, socket_dir: Path
) -> Iterator[Any]:
    paths = paths_under(tmp_path_factory.mktemp("home"))
    cfg = build_config(
        {
            "model": str(tiny_model_dir),
            "port": 0,
            "parallel": 1,
            "max_queue_depth": 1,
            "kv_cache_budget": "256KiB",  # 16 blocks of 32 tokens for this model
            "ctx_size": 1024,
        }
    )
    with EmbeddedDaemon(cfg, paths, socket_dir / "ctl.sock") as d:
        yield d


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[Path]:  # module scope: the daemon fixture outlives one test
    import shutil
    import tempfile

    from mlxcel.shared.paths import short_socket_dir

    folder = Path(tempfile.mkdtemp(prefix="mlxcel-t-", dir=short_socket_dir().parent))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def provoke(url: str) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession(url) as s:

        async def post(path: str, body: dict[str, Any]) -> int:
            async with s.post(path, json=body) as r:
                await r.read()
                return r.status

        # The HTTP layer: bad values. The engine: a prompt over the context.
        statuses.append(await post("/v1/completions", {"prompt": "x", "max_tokens": -1}))
        statuses.append(await post("/v1/chat/completions", {"messages": [{"role": "user"}]}))
        statuses.append(await post("/v1/completions", {"prompt": [1] * 1100, "max_tokens": 4}))
        # The engine: fits the context but never the 16-block KV budget.
        statuses.append(await post("/v1/completions", {"prompt": [1] * 600, "max_tokens": 4}))
        # The engine: one running, one queued, then two refused for the full queue.
        body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
        running = await s.post("/v1/completions", json=body)
        await running.content.readline()
        waiting = await s.post("/v1/completions", json=body)
        for _ in range(2):
            statuses.append(await post("/v1/completions", {**body, "stream": False}))
        running.close()
        waiting.close()
    return statuses


def from_metrics(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    counts = {}
    for family in text_string_to_metric_families(text):
        if family.name == "mlxcel_requests_rejected":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value:
                    counts[sample.labels["reason"]] = int(sample.value)
    return counts


def from_top(socket_path: Path) -> dict[str, int]:
    top = [sys.executable, "-m", "mlxcel.tui.cli", "--socket", str(socket_path), "--once"]
    out = subprocess.run([*top, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    counters = Snapshot.from_dict(json.loads(out.stdout)).engine.counters
    return {k: v for k, v in counters.rejections_by_reason.items() if v}


def from_status(socket_path: Path) -> dict[str, int]:
    reply = control(socket_path, "status")
    counters = Snapshot.from_dict(reply["result"]).engine.counters
    return {k: v for k, v in counters.rejections_by_reason.items() if v}


def test_every_surface_counts_every_rejection_the_same(daemon: Any) -> None:
    statuses = asyncio.run(provoke(daemon.http_url))
    assert statuses == [400, 400, 400, 400, 503, 503]
    socket_path = Path(daemon.socket_path)
    # The snapshot is republished after a refusal; the console reads it within a second.
    wait_until(lambda: from_status(socket_path) == EXPECTED, timeout=30)
    assert from_metrics(daemon.http_url) == EXPECTED
    assert from_top(socket_path) == EXPECTED
