"""Property tests of the OpenAI request validator (daemon/server/openai_schema.py).

Whatever JSON arrives, the validator either returns a request whose every value is in range
or raises its own APIError with a 400 and an OpenAI envelope: never anything else (a
TypeError, a KeyError, a RecursionError would be a 500).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import json_strategies
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlxcel.daemon.server.chat_messages import ROLES
from mlxcel.daemon.server.generation import sampling_params
from mlxcel.daemon.server.openai_schema import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    APIError,
    GenerationOptions,
    parse_chat_request,
    parse_completion_request,
)

json_values = json_strategies.json_values(max_text=10)
FIELDS = (
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "logit_bias",
    "ignore_eos",
    "n",
    "user",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "response_format",
    "echo",
    "best_of",
    "suffix",
    "messages",
    "prompt",
    "metadata",
    "bogus",
    "repetition_penalty",
    "parallel_tool_calls",
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(sorted(ROLES)), json_values),
        "content": st.one_of(
            st.text(max_size=20),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": json_values}
                ),
                max_size=3,
            ),
            json_values,
        ),
        "name": json_values,
        "refusal": json_values,
        "tool_call_id": json_values,
        "tool_calls": json_values,
    },
)
# Bodies near the valid ones: a valid core plus random values for real field names.
near_valid = st.builds(
    lambda core, extra: {**core, **extra},
    st.one_of(
        st.fixed_dictionaries({"messages": st.lists(message, max_size=3)}),
        st.fixed_dictionaries(
            {
                "prompt": st.one_of(
                    st.text(max_size=20), st.lists(st.integers(-5, 2**40), max_size=5)
                )
            }
        ),
    ),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
)


def check_refusal(err: APIError) -> None:
    assert err.status == 400, (err.status, err.message)
    body = err.body()["error"]
    assert isinstance(body["message"], str) and body["message"]
    assert body["type"] == "invalid_request_error" and isinstance(body["code"], str)
    json.dumps(err.body())  # the envelope always serialises


def check_options(o: GenerationOptions) -> None:
    s = o.sampling
    assert 0.0 <= s.temperature <= 2.0 and 0.0 <= s.top_p <= 1.0 and 0.0 <= s.min_p <= 1.0
    assert not any(math.isnan(v) for v in (s.temperature, s.top_p, s.min_p))
    assert isinstance(s.top_k, int) and s.top_k >= 0
    assert s.seed is None or 0 <= s.seed < 2**64
    assert o.max_tokens is None or (isinstance(o.max_tokens, int) and o.max_tokens >= 1)
    assert len(o.stop) <= MAX_STOP_SEQUENCES
    assert all(isinstance(x, str) and 1 <= len(x) <= MAX_STOP_CHARS for x in o.stop)
    assert len(s.logit_bias) <= MAX_LOGIT_BIAS
    assert all(isinstance(t, int) and t >= 0 and -100 <= b <= 100 for t, b in s.logit_bias.items())
    assert o.model is None or isinstance(o.model, str)
    assert all(isinstance(v, bool) for v in (o.stream, o.include_usage, o.ignore_eos))
    assert -2 <= s.presence_penalty <= 2 and -2 <= s.frequency_penalty <= 2
    assert s.repetition_penalty > 0 and isinstance(o.logprobs, bool)
    assert 0 <= o.top_logprobs <= MAX_TOP_LOGPROBS
    assert o.json_schema is None or isinstance(json.loads(o.json_schema), dict)
    sampling_params(o)  # what the engine gets builds without error


def validate(parse: Any, body: Any) -> Any:
    try:
        return parse(body)
    except APIError as err:
        check_refusal(err)
        return None


@settings(max_examples=200)
@given(json_values)
def test_any_json_body_is_a_request_or_a_400(body: Any) -> None:
    for parse in (parse_chat_request, parse_completion_request):
        req = validate(parse, body)
        if req is not None:
            check_options(req.options)


TEMPLATE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


@settings(max_examples=250)
@given(near_valid)
def test_near_valid_chat_bodies(body: dict[str, Any]) -> None:
    req = validate(parse_chat_request, body)
    strict = validate(lambda b: parse_chat_request(b, strict=True), body)
    if req is None:
        assert strict is None  # strict refuses at least what the tolerant default refuses
        return
    check_options(req.options)
    assert req.messages and all(set(m) <= TEMPLATE_KEYS for m in req.messages)
    assert all(m["role"] in ROLES and isinstance(m["content"], str) for m in req.messages)
    assert ("prompt" in body) == ("prompt" in req.options.ignored)
    assert strict is None or not strict.options.ignored


@settings(max_examples=250)
@given(near_valid)
def test_near_valid_completion_bodies(body: dict[str, Any]) -> None:
    req = validate(parse_completion_request, body)
    if req is None:
        return
    check_options(req.options)
    prompt = req.prompt
    if isinstance(prompt, str):
        assert prompt
    else:
        assert prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
        )
    assert ("messages" in body) == ("messages" in req.options.ignored)


schema_like = st.one_of(
    json_values,
    st.dictionaries(
        st.sampled_from(["type", "properties", "required", "items", "enum", "const", "anyOf",
                         "minItems", "pattern", "$ref", "additionalProperties"]),
        json_values,
        max_size=4,
    ),
)  # fmt: skip
tool_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "other"])},
    optional={
        "function": st.fixed_dictionaries(
            {}, optional={"name": json_values, "parameters": schema_like, "strict": json_values}
        )
    },
)
tool_fields = st.fixed_dictionaries(
    {},
    optional={
        "tools": st.one_of(st.lists(tool_like, max_size=3), json_values),
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries({"name": json_values}),
                }
            ),
            json_values,
        ),
        "response_format": st.one_of(
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["json_schema", "json_object", "text", "x"]),
                    "json_schema": st.fixed_dictionaries(
                        {}, optional={"name": json_values, "schema": schema_like}
                    ),
                }
            ),
            json_values,
        ),
    },
)


@settings(max_examples=300)
@given(tool_fields)
def test_tools_and_schemas_are_a_request_or_a_400(fields: dict[str, Any]) -> None:
    req = validate(parse_chat_request, {"messages": [{"role": "user", "content": "x"}], **fields})
    if req is None:
        return
    check_options(req.options)
    names = [t["function"]["name"] for t in req.tools]
    assert len(names) == len(set(names))
    if req.tool_choice.forced:
        assert req.options.json_schema is not None and req.tools


def nested(depth: int) -> Any:
    value: Any = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def deep_bodies(depth: int) -> list[tuple[Any, dict[str, Any]]]:
    """Deep nesting where the validator walks it (schemas, tool history, content parts)."""
    msg = [{"role": "user", "content": "hi"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": nested(depth)}}
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(depth)}}
    parts: Any = "x"
    for _ in range(depth):
        parts = [{"type": "text", "text": parts}]
    return [
        (parse_chat_request, {"messages": msg, "response_format": fmt}),
        (parse_chat_request, {"messages": msg, "tools": [tool]}),
        (parse_chat_request, {"messages": [{"role": "user", "content": parts}]}),
        (parse_completion_request, {"prompt": parts}),
    ]


@pytest.mark.parametrize("depth", [40, 400, 2000])
def test_deep_nesting_is_a_400(depth: int) -> None:
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    for parse, body in deep_bodies(depth):
        with pytest.raises(APIError) as err:
            parse(body)
        check_refusal(err.value)
