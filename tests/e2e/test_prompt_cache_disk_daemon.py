"""The disk tier on the real daemon and SmolLM2: prompts survive `mlxcel-daemon restart` and
the hit from disk answers what a cold prefill answers; stats, metrics, status and the
resets show both tiers; `--warm-prompts` prefills at start (docs/tuning.md)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import (
    RunningDaemon,
    attach,
    cli,
    http_json,
    start_daemon,
    stop_started,
    wait_until,
)
from mlxcel.daemon.engine.disk_cache import CHUNK_TOKENS

LENGTHS = (70, 200, 450)  # across block (32) and chunk (64) boundaries
DISK = ("--prompt-cache-disk-bytes", "1GiB", "--parallel", "2")


def ids(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1000, 20000) for _ in range(n)]


def complete(daemon: RunningDaemon, prompt: list[int]) -> tuple[str, int]:
    status, _, body = http_json(
        daemon.http_url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("disk-home")
    yield home
    stop_started(home)


def test_prompts_survive_a_restart_and_a_disk_hit_answers_as_a_cold_prefill(
    home: Path, default_model_dir: Path
) -> None:
    daemon = start_daemon(home, default_model_dir, *DISK)
    for n in LENGTHS:
        complete(daemon, ids(n, n))
    wait_until(
        lambda: daemon.status()["engine"]["prompt_cache"]["disk"]["entries"] >= 1 + 3 + 7,
        what="the writes reached the disk",
    )
    done = cli(home, "restart")
    assert done.returncode == 0, done.stderr
    daemon = attach(home)
    warm = {}
    for n in LENGTHS:
        text, cached = complete(daemon, ids(n, n) + ids(9, 1))
        assert cached >= (n // CHUNK_TOKENS) * CHUNK_TOKENS and cached % CHUNK_TOKENS == 0
        warm[n] = text
    disk = daemon.status()["engine"]["prompt_cache"]["disk"]
    assert disk["hits"] == 3 and disk["hit_tokens"] >= 64 + 192 + 448
    _, _, stats = http_json(daemon.http_url + "/v1/cache/stats")
    assert stats["prompt_cache"]["disk"]["hits"] == 3
    with open_url(daemon.http_url + "/metrics") as metrics:
        assert "mlxcel_prompt_cache_disk_hits_total 3.0" in metrics
    status_text = cli(home, "status").stdout
    assert "disk:" in status_text and "3 hits" in status_text

    # RAM only: the disk keeps its chunks; both: they go
    status, _, kept = http_json(daemon.http_url + "/v1/cache/reset", {"tier": "ram"})
    assert status == 200 and kept["entries_freed"] >= 1 and kept["disk_entries_freed"] == 0
    status, _, bad = http_json(daemon.http_url + "/v1/cache/reset", {"tier": "disk only"})
    assert status == 400 and bad["error"]["code"] == "invalid_request"
    status, _, gone = http_json(daemon.http_url + "/v1/cache/reset", {})
    assert status == 200 and gone["disk_entries_freed"] >= 1 + 3 + 7
    for n in LENGTHS:  # cold now: the same answers
        text, cached = complete(daemon, ids(n, n) + ids(9, 1))
        assert cached == 0
        assert text == warm[n]


def test_warm_prompts_are_prefilled_at_start(home: Path, default_model_dir: Path) -> None:
    stop_started(home)
    system = "You are a careful assistant. " + " ".join(
        f"Rule {i}: answer item {i} briefly." for i in range(40)
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    warm_file = home / "warm.json"
    warm_file.write_text(json.dumps([{"messages": messages}, "Once upon a time"]))
    daemon = start_daemon(
        home, default_model_dir, "--prompt-cache-disk-bytes", "0", "--warm-prompts", str(warm_file)
    )
    wait_until(lambda: "warmed 2 of 2 prompts" in daemon.log_text(), timeout=60, what="warm")
    status, _, body = http_json(
        daemon.http_url + "/v1/chat/completions",
        {"messages": messages, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 200
    stop_started(home)
    bad = home / "bad.json"
    bad.write_text('{"not": "a list"}')
    done = cli(home, "start", "--model", str(default_model_dir), "--warm-prompts", str(bad))
    assert done.returncode == 1
    assert "must hold a JSON list" in done.stderr + done.stdout


class open_url:
    """`with open_url(url) as text:` the body of a GET as text."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.url, timeout=30) as resp:
            return resp.read().decode()

    def __exit__(self, *exc: Any) -> None:
        return None
