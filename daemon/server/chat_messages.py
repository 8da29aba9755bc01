"""Validation of OpenAI chat `messages` into what the model's chat template takes.

Every field the OpenAI chat format defines is accepted (`name`, `refusal`, `tool_calls`,
`tool_call_id`, content parts); assistant `tool_calls` keep their arguments as objects, the
form Hugging Face chat templates render. A user, system or tool message needs content.
"""

from __future__ import annotations

from typing import Any

from mlxcel.daemon.server.errors import bad_request, loads_finite

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "refusal", "tool_calls", "tool_call_id", "function_call", "audio"}
)
TEXT_PARTS = frozenset({"text", "refusal"})
NEEDS_CONTENT = frozenset({"system", "developer", "user", "tool", "function"})


def message_text(content: Any, where: str) -> str | None:
    """A string, or the text parts joined; None when absent. Media parts are refused."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of parts", where, "invalid_type")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(
                f"'{where}[{i}]' must be a content part object", where, "invalid_type"
            )
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            raise bad_request(
                f"'{where}[{i}]': only text parts are supported, got {kind!r}",
                where,
                "unsupported_value",
            )
        text = part.get(kind)
        if not isinstance(text, str):
            raise bad_request(f"'{where}[{i}].{kind}' must be a string", where, "invalid_type")
        texts.append(text)
    return "".join(texts)


def _arguments(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise bad_request(f"'{where}' must be a JSON string", where, "invalid_type")
    try:
        return loads_finite(value) if value.strip() else {}
    except ValueError:
        raise bad_request(f"'{where}' is not valid JSON", where) from None


def tool_calls_for_template(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a list", where, "invalid_type")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"'{at}.function.name' must be a string", at, "invalid_type")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"'{at}.id' must be a string", at, "invalid_type")
        args = _arguments(fn.get("arguments", "{}"), f"{at}.function.arguments")
        calls.append(
            {
                "id": call_id or f"call_{i}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return calls


def _check_string(msg: dict[str, Any], key: str, where: str) -> None:
    value = msg.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{where}.{key}' must be a string", f"{where}.{key}", "invalid_type")


def parse_message(msg: Any, where: str, strict: bool) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise bad_request(f"'{where}' must be an object", where, "invalid_type")
    unknown = set(msg) - MESSAGE_FIELDS
    if strict and unknown:
        raise bad_request(f"unknown field '{where}.{sorted(unknown)[0]}'", where, "unknown_field")
    role = msg.get("role")
    if not isinstance(role, str) or role not in ROLES:  # [] or {} would not hash
        raise bad_request(
            f"'{where}.role' must be one of {', '.join(sorted(ROLES))}", f"{where}.role"
        )
    for key in ("name", "refusal", "tool_call_id"):
        _check_string(msg, key, where)
    text = message_text(msg.get("content"), f"{where}.content")
    if text is None and role in NEEDS_CONTENT:
        raise bad_request(f"'{where}.content' is required for a {role} message", where)
    item: dict[str, Any] = {
        "role": {"developer": "system", "function": "tool"}.get(role, role),
        "content": text or "",
    }
    if isinstance(msg.get("name"), str):
        item["name"] = msg["name"]
    if role == "tool":
        if not isinstance(msg.get("tool_call_id"), str):
            raise bad_request(f"'{where}.tool_call_id' is required for a tool message", where)
        item["tool_call_id"] = msg["tool_call_id"]
    if role == "assistant" and msg.get("tool_calls") is not None:
        calls = tool_calls_for_template(msg["tool_calls"], f"{where}.tool_calls")
        if calls:
            item["tool_calls"] = calls
    return item


def parse_messages(body: dict[str, Any], strict: bool) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages", "invalid_type")
    return [parse_message(m, f"messages[{i}]", strict) for i, m in enumerate(messages)]
