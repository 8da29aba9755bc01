"""Hostile HTTP against a real daemon subprocess (docs/reliability.md): over a hundred bad requests,
each answered with the right 4xx in the OpenAI envelope; odd-but-valid requests served; the
daemon's memory flat across rounds of it, and still serving afterwards.

The daemon runs with an API key, `--strict-api` (unknown fields refused), 512 tokens of
context per slot and a 12-block (384-token) KV budget, so that context and KV refusals can
both be provoked with the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import json_strategies
import pytest
from daemon_helpers import RunningDaemon, rss_bytes, running_daemon, wait_idle
from hostile_http_cases import (
    AUTH,
    CHAT,
    COMP,
    JSON,
    KEY,
    SURVIVORS,
    UNAUTHENTICATED,
    Case,
    all_cases,
    chat,
    comp,
    enc,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

RSS_TOLERANCE = 16 * 1024 * 1024  # over 3 rounds of ~200 requests, 18 MiB of them bodies


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("hostile-http")
    flags = ("--parallel", "4", "--ctx-size", "2048", "--kv-cache-budget", "192KiB")
    with running_daemon(home, tiny_model_dir, *flags, "--api-key", KEY, "--strict-api") as d:
        yield d


async def send(session: aiohttp.ClientSession, url: str, case: Case) -> tuple[int, str, Any]:
    headers = dict(case.headers)
    if case.name not in UNAUTHENTICATED:
        headers.update(AUTH)
    data = case.body if case.method != "GET" else None
    async with session.request(case.method, url + case.path, data=data, headers=headers) as r:
        raw = await r.read()
        ctype = r.headers.get("Content-Type", "")
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = raw[:200]
    return r.status, ctype, payload


async def post_ok(session: aiohttp.ClientSession, url: str, path: str, body: Any) -> None:
    async with session.post(url + path, data=enc(body), headers={**JSON, **AUTH}) as r:
        raw = await r.read()
        assert r.status == 200, (body, raw[:300])


def envelope_ok(case: Case, payload: Any) -> bool:
    """The error is in the envelope of the case's dialect, with a message (and OpenAI's code)."""
    if not isinstance(payload, dict):
        return False
    err = payload.get("error")
    if case.dialect == "ollama":
        return isinstance(err, str) and bool(err)
    if case.dialect == "anthropic":
        return payload.get("type") == "error" and isinstance(err, dict) and bool(err.get("message"))
    return (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and bool(err["message"])
        and isinstance(err.get("type"), str)
        and err.get("code") == case.code
    )


async def run_round(url: str, answers: dict[str, str] | None = None) -> list[str]:
    """Every bad case, then every survivor; returns the mismatches (and fills `answers`)."""
    problems = []
    async with aiohttp.ClientSession() as session:
        for case in all_cases():
            status, ctype, payload = await send(session, url, case)
            ok = (
                status == case.status
                and ctype.startswith("application/json")
                and envelope_ok(case, payload)
            )
            if not ok:
                problems.append(f"{case.name}: {status} {payload}")
            if answers is not None:
                answers[case.name] = json.dumps(payload, sort_keys=True)
        for path, body in SURVIVORS:
            await post_ok(session, url, path, body)
    return problems


def test_over_a_hundred_bad_requests_get_as_many_distinct_answers(daemon: RunningDaemon) -> None:
    """The daemon tells the cases apart: each refusal says what was wrong with that request,
    not one generic error for all (the table alone could not show this)."""
    answers: dict[str, str] = {}
    assert asyncio.run(run_round(daemon.http_url, answers)) == []
    assert len(answers) == len(all_cases()) >= 100
    distinct = set(answers.values())
    assert len(distinct) >= 100, f"only {len(distinct)} distinct answers to {len(answers)} cases"


def test_bad_requests_get_the_right_4xx_and_memory_stays_flat(daemon: RunningDaemon) -> None:
    url = daemon.http_url
    for _ in range(2):  # the warm-up rounds settle the allocator and the caches
        problems = asyncio.run(run_round(url))
        assert problems == [], "\n".join(problems)
    wait_idle(daemon)
    baseline = rss_bytes(daemon.pid)
    rss = []
    for _ in range(3):
        assert asyncio.run(run_round(url)) == []
        rss.append(rss_bytes(daemon.pid))
    print(f"rss baseline {baseline / 2**20:.1f} MiB, rounds {[round(r / 2**20, 1) for r in rss]}")
    assert max(rss) - baseline < RSS_TOLERANCE, (baseline, rss)
    engine = daemon.status()["engine"]
    assert engine["kv"]["blocks_used"] == 0
    assert all(s["state"] == "idle" for s in engine["slots"]) and engine["queue"] == []


def test_the_daemon_still_serves_and_logged_no_crash(daemon: RunningDaemon) -> None:
    async def main() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            body = chat(max_tokens=4, ignore_eos=True, temperature=1.0)
            async with s.post(daemon.http_url + CHAT, json=body, headers=AUTH) as r:
                assert r.status == 200
                return await r.json()

    assert asyncio.run(main())["usage"]["completion_tokens"] == 4
    log = daemon.log_text()
    assert "Traceback" not in log and "engine step failed" not in log, log[-3000:]


def test_garbage_on_the_http_port_is_refused_and_harmless(daemon: RunningDaemon) -> None:
    host, port = daemon.http_url.removeprefix("http://").rsplit(":", 1)
    lines = [
        b"GARBAGE\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS ClientHello
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ]
    for line in lines:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(line)
            reply = sock.recv(4096)
        assert reply == b"" or re.match(rb"HTTP/1\.[01] 4\d\d ", reply), reply[:100]
    assert daemon.alive()
    asyncio.run(post_ok_session(daemon.http_url))


async def post_ok_session(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await post_ok(session, url, COMP, comp())


# --- fuzzed bodies against the live daemon ------------------------------------------------

json_values = json_strategies.json_values(
    finite=True, max_int=2**70, max_text=20, max_items=4, max_leaves=12
)
FUZZ_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "logit_bias",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from([CHAT, COMP]),
    fields=st.dictionaries(st.sampled_from(FUZZ_FIELDS), json_values, max_size=4),
)
def test_fuzzed_fields_get_a_200_or_a_4xx_never_a_5xx(
    daemon: RunningDaemon, path: str, fields: dict[str, Any]
) -> None:
    body = chat() if path == CHAT else comp()
    body.update(fields)
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 8:
        body["max_tokens"] = 2  # a valid body must stay cheap to serve

    async def main() -> tuple[int, str, Any]:
        async with aiohttp.ClientSession() as session:
            case = Case("fuzz", path, enc(body), 0, "")
            return await asyncio.wait_for(send(session, daemon.http_url, case), 60)

    status, ctype, payload = asyncio.run(main())
    assert status == 200 or 400 <= status < 500, (body, status, payload)
    if status != 200:
        assert ctype.startswith("application/json")
        assert set(payload["error"]) >= {"message", "type", "code"}


schema_values = st.recursive(
    st.one_of(
        st.sampled_from(["string", "integer", "boolean", "object", "array", "null", "number"]),
        st.integers(-3, 3),
        st.booleans(),
        st.text(max_size=6),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.sampled_from(
                ["type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf",
                 "minItems", "maxLength", "pattern", "$ref", "additionalProperties", "a", "b"]
            ),
            children,
            max_size=4,
        ),
    ),
    max_leaves=16,
)  # fmt: skip


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=schema_values, forced=st.booleans())
def test_fuzzed_schemas_get_a_200_or_a_400_never_a_5xx(
    daemon: RunningDaemon, schema: Any, forced: bool
) -> None:
    """Random JSON schemas, as a response_format or as a forced tool's parameters, through
    the validator and the engine's grammar compiler: served or refused, never a 5xx."""
    if forced:
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        body = chat(tools=[tool], tool_choice="required", max_tokens=8)
    else:
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        body = chat(response_format=fmt, max_tokens=8)

    async def main() -> tuple[int, str, Any]:
        async with aiohttp.ClientSession() as session:
            case = Case("fuzz schema", CHAT, enc(body), 0, "")
            return await asyncio.wait_for(send(session, daemon.http_url, case), 60)

    status, _, payload = asyncio.run(main())
    assert status in (200, 400), (schema, status, payload)
