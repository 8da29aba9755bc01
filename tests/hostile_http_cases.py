"""The hostile HTTP table for tests/e2e/test_hostile_http.py: over a hundred bad requests, each
with the status and OpenAI error code it must get, and odd-but-valid requests that must be
served. Data only; the tiny model and the daemon flags of that test (`--strict-api`, so
unknown fields are refused) are assumed. Anthropic and Ollama cases carry their dialect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxcel.daemon.models.tiny import NUM_MERGES, SPECIAL_TOKENS

KEY = "hostile-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
VOCAB = 256 + NUM_MERGES + len(SPECIAL_TOKENS)  # the tiny model's: bytes, merges, specials
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BIG_BODY = 9 * 1024 * 1024  # over the 8 MiB limit


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    status: int
    code: str
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    method: str = "POST"
    dialect: str = "openai"  # openai | anthropic | ollama: which error envelope


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
        "part a string": {"messages": [{"role": "user", "content": ["hi"]}]},
        "refusal a number": {"messages": [{"role": "assistant", "refusal": 5}]},
        "name a number": {"messages": [{"role": "user", "content": "x", "name": 5}]},
        "tool_calls an object": {"messages": [{"role": "assistant", "tool_calls": {"a": 1}}]},
        "tool call without a function": {
            "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]
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
        "user without content": {"messages": [{"role": "user"}]},
        "system with null content": {"messages": [{"role": "system", "content": None}]},
        "tool message without tool_call_id": {"messages": [{"role": "tool", "content": "r"}]},
        "tool call arguments not JSON": {
            "messages": [
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
            ]
        },
    }
    cases += [
        Case(n, CHAT, enc({"max_tokens": 2, **b}), 400, "invalid_value") for n, b in values.items()
    ]
    unknown = {"messages": [{"role": "user", "content": "hi", "x": 1}]}
    cases.append(Case("unknown message field", CHAT, enc(unknown), 400, "unknown_field"))
    cases.append(
        Case("image part", CHAT, enc(chat(messages=[{"role": "user", "content": image}])), 400,
             "unsupported_value")
    )  # fmt: skip
    return cases


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def fn(name: str = "f", **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **extra}}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


HUGE_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string", "description": "x" * 60} for i in range(1200)},
}


def tool_cases() -> list[Case]:
    """Bad tools, tool_choice, response_format and schemas: 400 naming the field (chat)."""
    typed = {
        "tools an object": {"tools": {"f": {}}},
        "tool a string": {"tools": ["f"]},
        "tool without function": {"tools": [{"type": "function"}]},
        "tool of another type": {"tools": [{"type": "retrieval"}]},
        "response_format a string": {"response_format": "json"},
        "json_schema without spec": {"response_format": {"type": "json_schema"}},
        "schema a list": {"response_format": schema_format([1])},
        "tool parameters a string": {"tools": [fn(parameters="object")]},
        "strict a string": {"tools": [fn(strict="yes")]},
        "parallel_tool_calls a string": {"parallel_tool_calls": "yes", "tools": [fn()]},
        "logprobs a string": {"logprobs": "yes"},
        "presence_penalty a string": {"presence_penalty": "x"},
    }
    cases = [Case(f"chat {n}", CHAT, enc(chat(**b)), 400, "invalid_type") for n, b in typed.items()]
    valued = {
        "tool without name": {"tools": [fn(name="")]},
        "tool name with spaces": {"tools": [fn(name="get weather")]},
        "tool name of 65 chars": {"tools": [fn(name="x" * 65)]},
        "duplicate tool names": {"tools": [fn(), fn()]},
        "129 tools": {"tools": [fn(f"f{i}") for i in range(129)]},
        "tool parameters not a schema": {"tools": [fn(parameters={"type": "banana"})]},
        "tool parameters huge": {"tools": [fn(parameters=HUGE_SCHEMA)]},
        "tool parameters 40 deep": {"tools": [fn(parameters=_nested_schema(40))]},
        "tool_choice unknown word": {"tool_choice": "sometimes", "tools": [fn()]},
        "tool_choice a number": {"tool_choice": 1, "tools": [fn()]},
        "tool_choice unknown function": {
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "tools": [fn()],
        },
        "tool_choice without a name": {
            "tool_choice": {"type": "function", "function": {}},
            "tools": [fn()],
        },
        "tool_choice required without tools": {"tool_choice": "required"},
        "forced tool with response_format": {
            "tool_choice": "required",
            "tools": [fn()],
            "response_format": {"type": "json_object"},
        },
        "response_format type xml": {"response_format": {"type": "xml"}},
        "schema type 5": {"response_format": schema_format({"type": 5})},
        "schema required a string": {"response_format": schema_format({"required": "a"})},
        "schema huge": {"response_format": schema_format(HUGE_SCHEMA)},
        "schema 40 deep": {"response_format": schema_format(_nested_schema(40))},
        "schema name with spaces": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}
        },
        "top_logprobs 21": {"logprobs": True, "top_logprobs": 21},
        "top_logprobs without logprobs": {"top_logprobs": 2},
        "frequency_penalty 2.5": {"frequency_penalty": 2.5},
        "presence_penalty -3": {"presence_penalty": -3},
        "repetition_penalty 0": {"repetition_penalty": 0},
        "repetition_penalty -1": {"repetition_penalty": -1},
    }
    cases += [
        Case(f"chat {n}", CHAT, enc(chat(**b)), 400, "invalid_value") for n, b in valued.items()
    ]
    cases.append(Case("completion logprobs 21", COMP, enc(comp(logprobs=21)), 400, "invalid_value"))
    return cases


ANTHROPIC = "/v1/messages"
OLLAMA = "/api/chat"


def dialect_cases() -> list[Case]:
    """Bad Anthropic and Ollama bodies: a 4xx in that dialect's error envelope."""
    user = [{"role": "user", "content": "hi"}]
    anthropic = {
        "no max_tokens": {"messages": user},
        "system role in messages": {"max_tokens": 2, "messages": [{"role": "system"}]},
        "image block": {
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        "tool without input_schema": {"max_tokens": 2, "messages": user, "tools": [{"name": "t"}]},
        "tool_choice type bogus": {
            "max_tokens": 2,
            "messages": user,
            "tools": [{"name": "t", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "bogus"},
        },
        "temperature 1.5": {"max_tokens": 2, "messages": user, "temperature": 1.5},
        "unknown field (strict)": {"max_tokens": 2, "messages": user, "response_format": {}},
        "body a list": [],
    }
    ollama = {
        "messages a string": {"messages": "hi"},
        "options a string": {"messages": user, "options": "x"},
        "format yaml": {"messages": user, "format": "yaml"},
        "stream a string": {"messages": user, "stream": "yes"},
        "images": {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
        "format a bad schema": {"messages": user, "format": {"type": 7}},
        "unknown field (strict)": {"messages": user, "n": 2},
    }
    return [
        *(Case(f"anthropic {n}", ANTHROPIC, enc(b), 400, "", dialect="anthropic")
          for n, b in anthropic.items()),
        *(Case(f"ollama {n}", OLLAMA, enc(b), 400, "", dialect="ollama")
          for n, b in ollama.items()),
        Case("ollama unknown model", OLLAMA, enc({"model": "llama3", "messages": user}), 404, "",
             dialect="ollama"),
    ]  # fmt: skip


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
    # 1e309 is written as Infinity, which is no JSON: refused where the body is read
    cases += both("temperature inf", {"temperature": 1e309}, 400, "invalid_json")
    unsupported = {"n 2": {"n": 2}, "audio modality": {"modalities": ["audio"]}}
    for name, fields in unsupported.items():
        cases += both(name, fields, 400, "unsupported_value")
    for name, fields in {"best_of 2": {"best_of": 2}, "echo": {"echo": True}}.items():
        cases.append(
            Case(f"completion {name}", COMP, enc(comp(**fields)), 400, "unsupported_value")
        )
    cases += both("unknown field", {"foo": 1}, 400, "unknown_field")
    cases += both("functions (legacy)", {"functions": [{"name": "f"}]}, 400, "unsupported_value")
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
                403,  # a foreign page with a type it sends without a preflight (guards.py)
                "origin_not_allowed",
                (("Content-Type", ctype), ("Origin", "http://evil.example")),
            )
        )
    evil = ("Origin", "http://evil.example")
    blob = (("Content-Type", "application/octet-stream"), evil)
    cases.append(Case("blob type from a page", CHAT, enc(chat()), 403, "origin_not_allowed", blob))
    reset = (("Content-Type", "text/plain"), evil)
    cases.append(
        Case("cache reset from a page", "/v1/cache/reset", b"", 403, "origin_not_allowed", reset)
    )
    rebound = (*JSON.items(), ("Host", "evil.example:8080"))
    cases.append(
        Case("foreign Host (DNS rebinding)", CHAT, enc(chat()), 403, "host_not_allowed", rebound)
    )
    nan = b'{"messages": [{"role": "user", "content": "hi"}], "x": NaN}'
    cases.append(
        Case("NaN in an ignored field", CHAT, nan, 400, "invalid_json", tuple(JSON.items()))
    )
    big = b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}'
    cases.append(Case("1e999 as a number", CHAT, big, 400, "invalid_json", tuple(JSON.items())))
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
        *tool_cases(),
        *dialect_cases(),
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
    (CHAT, chat(user="u", metadata={"a": "b"}, n=1, logprobs=False, stream=True, store=False)),
    (CHAT, chat(messages=[{"role": "assistant", "content": "", "tool_calls": []}])),
    (CHAT, chat(logprobs=True, top_logprobs=20, presence_penalty=-2, frequency_penalty=2)),
    (COMP, comp(logprobs=20, repetition_penalty=9.5)),
    (CHAT, chat(response_format={"type": "json_object"}, max_tokens=4)),
    (CHAT, chat(tools=[fn(parameters={"type": "object"})], tool_choice="required", max_tokens=4)),
    (CHAT, chat(tools=[fn()], tool_choice="none", parallel_tool_calls=False)),
    (ANTHROPIC, {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    (
        ANTHROPIC,
        {
            "max_tokens": 10**9,
            "messages": [{"role": "user", "content": "hi"}],
            "stop_sequences": ["e", "a", "o"],
        },
    ),
    (
        "/api/chat",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": False,
            "options": {"num_predict": 10**9, "stop": ["e", "a", "o"]},
        },
    ),
    ("/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": 2}}),
    (COMP, comp(prompt=[0, VOCAB - 1], max_tokens=2)),
    (COMP, comp(prompt=[5] * 300, max_tokens=2)),
]
