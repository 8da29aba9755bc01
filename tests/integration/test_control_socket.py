"""The control API on the Unix socket (docs/api.md), on the real daemon and the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import async_wait_until, next_control_event
from embedded import EmbeddedDaemon, paths_under
from mlxcel.daemon.server.control_server import HANDLERS, READ_ONLY_METHODS, WRITE_HIGH_WATER
from mlxcel.shared import PROTOCOL_VERSION
from mlxcel.shared.config import build_config
from mlxcel.shared.control_client import ControlClient, ControlError
from mlxcel.shared.paths import short_socket_dir
from mlxcel.shared.protocol import MAX_LINE_BYTES, METHODS
from mlxcel.shared.snapshot import Snapshot

CONFIG_TEXT = "# operator notes: keep this comment\nparallel = 4  # slots\n"


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    paths = paths_under(tmp_path_factory.mktemp("home"))
    paths.config_dir.mkdir(parents=True)
    paths.config_file.write_text(CONFIG_TEXT)
    cfg = build_config({"model": str(tiny_model_dir), "port": 0, "parallel": 4})
    # Outside pytest's private temp root, so that another uid can reach it (uid test).
    outer = Path(tempfile.mkdtemp(prefix="mlxcel-ctl-", dir=short_socket_dir().parent))
    try:
        with EmbeddedDaemon(cfg, paths, outer / "run" / "mlxcel.sock") as d:
            yield d
    finally:
        shutil.rmtree(outer, ignore_errors=True)


async def connected(daemon: Any) -> ControlClient:
    client = ControlClient(daemon.socket_path)
    await client.connect()
    return client


async def raw_lines(daemon: Any, lines: list[bytes]) -> list[dict[str, Any]]:
    reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
    replies = []
    for line in lines:
        writer.write(line)
        await writer.drain()
        replies.append(json.loads(await asyncio.wait_for(reader.readline(), 10)))
    writer.close()
    return replies


def test_every_protocol_method_has_a_handler() -> None:
    missing = [m for m in METHODS if m not in HANDLERS]
    assert not missing, f"methods of METHODS without a handler in HANDLERS: {missing}"
    unknown = sorted(set(HANDLERS) - set(METHODS))
    assert not unknown, f"handlers of methods that METHODS lacks: {unknown}"
    assert not READ_ONLY_METHODS - set(METHODS), sorted(READ_ONLY_METHODS - set(METHODS))


def test_socket_and_directory_are_private(daemon: Any) -> None:
    assert stat.S_IMODE(daemon.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(daemon.socket_path.parent.stat().st_mode) == 0o700


async def test_hello_and_status(daemon: Any) -> None:
    client = await connected(daemon)
    try:
        hello = client.hello
        assert hello["protocol"] == PROTOCOL_VERSION and hello["pid"] == os.getpid()
        assert hello["model"] == daemon.daemon.state.model.name and hello["version"]
        status = await client.call("status")
        snap = Snapshot.from_dict(status)
        assert snap.to_dict() == status
        assert snap.daemon.pid == os.getpid() and snap.daemon.http_url == daemon.http_url
        assert len(snap.engine.slots) == 4 and snap.engine.config.parallel == 4
        with pytest.raises(ControlError, match="protocol_version"):
            await client.call("hello", {"protocol": 99})
    finally:
        await client.close()


async def test_config_set_applies_refuses_and_pushes_events(daemon: Any) -> None:
    client, watcher = await connected(daemon), await connected(daemon)
    try:
        await watcher.call("subscribe", {"interval_ms": 1000})
        result = await client.call("config.set", {"values": {"parallel": 2}})
        (change,) = result["changes"]
        assert (change["applied"], change["previous"], change["effective"]) == (True, 4, 2)
        assert result["effective"]["parallel"] == 2
        event = await next_control_event(watcher, "config_changed")
        assert (event["key"], event["effective"]) == ("parallel", 2)
        result = await client.call("config.set", {"parallel": 0, "port": 1})
        refused = {c["key"]: c for c in result["changes"]}
        assert not refused["parallel"]["applied"] and ">= 1" in refused["parallel"]["reason"]
        assert not refused["port"]["applied"] and "runtime" in refused["port"]["reason"]
        assert (await client.call("config.get"))["effective"]["parallel"] == 2
        await client.call("config.set", {"key": "parallel", "value": 4})
        with pytest.raises(ControlError, match="invalid_params"):
            await client.call("config.set", {})
    finally:
        await client.close()
        await watcher.close()


async def test_config_save_writes_runtime_keys_and_keeps_comments(daemon: Any) -> None:
    client = await connected(daemon)
    try:
        await client.call("config.set", {"values": {"max_batch_prefill_tokens": 2048}})
        saved = await client.call("config.save")
        text = Path(saved["path"]).read_text()
        assert "# operator notes: keep this comment" in text and "parallel = 4  # slots" in text
        assert "max_batch_prefill_tokens = 2048" in text and "prompt_cache = true" in text
        await client.call("config.set", {"values": {"max_batch_prefill_tokens": 4096}})
    finally:
        await client.close()


async def test_cache_reset_answers_and_pushes_an_event(daemon: Any) -> None:
    client = await connected(daemon)
    try:
        base = (await client.call("status"))["engine"]["prompt_cache"]["bytes"]
        async with aiohttp.ClientSession(daemon.http_url) as s:  # 70+ tokens: cached blocks
            body = {"prompt": "tell me a story " * 20, "max_tokens": 4, "ignore_eos": True}
            async with s.post("/v1/completions", json=body) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
        # The answer goes out before the finished sequence's KV is copied into the prompt
        # cache (`Engine._settle_kv_offers`, later in that step), so a status read at once may
        # show the prompt's KV only: wait for the one that shows the whole sequence's, the
        # prompt's and the generated tokens' (the last one's perhaps not: it need not have gone
        # through the model; here it has, 165 tokens' KV for 161 + 4).
        kv_tokens = usage["prompt_tokens"] + usage["completion_tokens"] - 1

        async def settled() -> dict[str, Any] | None:
            engine = (await client.call("status"))["engine"]
            per_token = engine["kv"]["bytes_per_block"] // engine["kv"]["block_size"]
            cache = engine["prompt_cache"]
            return cache if cache["bytes"] - base >= kv_tokens * per_token else None

        before = await async_wait_until(settled, timeout=20, what="the finished KV cached")
        assert before["entries"] >= 1 and before["bytes"] > 0
        await client.call("subscribe", {"interval_ms": 5000})
        result = await client.call("cache.reset")
        assert result == {"entries_freed": before["entries"], "bytes_freed": before["bytes"]}
        assert await next_control_event(client, "cache_reset") == result
        after = (await client.call("status"))["engine"]["prompt_cache"]
        assert (after["entries"], after["bytes"]) == (0, 0)
        assert await client.call("cache.reset") == {"entries_freed": 0, "bytes_freed": 0}
    finally:
        await client.close()


async def test_subscribe_pushes_snapshots_and_request_events(daemon: Any) -> None:
    client = await connected(daemon)
    try:
        assert await client.call("subscribe", {"interval_ms": 50}) == {
            "subscribed": True,
            "interval_ms": 50,
        }
        snap = Snapshot.from_dict(await next_control_event(client, "snapshot"))
        assert snap.daemon.model == daemon.daemon.state.model.name
        async with aiohttp.ClientSession(daemon.http_url) as s:
            body = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
            async with s.post("/v1/completions", json=body) as r:
                assert r.status == 200
            async with s.post("/v1/completions", json={"prompt": "x", "max_tokens": 9999}) as r:
                assert r.status == 400
        finished = await next_control_event(client, "request_finished")
        assert finished["finish_reason"] == "length" and finished["completion_tokens"] == 3
        rejected = await next_control_event(client, "request_rejected")
        assert rejected["reason"] in ("too_long", "invalid_request")
        await client.call("unsubscribe")
        while not client._events.empty():  # pushed before the reply, so already read
            client._events.get_nowait()
        witness = await connected(daemon)
        try:  # a subscriber that still hears everything the unsubscribed one must not
            await witness.call("subscribe", {"interval_ms": 50})
            async with aiohttp.ClientSession(daemon.http_url) as s:
                body = {"prompt": "again", "max_tokens": 2, "ignore_eos": True}
                async with s.post("/v1/completions", json=body) as r:
                    assert r.status == 200
            await next_control_event(witness, "request_finished")
            for _ in range(3):
                await next_control_event(witness, "snapshot")
        finally:
            await witness.close()
        await client.call("status")  # a round trip: whatever was pushed before it is read
        assert client._events.empty()
        with pytest.raises(ControlError, match="invalid_params"):
            await client.call("subscribe", {"interval_ms": 1})
    finally:
        await client.close()


async def test_malformed_lines_get_errors_and_the_connection_stays_usable(daemon: Any) -> None:
    replies = await raw_lines(
        daemon,
        [
            b"garbage\n",
            b"\xff\xfe\n",
            b"[1, 2]\n",
            b'{"id": 1}\n',
            b'{"id": 2, "method": "nope"}\n',
            b'{"id": 3, "method": "status", "params": 5}\n',
            b'{"id": 4, "method": "subscribe", "params": {"interval_ms": "x"}}\n',
            b'{"id": 5, "method": "hello"}\n',
        ],
    )
    codes = [r.get("error", {}).get("code") for r in replies]
    assert codes == [
        "parse_error",
        "parse_error",
        "invalid_request",
        "invalid_request",
        "method_not_found",
        "invalid_params",
        "invalid_params",
        None,
    ]
    assert replies[4]["id"] == 2 and replies[-1]["result"]["protocol"] == PROTOCOL_VERSION


async def test_an_oversized_line_closes_the_connection(daemon: Any) -> None:
    reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
    writer.write(b'{"id": 1, "method": "hello", "params": {"x": "' + b"a" * MAX_LINE_BYTES)
    with pytest.raises((ConnectionError, BrokenPipeError)):
        await writer.drain()
        writer.write(b'"}}\n')
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        raise ConnectionResetError  # closed cleanly: EOF
    writer.close()
    assert (await raw_lines(daemon, [b'{"id": 1, "method": "hello"}\n']))[0]["result"]


def hello_as_nobody(path: Path) -> dict[str, Any]:
    """Root only: a forked child becomes uid 65534 and says hello; its first reply."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, say hello, report the reply
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(str(path))
                s.sendall(b'{"id": 1, "method": "hello"}\n')
                os.write(wfd, s.recv(4096))
        except Exception as exc:
            os.write(wfd, json.dumps({"child": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    os.waitpid(pid, 0)
    with os.fdopen(rfd, "rb") as r:
        return json.loads(r.read().splitlines()[0])


def test_a_peer_with_another_uid_is_refused(daemon: Any) -> None:
    path, parent = daemon.socket_path, daemon.socket_path.parent
    if os.getuid() == 0:  # a real second uid
        # Let the other uid reach the socket, so that what refuses it is the uid check.
        os.chmod(parent.parent, 0o711)
        os.chmod(parent, 0o711)
        os.chmod(path, 0o666)
        try:
            reply = hello_as_nobody(path)
        finally:
            os.chmod(path, 0o600)
            os.chmod(parent, 0o700)
            os.chmod(parent.parent, 0o700)
        assert reply.get("error", {}).get("code") == "permission_denied", reply
    # Any user: the daemon is told it runs as another uid, so our own connection (whose uid
    # the kernel reports through SO_PEERCRED) is the foreign one.
    control = daemon.daemon._control
    own = control.uid
    control.uid = os.getuid() + 1
    try:
        [reply] = asyncio.run(raw_lines(daemon, [b'{"id": 1, "method": "hello"}\n']))
    finally:
        control.uid = own
    assert "result" not in reply and reply["error"]["code"] == "permission_denied", reply
    [ok] = asyncio.run(raw_lines(daemon, [b'{"id": 1, "method": "hello"}\n']))
    assert ok["result"]["pid"] == os.getpid()


def test_peer_uid_is_the_kernels_answer() -> None:
    from mlxcel.daemon.server.peercred import peer_uid

    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_uid(a) == os.getuid()


async def test_a_slow_subscriber_does_not_hold_the_engine(daemon: Any) -> None:
    reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
    writer.write(b'{"id": 1, "method": "subscribe", "params": {"interval_ms": 20}}\n')
    await writer.drain()  # ...and never read while the engine works

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        body = {"prompt": f"story {i}", "max_tokens": 200, "ignore_eos": True}
        async with s.post("/v1/completions", json=body) as r:
            return (await r.json())["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(daemon.http_url) as s:
        counts = await asyncio.wait_for(asyncio.gather(*(one(s, i) for i in range(4))), 120)
    assert counts == [200] * 4
    control = daemon.daemon._control
    buffered = [c.writer.transport.get_write_buffer_size() for c in control._connections]
    assert max(buffered) < WRITE_HIGH_WATER + 64 * 1024
    finished_at = daemon.daemon.bridge.snapshot().time
    latest = None
    while latest is None or latest["engine"]["time"] < finished_at:
        msg = json.loads(await asyncio.wait_for(reader.readline(), 10))
        if msg.get("event") == "snapshot":
            latest = msg["data"]
    writer.close()


async def test_a_family_that_cannot_batch_is_clamped_with_its_reason(
    tiny_nobatch_model_dir: Path, tmp_path: Path, short_tmp: Path
) -> None:
    paths = paths_under(tmp_path / "home")
    cfg = build_config({"model": str(tiny_nobatch_model_dir), "port": 0, "parallel": 4})
    with EmbeddedDaemon(cfg, paths, short_tmp / "nb.sock") as d:
        client = ControlClient(d.socket_path)
        await client.connect()
        try:
            eff = Snapshot.from_dict(await client.call("status")).engine.config
            assert (eff.parallel, eff.parallel_requested) == (1, 4)
            assert eff.parallel_clamp_reason
            result = await client.call("config.set", {"values": {"parallel": 3}})
            (change,) = result["changes"]
            assert change["applied"] and change["effective"] == 1
            assert change["reason"].startswith("clamped to 1")
        finally:
            await client.close()


def test_a_stop_with_a_console_attached_logs_no_error(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, caplog: Any
) -> None:
    """The stop cancels the open control connections (a console's): that is the end of
    them, not an error (Python 3.11's unix server logs a cancelled connection task as
    "Exception in callback ..." unless the task ends by itself)."""
    import socket as sockets

    paths = paths_under(tmp_path_factory.mktemp("home"))
    cfg = build_config({"model": str(tiny_model_dir), "port": 0})
    with caplog.at_level("ERROR", logger="asyncio"):
        d = EmbeddedDaemon(cfg, paths, paths.socket_path).start()
        console = sockets.socket(sockets.AF_UNIX)
        try:
            console.connect(str(d.socket_path))
            console.sendall(b'{"id": 1, "method": "hello", "params": {}}\n')
            assert console.recv(65536)  # the connection is up and served
            d.stop()
        finally:
            console.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [], errors
