"""Hostile peers on the control socket of a real daemon subprocess (docs/reliability.md).

Garbage and wrong-typed lines get an error reply on a connection that stays usable; an
oversized line closes only its own connection; subscribers that never read and hundreds of
idle connections do not slow the engine; another uid is refused; the socket is 0600 in a
0700 directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import pwd
import shutil
import socket
import stat
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import (
    RunningDaemon,
    chat_body,
    control,
    running_daemon,
    wait_idle,
    wait_until,
)
from mlxcel.shared.paths import short_socket_dir
from repo_paths import TESTS

NOBODY = 65534
NUM_SLOW_SUBSCRIBERS = 50
NUM_IDLE_CONNECTIONS = 200


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("hostile-ctl")
    # The socket lives under a folder other users may traverse (pytest's temp root is
    # private), so that only the daemon's own 0700 folder and peer check stand in the way.
    public = Path(tempfile.mkdtemp(prefix="mlxcel-ctl-", dir=short_socket_dir().parent))
    public.chmod(0o711)
    sock = public / "run" / "mlxcel.sock"
    # No prompt cache: the latency probes repeat one request and must all compute it.
    flags = ("--parallel", "2", "--no-prompt-cache", "--socket", str(sock))
    try:
        with running_daemon(home, tiny_model_dir, *flags) as d:
            yield d
    finally:
        shutil.rmtree(public, ignore_errors=True)


class Line:
    """One raw connection that reads replies a line at a time."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.buf = b""

    def ask(self, raw: bytes) -> dict[str, Any]:
        """Send one line; the next reply (events pushed meanwhile are skipped)."""
        self.sock.sendall(raw if raw.endswith(b"\n") else raw + b"\n")
        while "event" in (msg := self.read()):
            pass
        return msg

    def read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("closed by the daemon")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def next_event(self, name: str) -> dict[str, Any]:
        while (msg := self.read()).get("event") != name:
            pass
        return msg["data"]

    def close(self) -> None:
        self.sock.close()


def req(method: str, params: Any = None, req_id: Any = 1) -> bytes:
    obj: dict[str, Any] = {"id": req_id, "method": method}
    if params is not None:
        obj["params"] = params
    return json.dumps(obj).encode()


# (line, error code, id echoed in the reply)
GARBAGE = [
    (b"hello", "parse_error", None),
    (b"\x00\xff\xfe\x80", "parse_error", None),
    (b'{"id": 1, "method": "status"', "parse_error", None),
    (b"[" * 100_000, "parse_error", None),
    (b'{"id": ' + b"9" * 5000 + b', "method": "status"}', "parse_error", None),
    (b"[]", "invalid_request", None),
    (b'"status"', "invalid_request", None),
    (b"42", "invalid_request", None),
    (b'{"id": 2}', "invalid_request", 2),
    (b'{"id": 3, "method": 5}', "invalid_request", 3),
    (b'{"id": [1], "method": "status"}', "invalid_request", None),
    (b'{"id": true, "method": "status"}', "invalid_request", None),
    (b'{"id": {"a": 1}, "method": "status"}', "invalid_request", None),
    (req("nope", req_id=4), "method_not_found", 4),
    (req("STATUS", req_id=5), "method_not_found", 5),
    (req("__init__", req_id=6), "method_not_found", 6),
    (req("status", [], 7), "invalid_params", 7),
    (req("status", "x", 8), "invalid_params", 8),
    (req("config.set", {"values": 5}, 9), "invalid_params", 9),
    (req("config.set", {}, 10), "invalid_params", 10),
    (req("config.set", {"key": 5, "value": 1}, 11), "invalid_params", 11),
    (req("config.set", {"key": "parallel"}, 12), "invalid_params", 12),
    (req("subscribe", {"interval_ms": "fast"}, 13), "invalid_params", 13),
    (req("subscribe", {"interval_ms": -1}, 14), "invalid_params", 14),
    (req("subscribe", {"interval_ms": 10**9}, 15), "invalid_params", 15),
    (req("subscribe", {"interval_ms": True}, 16), "invalid_params", 16),
    # Not JSON (RFC 8259); a NaN that got through would be echoed in a reply and an event
    # that cannot be encoded, killing the connection and every subscriber's push loop.
    (b'{"id": 17, "method": "subscribe", "params": {"interval_ms": NaN}}', "parse_error", None),
    (b'{"id": 23, "method": "config.set", "params": {"parallel": NaN}}', "parse_error", None),
    (b'{"id": 24, "method": "config.set", "params": {"parallel": 1e999}}', "parse_error", None),
    (b'{"id": 25, "method": "config.set", "params": {"parallel": -Infinity}}', "parse_error", None),
    (req("shutdown", {"drain": "yes"}, 18), "invalid_params", 18),
    (req("shutdown", {"timeout": -1}, 19), "invalid_params", 19),
    (req("shutdown", {"timeout": "soon"}, 20), "invalid_params", 20),
    (req("hello", {"protocol": 99}, 21), "protocol_version", 21),
    (req("hello", {"protocol": "one"}, 22), "protocol_version", 22),
]

# Values config.set refuses with a reason (a result, not an error); nothing changes.
REFUSED_VALUES = [
    {"parallel": "many"},
    {"parallel": -1},
    {"parallel": 0},
    {"parallel": 1.5},
    {"parallel": None},
    {"parallel": [4]},
    {"parallel": 10**100},
    {"max_batch_prefill": 10**6},
    {"max_batch_prefill_tokens": -5},
    {"max_batch_prefill_tokens": 1e308},
    {"prompt_cache": "maybe"},
    {"model": "other"},
    {"api_key": "steal"},
    {"host": "0.0.0.0"},
]


def test_garbage_lines_get_errors_and_the_connection_stays_usable(daemon: RunningDaemon) -> None:
    before = control(daemon.socket, "config.get")["result"]["effective"]
    watcher = Line(daemon.socket)
    assert watcher.ask(req("subscribe", {"interval_ms": 60_000}))["result"]["subscribed"]
    conn = Line(daemon.socket)
    try:
        for line, code, req_id in GARBAGE:
            reply = conn.ask(line)
            assert "result" not in reply, (line[:60], reply)
            assert reply["error"]["code"] == code, (line[:60], reply)
            assert reply["error"]["message"] and reply.get("id") == req_id, (line[:60], reply)
        for n, values in enumerate(REFUSED_VALUES):
            reply = conn.ask(req("config.set", {"values": values}, 100 + n))
            (change,) = reply["result"]["changes"]
            assert change["applied"] is False and change["reason"], (values, change)
        assert conn.ask(req("hello", {"protocol": 1}, 999))["result"]["pid"] == daemon.pid
        # A subscriber watching all along still gets events: the refusals, in order.
        keys = [watcher.next_event("config_changed")["key"] for _ in REFUSED_VALUES]
        assert keys == [next(iter(v)) for v in REFUSED_VALUES]
    finally:
        conn.close()
        watcher.close()
    assert control(daemon.socket, "config.get")["result"]["effective"] == before


def test_an_oversized_line_closes_only_that_connection(daemon: RunningDaemon) -> None:
    bystander = Line(daemon.socket)
    big = Line(daemon.socket)
    try:
        payload = b'{"id": 1, "method": "status", "params": {"x": "' + b"a" * (10 << 20)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            big.sock.sendall(payload + b'"}}\n')
        # The daemon hangs up on it: EOF (or a reset), and never a reply.
        with contextlib.suppress(ConnectionResetError):
            assert big.sock.recv(1 << 16) == b""
        assert bystander.ask(req("status"))["result"]["daemon"]["pid"] == daemon.pid
        assert control(daemon.socket, "hello")["result"]["pid"] == daemon.pid
    finally:
        big.close()
        bystander.close()
    assert daemon.alive()


def timed_chat(url: str, i: int) -> float:
    async def main() -> float:
        body = chat_body(f"Latency probe {i}.", 32, stream=False)
        async with aiohttp.ClientSession() as session:
            start = time.monotonic()
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 32
            return time.monotonic() - start

    return asyncio.run(main())


def pending_bytes(sock: socket.socket) -> int:
    """Bytes the daemon has pushed that this socket has not read yet."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_subscribers_that_never_read_do_not_slow_the_engine(daemon: RunningDaemon) -> None:
    alone = statistics.median(timed_chat(daemon.http_url, i) for i in range(3))
    stuck = []
    try:
        for _ in range(NUM_SLOW_SUBSCRIBERS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(str(daemon.socket))
            sock.sendall(req("subscribe", {"interval_ms": 20}))
            sock.sendall(b"\n")
            stuck.append(sock)  # never read: their buffers fill within a second
        for _ in range(NUM_IDLE_CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(daemon.socket))
            stuck.append(sock)
        slow = stuck[:NUM_SLOW_SUBSCRIBERS]
        wait_until(lambda: all(pending_bytes(s) >= 2048 for s in slow), 30, what="buffers full")
        steps_before = daemon.status()["engine"]["counters"]["steps"]
        crowded = statistics.median(timed_chat(daemon.http_url, i) for i in range(3, 6))
        steps_after = daemon.status()["engine"]["counters"]["steps"]
        start = time.monotonic()
        assert control(daemon.socket, "status")["result"]["daemon"]["pid"] == daemon.pid
        status_s = time.monotonic() - start
    finally:
        for sock in stuck:
            sock.close()
    print(f"chat latency alone {alone:.3f} s, with stuck subscribers {crowded:.3f} s")
    assert steps_after > steps_before  # the engine kept stepping
    assert crowded < 5 * alone + 2.0, (alone, crowded)  # generous: 2 shared cores
    assert status_s < 5.0
    wait_idle(daemon)


def test_socket_and_directory_modes(daemon: RunningDaemon) -> None:
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(daemon.socket.parent.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(daemon.socket.stat().st_mode)


def connect_as(uid: int, path: Path) -> str:
    """Connect from a forked child running as `uid`; what it saw, as one line of text."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain system calls only, then _exit
        result = b"?"
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            try:
                sock.connect(str(path))
            except PermissionError:
                result = b"EACCES"
            else:
                sock.sendall(b'{"id": 1, "method": "status"}\n')
                data = b""
                while chunk := sock.recv(1 << 16):
                    data += chunk
                result = b"REPLY " + data[:2000]
        except BaseException as exc:
            result = f"ERROR {type(exc).__name__}: {exc}".encode()
        finally:
            os.write(write_fd, result)
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as r:
        out = r.read()
    os.waitpid(pid, 0)
    return out.decode(errors="replace")


NS_HINT = (
    "the cross-uid check needs root, or a user namespace with a subordinate uid range: "
    "install `uidmap` (newuidmap) and give this user a range in /etc/subuid and /etc/subgid"
)


def userns_other_uid() -> int:
    """The outer uid that `unshare --map-auto` makes root inside (the first subuid)."""
    user = pwd.getpwuid(os.getuid()).pw_name
    for line in Path("/etc/subuid").read_text().splitlines():
        name, start, _count = line.split(":")
        if name in (user, str(os.getuid())):
            return int(start)
    pytest.fail(f"no /etc/subuid range for {user}: {NS_HINT}")


def connect_from_userns(path: Path) -> str:
    """Connect from a user namespace whose root is a subordinate uid (no root needed)."""
    if not shutil.which("unshare") or not shutil.which("newuidmap"):
        pytest.fail(NS_HINT)
    argv = ["unshare", "--user", "--map-auto", "--setuid", "0", "--setgid", "0"]
    # The client prints what it saw; the namespace's root reads it as "other" (the checkout's
    # files are world-readable, as the interpreter it runs on is).
    client = TESTS / "child_scripts" / "hostile_control_ns_client.py"
    done = subprocess.run(
        [*argv, sys.executable, str(client), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"the namespace client failed ({NS_HINT}?)\n{done.stderr}"
    out = done.stdout
    if out.startswith("UID "):  # inside the namespace we are root
        _, uid, rest = out.split(" ", 2)
        assert uid == "0", out
        out = rest
    return out


def test_another_uid_is_refused(daemon: RunningDaemon) -> None:
    if os.geteuid() == 0:
        other, connect = NOBODY, lambda: connect_as(NOBODY, daemon.socket)
    else:  # runs on every CI machine: a subordinate uid through a user namespace
        other, connect = userns_other_uid(), lambda: connect_from_userns(daemon.socket)
    # The 0700 directory alone keeps it out.
    assert connect() == "EACCES"
    # Opened up on purpose, the daemon's own peer-uid check still refuses it.
    sock_dir = daemon.socket.parent
    os.chmod(sock_dir, 0o711)
    os.chmod(daemon.socket, 0o666)
    try:
        seen = connect()
    finally:
        os.chmod(daemon.socket, 0o600)
        os.chmod(sock_dir, 0o700)
    assert seen.startswith("REPLY "), seen
    replies = [json.loads(line) for line in seen[len("REPLY ") :].splitlines() if line]
    assert len(replies) == 1 and "result" not in replies[0], replies
    assert replies[0]["error"]["code"] == "permission_denied"
    assert f"refused a control connection from uid {other}" in daemon.log_text()
    assert control(daemon.socket, "hello")["result"]["pid"] == daemon.pid
