"""Validation of OpenAI request bodies: types, ranges, and which fields we accept.

Field policy (documented in docs/api.md):
- supported fields are validated (type and range) and used;
- harmless OpenAI fields are accepted and ignored (`user`, `store`, `metadata`, ...);
- fields whose neutral value changes nothing are accepted only at that value
  (`n: 1`, `frequency_penalty: 0`, `logprobs: false`, ...), otherwise 400;
- any other field is refused with 400, so a client never silently gets a behaviour it
  did not ask for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    }
)
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls"})
# field -> the values that change nothing (accepted); anything else is refused.
NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, ()),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ("text",)),
}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MESSAGE_FIELDS = frozenset({"role", "content", "name"})


class APIError(Exception):
    """An HTTP error in the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationOptions:
    model: str | None = None
    max_tokens: int | None = None  # None: what is left of the context
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingOptions = field(default_factory=SamplingOptions)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    options: GenerationOptions


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
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", key, "invalid_type")
    return value


def _check_fields(
    body: dict[str, Any], allowed: frozenset[str], neutral: dict[str, tuple[Any, ...]]
) -> None:
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
        raise bad_request(f"unknown field '{key}'", key, "unknown_field")


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


def _options(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> GenerationOptions:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model", "invalid_type")
    max_tokens = None
    for key in max_tokens_keys:
        value = _integer(body, key, lo=1)
        max_tokens = value if value is not None else max_tokens
    seed = _integer(body, "seed", lo=-(2**63), hi=2**64 - 1)
    sampling = SamplingOptions(
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        top_k=max(0, _integer(body, "top_k", lo=-1) or 0),
        min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
        seed=None if seed is None else seed % 2**64,
        logit_bias=_logit_bias(body),
    )
    return GenerationOptions(
        model=model,
        max_tokens=max_tokens,
        stop=_stop(body),
        ignore_eos=_boolean(body, "ignore_eos"),
        stream=_boolean(body, "stream"),
        include_usage=_include_usage(body),
        sampling=sampling,
    )


def _message_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of parts", where, "invalid_type")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"'{where}[{i}]': only text parts are supported, got {kind!r}", where)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}[{i}].text' must be a string", where, "invalid_type")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"'{where}' must be an object", where, "invalid_type")
        unknown = set(msg) - MESSAGE_FIELDS
        if unknown:
            raise bad_request(f"unknown field '{where}.{sorted(unknown)[0]}'", where)
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:  # [] or {} would not hash
            raise bad_request(
                f"'{where}.role' must be one of {', '.join(sorted(ROLES))}", f"{where}.role"
            )
        item = {
            "role": "system" if role == "developer" else role,
            "content": _message_text(msg.get("content"), f"{where}.content"),
        }
        if isinstance(msg.get("name"), str):
            item["name"] = msg["name"]
        out.append(item)
    return out


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    _check_fields(body, CHAT_FIELDS, NEUTRAL_FIELDS)
    options = _options(body, ("max_tokens", "max_completion_tokens"))
    return ChatRequest(messages=_messages(body), options=options)


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


def parse_completion_request(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    _check_fields(body, COMPLETION_FIELDS, {**NEUTRAL_FIELDS, **COMPLETION_NEUTRAL})
    options = _options(body, ("max_tokens",))
    return CompletionRequest(prompt=_prompt(body), options=options)
