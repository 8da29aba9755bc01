"""One model across several ranks (docs/distributed.md): the hosts file and the split plan
(unit), and real groups of daemon + worker processes on 127.0.0.1 with the ring backend (e2e):
exact greedy tokens against a single process, SmolLM2 on 3 tensor-parallel ranks, a killed
rank (degraded, every client answered, restart serves again)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import (
    RunningDaemon,
    attach,
    cli,
    http_json,
    pid_running,
    running_daemon,
    sse_events,
    start_daemon,
    wait_until,
)
from mlxcel.daemon.distributed.hosts import (
    HostsError,
    group_available_bytes,
    parse_hosts,
    plan_sharding,
)
from mlxcel.daemon.distributed.status import group_lines
from mlxcel.shared.config import ConfigError, build_config
from mlxcel.shared.snapshot import GroupInfo, RankInfo

SMOLLM2 = {
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
}
NO_FAST_FORWARD = {"MLXCEL_NO_FAST_FORWARD": "1"}  # the group runs without the fused forward


# -- unit: hosts file, plan, options -------------------------------------------------------


@pytest.mark.unit
def test_hosts_file_gives_each_rank_an_address() -> None:
    hosts = parse_hosts(
        {
            "starting_port": 40000,
            "hosts": [
                {"ssh": "mac1", "ips": ["10.0.0.1"]},
                {"ssh": "mac2", "ips": ["10.0.0.2:5000"]},
                "10.0.0.3",
            ],
        }
    )
    assert [h.ssh for h in hosts.hosts] == ["mac1", "mac2", "10.0.0.3"]
    assert hosts.ring_hostfile() == [["10.0.0.1:40000"], ["10.0.0.2:5000"], ["10.0.0.3:40002"]]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([{"ssh": "a", "ips": ["1.2.3.4"]}], "at least 2 hosts"),
        ({"hosts": "a,b"}, "at least 2 hosts"),
        ([{"ssh": "a", "ips": ["1.1.1.1"]}, {"ssh": "b"}], "host 1 (b) needs ips"),
        ([{"ssh": "a", "ips": ["h:1"]}, {"ssh": "b", "ips": ["h:1"]}], "share the address h:1"),
    ],
)
def test_bad_hosts_files_are_refused_in_one_line(data: Any, words: str) -> None:
    with pytest.raises(HostsError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        parse_hosts(data)
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_plan_takes_tensor_when_heads_divide_else_pipeline_else_refuses() -> None:
    tiny = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
    assert plan_sharding(tiny, 2, "auto", has_shard=True, has_pipeline=False) == "tensor"
    assert plan_sharding(SMOLLM2, 3, "auto", has_shard=True, has_pipeline=False) == "tensor"
    # SmolLM2's 3 KV heads do not divide by 2; a family with pipeline() falls back to it
    assert plan_sharding(SMOLLM2, 2, "auto", has_shard=True, has_pipeline=True) == "pipeline"
    with pytest.raises(HostsError) as info:
        plan_sharding(SMOLLM2, 2, "auto", has_shard=True, has_pipeline=False)
    assert str(info.value) == (
        "cannot split the model across 2 ranks: tensor parallel: llama has 9 attention heads, "
        "which do not divide by 2; pipeline: llama has no pipeline() in mlx-lm"
    )
    with pytest.raises(HostsError, match="cannot run pipeline parallel on 2 ranks"):
        plan_sharding(tiny, 2, "pipeline", has_shard=True, has_pipeline=False)
    with pytest.raises(HostsError, match="2 layers, fewer than 3 ranks"):
        plan_sharding({"num_hidden_layers": 2}, 3, "pipeline", has_shard=False, has_pipeline=True)


@pytest.mark.unit
def test_common_kv_budget_is_what_the_tightest_rank_holds() -> None:
    # (available bytes, KV bytes per token) per rank: rank 1 holds only 50 tokens
    table = [[1000, 10], [1000, 20]]
    assert group_available_bytes(table, 0) == 500
    assert group_available_bytes(table, 1) == 1000


@pytest.mark.unit
def test_distributed_options_parse() -> None:
    values = {"hosts": "h.json", "distributed_mode": "Tensor", "distributed_timeout": "5"}
    cfg = build_config(values)
    assert (cfg.hosts, cfg.distributed_mode, cfg.distributed_timeout) == ("h.json", "tensor", 5.0)
    with pytest.raises(ConfigError, match="distributed_mode must be one of"):
        build_config({"distributed_mode": "ring"})
    with pytest.raises(ConfigError, match="distributed_timeout must be between 1 and 86400"):
        build_config({"distributed_timeout": "0"})


def degraded_group() -> GroupInfo:
    return GroupInfo(
        size=2,
        mode="tensor",
        backend="ring",
        status="degraded",
        reason="rank 1 (mac2, pid 2) exited with status -9; run `mlxcel-daemon restart`",
        comm_ms=3.25,
        timeout_s=10,
        ranks=(
            RankInfo(0, "localhost", 1, 400 << 20, 35.2, 10),
            RankInfo(1, "mac2", 2, 300 << 20, 18.0, 10),
        ),
    )


@pytest.mark.unit
def test_status_lines_show_each_rank_and_the_state() -> None:
    lines = group_lines(degraded_group().to_dict())
    assert lines[0] == (
        "  group:   2 ranks, tensor parallel (ring), step exchange 3.2 ms, timeout 10 s"
    )
    assert lines[1].startswith("  state:   DEGRADED: rank 1 (mac2, pid 2) exited")
    assert lines[3] == "    rank 1: mac2 pid 2, memory 300.0 MiB, last step 18.0 ms, 10 steps"
    assert group_lines(None) == []


@pytest.mark.unit
async def test_console_header_shows_the_group_and_degraded() -> None:
    from mlxcel.tui.app import make_app
    from test_tui_render import CannedDaemon, connected_with_snapshot, fixed_clock, make_snapshot
    from test_tui_render import wait_for as async_wait_for

    snap = replace(make_snapshot(False), group=degraded_group())
    with CannedDaemon(snap) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(200, 40)):
            await async_wait_for(lambda: connected_with_snapshot(app))
            assert app.snapshot.group == degraded_group()  # through the socket and back
            text = str(app.query_one("#header").render())
    assert "2 ranks tensor" in text
    assert "r0@localhost 400" in text and "35ms" in text
    assert "r1@mac2 300" in text and "18ms" in text
    assert "⚠ group degraded" in text


# -- e2e: real groups on 127.0.0.1 ---------------------------------------------------------


def _listen_range() -> range:
    """Ports to listen on that no outgoing connection can take meanwhile: below the
    kernel's ephemeral range (the ring's own connects, HTTP clients and the other daemons
    of the suite draw from that range, and one of them took a rank's port once in CI)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return range(max(1024, low - 12000), low)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports on 127.0.0.1 that are free now, outside the ephemeral range."""
    ports: list[int] = []
    candidates = list(_listen_range())
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports on 127.0.0.1")


def write_hosts(path: Path, ranks: int) -> Path:
    hosts = [{"ssh": "localhost", "ips": [f"127.0.0.1:{p}"]} for p in free_ports(ranks)]
    path.write_text(json.dumps(hosts))
    return path


def start_group(home: Path, model_dir: Path, ranks: int, *flags: str, **env: str) -> RunningDaemon:
    """A daemon with `ranks` ranks on fresh ports; a start that lost a port to another
    process between the pick and the bind is tried again on new ports (twice at most)."""
    for attempt in range(3):
        hosts = write_hosts(home.parent / f"{home.name}-hosts.json", ranks)
        try:
            return start_daemon(home, model_dir, "--hosts", str(hosts), *flags, **env)
        except AssertionError as err:
            if "Couldn't bind" not in str(err) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def rank_pids(daemon: RunningDaemon) -> list[int]:
    group = daemon.status()["group"]
    return [r["pid"] for r in group["ranks"][1:]]


def kill_ranks(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_smollm2_on_three_tensor_parallel_ranks_answers_paris(
    tmp_path: Path, default_model_dir: Path
) -> None:
    daemon = start_group(tmp_path / "home", default_model_dir, 3)
    pids = rank_pids(daemon)
    try:
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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
