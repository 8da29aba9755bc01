"""`mlxcel-daemon` as a real subprocess: start, serve, live changes, save, stop, crashes.

Each test gets its own MLXCEL_HOME; the tiny random-weight model keeps startup short.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_helpers import wait_until
from mlxcel.daemon.process.lifecycle import pid_alive
from mlxcel.shared.control_client import ControlClient
from mlxcel.shared.snapshot import Snapshot

CONFIG_TEXT = "# my daemon settings\n# (do not lose this comment)\nmax_queue_depth = 32  # plenty\n"


class Home:
    def __init__(self, root: Path, model: Path, socket_dir: Path) -> None:
        self.root = root
        self.model = model
        self.env = {**os.environ, "MLXCEL_HOME": str(root)}
        self.env.pop("MLXCEL_SOCKET", None)
        self.socket = socket_dir / "ctl.sock"

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mlxcel.daemon.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.cli(
            "start", "--model", str(self.model), "--port", "0", "--socket", str(self.socket), *extra
        )

    def state(self) -> dict[str, Any]:
        return json.loads((self.root / "run" / "daemon.json").read_text())

    def pid(self) -> int | None:
        try:
            return int((self.root / "run" / "daemon.pid").read_text())
        except (OSError, ValueError):
            return None


@pytest.fixture
def home(tmp_path: Path, tiny_model_dir: Path, short_tmp: Path) -> Iterator[Home]:
    h = Home(tmp_path / "home", tiny_model_dir, short_tmp)
    (h.root / "config").mkdir(parents=True)
    (h.root / "config" / "config.toml").write_text(CONFIG_TEXT)
    yield h
    pid = h.pid()  # never leave a daemon behind, whatever the test did
    if pid is not None and pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except OSError:
        return None


def assert_one_line_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel-daemon: error: "), result.stderr
    assert needle in lines[0] and "Traceback" not in result.stderr


async def _chats_and_transitions(url: str, socket_path: Path) -> int:
    """8 concurrent streaming chats; returns how many the subscription saw finish (its
    `request_finished` events), once its snapshots have shown slots busy on the way (a
    20 ms frame may fall between a short request's start and end on a loaded machine, so the
    count comes from the events, which are never sampled)."""
    watcher = ControlClient(socket_path)
    await watcher.connect()
    await watcher.call("subscribe", {"interval_ms": 20})
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    model = (await client.models.list()).data[0].id

    async def chat(i: int) -> int:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Tell me story number {i}."}],
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        return [c async for c in stream][-1].usage.completion_tokens

    busy: set[str] = set()
    done: set[str] = set()

    async def watch() -> None:
        while len(done) < 8 or not busy:
            event = await watcher.next_event(timeout=60)
            assert event is not None
            if event.event == "request_finished":
                done.add(event.data["request_id"])
            elif event.event == "snapshot":
                slots = Snapshot.from_dict(event.data).engine.slots
                busy.update(s.request_id for s in slots if s.state != "idle" and s.request_id)

    watching = asyncio.create_task(watch())
    assert await asyncio.gather(*(chat(i) for i in range(8))) == [48] * 8
    await asyncio.wait_for(watching, 30)
    await watcher.close()
    await client.close()
    return len(done)


async def _parallel_changes(socket_path: Path) -> list[tuple[int, int]]:
    """parallel 4 -> 2 -> 6 over the socket; (effective, event value) per change."""
    client, watcher = ControlClient(socket_path), ControlClient(socket_path)
    await client.connect()
    await watcher.connect()
    await watcher.call("subscribe", {"interval_ms": 10_000})
    seen = []
    for value in (2, 6):
        result = await client.call("config.set", {"values": {"parallel": value}})
        while (event := await watcher.next_event(timeout=10)) is not None:
            if event.event == "config_changed":
                break
        assert event is not None
        seen.append((result["effective"]["parallel"], event.data["effective"]))
    await client.close()
    await watcher.close()
    return seen


def test_start_serve_change_save_and_stop(home: Home) -> None:
    started = home.start()
    assert started.returncode == 0, started.stderr
    state = home.state()
    assert f"pid {state['pid']}" in started.stdout
    for what in (state["http_url"], str(home.socket), "daemon.log"):
        assert what in started.stdout
    assert health(state["http_url"]) == 200

    assert asyncio.run(_chats_and_transitions(state["http_url"], home.socket)) == 8
    assert asyncio.run(_parallel_changes(home.socket)) == [(2, 2), (6, 6)]

    saved = home.cli("set", "parallel=3", "max_batch_prefill_tokens=2048", "--save")
    assert saved.returncode == 0, saved.stderr
    assert "parallel: 6 -> 3" in saved.stdout and "saved to" in saved.stdout
    text = (home.root / "config" / "config.toml").read_text()
    assert text.startswith(CONFIG_TEXT.rstrip("\n"))
    assert "parallel = 3" in text and "max_batch_prefill_tokens = 2048" in text

    status = home.cli("status", "--json")
    assert status.returncode == 0 and Snapshot.from_dict(json.loads(status.stdout)).engine
    assert "running" in home.cli("status").stdout

    stopped = home.cli("stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not pid_alive(state["pid"])
    assert not any((home.root / "run").iterdir()) and not home.socket.exists()
    assert home.cli("status").returncode == 3
    log = home.cli("logs", "-n", "200").stdout
    assert "config parallel: 4 -> 2" in log and "stopped" in log


def test_kill_9_leaves_stale_files_that_the_next_start_cleans(home: Home) -> None:
    assert home.start().returncode == 0
    first = home.state()
    again = home.start()
    assert_one_line_error(again, "already running")

    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(first["pid"]), 10, 0.05, what="the killed daemon gone")
    assert home.socket.exists() and (home.root / "run" / "daemon.pid").exists()
    assert home.cli("status").returncode == 3

    restarted = home.start()
    assert restarted.returncode == 0, restarted.stderr
    assert "removed stale files" in restarted.stderr
    second = home.state()
    assert second["pid"] != first["pid"] and health(second["http_url"]) == 200
    assert home.cli("stop").returncode == 0


def test_start_failures_exit_1_with_one_line(home: Home, tmp_path: Path) -> None:
    bad_model = home.cli("start", "--model", str(tmp_path / "no-such-model"), "--port", "0")
    assert_one_line_error(bad_model, "no such model")

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = home.cli("start", "--model", str(home.model), "--port", str(port))
    assert_one_line_error(in_use, f"port {port} on 127.0.0.1 is already in use")

    config = home.root / "config" / "config.toml"
    config.write_text("parallel = 2\nthis is = = broken\n")
    corrupt = home.start()
    assert_one_line_error(corrupt, "config.toml line 2")
    assert config.read_text() == "parallel = 2\nthis is = = broken\n"
    assert home.pid() is None or not pid_alive(home.pid())


def start_foreground(home: Home) -> subprocess.Popen[str]:
    serving = ["--model", str(home.model), "--port", "0", "--socket", str(home.socket)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel.daemon.cli", "start", "--foreground", *serving],
        env=home.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def healthy() -> bool:
        state_file = home.root / "run" / "daemon.json"
        if state_file.exists() and health(home.state()["http_url"]) == 200:
            return True
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        return False

    try:
        wait_until(healthy, 120, 0.1, what="the foreground daemon healthy")
    except AssertionError:
        proc.kill()
        raise
    return proc


def open_stream(home: Home, max_tokens: int) -> Any:
    client = openai.OpenAI(base_url=home.state()["http_url"] + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    return client.completions.create(
        model=model,
        prompt="Count",
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_in_flight_requests_and_exits_0(home: Home, sig: int) -> None:
    proc = start_foreground(home)
    try:
        stream = open_stream(home, 300)
        first = next(iter(stream))
        proc.send_signal(sig)
        rest = list(stream)
        assert first.choices[0].finish_reason is None
        assert rest[-1].choices[0].finish_reason == "length"  # drained, not cut
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not home.socket.exists() and not (home.root / "run" / "daemon.pid").exists()


def test_a_second_signal_stops_without_draining(home: Home) -> None:
    proc = start_foreground(home)
    try:
        stream = open_stream(home, 1900)
        next(iter(stream))
        log = Path(home.state()["log_file"])
        proc.send_signal(signal.SIGTERM)  # the second comes once it drains, not merged with it
        wait_until(lambda: "draining in-flight" in log.read_text(), 30, what="the first handled")
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "abort"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
