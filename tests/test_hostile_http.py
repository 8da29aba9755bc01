"""Hostile HTTP against a real daemon subprocess (SPEC §4, §9): over a hundred bad requests,
each answered with the right 4xx in the OpenAI envelope; odd-but-valid requests served; the
daemon's memory flat across rounds of it, and still serving afterwards.

The daemon runs with an API key, 512 tokens of context per slot and a 12-block (384-token) KV
budget, so that context and KV refusals can both be provoked with the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from daemon_helpers import RunningDaemon, rss_bytes, running_daemon, wait_idle

KEY = "hostile-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
VOCAB = 323  # the tiny model's vocabulary
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BIG_BODY = 9 * 1024 * 1024  # over the 8 MiB limit
RSS_TOLERANCE = 16 * 1024 * 1024  # over 3 rounds of ~200 requests, 18 MiB of them bodies


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("hostile-http")
    flags = ("--parallel", "4", "--ctx-size", "2048", "--kv-cache-budget", "192KiB")
    with running_daemon(home, tiny_model_dir, *flags, "--api-key", KEY) as d:
        yield d


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    status: int
    code: str
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    method: str = "POST"


def enc(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 2, **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def both(name: str, fields: dict[str, Any], status: int, code: str) -> list[Case]:
    """The same bad field on both generation endpoints."""
    return [
        Case(f"chat {name}", CHAT, enc(chat(**fields)), status, code),
        Case(f"completion {name}", COMP, enc(comp(**fields)), status, code),
    ]


def malformed_cases() -> list[Case]:
    bodies = {
        "empty body": b"",
        "open brace": b"{",
        "single quotes": b"{'messages': []}",
        "bad array": b'{"messages": [}',
        "bare word": b"nul",
        "trailing garbage": enc(chat()) + b" x",
        "deep nesting": b"[" * 100_000,
        "non-UTF-8 bytes": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        "UTF-16 body": json.dumps(chat()).encode("utf-16"),
        "lone surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "NUL byte": b'{"messages": \x00}',
        "integer of 5000 digits": b'{"messages": [], "max_tokens": ' + b"7" * 5000 + b"}",
    }
    cases = [Case(f"chat {n}", CHAT, b, 400, "invalid_json") for n, b in bodies.items()]
    cases.append(
        Case("completion lone surrogate", COMP, b'{"prompt": "\\udfff"}', 400, "invalid_json")
    )
    cases.append(Case("completion non-UTF-8", COMP, b'{"prompt": "\xc3\x28"}', 400, "invalid_json"))
    for name, value in {"list": [], "string": "x", "number": 1, "null": None, "true": True}.items():
        cases.append(Case(f"chat body {name}", CHAT, enc(value), 400, "invalid_type"))
        cases.append(Case(f"completion body {name}", COMP, enc(value), 400, "invalid_type"))
    return cases


def message_cases() -> list[Case]:
    bad = {
        "missing messages": {"max_tokens": 2},
        "null messages": {"messages": None},
        "empty messages": {"messages": []},
        "messages a string": {"messages": "hi"},
        "messages an object": {"messages": {"role": "user"}},
        "message a number": {"messages": [1]},
        "message a list": {"messages": [["user", "hi"]]},
        "content a number": {"messages": [{"role": "user", "content": 5}]},
        "content an object": {"messages": [{"role": "user", "content": {"text": "hi"}}]},
        "text part without text": {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "text part number": {
            "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]
        },
    }
    cases = [
        Case(n, CHAT, enc({"max_tokens": 2, **b}), 400, "invalid_type") for n, b in bad.items()
    ]
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    values = {
        "missing role": {"messages": [{"content": "hi"}]},
        "unknown role": {"messages": [{"role": "robot", "content": "hi"}]},
        "role a number": {"messages": [{"role": 1, "content": "hi"}]},
        "role a list": {"messages": [{"role": ["user"], "content": "hi"}]},
        "role an object": {"messages": [{"role": {"user": 1}, "content": "hi"}]},
        "image part": {"messages": [{"role": "user", "content": image}]},
        "part a string": {"messages": [{"role": "user", "content": ["hi"]}]},
        "unknown message field": {"messages": [{"role": "user", "content": "hi", "x": 1}]},
        "tool calls in a message": {
            "messages": [{"role": "assistant", "content": "", "tool_calls": []}]
        },
    }
    cases += [
        Case(n, CHAT, enc({"max_tokens": 2, **b}), 400, "invalid_value") for n, b in values.items()
    ]
    return cases


def option_cases() -> list[Case]:
    cases: list[Case] = []
    typed = {
        "max_tokens string": {"max_tokens": "10"},
        "max_tokens float": {"max_tokens": 1.5},
        "max_tokens bool": {"max_tokens": True},
        "temperature string": {"temperature": "hot"},
        "temperature list": {"temperature": [1]},
        "temperature bool": {"temperature": False},
        "top_p string": {"top_p": "x"},
        "top_k float": {"top_k": 1.5},
        "top_k string": {"top_k": "5"},
        "min_p string": {"min_p": "none"},
        "seed string": {"seed": "abc"},
        "seed float": {"seed": 1.5},
        "stop number": {"stop": 5},
        "stop list of numbers": {"stop": [1, 2]},
        "stop object": {"stop": {"a": 1}},
        "logit_bias list": {"logit_bias": [1, 2]},
        "logit_bias string": {"logit_bias": "x"},
        "stream string": {"stream": "yes"},
        "stream number": {"stream": 1},
        "stream_options string": {"stream_options": "x"},
        "include_usage string": {"stream": True, "stream_options": {"include_usage": "yes"}},
        "ignore_eos string": {"ignore_eos": "true"},
        "model number": {"model": 5},
    }
    for name, fields in typed.items():
        cases += both(name, fields, 400, "invalid_type")
    ranged = {
        "max_tokens -1": {"max_tokens": -1},
        "max_tokens 0": {"max_tokens": 0},
        "temperature -0.1": {"temperature": -0.1},
        "temperature 2.5": {"temperature": 2.5},
        "temperature inf": {"temperature": 1e309},
        "top_p -0.5": {"top_p": -0.5},
        "top_p 1.5": {"top_p": 1.5},
        "top_k -2": {"top_k": -2},
        "min_p 2": {"min_p": 2},
        "seed 2**70": {"seed": 2**70},
        "five stops": {"stop": ["a", "b", "c", "d", "e"]},
        "empty stop": {"stop": [""]},
        "stop 300 chars": {"stop": "x" * 300},
        "logit_bias word key": {"logit_bias": {"abc": 1}},
        "logit_bias negative id": {"logit_bias": {"-1": 1}},
        "logit_bias 101": {"logit_bias": {"1": 101}},
        "logit_bias string value": {"logit_bias": {"1": "high"}},
        "logit_bias bool value": {"logit_bias": {"1": True}},
        "logit_bias id out of vocab": {"logit_bias": {str(VOCAB): 5}},
        "logit_bias huge id": {"logit_bias": {str(10**30): 5}},
        "logit_bias 301 entries": {"logit_bias": {str(i): 1 for i in range(301)}},
        "unknown stream_options": {"stream": True, "stream_options": {"foo": True}},
    }
    for name, fields in ranged.items():
        cases += both(name, fields, 400, "invalid_value")
    unsupported = {
        "n 2": {"n": 2},
        "logprobs": {"logprobs": True},
        "frequency_penalty": {"frequency_penalty": 0.5},
        "presence_penalty": {"presence_penalty": 1},
        "json response_format": {"response_format": {"type": "json_object"}},
        "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    }
    for name, fields in unsupported.items():
        cases += both(name, fields, 400, "unsupported_value")
    for name, fields in {"best_of 2": {"best_of": 2}, "echo": {"echo": True}}.items():
        cases.append(
            Case(f"completion {name}", COMP, enc(comp(**fields)), 400, "unsupported_value")
        )
    cases += both("unknown field", {"foo": 1}, 400, "unknown_field")
    cases += both("functions (legacy)", {"functions": [{"name": "f"}]}, 400, "unknown_field")
    cases.append(Case("chat with a prompt", CHAT, enc(chat(prompt="x")), 400, "unknown_field"))
    cases.append(
        Case("completion with messages", COMP, enc(comp(messages=MSG)), 400, "unknown_field")
    )
    cases += both("unknown model", {"model": "gpt-4o"}, 404, "model_not_found")
    return cases


def prompt_cases() -> list[Case]:
    bad_types = {
        "missing prompt": {"max_tokens": 2},
        "null prompt": {"prompt": None},
        "empty list": {"prompt": []},
        "object": {"prompt": {"a": 1}},
        "number": {"prompt": 5},
        "float ids": {"prompt": [1.5, 2]},
        "bool ids": {"prompt": [True, False]},
        "mixed ids": {"prompt": [1, "a"]},
    }
    cases = [
        Case(f"prompt {n}", COMP, enc({"max_tokens": 2, **b}), 400, "invalid_type")
        for n, b in bad_types.items()
    ]
    values = {
        "empty string": {"prompt": ""},
        "negative id": {"prompt": [1, -1]},
        "id = vocab": {"prompt": [1, VOCAB]},
        "huge id": {"prompt": [10**12]},
        "over the context (ids)": {"prompt": [5] * 600},
    }
    codes = {"over the context (ids)": "context_length_exceeded"}
    cases += [
        Case(f"prompt {n}", COMP, enc({"max_tokens": 2, **b}), 400, codes.get(n, "invalid_value"))
        for n, b in values.items()
    ]
    cases.append(
        Case("several prompts", COMP, enc(comp(prompt=["a", "b"])), 400, "unsupported_value")
    )
    long_chat = {"messages": [{"role": "user", "content": "word " * 1200}], "max_tokens": 2}
    cases += [
        Case("chat over the context", CHAT, enc(long_chat), 400, "context_length_exceeded"),
        Case(
            "text over the context",
            COMP,
            enc(comp(prompt="word " * 1200)),
            400,
            "context_length_exceeded",
        ),
        Case(
            "prompt + max_tokens over the context",
            COMP,
            enc(comp(max_tokens=600)),
            400,
            "context_length_exceeded",
        ),
        Case(
            "max_tokens 10**30", COMP, enc(comp(max_tokens=10**30)), 400, "context_length_exceeded"
        ),
        # 400 prompt tokens fit the 512 context but need 13 of the 12 KV blocks.
        Case("prompt over the KV budget", COMP, enc(comp(prompt=[5] * 400)), 400, "kv_never_fits"),
        Case(
            "max_tokens over the KV budget", COMP, enc(comp(max_tokens=400)), 400, "kv_never_fits"
        ),
    ]
    return cases


def transport_cases() -> list[Case]:
    big = b'{"prompt": "' + b"a" * BIG_BODY + b'"}'
    cases = [
        Case("oversized body", COMP, big, 413, "request_too_large"),
        Case("oversized chat body", CHAT, big, 413, "request_too_large"),
    ]
    for ctype in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ):
        cases.append(
            Case(
                f"content type {ctype}",
                CHAT,
                enc(chat()),
                415,
                "unsupported_media_type",
                (("Content-Type", ctype),),
            )
        )
    cases.append(Case("GET on a POST route", CHAT, b"", 405, "method_not_allowed", (), "GET"))
    cases.append(
        Case("PUT on a POST route", COMP, enc(comp()), 405, "method_not_allowed", JSON_ITEMS, "PUT")
    )
    cases.append(Case("unknown route", "/v1/nothing", enc(comp()), 404, "not_found"))
    cases.append(Case("unknown GET route", "/v2/models", b"", 404, "not_found", (), "GET"))
    return cases


JSON_ITEMS = tuple(JSON.items())


def auth_cases() -> list[Case]:
    """Sent without the good key (the table adds it to every other case)."""
    wrong = {
        "no key": (),
        "wrong key": (("Authorization", "Bearer nope"),),
        "key without scheme": (("Authorization", KEY),),
        "basic scheme": (("Authorization", f"Basic {KEY}"),),
        "empty bearer": (("Authorization", "Bearer "),),
        "key prefix": (("Authorization", f"Bearer {KEY[:-1]}"),),
        "key with a suffix": (("Authorization", f"Bearer {KEY}x"),),
    }
    cases = []
    for name, hdrs in wrong.items():
        cases.append(
            Case(f"chat {name}", CHAT, enc(chat()), 401, "invalid_api_key", (*JSON_ITEMS, *hdrs))
        )
    for path in ("/v1/models", "/slots", "/metrics", "/v1/cache/stats"):
        cases.append(Case(f"GET {path} with no key", path, b"", 401, "invalid_api_key", (), "GET"))
    cases.append(
        Case(
            "cache reset with a wrong key",
            "/v1/cache/reset",
            b"",
            401,
            "invalid_api_key",
            (("Authorization", "Bearer x"),),
        )
    )
    return cases


def all_cases() -> list[Case]:
    return [
        *malformed_cases(),
        *message_cases(),
        *option_cases(),
        *prompt_cases(),
        *transport_cases(),
        *auth_cases(),
    ]


UNAUTHENTICATED = {c.name for c in auth_cases()}


# Odd but valid: each must be served (200), never a 5xx, and must not harm later requests.
SURVIVORS = [
    (COMP, comp(top_k=10**30, temperature=1.0)),
    (COMP, comp(top_k=VOCAB, temperature=1.0)),
    (COMP, comp(top_k=VOCAB - 1, temperature=1.0, seed=3)),
    (CHAT, chat(top_k=5000, seed=2**64 - 1, temperature=0.7)),
    (COMP, comp(top_p=0.0)),
    (COMP, comp(min_p=1.0)),
    (COMP, comp(temperature=1e-300)),
    (COMP, comp(seed=-(2**63))),
    (COMP, comp(logit_bias={"0": -100, "1": 100})),
    (COMP, comp(stop=["\u0000", "é", "🙂"])),
    (CHAT, {"messages": [{"role": "user", "content": "🙂 \ud83d\ude00 ünïcödé"}], "max_tokens": 2}),
    (CHAT, {"messages": [{"role": "assistant", "content": None}], "max_tokens": 2}),
    (CHAT, chat(user="u", metadata={"a": "b"}, n=1, logprobs=False, stream=True)),
    (COMP, comp(prompt=[0, VOCAB - 1], max_tokens=2)),
    (COMP, comp(prompt=[5] * 300, max_tokens=2)),
]


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


async def run_round(url: str) -> list[str]:
    """Every bad case, then every survivor; returns the mismatches."""
    problems = []
    async with aiohttp.ClientSession() as session:
        for case in all_cases():
            status, ctype, payload = await send(session, url, case)
            err = payload.get("error") if isinstance(payload, dict) else None
            ok = (
                status == case.status
                and ctype.startswith("application/json")
                and isinstance(err, dict)
                and isinstance(err.get("message"), str)
                and err["message"]
                and isinstance(err.get("type"), str)
                and err.get("code") == case.code
            )
            if not ok:
                problems.append(f"{case.name}: {status} {payload}")
        for path, body in SURVIVORS:
            await post_ok(session, url, path, body)
    return problems


def test_the_table_has_over_a_hundred_distinct_cases() -> None:
    names = [c.name for c in all_cases()]
    assert len(names) == len(set(names)) and len(names) >= 100, len(names)


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

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
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
