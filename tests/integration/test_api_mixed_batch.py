"""Eight concurrent requests mixing free text, JSON-schema, forced-tool and logprobs rows:
the daemon batches them together (the control snapshot shows 8 busy slots), every
constrained output parses and matches its schema, and the free rows are token-identical to a
run without the constrained ones. Real daemon, tiny model with a tool-capable template.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import jsonschema
import pytest
from daemon_helpers import control, embedded_daemon
from tool_model import make_tool_model

FLAGS_SCHEMA = {
    "type": "object",
    "properties": {
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 16, "maxItems": 16}
    },
    "required": ["flags"],
    "additionalProperties": False,
}
PLAN_PARAMS = {
    "type": "object",
    "properties": {
        "days": {
            "type": "array",
            "items": {"enum": ["sun", "rain", "snow"]},
            "minItems": 12,
            "maxItems": 12,
        }
    },
    "required": ["days"],
    "additionalProperties": False,
}
PLAN_TOOL = {"type": "function", "function": {"name": "plan", "parameters": PLAN_PARAMS}}


def free(i: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"Tell me a story about number {i}."}],
        "max_tokens": 160,
        "temperature": 0,
        "ignore_eos": True,
    }


def with_logprobs(i: int) -> dict[str, Any]:
    return {**free(10 + i), "logprobs": True, "top_logprobs": 5}


def schema_row(i: int) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "flags", "schema": FLAGS_SCHEMA}}
    return {**free(20 + i), "ignore_eos": False, "max_tokens": 400, "response_format": fmt}


def tool_row(i: int) -> dict[str, Any]:
    return {
        **free(30 + i),
        "ignore_eos": False,
        "max_tokens": 400,
        "tools": [PLAN_TOOL],
        "tool_choice": "required",
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tool_model(tmp_path_factory.mktemp("toolmodel") / "llama")
    config = {"parallel": 8, "max_batch_prefill": 8, "prefill_chunk_size": 64}
    with embedded_daemon(tmp_path_factory, model, **config) as d:
        yield d


async def post_all(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        return await asyncio.gather(*(one(b) for b in bodies))


class BusyWatcher(threading.Thread):
    """Polls the control socket's status snapshot; keeps the most busy slots seen."""

    def __init__(self, socket_path: Any) -> None:
        super().__init__(daemon=True)
        self.socket_path = socket_path
        self.most_busy = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            slots = control(self.socket_path, "status")["result"]["engine"]["slots"]
            busy = sum(1 for s in slots if s["state"] != "idle")
            self.most_busy = max(self.most_busy, busy)
            time.sleep(0.005)


def test_eight_mixed_rows_batch_together_and_constrained_rows_parse(daemon: Any) -> None:
    url = daemon.http_url
    free_bodies = [free(0), free(1), with_logprobs(0), with_logprobs(1)]
    alone = asyncio.run(post_all(url, free_bodies))

    watcher = BusyWatcher(daemon.daemon.socket_path)
    watcher.start()
    mixed_bodies = [*free_bodies, schema_row(0), schema_row(1), tool_row(0), tool_row(1)]
    try:
        mixed = asyncio.run(post_all(url, mixed_bodies))
    finally:
        watcher.stop.set()
        watcher.join(10)
    assert watcher.most_busy == 8

    texts = [r["choices"][0]["message"]["content"] for r in mixed[:4]]
    assert texts == [r["choices"][0]["message"]["content"] for r in alone]
    for a, m in zip(alone[2:4], mixed[2:4], strict=True):  # token by token, bytes included
        tokens = [(t["token"], t["bytes"]) for t in m["choices"][0]["logprobs"]["content"]]
        assert tokens == [(t["token"], t["bytes"]) for t in a["choices"][0]["logprobs"]["content"]]
    for r in mixed[2:4]:  # logprobs rows: one entry per token, five alternatives each
        content = r["choices"][0]["logprobs"]["content"]
        assert len(content) == r["usage"]["completion_tokens"] == 160
        assert all(len(item["top_logprobs"]) == 5 for item in content)
    for r in mixed[4:6]:
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), FLAGS_SCHEMA)
    for r in mixed[6:8]:
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "plan"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PLAN_PARAMS)
