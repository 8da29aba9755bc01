"""A real `mlxcel-daemon` in a subprocess, for the reliability and hostile-input tests.

`start_daemon` runs the detached `mlxcel-daemon start` exactly as an operator would, under a
private MLXCEL_HOME; `RunningDaemon.stop` ends it by its pid (SIGTERM, then SIGKILL).
`control` speaks the newline-JSON control protocol over a raw socket, with no client library
in between, so the tests see what any peer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

T = TypeVar("T")

START_TIMEOUT_S = 120.0
CLI = [sys.executable, "-m", "mlxcel.daemon.cli"]


@dataclass
class RunningDaemon:
    home: Path
    pid: int
    http_url: str
    socket: Path
    log_file: Path

    @property
    def env(self) -> dict[str, str]:
        return daemon_env(self.home)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the daemon drains), SIGKILL after `timeout`; the exit status if ours."""
        return stop_pid(self.pid, timeout)

    def alive(self) -> bool:
        return pid_running(self.pid)

    def status(self) -> dict[str, Any]:
        """The control socket's `status` snapshot."""
        return control(self.socket, "status")["result"]

    def log_text(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""


def daemon_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    # the prompt cache's disk tier is off unless a test turns it on (conftest.py says why)
    return {**env, "MLXCEL_HOME": str(home), "MLXCEL_PROMPT_CACHE_DISK_BYTES": "0", **extra}


def cli(home: Path, *args: str, timeout: float = START_TIMEOUT_S, **env: str):
    """Run `mlxcel-daemon ARGS` with MLXCEL_HOME=home; returns the CompletedProcess."""
    return subprocess.run(
        [*CLI, *args],
        env=daemon_env(home, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def start_daemon(home: Path, model_dir: Path, *flags: str, **env: str) -> RunningDaemon:
    """`mlxcel-daemon start --model DIR --port 0 FLAGS`; fails the test if it does not start."""
    home.mkdir(parents=True, exist_ok=True)
    try:
        done = cli(home, "start", "--model", str(model_dir), "--port", "0", *flags, **env)
    except subprocess.TimeoutExpired:
        stop_started(home)  # the detached child outlives the CLI: never leave it running
        raise
    if done.returncode != 0:
        stop_started(home)
    assert done.returncode == 0, f"start failed: {done.stdout}{done.stderr}"
    return attach(home)


def stop_started(home: Path) -> None:
    """Stop the daemon a failed or timed-out start left behind under `home`, if any."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        stop_pid(int(json.loads((home / "run" / "daemon.json").read_text())["pid"]))


def attach(home: Path) -> RunningDaemon:
    """The daemon described by the state file under `home`."""
    state = json.loads((home / "run" / "daemon.json").read_text())
    return RunningDaemon(
        home=home,
        pid=int(state["pid"]),
        http_url=state["http_url"],
        socket=Path(state["socket"]),
        log_file=Path(state["log_file"]),
    )


@contextlib.contextmanager
def running_daemon(home: Path, model_dir: Path, *flags: str, **env: str) -> Iterator[RunningDaemon]:
    daemon = start_daemon(home, model_dir, *flags, **env)
    try:
        yield daemon
    finally:
        daemon.stop()


def pid_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_pid(pid: int, timeout: float = 30.0) -> int | None:
    """Stop one process by its pid; its exit status when it is our child, else None."""
    try:
        proc = psutil.Process(pid)
        if proc.ppid() != os.getpid():
            return _stop_detached(proc, timeout)
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except psutil.TimeoutExpired:
            proc.kill()
            return proc.wait(10)
    except psutil.NoSuchProcess:
        return None


def _stop_detached(proc: psutil.Process, timeout: float) -> None:
    """A process that is not our child (a detached daemon) is stopped once it is a zombie:
    `psutil.Process.wait` would wait for its parent (init) to reap it, which some container
    inits do only every second or so (1.3 s per daemon here, the suite's ~110 of them)."""
    proc.send_signal(signal.SIGTERM)
    try:
        wait_until(lambda: not pid_running(proc.pid), timeout, what=f"pid {proc.pid} exits")
    except AssertionError:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
        wait_until(lambda: not pid_running(proc.pid), 10, what=f"pid {proc.pid} dies")


# --- waiting for a state, never for a fixed time ---------------------------------------------


def wait_until(
    predicate: Callable[[], T], timeout: float = 30.0, poll: float = 0.01, what: str = ""
) -> T:
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout} s: {what or predicate}")
        time.sleep(poll)


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = 30.0,
    poll: float = 0.01,
    what: str = "",
) -> T:
    """`wait_until` for the event loop: `predicate` may be a plain or a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout} s: {what or predicate}")
        await asyncio.sleep(poll)


async def next_control_event(
    client: Any,
    name: str,
    timeout: float = 10.0,
    match: Callable[[dict[str, Any]], bool] | None = None,
    what: str = "",
) -> dict[str, Any]:
    """The data of the next `name` event a `ControlClient` hears for which `match(data)` holds
    (every other event is skipped); fails after `timeout` naming `what`."""

    async def wanted() -> Any:
        try:
            event = await client.next_event(0.1)
        except asyncio.TimeoutError:
            return None
        assert event is not None, "connection closed"
        ok = event.event == name and (match is None or match(event.data))
        return event if ok else None

    return (await async_wait_until(wanted, timeout, 0, what=what or f"a {name} event")).data


# --- control socket ---------------------------------------------------------------------------


def control(path: Path, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """One request on a fresh connection; the reply object (result or error)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        line = json.dumps({"id": 1, "method": method, "params": params or {}}) + "\n"
        sock.sendall(line.encode())
        return json.loads(read_line(sock))


def read_line(sock: socket.socket, limit: int = 64 << 20) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} bytes")
        buf += chunk
        assert len(buf) < limit
    return bytes(buf)


class EventReader:
    """Subscribed to the control socket on a thread; collects every event but snapshots."""

    def __init__(self, path: Path) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(path))
        self._sock.sendall(b'{"id": 1, "method": "subscribe", "params": {"interval_ms": 5000}}\n')
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self._sock.makefile("rb"):
                msg = json.loads(line)
                if "event" in msg and msg["event"] != "snapshot":
                    self.events.append((msg["event"], msg["data"]))
        except (OSError, ValueError):
            return

    def names(self) -> list[str]:
        return [name for name, _ in self.events if name.startswith("model_")]

    def of(self, name: str) -> list[dict[str, Any]]:
        """The data of every `name` event so far."""
        return [data for event, data in self.events if event == name]

    def close(self) -> None:
        self._sock.close()


def busy_figures(engine: dict[str, Any]) -> tuple[int, int, int]:
    """(busy slots, waiting requests, KV blocks reserved) of an engine snapshot dict."""
    busy = sum(1 for s in engine["slots"] if s["state"] != "idle")
    return busy, len(engine["queue"]), engine["kv"]["blocks_used"]


def wait_idle(daemon: RunningDaemon, timeout: float = 20.0, poll: float = 0.02) -> float:
    """Wait until no slot is busy, nothing waits and no KV is reserved; returns the time."""
    deadline = time.monotonic() + timeout
    figures: tuple[int, int, int] = (-1, -1, -1)
    while time.monotonic() < deadline:
        figures = busy_figures(daemon.status()["engine"])
        if figures == (0, 0, 0):
            return time.monotonic()
        time.sleep(poll)
    raise AssertionError(f"not idle after {timeout} s: busy, waiting, kv = {figures}")


def wait_idle_embedded(daemon: Any, timeout: float = 20.0, poll: float = 0.05) -> Any:
    """`wait_idle` for an in-process daemon (`embedded_daemon`): its engine snapshot, the one
    the control socket's `status` reports (read on the daemon's loop thread), once no slot is
    busy, nothing waits and no KV is reserved; fails after `timeout` naming what was busy."""
    last: list[tuple[int, int, int]] = []

    def idle() -> Any:
        snap = daemon.call(daemon.daemon.host.facade.snapshot)
        if snap is None:  # no model loaded yet
            return None
        busy = sum(1 for s in snap.slots if s.state != "idle")
        last[:] = [(busy, len(snap.queue), snap.kv.blocks_used)]
        return snap if last[0] == (0, 0, 0) else None

    try:
        return wait_until(idle, timeout, poll, what="the engine idle")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: busy, waiting, kv = {last}") from None


# --- HTTP ------------------------------------------------------------------------------------


def http_json(
    url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, dict[str, str], Any]:
    """POST JSON (or GET when body is None; bytes are sent as they are, already encoded);
    (status, headers, parsed body)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})} if data else headers or {}
    req = urllib.request.Request(url, data=data, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")


def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def sse_events(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" stays a string)."""
    out: list[Any] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def chat_body(text: str, max_tokens: int, stream: bool = True, **extra: Any) -> dict[str, Any]:
    """A greedy chat request that always produces exactly `max_tokens` tokens."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@contextlib.contextmanager
def embedded_daemon(tmp_path_factory: Any, model: Path | str, **config: Any) -> Iterator[Any]:
    """The whole daemon on a thread of this process (`EmbeddedDaemon`), on `model`, HTTP on a
    free 127.0.0.1 port, its home and socket in a fresh temp folder; `config` are
    `ServingConfig` fields."""
    from embedded import EmbeddedDaemon, paths_under
    from mlxcel.shared.config import ServingConfig

    paths = paths_under(tmp_path_factory.mktemp("home"))
    cfg = ServingConfig(model=str(model), port=0, **config)
    with EmbeddedDaemon(cfg, paths, paths.socket_path) as d:
        yield d


def random_llama(tmp_path_factory: Any, folder: str, **sizes: int) -> Path:
    """A random-weight llama (seed 0, 4 KV heads) of `sizes` (hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads) in a fresh temp folder."""
    from mlxcel.daemon.models.tiny import make_tiny_model

    path = tmp_path_factory.mktemp(folder) / "llama"
    return make_tiny_model(path, "llama", seed=0, num_key_value_heads=4, **sizes)


def openai_client(daemon: Any) -> Any:
    """The official `openai` client on `daemon`'s API, without retries (a test sees each try)."""
    import openai

    return openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0)
