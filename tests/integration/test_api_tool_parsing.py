"""Auto-mode tool calls: the model's own markup cut out of streamed text and parsed with
mlx-lm's parser for its template; the forced-call schema and its parsing (no engine needed)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlxcel.daemon.server.tool_schema import (
    ToolChoice,
    forced_call_schema,
    parse_tool_choice,
    parse_tools,
    tool_calls_from_json,
)
from mlxcel.daemon.server.turn import ToolCallSplitter, ToolMode, parse_calls, tool_mode
from tool_model import make_tool_model

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TEXT = f"Let me check. <tool_call>\n{CALL}\n</tool_call> and <tool_call>{CALL}</tool_call>!"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model_dir: Path = make_tool_model(tmp_path_factory.mktemp("toolmodel") / "llama")
    return load_tokenizer(model_dir)


def split_all(text: str, cuts: list[int]) -> tuple[str, list[str]]:
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>")
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    content, calls = "", []
    for a, b in itertools.pairwise(bounds):
        c, k = splitter.feed(text[a:b])
        content, calls = content + c, calls + k
    c, k = splitter.finish()
    return content + c, calls + k


@given(cuts=st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_calls_are_cut_out_wherever_the_pieces_break(cuts: list[int]) -> None:
    content, calls = split_all(TEXT, cuts)
    assert content == "Let me check.  and !"
    assert [json.loads(c) for c in calls] == [json.loads(CALL)] * 2


def test_a_false_start_is_content_and_an_unterminated_call_is_tried() -> None:
    assert split_all("a <tool_cal b", [3, 5]) == ("a <tool_cal b", [])
    assert split_all(f"x<tool_call>{CALL}", [4]) == ("x", [CALL])


def test_the_templates_parser_turns_markup_into_calls(tokenizer: Any) -> None:
    mode = tool_mode(tokenizer, TOOLS, ToolChoice("auto"))
    assert (mode.kind, mode.start, mode.end) == ("auto", "<tool_call>", "</tool_call>")
    calls = parse_calls(mode, [f"\n{CALL}\n", "not json"])  # a broken call is dropped
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_tool_modes(tokenizer: Any) -> None:
    assert tool_mode(tokenizer, TOOLS, ToolChoice("none")).kind == "off"
    assert tool_mode(tokenizer, [], ToolChoice("auto")).kind == "off"
    assert tool_mode(tokenizer, TOOLS, ToolChoice("required")).kind == "forced"
    plain = ToolMode()
    assert plain.kind == "off" and parse_calls(plain, [CALL]) == []


def test_forced_schemas_accept_exactly_the_allowed_calls() -> None:
    tools = parse_tools({"tools": TOOLS})
    required = json.loads(forced_call_schema(tools, ToolChoice("required")))
    named = json.loads(forced_call_schema(tools, ToolChoice("named", "get_time")))
    weather = {"name": "get_weather", "arguments": {"city": "Paris"}}
    jsonschema.validate(weather, required)
    jsonschema.validate({"name": "get_time", "arguments": {}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(weather, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "other", "arguments": {}}, required)
    (call,) = tool_calls_from_json(json.dumps(weather))
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert tool_calls_from_json('{"name": "get_weather", "argu') is None


def test_forced_arguments_take_only_the_declared_parameters() -> None:
    """A listed `properties` closes the arguments object unless the tool says otherwise (a
    small model under an open schema was seen inventing keys until max_tokens)."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    open_ = {**city, "additionalProperties": True}
    tools = parse_tools(
        {
            "tools": [
                {"type": "function", "function": {"name": "closed", "parameters": city}},
                {"type": "function", "function": {"name": "open", "parameters": open_}},
            ]
        }
    )
    closed = json.loads(forced_call_schema(tools, ToolChoice("named", "closed")))
    opened = json.loads(forced_call_schema(tools, ToolChoice("named", "open")))
    extra = {"city": "Paris", "description": "sunny"}
    jsonschema.validate({"name": "closed", "arguments": {"city": "Paris"}}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "closed", "arguments": extra}, closed)
    jsonschema.validate({"name": "open", "arguments": extra}, opened)


def test_tool_choice_forms() -> None:
    tools = parse_tools({"tools": TOOLS})
    assert parse_tool_choice({}, tools).mode == "auto"
    assert parse_tool_choice({}, []).mode == "none"
    named = {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    assert parse_tool_choice(named, tools) == ToolChoice("named", "get_time", True)
    assert not parse_tool_choice({"parallel_tool_calls": False}, tools).parallel
