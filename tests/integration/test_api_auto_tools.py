"""Auto-mode tool calls end to end: the model's own markup, parsed by mlx-lm's parser.

A random-weight model never writes tool markup by itself, so the output is pinned with a
JSON-schema `const`: a JSON string whose text is a Qwen3-Coder style call (no quotes inside,
so the JSON string holds it verbatim). The daemon must cut the markup out of the content,
parse it with the template's parser and answer with tool calls in each dialect.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import ollama
import openai
import pytest
from daemon_helpers import embedded_daemon, openai_client
from tool_model import make_tool_model

# No quotes, backslashes or newlines: a JSON string holds it as it is.
CALL_TEXT = (
    "<tool_call><function=get_time><parameter=zone>UTC</parameter>"
    "<parameter=days>3</parameter></function></tool_call>"
)
PINNED = {"type": "json_schema", "json_schema": {"name": "pin", "schema": {"const": CALL_TEXT}}}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
ASK = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tool_model(tmp_path_factory.mktemp("toolmodel") / "llama", parser="qwen3_coder")
    with embedded_daemon(tmp_path_factory, model, parallel=2, prefill_chunk_size=64) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Any) -> openai.OpenAI:
    return openai_client(daemon)


@pytest.fixture(scope="module")
def model(daemon: Any) -> str:
    return daemon.daemon.state.model.name


def test_the_parser_is_the_one_asked_for(daemon: Any) -> None:
    tokenizer = daemon.daemon.state.model.tokenizer
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"


def test_markup_becomes_tool_calls(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[TIME_TOOL], response_format=PINNED, max_tokens=200
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == '""'  # the JSON string's quotes, the markup cut out
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"zone": "UTC", "days": 3}  # typed by schema


def test_streamed_markup_becomes_delta_tool_calls(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[TIME_TOOL], response_format=PINNED, max_tokens=200,
        stream=True,
    )  # fmt: skip
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert (content, finish) == ('""', "tool_calls")
    assert [c.function.name for c in calls] == ["get_time"] and calls[0].index == 0


def test_tool_choice_none_leaves_the_markup_as_text(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[TIME_TOOL], tool_choice="none", response_format=PINNED,
        max_tokens=200,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content) == CALL_TEXT


def test_ollama_gets_tool_calls_with_object_arguments(daemon: Any, model: str) -> None:
    r = ollama.Client(host=daemon.http_url).chat(
        model=model, messages=ASK, tools=[TIME_TOOL], format={"const": CALL_TEXT},
        options={"num_predict": 200}, stream=False,
    )  # fmt: skip
    (call,) = r.message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments == {
        "zone": "UTC",
        "days": 3,
    }
