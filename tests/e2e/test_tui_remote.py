"""Watching a daemon from another machine: `mlxcel-top --url` over the daemon's WebSocket
control endpoint (`/v1/control`), against the real daemon (a subprocess on the tiny model)
listening on a non-loopback address of this machine (127.0.0.1 where there is none) with an
API key and a read-only key. The full key sees the slots fill and changes `parallel`; the
read-only key watches with its controls disabled (the models panel's load and unload too) and
cannot change `parallel` or unload the model; a wrong or a missing key is refused."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from console_daemon import Daemon, daemon_config, live, log_text, start_daemon
from daemon_helpers import async_wait_until
from mlxcel.shared.control_client import ControlClient, ControlError, NotConnected
from mlxcel.tui.app import make_app
from mlxcel.tui.models_panel import ModelsScreen
from mlxcel.tui.remote import RemoteControlClient
from mlxcel.tui.state import Link
from textual.widgets import DataTable, Label

FULL_KEY = "full-key-for-the-test"
READ_KEY = "read-only-key-for-the-test"


def outside_address() -> str:
    """A non-loopback IPv4 address of this machine that can be bound; else 127.0.0.1."""
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family != socket.AF_INET or ipaddress.ip_address(addr.address).is_loopback:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind((addr.address, 0))
                except OSError:
                    continue
            return addr.address
    return "127.0.0.1"


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("home")
    folder = tempfile.mkdtemp(prefix="mtr-", dir="/tmp")
    keys = {
        "MLXCEL_HOST": outside_address(),
        "MLXCEL_API_KEY": FULL_KEY,
        "MLXCEL_READONLY_API_KEY": READ_KEY,
    }
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        d = start_daemon(tiny_model_dir, home, os.path.join(folder, "d.sock"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield d
    d.stop()
    shutil.rmtree(folder, ignore_errors=True)


async def stream(url: str, max_tokens: int = 1500) -> None:
    body = {"prompt": "count with me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {FULL_KEY}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            async for _ in resp.content:
                pass


def busy(app: Any) -> int:
    return sum(1 for s in app.latest.engine.slots if s.state != "idle") if app.latest else 0


async def test_full_key_watches_the_slots_fill_and_changes_parallel(daemon: Daemon) -> None:
    assert not ipaddress.ip_address(daemon.url.split("//")[1].rsplit(":", 1)[0]).is_loopback or (
        outside_address() == "127.0.0.1"
    )
    app = make_app(url=daemon.url, api_key=FULL_KEY, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await async_wait_until(lambda: live(app))
        assert app.link_state.hello_dict["access"] == "full" and not app.read_only
        jobs = [asyncio.create_task(stream(daemon.url)) for _ in range(2)]
        try:
            await async_wait_until(lambda: busy(app) == 2, timeout=30)
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        before = (await daemon_config(daemon.socket))["parallel"]
        await pilot.press("plus")

        async def raised() -> bool:
            return (await daemon_config(daemon.socket))["parallel"] == before + 1

        await async_wait_until(raised, timeout=10, poll=0.05)
        await pilot.press("minus")
        await async_wait_until(
            lambda: f"parallel {before + 1} → {before}" in log_text(app), timeout=10
        )
        # The daemon's log comes over the WebSocket too.
        pane = app.query_one("#daemon-log")
        await async_wait_until(
            lambda: any("remote control connection" in str(x) for x in pane.kept)
        )


async def loaded_models(sock: str) -> list[str]:
    async with ControlClient(sock) as client:
        return [m["name"] for m in (await client.call("model.list"))["models"]]


async def test_read_only_key_watches_but_cannot_change_parallel(daemon: Daemon) -> None:
    before = (await daemon_config(daemon.socket))["parallel"]
    [daemon_model] = await loaded_models(daemon.socket)
    app = make_app(url=daemon.url, api_key=READ_KEY, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await async_wait_until(lambda: live(app))
        assert app.read_only and app.link_state.hello_dict["access"] == "read-only"
        header = str(app.query_one("#header").render())
        assert "read-only" in header
        assert app.check_action("parallel", (1,)) is None  # shown disabled in the footer
        assert "read-only key" in log_text(app)
        await pilot.press("plus")
        await pilot.press("x")
        await asyncio.sleep(0.5)
        assert (await daemon_config(daemon.socket))["parallel"] == before
        assert (await daemon_config(daemon.socket))["prompt_cache"] is True
        # The models panel: load and unload shown disabled, and refused.
        await pilot.press("m")
        await async_wait_until(lambda: isinstance(app.screen, ModelsScreen))
        panel = app.screen
        assert isinstance(panel, ModelsScreen)
        await async_wait_until(lambda: panel.query_one("#models-table", DataTable).row_count > 0)
        assert panel.check_action("load", ()) is None and panel.check_action("unload", ()) is None
        assert "read-only key" in str(panel.query_one("#models-hint", Label).render())
        panel.query_one("#models-table", DataTable).focus()
        await pilot.press("u")
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is panel  # no confirmation asked
        assert "read-only key: cannot load or unload models" in log_text(app)
        await pilot.press("escape")
        assert await loaded_models(daemon.socket) == [daemon_model]
    # The protocol itself refuses a change on that key, whatever the client.
    client = RemoteControlClient(daemon.url, READ_KEY)
    await client.connect()
    try:
        assert (await client.call("status"))["engine"]["config"]["parallel"] == before
        with pytest.raises(ControlError) as err:
            await client.call("config.set", {"values": {"parallel": before + 1}})
        assert err.value.code == "permission_denied"
        for method in ("request.cancel", "cache.reset", "config.save", "shutdown", "model.unload"):
            with pytest.raises(ControlError) as err:
                await client.call(method, {"request_id": "x", "name": daemon_model})
            assert err.value.code == "permission_denied", method
    finally:
        await client.close()
    assert (await daemon_config(daemon.socket))["parallel"] == before


async def test_wrong_or_missing_key_is_refused(daemon: Daemon) -> None:
    for key, why in (("not-the-key", "wrong API key"), (None, "an API key is needed")):
        client = RemoteControlClient(daemon.url, key)
        with pytest.raises(NotConnected) as err:
            await client.connect()
        assert why in str(err.value)
    # The console says so, and keeps retrying (as it does for the socket).
    app = make_app(url=daemon.url, api_key="not-the-key", interval_ms=100, retry_s=0.2)
    async with app.run_test(size=(120, 40)):
        await async_wait_until(lambda: app.link_state.link is Link.DISCONNECTED)
        assert "wrong API key" in app.link_state.detail
        assert app.latest is None
    # The HTTP API does not take the read-only key either.
    async with aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {READ_KEY}"}
        async with session.get(f"{daemon.url}/v1/models", headers=headers) as resp:
            assert resp.status == 401
    # The socket, for the daemon's own user, is unchanged.
    async with ControlClient(daemon.socket) as local:
        assert local.hello["access"] == "full"


async def test_a_web_page_cannot_open_the_control_socket(daemon: Daemon) -> None:
    """WebSockets are not bound by CORS: a handshake carrying a page's Origin is refused even
    with the right key, unless the operator allowed that origin."""
    headers = {"Authorization": f"Bearer {FULL_KEY}"}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await session.ws_connect(
                f"{daemon.url}/v1/control", headers=headers, origin="http://evil.example"
            )
        assert err.value.status == 403
        async with session.ws_connect(f"{daemon.url}/v1/control", headers=headers) as ws:
            await ws.send_json({"id": 1, "method": "status", "params": {}})
            reply = await ws.receive_json(timeout=10)
            assert reply["id"] == 1 and "result" in reply, reply  # no Origin: still opens
