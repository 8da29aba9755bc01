"""`logs.subscribe` on the real daemon (tiny model, embedded): the recent lines come first, new
ones follow as `log` events, the level filter holds, and a subscriber that never reads blocks
neither the daemon nor the code that logs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import control, embedded_daemon, next_control_event
from mlxcel.shared.control_client import ControlClient, ControlError


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # The embedded daemon shares this process's root logger: let INFO through, as the
    # daemon's own setup_logging does.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with embedded_daemon(tmp_path_factory, tiny_model_dir, parallel=2) as d:
            yield d
    finally:
        root.setLevel(level)


async def next_log(client: ControlClient, want: str, timeout: float = 10) -> dict[str, Any]:
    """The next `log` event whose message holds `want` (the others are skipped)."""
    return await next_control_event(
        client, "log", timeout, lambda data: want in data["message"], f"a log line with {want!r}"
    )


async def test_recent_lines_first_then_new_ones(daemon: Any) -> None:
    async with ControlClient(daemon.socket_path) as client:
        assert "logs.subscribe" in client.hello["methods"]
        reply = await client.call("logs.subscribe", {"level": "info"})
        assert reply["subscribed"] and reply["level"] == "info"
        messages = [line["message"] for line in reply["lines"]]
        assert any(m.startswith("ready: ") for m in messages), messages  # from the start
        first = reply["lines"][0]
        assert set(first) == {"ts", "level", "levelno", "logger", "message"}
        # A config change logs an INFO line: it arrives as an event.
        await client.call("config.set", {"values": {"parallel": 3}})
        line = await next_log(client, "config parallel: 2 -> 3")
        assert line["level"] == "INFO" and line["logger"] == "mlxcel.daemon"
        await client.call("config.set", {"values": {"parallel": 2}})
        await next_log(client, "config parallel: 3 -> 2")
        # A log-only subscription gets log lines, no snapshots nor other events.
        with contextlib.suppress(asyncio.TimeoutError):
            while True:
                event = await client.next_event(0.5)
                assert event is not None and event.event == "log", event


async def test_level_filter_and_bad_params(daemon: Any) -> None:
    async with ControlClient(daemon.socket_path) as client:
        reply = await client.call("logs.subscribe", {"level": "warning", "backlog": 50})
        assert all(line["levelno"] >= logging.WARNING for line in reply["lines"])
        logging.getLogger("mlxcel.test").info("an info line nobody at warning sees")
        logging.getLogger("mlxcel.test").warning("a warning line")
        line = await next_log(client, "line")
        assert line["message"] == "a warning line" and line["level"] == "WARNING"
        for bad in ({"level": "loud"}, {"level": 3}, {"backlog": -1}, {"backlog": True}):
            with pytest.raises(ControlError) as err:
                await client.call("logs.subscribe", bad)
            assert err.value.code == "invalid_params"
        assert (await client.call("logs.unsubscribe"))["subscribed"] is False
        logging.getLogger("mlxcel.test").warning("after unsubscribe")
        with pytest.raises(AssertionError, match=r"not true after 0\.5 s: a log line with"):
            await next_log(client, "after unsubscribe", timeout=0.5)


async def test_a_subscriber_that_never_reads_blocks_nobody(daemon: Any) -> None:
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(str(daemon.socket_path))
    try:
        req = {"id": 1, "method": "logs.subscribe", "params": {"level": "debug", "backlog": 0}}
        stuck.sendall((json.dumps(req) + "\n").encode())
        # 20,000 lines of 1 KiB (20 MiB) towards a peer that reads nothing: logging stays
        # fast (no line waits for a socket) and the daemon keeps answering.
        noisy = logging.getLogger("mlxcel.test.noise")
        started = time.monotonic()
        for i in range(20_000):
            noisy.warning("line %d %s", i, "x" * 1000)
        took = time.monotonic() - started
        assert took < 10, f"logging took {took:.1f} s"
        async with ControlClient(daemon.socket_path) as client:
            asked = time.monotonic()
            await client.call("status")
            assert time.monotonic() - asked < 2.0
            reply = await client.call("logs.subscribe", {"level": "warning", "backlog": 1})
            assert reply["lines"][-1]["message"].startswith("line 19999 ")
            noisy.warning("the newest line")
            await next_log(client, "the newest line")
        status = await asyncio.to_thread(control, daemon.socket_path, "status")
        assert "result" in status
    finally:
        stuck.close()
