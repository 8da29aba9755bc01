"""Tool calling, structured outputs, logprobs, penalties, tolerant parsing and CORS through the
official `openai` package and LangChain, unmodified, against a real daemon on a tiny model
whose chat template renders tools (the point here is the plumbing, not the answers).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from daemon_helpers import embedded_daemon, openai_client
from pydantic import BaseModel
from tool_model import make_tool_model

ORIGIN = "http://app.example"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time", "parameters": TIME_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tool_model(tmp_path_factory.mktemp("toolmodel") / "llama")
    config = {"parallel": 4, "prefill_chunk_size": 64, "allowed_origins": (ORIGIN,)}
    with embedded_daemon(tmp_path_factory, model, **config) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Any) -> openai.OpenAI:
    return openai_client(daemon)


@pytest.fixture(scope="module")
def model(daemon: Any) -> str:
    return daemon.daemon.state.model.name


def check_call(call: Any) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    assert call.type == "function" and call.id.startswith("call_")
    return args


def test_the_template_knows_tools(daemon: Any) -> None:
    assert daemon.daemon.state.model.tokenizer.has_tool_calling


def test_a_named_tool_call_returns_arguments_that_match_the_schema(
    client: openai.OpenAI, model: str
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=1.0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    check_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_picks_one_of_the_tools(client: openai.OpenAI, model: str, seed: int) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        seed=seed,
    )
    (call,) = r.choices[0].message.tool_calls
    check_call(call)


def test_a_streamed_tool_call_arrives_as_delta_tool_calls(
    client: openai.OpenAI, model: str
) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_a_full_tool_round_trip(client: openai.OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),  # as the client sends it back
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result count


def test_the_history_reaches_the_template(daemon: Any) -> None:
    tokenizer = daemon.daemon.state.model.tokenizer
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "RESULT-42"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}' in text
    assert "<tool_response>\nRESULT-42" in text and '"get_weather"' in text


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool
    unit: Literal["celsius", "fahrenheit"]


def test_parse_with_a_pydantic_model_returns_a_valid_object(
    client: openai.OpenAI, model: str
) -> None:
    r = client.chat.completions.parse(
        model=model, messages=ASK, response_format=Forecast, max_tokens=60, temperature=0
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast)
    assert r.choices[0].finish_reason == "stop"


def test_chat_logprobs_have_openais_shape(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and bytes(item.bytes).decode(errors="replace") == item.token
        assert len(item.top_logprobs) == 3
        top = [t.logprob for t in item.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert item.logprob == pytest.approx(top[0])  # greedy: the sampled token is the top one
    assert r.choices[0].logprobs.refusal is None


def test_streamed_logprobs_cover_every_token(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    entries = []
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].logprobs:
            entries += chunk.choices[0].logprobs.content or []
    assert usage is not None and len(entries) == usage.completion_tokens == 6
    assert all(e.top_logprobs == [] for e in entries)


def test_completion_logprobs_have_the_legacy_shape(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def greedy(client: openai.OpenAI, model: str, **extra: Any) -> str:
    r = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    return r.choices[0].text


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}],
)
def test_penalties_change_greedy_text(
    client: openai.OpenAI, model: str, penalty: dict[str, float]
) -> None:
    assert greedy(client, model, **penalty) != greedy(client, model)


def test_unknown_fields_are_ignored_and_named(client: openai.OpenAI, model: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=ASK,
        max_tokens=2,
        user="u1",
        extra_body={"typical_p": 0.9, "mirostat": 2},
    )
    assert raw.headers["x-mlxcel-ignored-fields"] == "typical_p, mirostat"
    assert raw.parse().choices[0].message.role == "assistant"


def test_strict_api_refuses_unknown_fields(daemon: Any, client: openai.OpenAI, model: str) -> None:
    daemon.daemon.state.strict_api = True
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=model, messages=ASK, max_tokens=2, extra_body={"mirostat": 2}
            )
        assert err.value.code == "unknown_field" and err.value.param == "mirostat"
    finally:
        daemon.daemon.state.strict_api = False


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, None),
        ({"top_logprobs": 4}, "top_logprobs"),
    ],
)
def test_bad_new_fields_are_400s_naming_the_field(
    client: openai.OpenAI, model: str, extra: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, max_tokens=2, extra_body=extra
        )
    assert err.value.param == (param or "response_format.json_schema.schema")


def request(daemon: Any, method: str, headers: dict[str, str], data: bytes | None = None) -> Any:
    req = urllib.request.Request(
        daemon.http_url + "/v1/chat/completions", data=data, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers


def test_a_preflight_from_an_allowed_origin_is_answered(daemon: Any) -> None:
    asked = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers = request(daemon, "OPTIONS", asked)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"


def test_other_origins_get_no_cors_headers(daemon: Any) -> None:
    status, headers = request(daemon, "OPTIONS", {"Origin": "http://evil.example"})
    assert status == 204 and "Access-Control-Allow-Origin" not in headers
    body = json.dumps({"messages": ASK, "max_tokens": 1}).encode()
    json_type = {"Content-Type": "application/json"}
    status, headers = request(daemon, "POST", {**json_type, "Origin": "http://evil.example"}, body)
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    assert headers["Vary"] == "Origin"
    status, headers = request(daemon, "POST", {**json_type, "Origin": ORIGIN}, body)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN


def test_form_content_types_still_get_415_from_a_web_page(daemon: Any) -> None:
    body = json.dumps({"messages": ASK}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        status, _ = request(daemon, "POST", {"Content-Type": ctype, "Origin": ORIGIN}, body)
        assert status == 415


def test_curl_d_without_a_content_type_is_read_as_json(daemon: Any) -> None:
    """`curl -d '{...}'` sends application/x-www-form-urlencoded and no Origin."""
    body = json.dumps({"messages": ASK, "max_tokens": 2}).encode()
    ctype = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _ = request(daemon, "POST", ctype, body)
    assert status == 200


def test_langchain_chat_openai_with_tools_bound(daemon: Any, model: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=model,
        base_url=daemon.http_url + "/v1",
        api_key="unused",
        max_tokens=80,
        temperature=0,
        max_retries=0,
    )
    bound = llm.bind_tools([TOOLS[0]], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_PARAMS)
