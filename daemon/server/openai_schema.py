"""Validation of OpenAI request bodies: types, ranges, and which fields we accept.

Field policy (documented in docs/api.md): tolerant, not lax.
- supported fields are validated (type and range) and used;
- harmless OpenAI fields (`user`, `store`, `metadata`, ...) are accepted and ignored;
- a field we cannot honour at the value given (`n: 2`, `echo: true`) is a 400 naming it;
- any other field is ignored and listed in `X-Mlxcel-Ignored-Fields`, unless the daemon runs
  with `strict_api`, where it is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from mlxcel.daemon.engine.lanes import parse_lane, parse_timeout
from mlxcel.daemon.server.chat_messages import parse_messages
from mlxcel.daemon.server.errors import APIError, bad_request
from mlxcel.daemon.server.tool_schema import (
    ToolChoice,
    forced_call_schema,
    parse_response_format,
    parse_tool_choice,
    parse_tools,
)

__all__ = ["APIError", "bad_request"]

MAX_STOP_SEQUENCES = 4
MAX_LOGIT_BIAS = 300
MAX_STOP_CHARS = 256

COMMON_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "logit_bias",
        "ignore_eos",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "priority",
        "timeout",
        "speculative",
    }
)
# Known and harmless: accepted and ignored even under strict_api.
IGNORED_FIELDS = frozenset(
    {"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
)
# field -> the values we can honour (accepted); anything else is refused.
NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "modalities": (None, ("text",)),
}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "chat_template_kwargs",
    "reasoning_budget",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
# Legacy function calling: refused rather than silently ignored (it asks for tools).
REFUSED_FIELDS = {"functions": "use 'tools'", "function_call": "use 'tool_choice'"}
MAX_TOP_LOGPROBS = 20
# Thinking models (docs/api.md, "Reasoning"): `none`/`minimal` turn the thinking off where the
# template can (enable_thinking false) and close any reasoning at once (budget 0).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
THINKING_OFF_EFFORTS = ("none", "minimal")
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 8192
# apply_chat_template's own parameters: a template kwarg must not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "chat_template",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that does not set a sampling field gets: the API's defaults, or the
    daemon's `--temperature`, `--top-p`, `--top-k`, `--min-p` (docs/api.md, "Sampling
    defaults"). Every dialect reaches `_options` with only the fields its client sent."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @classmethod
    def with_set(cls, values: Mapping[str, Any]) -> SamplingDefaults:
        """The API's defaults, the daemon's set ones (`ServingConfig.sampling_set`) over them."""
        return replace(cls(), **values)


API_SAMPLING = SamplingDefaults()


@dataclass(frozen=True)
class GenerationOptions:
    model: str | None = None
    max_tokens: int | None = None  # None: what is left of the context
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    logprobs: bool = False
    top_logprobs: int = 0
    json_schema: str | None = None  # constrain the output to this JSON schema (text)
    lane: str | None = None  # `priority`: high | normal | low (None: the header's, else normal)
    timeout_s: float | None = None  # `timeout` seconds (None: the header's, else the server's)
    # `speculative`: false opts this request out of speculative decoding (None: the
    # X-Speculative header's, else on wherever the server's --speculative is)
    speculative: bool | None = None
    ignored: tuple[str, ...] = ()  # unknown top-level fields that were ignored


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    options: GenerationOptions
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    # Extra chat-template variables (`chat_template_kwargs`, `enable_thinking` from
    # `reasoning_effort`), and the reasoning budget in tokens (None: the server's default,
    # -1: unbounded, 0: no reasoning); docs/api.md, "Reasoning".
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_budget: int | None = None


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    options: GenerationOptions


# --- scalar checks ----------------------------------------------------------------------


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number", key, "invalid_type")
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo:g} and {hi:g}, got {value}", key)
    return float(value)


def _top_k(body: dict[str, Any], default: int) -> int:
    """`top_k` as sent (-1 and 0: off), else the default."""
    value = _integer(body, "top_k", lo=-1)
    return default if value is None else max(0, value)


def _integer(
    body: dict[str, Any], key: str, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", key, "invalid_type")
    if lo is not None and value < lo:
        raise bad_request(f"'{key}' must be >= {lo}, got {value}", key)
    if hi is not None and value > hi:
        raise bad_request(f"'{key}' must be <= {hi}, got {value}", key)
    return value


def _boolean(body: dict[str, Any], key: str) -> bool:
    return _optional_boolean(body, key) or False


def _optional_boolean(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", key, "invalid_type")
    return value


def _check_fields(
    body: dict[str, Any],
    allowed: frozenset[str],
    neutral: dict[str, tuple[Any, ...]],
    strict: bool,
) -> tuple[str, ...]:
    """Refuse what cannot be honoured; returns the unknown fields that were ignored."""
    ignored = []
    for key, value in body.items():
        if key in allowed or key in IGNORED_FIELDS:
            continue
        if key in neutral:
            accepted = neutral[key]
            if value in accepted or (isinstance(value, list) and tuple(value) in accepted):
                continue
            raise bad_request(
                f"'{key}' = {value!r} is not supported by this server", key, "unsupported_value"
            )
        if key in REFUSED_FIELDS:
            raise bad_request(
                f"'{key}' is not supported: {REFUSED_FIELDS[key]}", key, "unsupported_value"
            )
        if strict:
            raise bad_request(f"unknown field '{key}'", key, "unknown_field")
        ignored.append(key)
    return tuple(ignored)


# --- composite fields -------------------------------------------------------------------


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"stop sequences must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(dict.fromkeys(stops))


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object", "logit_bias", "invalid_type")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    bias: dict[int, float] = {}
    for key, b in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if token < 0:
            raise bad_request(f"logit_bias token id {token} is negative", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad_request(
                f"logit_bias values must be numbers in [-100, 100], got {b!r}", "logit_bias"
            )
        bias[token] = float(b)
    return bias


def _include_usage(body: dict[str, Any]) -> bool:
    value = body.get("stream_options")
    if value is None:
        return False
    if not isinstance(value, dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    unknown = set(value) - {"include_usage", "include_obfuscation"}
    if unknown:
        raise bad_request(f"unknown field 'stream_options.{sorted(unknown)[0]}'", "stream_options")
    return _boolean(value, "include_usage")


def _penalties(body: dict[str, Any]) -> dict[str, float]:
    repetition = body.get("repetition_penalty")
    if repetition is not None and (
        isinstance(repetition, bool) or not isinstance(repetition, (int, float)) or repetition <= 0
    ):
        raise bad_request("'repetition_penalty' must be a number > 0", "repetition_penalty")
    return {
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0, 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0, 10.0, 1.0),
    }


def _options(
    body: dict[str, Any],
    max_tokens_keys: tuple[str, ...],
    defaults: SamplingDefaults = API_SAMPLING,
    **extra: Any,
) -> GenerationOptions:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model", "invalid_type")
    n = _integer(body, "n", lo=1)
    if n is not None and n > 1:
        raise bad_request(
            "'n' > 1 is not supported: send one request per choice", "n", "unsupported_value"
        )
    max_tokens = None
    for key in max_tokens_keys:
        value = _integer(body, key, lo=1)
        max_tokens = value if value is not None else max_tokens
    seed = _integer(body, "seed", lo=-(2**63), hi=2**64 - 1)
    sampling = SamplingOptions(
        temperature=_number(body, "temperature", 0.0, 2.0, defaults.temperature),
        top_p=_number(body, "top_p", 0.0, 1.0, defaults.top_p),
        top_k=_top_k(body, defaults.top_k),
        min_p=_number(body, "min_p", 0.0, 1.0, defaults.min_p),
        seed=None if seed is None else seed % 2**64,
        logit_bias=_logit_bias(body),
        **_penalties(body),
    )
    return GenerationOptions(
        model=model,
        max_tokens=max_tokens,
        stop=_stop(body),
        ignore_eos=_boolean(body, "ignore_eos"),
        stream=_boolean(body, "stream"),
        include_usage=_include_usage(body),
        sampling=sampling,
        speculative=_optional_boolean(body, "speculative"),
        **_policy(body),
        **extra,
    )


def _policy(body: dict[str, Any]) -> dict[str, Any]:
    """`priority` (a lane name or vLLM's integer) and `timeout` (seconds)."""
    out: dict[str, Any] = {}
    for key, parse, name in (
        ("priority", parse_lane, "lane"),
        ("timeout", parse_timeout, "timeout_s"),
    ):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise bad_request(f"'{key}' must be a string or a number", key, "invalid_type")
        try:
            out[name] = parse(value)
        except ValueError as exc:
            raise bad_request(str(exc), key) from None
    return out


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return {"logprobs": logprobs, "top_logprobs": top}


def _completion_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    value = body.get("logprobs")
    if isinstance(value, bool):  # some clients send the chat form
        return {"logprobs": value, "top_logprobs": 0}
    top = _integer(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    return {"logprobs": top is not None, "top_logprobs": top or 0}


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    key = "chat_template_kwargs"
    if not isinstance(value, dict):
        raise bad_request(f"'{key}' must be an object", key, "invalid_type")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise bad_request(f"'{key}' takes at most {MAX_TEMPLATE_KWARGS} entries", key)
    for name in value:
        if not name.isidentifier():
            raise bad_request(f"'{key}' names must be identifiers, got {name!r}", key)
        if name in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"'{key}.{name}' is set by the server, not a template variable", key)
    if len(json.dumps(value, ensure_ascii=False)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise bad_request(f"'{key}' is over {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON", key)
    return dict(value)


def _reasoning(body: dict[str, Any]) -> dict[str, Any]:
    """`reasoning_effort`, `chat_template_kwargs` and `reasoning_budget` -> the template's
    variables and the budget. An explicit `chat_template_kwargs.enable_thinking` wins."""
    kwargs = _template_kwargs(body)
    budget = _integer(body, "reasoning_budget", lo=-1)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
                "reasoning_effort",
            )
        if effort in THINKING_OFF_EFFORTS:
            kwargs.setdefault("enable_thinking", False)
            budget = 0 if budget is None else budget
        else:  # gpt-oss's template reads it ("Reasoning: high"); others ignore it
            kwargs.setdefault("reasoning_effort", effort)
    return {"template_kwargs": kwargs, "reasoning_budget": budget}


def parse_chat_request(
    body: Any, strict: bool = False, defaults: SamplingDefaults = API_SAMPLING
) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    ignored = _check_fields(body, CHAT_FIELDS, NEUTRAL_FIELDS, strict)
    messages = parse_messages(body, strict)
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    schema = parse_response_format(body.get("response_format"))
    if choice.forced:
        if schema is not None:
            raise bad_request(
                "'response_format' cannot be combined with a forced tool_choice", "response_format"
            )
        schema = forced_call_schema(tools, choice)
    options = _options(
        body,
        ("max_tokens", "max_completion_tokens"),
        defaults,
        json_schema=schema,
        ignored=ignored,
        **_chat_logprobs(body),
    )
    return ChatRequest(
        messages=messages, options=options, tools=tools, tool_choice=choice, **_reasoning(body)
    )


def _prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 for t in prompt):
                raise bad_request("token ids in 'prompt' must be >= 0", "prompt")
            return list(prompt)
        if all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request("one prompt per request is supported", "prompt", "unsupported_value")
    raise bad_request(
        "'prompt' must be a non-empty string or a list of token ids", "prompt", "invalid_type"
    )


def parse_completion_request(
    body: Any, strict: bool = False, defaults: SamplingDefaults = API_SAMPLING
) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    neutral = {**NEUTRAL_FIELDS, **COMPLETION_NEUTRAL}
    ignored = _check_fields(body, COMPLETION_FIELDS, neutral, strict)
    options = _options(
        body, ("max_tokens",), defaults, ignored=ignored, **_completion_logprobs(body)
    )
    return CompletionRequest(prompt=_prompt(body), options=options)
