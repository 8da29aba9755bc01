"""`request.cancel` on the real daemon (tiny model): an OpenAI streaming client's request is
cancelled over the control socket; its stream ends cleanly (finish_reason "abort", usage), its
slot and KV are free when the reply comes, subscribers hear who cancelled it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_helpers import async_wait_until, next_control_event
from embedded import EmbeddedDaemon, paths_under
from mlxcel.shared.config import build_config
from mlxcel.shared.control_client import ControlClient, ControlError
from mlxcel.shared.paths import short_socket_dir
from mlxcel.shared.snapshot import Snapshot


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    paths = paths_under(tmp_path_factory.mktemp("home"))
    cfg = build_config({"model": str(tiny_model_dir), "port": 0, "parallel": 2})
    outer = Path(tempfile.mkdtemp(prefix="mlxcel-cc-", dir=short_socket_dir().parent))
    try:
        with EmbeddedDaemon(cfg, paths, outer / "run" / "mlxcel.sock") as d:
            yield d
    finally:
        shutil.rmtree(outer, ignore_errors=True)


async def status(client: ControlClient) -> Snapshot:
    return Snapshot.from_dict(await client.call("status"))


async def busy_request(client: ControlClient, job: asyncio.Task[Any], timeout: float = 60) -> str:
    """The id of a request the engine decodes (`job`'s, while it is the only one)."""

    async def decoding() -> str | None:
        if job.done():
            job.result()  # the client failed: say why
            raise AssertionError("the request finished before it was seen decoding")
        snap = await status(client)
        ids = [s.request_id for s in snap.engine.slots if s.state == "decode" and s.request_id]
        return ids[0] if ids else None

    return await async_wait_until(decoding, timeout, 0.05, what="a request decoding")


async def stream_until_end(url: str, model: str, seen: list[str]) -> tuple[str | None, Any]:
    """An OpenAI SDK streaming client: (the last finish_reason, the usage)."""
    api = openai.AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="unused")
    finish, usage = None, None
    stream = await api.completions.create(
        model=model,
        prompt="count with me " * 4,
        max_tokens=1900,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            seen.append(choice.text)
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    await api.close()
    return finish, usage


async def test_cancel_ends_the_stream_and_frees_the_slot(daemon: Any) -> None:
    client = ControlClient(daemon.socket_path)
    await client.connect()
    watcher = ControlClient(daemon.socket_path)
    await watcher.connect()
    try:
        await watcher.call("subscribe", {"interval_ms": 1000})
        seen: list[str] = []
        job = asyncio.create_task(stream_until_end(daemon.http_url, client.hello["model"], seen))
        request_id = await busy_request(client, job)
        reply = await client.call("request.cancel", {"request_id": request_id, "by": "a test"})
        assert reply["cancelled"] is True and reply["request_id"] == request_id
        assert reply["by"].startswith("a test (pid ")
        # Free when the reply comes: the engine aborted it between two steps.
        snap = await status(client)
        assert all(s.request_id != request_id for s in snap.engine.slots)
        assert snap.engine.kv.blocks_used == 0
        finish, usage = await asyncio.wait_for(job, 30)
        assert finish == "abort"
        assert usage is not None and 0 < usage.completion_tokens < 1900
        assert usage.prompt_tokens > 0
        cancelled = await next_control_event(watcher, "request_cancelled")
        assert cancelled["request_id"] == request_id and cancelled["by"] == reply["by"]
        # Once finished it is unknown: a second cancel is a clear error.
        with pytest.raises(ControlError, match="not_found"):
            await client.call("request.cancel", {"request_id": request_id})
    finally:
        await client.close()
        await watcher.close()


async def test_cancel_refuses_unknown_ids_and_bad_params(daemon: Any) -> None:
    client = ControlClient(daemon.socket_path)
    await client.connect()
    try:
        with pytest.raises(ControlError, match="not_found") as err:
            await client.call("request.cancel", {"request_id": "cmpl-nope"})
        assert "cmpl-nope" in err.value.message
        for params in ({}, {"request_id": ""}, {"request_id": 7}, {"request_id": "a", "by": 1}):
            with pytest.raises(ControlError, match="invalid_params"):
                await client.call("request.cancel", params)
        assert "request.cancel" in client.hello["methods"]
        assert (await status(client)).engine.slots  # still serving
    finally:
        await client.close()


async def test_cancel_a_queued_request(daemon: Any) -> None:
    client = ControlClient(daemon.socket_path)
    await client.connect()
    try:
        await client.call("config.set", {"parallel": 1})
        model = client.hello["model"]
        first = asyncio.create_task(stream_until_end(daemon.http_url, model, []))
        await busy_request(client, first)
        queued = asyncio.create_task(stream_until_end(daemon.http_url, model, []))

        async def queue() -> Any:
            assert not queued.done(), "the second request ended before it was queued"
            return (await status(client)).engine.queue

        waiting = (await async_wait_until(queue, 30, 0.05, what="a request queued"))[0].request_id
        await client.call("request.cancel", {"request_id": waiting})
        assert not (await status(client)).engine.queue  # gone when the reply comes
        finish, usage = await asyncio.wait_for(queued, 30)
        assert finish == "abort" and usage is not None and usage.completion_tokens == 0
        assert not first.done()  # the running one is untouched
        running = await busy_request(client, first)
        await client.call("request.cancel", {"request_id": running})
        assert (await asyncio.wait_for(first, 30))[0] == "abort"
    finally:
        await client.call("config.set", {"parallel": 2})
        await client.close()
