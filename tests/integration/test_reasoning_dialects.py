"""A thinking model's reasoning in the Anthropic and Ollama dialects (docs/api.md, "Reasoning"),
through the official `anthropic` and `ollama` packages, on the tiny bigram thinking model of
tests/tool_model.py (`make_think_model`: greedy output `<think>XZ</think>QJ`).

Anthropic: `thinking` content blocks before the `text` block, streamed as thinking_delta events;
`thinking.budget_tokens` is the reasoning budget, `thinking.type: disabled` turns it off; a
forced tool call comes after the reasoning. Ollama: `message.thinking` / `thinking` apart from
the content, streamed and not, the `think` flag, a `format` schema on the answer only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import ollama
import pytest
from daemon_helpers import embedded_daemon
from tool_model import make_think_model

ASK = [{"role": "user", "content": "What is 2+2?"}]
GREEDY = {"temperature": 0}  # this anthropic SDK version has no temperature argument
OPTIONS = {"temperature": 0, "num_predict": 20}
WEATHER = {
    "name": "get_weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 4}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_think_model(tmp_path_factory.mktemp("think") / "llama")
    with embedded_daemon(tmp_path_factory, model) as d:
        yield d


@pytest.fixture(scope="module")
def claude(daemon: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.http_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llama(daemon: Any) -> ollama.Client:
    return ollama.Client(host=daemon.http_url)


def message(claude: anthropic.Anthropic, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 20)
    return claude.messages.create(model="llama", extra_body=GREEDY, **kwargs)


def blocks(msg: Any) -> list[tuple[str, str]]:
    """(type, its text) per content block."""
    out = []
    for block in msg.content:
        text = {"thinking": getattr(block, "thinking", None), "text": getattr(block, "text", None)}
        out.append((block.type, text.get(block.type) or getattr(block, "name", "")))
    return out


# --- Anthropic ----------------------------------------------------------------------------


def test_anthropic_thinking_block_comes_before_the_text(claude: anthropic.Anthropic) -> None:
    msg = message(claude)
    assert blocks(msg) == [("thinking", "XZ"), ("text", "QJ")]
    assert msg.content[0].signature == ""  # ThinkingBlock.signature: str, required
    assert msg.stop_reason == "end_turn"
    # as Anthropic counts: the reasoning is output (<think> X Z </think> Q J, the end of turn)
    assert msg.usage.output_tokens == 7


def test_anthropic_streams_thinking_deltas_then_the_text(claude: anthropic.Anthropic) -> None:
    once = message(claude)
    with claude.messages.stream(model="llama", max_tokens=20, messages=ASK, extra_body=GREEDY) as s:
        events = list(s)
        final = s.get_final_message()
    raw = [e for e in events if e.type.startswith(("content_block", "message"))]
    kinds = [
        f"{e.type}:{e.content_block.type}" if e.type == "content_block_start"
        else f"{e.type}:{e.delta.type}" if e.type == "content_block_delta"
        else e.type
        for e in raw
    ]  # fmt: skip
    thinking = "".join(e.delta.thinking for e in raw if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")  # fmt: skip
    text = "".join(e.delta.text for e in raw if e.type == "content_block_delta"
                   and e.delta.type == "text_delta")  # fmt: skip
    assert (thinking, text) == ("XZ", "QJ")
    # message_start, the thinking block (its deltas, the signature), then the text block
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed == [
        "message_start",
        "content_block_start:thinking",
        "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta",
        "content_block_stop",
        "content_block_start:text",
        "content_block_delta:text_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in once.content]
    assert final.usage.output_tokens == once.usage.output_tokens == 7


def test_anthropic_budget_tokens_closes_the_reasoning_at_n(claude: anthropic.Anthropic) -> None:
    msg = message(claude, thinking={"type": "enabled", "budget_tokens": 1})
    # one reasoning token, then the forced </think>, then the answer
    assert blocks(msg) == [("thinking", "X"), ("text", "QJ")]
    assert msg.usage.output_tokens == 6
    wide = message(claude, thinking={"type": "enabled", "budget_tokens": 1024})
    assert blocks(wide) == [("thinking", "XZ"), ("text", "QJ")]
    omitted = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    assert blocks(message(claude, thinking=omitted)) == [("thinking", ""), ("text", "QJ")]


def test_anthropic_thinking_disabled_and_history_blocks(claude: anthropic.Anthropic) -> None:
    off = message(claude, thinking={"type": "disabled"})
    assert blocks(off) == [("text", "QJ")]  # the template closed an empty reasoning
    adaptive = message(claude, thinking={"type": "adaptive"})  # the model's default
    assert blocks(adaptive) == [("thinking", "XZ"), ("text", "QJ")]
    # a client sends the thinking block back: accepted, left out of the prompt
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in adaptive.content]},
        {"role": "user", "content": "And then?"},
    ]
    again = message(claude, messages=history)
    assert blocks(again) == [("thinking", "XZ"), ("text", "QJ")]
    plain_history = [*ASK, {"role": "assistant", "content": "QJ"}, history[-1]]
    same = claude.messages.count_tokens(model="llama", messages=history)
    assert (
        same.input_tokens
        == claude.messages.count_tokens(model="llama", messages=plain_history).input_tokens
    )
    # thinking off changes the prompt (the empty closed reasoning): count_tokens sees it too
    default = claude.messages.count_tokens(model="llama", messages=ASK).input_tokens
    counted = claude.messages.count_tokens(
        model="llama", messages=ASK, thinking={"type": "disabled"}
    ).input_tokens
    assert counted > default
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        message(claude, thinking={"type": "sometimes"})


def test_anthropic_forced_tool_use_comes_after_the_thinking(claude: anthropic.Anthropic) -> None:
    msg = message(
        claude, max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == "XZ"  # free text, then the call under its schema
    assert msg.content[1].name == "get_weather" and "city" in msg.content[1].input
    assert msg.stop_reason == "tool_use"


# --- Ollama -------------------------------------------------------------------------------


def test_ollama_chat_thinking_apart_from_the_content(llama: ollama.Client) -> None:
    r = llama.chat(model="llama", messages=ASK, options=OPTIONS)
    assert (r.message.thinking, r.message.content) == ("XZ", "QJ")
    assert r.done and r.eval_count == 7  # the reasoning counted
    on = llama.chat(model="llama", messages=ASK, options=OPTIONS, think=True)
    assert (on.message.thinking, on.message.content) == ("XZ", "QJ")
    thinking, content = "", ""
    for part in llama.chat(model="llama", messages=ASK, options=OPTIONS, stream=True):
        assert not (part.message.thinking and part.message.content), "one or the other"
        thinking += part.message.thinking or ""
        content += part.message.content or ""
    assert (thinking, content) == ("XZ", "QJ")


def test_ollama_generate_thinking_apart_from_the_response(llama: ollama.Client) -> None:
    r = llama.generate(model="llama", prompt="What is 2+2?", options=OPTIONS)
    assert (r.thinking, r.response) == ("XZ", "QJ")
    thinking, response = "", ""
    for part in llama.generate(model="llama", prompt="What is 2+2?", options=OPTIONS, stream=True):
        assert not (part.thinking and part.response), "one or the other"
        thinking += part.thinking or ""
        response += part.response or ""
    assert (thinking, response) == ("XZ", "QJ")


def test_ollama_think_false_turns_it_off(llama: ollama.Client) -> None:
    r = llama.chat(model="llama", messages=ASK, options=OPTIONS, think=False)
    assert (r.message.thinking, r.message.content) == (None, "QJ")
    g = llama.generate(model="llama", prompt="What is 2+2?", options=OPTIONS, think=False)
    assert (g.thinking, g.response) == (None, "QJ")
    streamed = list(
        llama.chat(model="llama", messages=ASK, options=OPTIONS, think=False, stream=True)
    )
    assert not any(p.message.thinking for p in streamed)
    assert "".join(p.message.content or "" for p in streamed) == "QJ"


def test_ollama_think_levels_and_bad_values() -> None:
    from mlxcel.daemon.server.ollama_api import chat_body

    body = {"messages": ASK}
    assert chat_body(None, {**body, "think": "high"})["reasoning_effort"] == "high"
    off = chat_body(None, {**body, "think": False})
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert off["reasoning_budget"] == 0
    assert "reasoning_budget" not in chat_body(None, {**body, "think": True})
    assert not {"chat_template_kwargs", "reasoning_effort"} & set(chat_body(None, body))


def test_ollama_think_level_reaches_the_request(llama: ollama.Client) -> None:
    r = llama.chat(model="llama", messages=ASK, options=OPTIONS, think="low")
    assert (r.message.thinking, r.message.content) == ("XZ", "QJ")  # the template ignores it
    with pytest.raises(ollama.ResponseError, match="think") as info:
        llama.chat(model="llama", messages=ASK, options=OPTIONS, think="max")
    assert info.value.status_code == 400


def test_ollama_format_constrains_the_answer_only(llama: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    options = {**OPTIONS, "num_predict": 40}
    r = llama.chat(model="llama", messages=ASK, options=options, format=schema)
    assert r.message.thinking == "XZ"  # free text, then </think>
    assert set(json.loads(r.message.content)) == {"ok"}


def test_ollama_show_reports_the_thinking_capability(llama: ollama.Client) -> None:
    assert "thinking" in llama.show("llama").capabilities
