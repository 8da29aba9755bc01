"""Bad input over HTTP gets a clear OpenAI error and leaks nothing (docs/reliability.md).

One daemon with an API key, one slot, a queue of one and a small KV budget, so that auth,
the 503 flood answer and the KV never-fits refusal can all be provoked. A first table;
the reliability tests extend it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import async_wait_until, wait_idle_embedded
from embedded import EmbeddedDaemon, paths_under
from mlxcel.daemon.server.http_app import CLIENT_MAX_SIZE
from mlxcel.shared.config import build_config

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hi"}]
STATE_TIMEOUT_S = 60.0  # generous: a loaded CI machine is slow, a passing run is not


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    paths = paths_under(tmp_path_factory.mktemp("home"))
    cfg = build_config(
        {
            "model": str(tiny_model_dir),
            "port": 0,
            "api_key": KEY,
            "parallel": 1,
            "max_queue_depth": 1,
            "kv_cache_budget": "256KiB",  # 16 blocks of 32 tokens for this model
            "ctx_size": 1024,
        }
    )
    with EmbeddedDaemon(cfg, paths, paths.socket_path) as d:
        yield d


async def send(
    daemon: Any,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    hdrs = AUTH if headers is None else headers
    async with (
        aiohttp.ClientSession(daemon.http_url) as s,
        s.request(method, path, json=body, data=raw, headers=hdrs) as r,
    ):
        text = await r.text()
        try:
            payload: Any = await r.json(content_type=None)
        except ValueError:
            payload = text
        return r.status, dict(r.headers), payload


def call(daemon: Any, *args: Any, **kwargs: Any) -> tuple[int, dict[str, str], Any]:
    return asyncio.run(send(daemon, *args, **kwargs))


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 4, **fields}


BAD = [
    # (method, path, json body, raw body, status, error code)
    ("POST", "/v1/chat/completions", None, b"{not json", 400, "invalid_json"),
    ("POST", "/v1/chat/completions", None, b'{"messages": "\xff\xfe"}', 400, "invalid_json"),
    ("POST", "/v1/chat/completions", None, b"", 400, "invalid_json"),
    ("POST", "/v1/chat/completions", [1, 2], None, 400, "invalid_type"),
    ("POST", "/v1/chat/completions", {"messages": []}, None, 400, "invalid_type"),
    ("POST", "/v1/chat/completions", chat(max_tokens=-5), None, 400, "invalid_value"),
    ("POST", "/v1/chat/completions", chat(max_tokens=10**9), None, 400, "context_length_exceeded"),
    ("POST", "/v1/chat/completions", chat(temperature="x"), None, 400, "invalid_type"),
    ("POST", "/v1/chat/completions", chat(n=3), None, 400, "unsupported_value"),
    ("POST", "/v1/chat/completions", chat(tool_choice="required"), None, 400, "invalid_value"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, None, 400, "invalid_value"),
    (
        "POST",
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
        None,
        400,
        "invalid_value",
    ),
    ("POST", "/v1/chat/completions", chat(model="gpt-4o"), None, 404, "model_not_found"),
    ("POST", "/v1/chat/completions", chat(logit_bias={"99999": 1}), None, 400, "invalid_value"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 1200}]},
        None,
        400,
        "context_length_exceeded",
    ),
    ("POST", "/v1/completions", {"prompt": [5, 100000]}, None, 400, "invalid_value"),
    ("POST", "/v1/completions", {"prompt": ""}, None, 400, "invalid_value"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 600}, None, 400, "kv_never_fits"),
    ("GET", "/v1/chat/completions", None, None, 405, "method_not_allowed"),
    ("GET", "/v1/nothing", None, None, 404, "not_found"),
]


@pytest.mark.parametrize(("method", "path", "body", "raw", "status", "code"), BAD)
def test_bad_requests_get_the_openai_error_envelope(
    daemon: Any, method: str, path: str, body: Any, raw: bytes | None, status: int, code: str
) -> None:
    got, _, payload = call(daemon, method, path, body=body, raw=raw)
    assert got == status, payload
    err = payload["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    assert err["type"] in ("invalid_request_error", "not_found_error")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": [5] * 1100, "max_tokens": 4}, "= 1104 exceeds the context per slot (1024"),
        ({"prompt": [5, 100000]}, "prompt token ids must be in [0, "),
    ],
)
def test_the_limits_are_the_engines_admission_check(daemon: Any, body: Any, words: str) -> None:
    """HTTP parses shapes; the context and the vocabulary are checked once, by the engine's
    admission (daemon/engine/admission.py), whose words reach the client."""
    status, _, payload = call(daemon, "POST", "/v1/completions", body=body)
    assert status == 400 and words in payload["error"]["message"], payload


def test_an_oversized_body_gets_413(daemon: Any) -> None:
    raw = b'{"prompt": "' + b"a" * (CLIENT_MAX_SIZE + 10) + b'"}'
    status, _, payload = call(daemon, "POST", "/v1/completions", raw=raw)
    assert status == 413 and payload["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}],
)
def test_a_missing_or_wrong_key_gets_401(daemon: Any, headers: dict[str, str]) -> None:
    for path in ("/v1/models", "/metrics", "/slots"):
        status, _, payload = call(daemon, "GET", path, headers=headers)
        assert status == 401 and payload["error"]["code"] == "invalid_api_key"


def test_health_needs_no_key(daemon: Any) -> None:
    assert call(daemon, "GET", "/health", headers={})[:3:2] == (200, {"status": "ok"})


def test_a_flood_beyond_the_queue_gets_503_with_retry_after(daemon: Any) -> None:
    async def main() -> list[tuple[int, str | None]]:
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession(daemon.http_url, headers=AUTH) as s:
            running = await s.post("/v1/completions", json=body)  # takes the one slot
            await running.content.readline()
            waiting = await s.post("/v1/completions", json=body)  # fills the queue of one
            await wait_for_state(lambda snap: len(snap.queue) == 1, "one request queued")
            results = []
            for _ in range(3):
                async with s.post("/v1/completions", json={**body, "stream": False}) as r:
                    payload = await r.json()
                    results.append((r.status, r.headers.get("Retry-After")))
                    assert payload["error"]["code"] == "queue_full"
            running.close()
            waiting.close()
            return results

    async def wait_for_state(ready: Any, what: str) -> Any:
        """The engine snapshot (republished after each step) once `ready(snap)`."""

        def reached() -> Any:
            snap = daemon.daemon.bridge.snapshot()
            return snap if ready(snap) else None

        return await async_wait_until(reached, STATE_TIMEOUT_S, 0.02, what=what)

    assert asyncio.run(main()) == [(503, "1")] * 3
    snap = asyncio.run(
        wait_for_state(
            lambda s: s.counters.rejections_by_reason.get("queue_full", 0) >= 3,
            "three queue_full rejections counted",
        )
    )
    assert snap.counters.rejections_by_reason.get("queue_full", 0) == 3


def test_unknown_fields_are_ignored_and_named_in_a_header(daemon: Any) -> None:
    wait_idle_embedded(daemon, STATE_TIMEOUT_S)  # the flood test's aborted requests leave
    status, headers, payload = call(
        daemon, "POST", "/v1/chat/completions", body=chat(bogus=1, typical_p=0.9)
    )
    assert status == 200 and payload["choices"][0]["message"]["role"] == "assistant"
    assert headers["X-Mlxcel-Ignored-Fields"] == "bogus, typical_p"


def test_bad_input_leaks_no_slot_or_kv(daemon: Any) -> None:
    snap = wait_idle_embedded(daemon, STATE_TIMEOUT_S)
    assert snap.kv.blocks_used == 0
    status, _, payload = call(daemon, "POST", "/v1/chat/completions", body=chat(ignore_eos=True))
    assert status == 200 and payload["usage"]["completion_tokens"] == 4
