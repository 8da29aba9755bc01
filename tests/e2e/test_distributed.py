"""One model across several ranks (docs/distributed.md): real groups of daemon + worker
processes on 127.0.0.1 with the ring backend: exact greedy tokens against a single process,
SmolLM2 on 3 tensor-parallel ranks, a killed rank (degraded, every client answered, restart
serves again). The hosts file, the split plan and the status lines are
tests/unit/test_distributed_config.py's."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import (
    attach,
    cli,
    http_json,
    pid_running,
    running_daemon,
    sse_events,
    wait_until,
)
from ring_group import free_ports, kill_ranks, rank_pids, start_group, write_hosts

NO_FAST_FORWARD = {"MLXCEL_NO_FAST_FORWARD": "1"}  # the group runs without the fused forward


def completions(url: str, n: int, max_tokens: int) -> list[str]:
    """`n` concurrent greedy completions; their texts in request order."""
    out: list[Any] = [None] * n

    def one(i: int) -> None:
        body = {
            "prompt": f"request {i}: the quick brown fox number {i * 7}",
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        status, _, reply = http_json(f"{url}/v1/completions", body, timeout=120)
        out[i] = reply["choices"][0]["text"] if status == 200 else f"HTTP {status}: {reply}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def cached_completion(url: str) -> tuple[str, int]:
    """A long greedy prompt: (text, prompt tokens the prompt cache supplied)."""
    prompt = " ".join(f"word{i}" for i in range(60))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    status, _, reply = http_json(f"{url}/v1/completions", body, timeout=120)
    assert status == 200, reply
    return reply["choices"][0]["text"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_ranks_give_the_greedy_tokens_of_one_process(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """8 concurrent greedy requests on a tiny llama (4 heads, 2 KV heads) split across 2
    tensor-parallel ranks: exactly the text of a single-process run."""
    with running_daemon(tmp_path / "single", tiny_model_dir, **NO_FAST_FORWARD) as single:
        expected = completions(single.http_url, 8, 24)
    assert len(set(expected)) > 1, expected  # distinct texts: a mix-up would show
    daemon = start_group(tmp_path / "group", tiny_model_dir, 2)
    pids = rank_pids(daemon)
    try:
        got = completions(daemon.http_url, 8, 24)
        group = daemon.status()["group"]
        status_text = cli(daemon.home, "status").stdout
        reused = [cached_completion(daemon.http_url) for _ in range(2)]
    finally:
        daemon.stop()
        kill_ranks(pids)
    assert got == expected
    # the prompt cache works in a group: the second identical prompt reuses the first's KV
    # (on every rank, each its own shard) and answers the same
    (first, cached_before), (second, cached_after) = reused
    assert cached_before == 0 and cached_after >= 64 and first == second
    assert (group["size"], group["mode"], group["status"]) == (2, "tensor", "ok")
    assert [r["rank"] for r in group["ranks"]] == [0, 1]
    worker = group["ranks"][1]
    assert worker["steps"] > 0 and worker["step_ms"] > 0 and worker["memory_bytes"] > 0
    assert group["comm_ms"] is not None
    assert "  group:   2 ranks, tensor parallel (ring)" in status_text
    assert f"    rank 1: localhost pid {pids[0]}, memory " in status_text
    wait_until(lambda: not any(pid_running(p) for p in pids), timeout=10)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random qwen2 (mlx-lm gives qwen2 a pipeline())."""
    from mlxcel.daemon.models.tiny import make_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "qwen2"
    return make_tiny_model(path, "llama", seed=0, model_type="qwen2", architectures=["Qwen2"])


def test_two_pipeline_ranks_give_the_greedy_tokens_of_one_process(
    tmp_path: Path, tiny_qwen2_dir: Path
) -> None:
    with running_daemon(tmp_path / "single", tiny_qwen2_dir, **NO_FAST_FORWARD) as single:
        expected = completions(single.http_url, 8, 16)
    home = tmp_path / "group"
    daemon = start_group(home, tiny_qwen2_dir, 2, "--distributed-mode", "pipeline")
    pids = rank_pids(daemon)
    try:
        got = completions(daemon.http_url, 8, 16)
        snap = daemon.status()
        refused = cli(home, "set", "prompt_cache=true")
    finally:
        daemon.stop()
        kill_ranks(pids)
    assert got == expected
    assert (snap["group"]["mode"], snap["engine"]["config"]["prompt_cache"]) == ("pipeline", False)
    assert "prompt_cache: refused: a pipeline group runs without the prompt cache" in (
        refused.stdout + refused.stderr
    )


def test_smollm2_on_three_tensor_parallel_ranks_answers_paris(
    tmp_path: Path, default_model_dir: Path
) -> None:
    daemon = start_group(tmp_path / "home", default_model_dir, 3)
    pids = rank_pids(daemon)
    try:
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 7,  # "The capital of France is Paris." on one process
            "temperature": 0,
        }
        status, _, reply = http_json(f"{daemon.http_url}/v1/chat/completions", body, timeout=300)
        group = daemon.status()["group"]
    finally:
        daemon.stop()
        kill_ranks(pids)
    assert status == 200, reply
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert (group["size"], group["mode"]) == (3, "tensor")


def test_smollm2_on_two_ranks_is_refused_at_start_in_one_line(
    tmp_path: Path, default_model_dir: Path
) -> None:
    hosts = write_hosts(tmp_path / "hosts.json", 2)
    home = tmp_path / "home"
    home.mkdir()
    model = str(default_model_dir)
    done = cli(home, "start", "--model", model, "--port", "0", "--hosts", str(hosts))
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert "cannot split the model across 2 ranks" in line
    assert "9 attention heads, which do not divide by 2" in line
    assert "no pipeline() in mlx-lm" in line


def test_rank_that_dies_before_the_group_forms_fails_the_start_in_one_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Rank 1's address is not on this machine: it cannot bind and exits, while rank 0 would
    wait in mx.distributed.init for ever (holding the GIL); the guard process ends the start."""
    (port,) = free_ports(1)
    hosts = tmp_path / "hosts.json"
    bad = [
        {"ssh": "localhost", "ips": [f"127.0.0.1:{port}"]},
        {"ssh": "localhost", "ips": ["192.0.2.1:40123"]},
    ]
    hosts.write_text(json.dumps(bad))
    home = tmp_path / "home"
    home.mkdir()
    began = time.monotonic()
    model = str(tiny_model_dir)
    done = cli(home, "start", "--model", model, "--port", "0", "--hosts", str(hosts))
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert "rank 1 (pid" in line and "exited before the group formed" in line, line
    assert f"(see {home}/logs/rank1.log)" in line
    assert "Couldn't bind" in (home / "logs" / "rank1.log").read_text()
    assert time.monotonic() - began < 90


def stream_completion(
    url: str, max_tokens: int, record: dict[str, Any], on_chunk: Any = lambda: None
) -> None:
    """One streaming completion; `record` gets its token count, how it ended and when;
    `on_chunk()` runs after each chunk, on this reader's thread."""
    body = {
        "prompt": "count with me",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # runs to max_tokens: still running when the rank goes
        "stream": True,
    }
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    raw = b""
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                raw += line
                if line.startswith(b"data: {"):
                    record["chunks"] = record.get("chunks", 0) + 1
                    on_chunk()
    except Exception as exc:  # a cut connection is an answer too, if it comes in time
        record["exception"] = repr(exc)
    record["events"] = sse_events(raw)
    record["ended_at"] = time.monotonic()


def streams_when_rank_gets(
    url: str, n: int, pid: int, signum: int, timeout_s: float
) -> list[dict[str, Any]]:
    """`n` long streams; once each has tokens, `signum` goes to the rank `pid`; returns
    their records (`signalled_at` on each) when they end or `timeout_s` + 20 s have passed."""
    records: list[dict[str, Any]] = [{} for _ in range(n)]
    lock, signalled = threading.Lock(), {}

    def maybe_signal() -> None:  # on a reader's thread, at once: no poll that may sleep long
        with lock:
            if not signalled and all(r.get("chunks", 0) >= 3 for r in records):
                os.kill(pid, signum)
                signalled["at"] = time.monotonic()

    threads = [
        threading.Thread(target=stream_completion, args=(url, 1800, r, maybe_signal))
        for r in records
    ]
    for t in threads:
        t.start()
    wait_until(lambda: "at" in signalled, timeout=60)
    for t in threads:
        t.join(timeout_s + 20)
    for r in records:
        r["signalled_at"] = signalled["at"]
    return records


def test_killed_rank_degrades_the_daemon_and_restart_serves_again(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    timeout_s = 10
    home = tmp_path / "home"
    daemon = start_group(home, tiny_model_dir, 2, "--distributed-timeout", str(timeout_s))
    seen = rank_pids(daemon)
    try:
        records = streams_when_rank_gets(daemon.http_url, 4, seen[0], signal.SIGKILL, timeout_s)
        killed_at = records[0]["signalled_at"]
        for r in records:
            assert "ended_at" in r, "a client was still waiting"
            assert r["ended_at"] - killed_at < timeout_s + 5
            finals = [e for e in r["events"] if isinstance(e, dict)]
            ended = [e for e in finals if "error" in e or e["choices"][0].get("finish_reason")]
            assert ended or "exception" in r, r
            errors = [e["error"]["message"] for e in finals if "error" in e]
            assert not errors or "distributed group degraded" in errors[0] or "[ring]" in errors[0]

        def degraded() -> bool:
            return daemon.status()["group"]["status"] == "degraded"

        wait_until(degraded, timeout=timeout_s + 5)
        group = daemon.status()["group"]
        assert "rank 1" in group["reason"] and "mlxcel-daemon restart" in group["reason"]
        status, _, health = http_json(f"{daemon.http_url}/health")
        assert (status, health["status"]) == (503, "degraded")
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        status, _, reply = http_json(f"{daemon.http_url}/v1/completions", body)
        assert status == 503 and "degraded" in json.dumps(reply)

        done = cli(home, "restart", "--wait", "120")
        assert done.returncode == 0, done.stderr
        daemon = attach(home)
        seen += rank_pids(daemon)
        assert daemon.status()["group"]["status"] == "ok"
        status, _, reply = http_json(f"{daemon.http_url}/v1/completions", body)
        assert status == 200 and reply["usage"]["completion_tokens"] == 4
        status, _, health = http_json(f"{daemon.http_url}/health")
        assert (status, health["status"]) == (200, "ok")
    finally:
        daemon.stop()
        kill_ranks(seen)
    wait_until(lambda: not any(pid_running(p) for p in seen), timeout=10)


def test_rank_that_stops_answering_is_caught_by_the_watchdog(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """SIGSTOP: the rank's sockets stay open, rank 0 would wait in a collective for ever."""
    timeout_s = 3
    daemon = start_group(tmp_path / "home", tiny_model_dir, 2, "--distributed-timeout", "3")
    pids = rank_pids(daemon)
    try:
        records = streams_when_rank_gets(daemon.http_url, 3, pids[0], signal.SIGSTOP, timeout_s)
        stopped_at = records[0]["signalled_at"]
        for r in records:
            assert "ended_at" in r, "a client was still waiting"
            assert r["ended_at"] - stopped_at < timeout_s + 5
            errors = [e["error"]["message"] for e in r["events"] if "error" in e]
            assert errors and "did not answer within 3 s" in errors[0], (
                r.get("exception"),
                r.get("chunks"),
                [
                    e["choices"][0]
                    for e in r["events"][-3:]
                    if isinstance(e, dict) and "choices" in e
                ],
            )
        group = daemon.status()["group"]
        assert group["status"] == "degraded"
        assert "a rank did not answer within 3 s; run `mlxcel-daemon restart`" in group["reason"]
        began = time.monotonic()
        assert daemon.stop() is not None or not daemon.alive()
        assert time.monotonic() - began < 10  # the stuck engine thread does not hold the stop
    finally:
        kill_ranks(pids)
        daemon.stop()
    wait_until(lambda: not any(pid_running(p) for p in pids), timeout=10)
