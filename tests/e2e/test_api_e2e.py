"""The official clients against a real `mlxcel-daemon` subprocess on SmolLM2, where the point
is the real model: structured outputs it fills sensibly, forced tool calls, a tool round trip,
Anthropic and Ollama answers, readable logprobs.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import ollama
import openai
import pytest
from daemon_helpers import RunningDaemon
from pydantic import BaseModel, Field

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WEATHER_PARAMS,
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def daemon(smollm2_daemon: RunningDaemon) -> RunningDaemon:
    """The session's shared SmolLM2 daemon (conftest.py)."""
    return smollm2_daemon


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)


def test_parse_fills_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format=Capital,
        max_tokens=80,
        temperature=0,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital) and "Paris" in parsed.capital


def test_json_object_mode_gives_an_object(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat as JSON with name and age."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_forced_tool_call_and_round_trip(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80,
        temperature=0,
    )  # fmt: skip
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_PARAMS)
    assert "paris" in args["city"].lower()
    history = [
        *ASK,
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "sunny"}'},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], max_tokens=60, temperature=0
    )
    assert answer.choices[0].message.content


def test_streamed_text_and_logprobs(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    text, entries = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs:
                entries += chunk.choices[0].logprobs.content or []
    assert "Paris" in text
    assert "".join(e.token for e in entries) == text  # ASCII answer: tokens spell the text
    assert all(bytes(e.bytes).decode() == e.token for e in entries)


def test_anthropic_create_and_stream(daemon: RunningDaemon, model: str) -> None:
    client = anthropic.Anthropic(base_url=daemon.http_url, api_key="unused", max_retries=0)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.messages.create(
        model=model, max_tokens=30, messages=q, system="You are a helpful assistant.",
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert "Paris" in r.content[0].text and r.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(
        model=model, max_tokens=30, messages=q, system="You are a helpful assistant.",
        extra_body={"temperature": 0},
    ) as s:  # fmt: skip
        streamed = "".join(s.text_stream)
    assert streamed == r.content[0].text
    tools = [{"name": "get_weather", "description": "weather", "input_schema": WEATHER_PARAMS}]
    used = client.messages.create(
        model=model, max_tokens=80, messages=ASK, tools=tools, tool_choice={"type": "any"}
    )
    (block,) = [b for b in used.content if b.type == "tool_use"]
    jsonschema.validate(block.input, WEATHER_PARAMS)


def test_ollama_chat_generate_list_stream(daemon: RunningDaemon, model: str) -> None:
    client = ollama.Client(host=daemon.http_url)
    assert [m.model for m in client.list().models] == [model]
    q = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat(model=model, messages=q, options={"temperature": 0, "num_predict": 30})
    assert "Paris" in r.message.content
    parts = client.chat(
        model=model, messages=q, options={"temperature": 0, "num_predict": 30}, stream=True
    )
    assert "".join(p.message.content for p in parts) == r.message.content
    g = client.generate(model=model, prompt="What is the capital of France?",
                        options={"temperature": 0, "num_predict": 30})  # fmt: skip
    assert "Paris" in g.response


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_inside_a_character_does_not_end_with_a_replacement_char(
    client: openai.OpenAI, model: str, stream: bool
) -> None:
    """SmolLM2 writes an emoji in several tokens: cut at 1, 2, 4 and 5 tokens (inside one),
    the text ends with the last whole character, never U+FFFD, streamed or not."""
    messages = [{"role": "user", "content": "Reply only with five emoji: 😀🎉🚀🌟🍕"}]
    texts = []
    for max_tokens in (1, 2, 4, 5):
        if stream:
            chunks = client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0
            )
            text = reply.choices[0].message.content or ""
        texts.append(text)
    assert all("\ufffd" not in t for t in texts), texts
    assert any(t for t in texts), texts  # some whole emoji got out
