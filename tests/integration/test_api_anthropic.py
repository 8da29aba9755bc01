"""The Anthropic Messages API through the official `anthropic` package, unmodified, against a
real daemon (tiny model with a tool-capable template: the point is the plumbing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import anthropic
import jsonschema
import pytest
from daemon_helpers import embedded_daemon, http_json
from tool_model import make_tool_model

KEY = "anthropic-test-key"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # this SDK version has no temperature argument


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tool_model(tmp_path_factory.mktemp("toolmodel") / "llama")
    with embedded_daemon(
        tmp_path_factory, model, parallel=4, prefill_chunk_size=64, api_key=KEY
    ) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.http_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(daemon: Any) -> str:
    return daemon.daemon.state.model.name


def test_messages_create(client: anthropic.Anthropic, model: str) -> None:
    r = client.messages.create(
        model=model, max_tokens=6, system="Be brief.", messages=ASK, extra_body=GREEDY,
    )  # fmt: skip
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.stop_reason in ("end_turn", "max_tokens") and r.content[0].type == "text"
    assert r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
    assert r.usage.cache_read_input_tokens is not None


def test_a_repeated_prompt_reports_cache_read_tokens(
    client: anthropic.Anthropic, model: str
) -> None:
    system = "You answer questions about the weather. " * 8  # several KV blocks
    first = client.messages.create(model=model, max_tokens=2, system=system, messages=ASK)
    again = client.messages.create(model=model, max_tokens=2, system=system, messages=ASK)
    assert again.usage.cache_read_input_tokens > 0
    total = again.usage.input_tokens + again.usage.cache_read_input_tokens
    assert total == first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_a_large_max_tokens_is_a_ceiling(client: anthropic.Anthropic, model: str) -> None:
    # Over the context; the SDK streams a request this large.
    with client.messages.stream(model=model, max_tokens=10**6, messages=ASK) as s:
        r = s.get_final_message()
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens > 0


def test_a_stop_sequence_is_reported(client: anthropic.Anthropic, model: str) -> None:
    free = client.messages.create(model=model, max_tokens=12, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[3:6]
    assert stop.strip(), f"greedy text too short to pick a stop sequence: {text!r}"
    r = client.messages.create(
        model=model, max_tokens=12, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.find(stop)]


def test_messages_stream_gives_the_same_text(client: anthropic.Anthropic, model: str) -> None:
    once = client.messages.create(model=model, max_tokens=8, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(model=model, max_tokens=8, messages=ASK, extra_body=GREEDY) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert final.content[0].text == once.content[0].text
    assert final.usage.output_tokens == once.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_the_raw_event_sequence_is_anthropics(daemon: Any, model: str) -> None:
    # greedy: a sampled token may be the random model's end of turn within 4 (seen once in CI)
    body = {"model": model, "max_tokens": 4, "messages": ASK, "stream": True, **GREEDY}

    async def main() -> str:
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        async with aiohttp.ClientSession() as s:
            async with s.post(daemon.http_url + "/v1/messages", json=body, headers=headers) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                return await r.text()

    blocks = [b for b in asyncio.run(main()).split("\n\n") if b.strip()]
    names = [b.splitlines()[0].removeprefix("event: ") for b in blocks]
    datas = [json.loads(b.splitlines()[1].removeprefix("data: ")) for b in blocks]
    assert all(d["type"] == n for n, d in zip(names, datas, strict=True))
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert (
        datas[-2]["delta"]["stop_reason"] == "max_tokens"
        and datas[-2]["usage"]["output_tokens"] == 4
    )


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_use(client: anthropic.Anthropic, model: str, choice: dict[str, Any]) -> None:
    r = client.messages.create(
        model=model, max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice=choice
    )
    assert r.stop_reason == "tool_use"
    (block,) = [b for b in r.content if b.type == "tool_use"]
    assert block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_streamed_tool_use_and_the_round_trip(client: anthropic.Anthropic, model: str) -> None:
    with client.messages.stream(
        model=model, max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}
    ) as s:
        first = s.get_final_message()
    (use,) = [b for b in first.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}],
        },
    ]
    answer = client.messages.create(model=model, max_tokens=4, messages=history, tools=[WEATHER])
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    )


def test_unknown_fields_are_ignored_not_read_as_openai_ones(
    client: anthropic.Anthropic, model: str
) -> None:
    raw = client.messages.with_raw_response.create(
        model=model,
        max_tokens=3,
        messages=ASK,
        extra_body={"n": 5, "response_format": {"type": "bogus"}},  # OpenAI names: not used
    )
    assert raw.headers["x-mlxcel-ignored-fields"] == "n, response_format"
    assert raw.parse().content[0].type == "text"


def test_count_tokens(client: anthropic.Anthropic, model: str, daemon: Any) -> None:
    counted = client.messages.count_tokens(model=model, messages=ASK, system="Be brief.")
    ids = daemon.daemon.state.model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *ASK], add_generation_prompt=True
    )
    assert counted.input_tokens == len(ids)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": ASK},  # no max_tokens
        {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
        {
            "max_tokens": 5,
            "messages": ASK,
            "tool_choice": {"type": "sometimes"},
            "tools": [WEATHER],
        },
        {"max_tokens": 5, "messages": ASK, "tools": [{"name": "x"}]},
        {"max_tokens": 5, "messages": ASK, "temperature": 1.5},
    ],
)
def test_bad_requests_get_anthropics_error_envelope(daemon: Any, body: dict[str, Any]) -> None:
    status, _, payload = http_json(
        daemon.http_url + "/v1/messages", body, headers={"x-api-key": KEY}
    )
    assert status == 400 and payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error" and payload["error"]["message"]


def test_a_wrong_key_is_an_anthropic_authentication_error(daemon: Any, model: str) -> None:
    bad = anthropic.Anthropic(base_url=daemon.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model, max_tokens=2, messages=ASK)
