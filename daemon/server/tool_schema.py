"""Validation of `tools`, `tool_choice` and `response_format`, and the JSON schemas they turn
into for constrained decoding (SamplingParams.json_schema).

A forced tool call (`tool_choice` "required" or a named function) is generated as one JSON
object `{"name": ..., "arguments": {...}}` under a schema built from the functions' parameters,
so it parses and matches whatever the model; `tool_calls_from_json` turns it back.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jsonschema
from mlxcel.daemon.server.errors import bad_request

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
# All of a request's tool parameter schemas together (JSON text): a bound on the metaschema
# checks one request can ask for (~4 ms per KB the first time), and more tool text than any
# context holds (~250k tokens).
MAX_TOOLS_SCHEMA_BYTES = 1024 * 1024
VERDICT_ENTRIES = 1024  # schemas whose check (valid or not) is remembered, LRU
VERDICT_CHARS = 16_000_000  # and at most this much schema text remembered
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # none | auto | required | named
    name: str | None = None  # the function, when mode is "named"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(
            id=self.id,
            type="function",
            function={"name": self.name, "arguments": self.arguments},
        )
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, stopping once over `limit`."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            node = list(node.values())
        children = node if isinstance(node, list) else ()
        stack.extend((c, d + 1) for c in children)
    return deepest


class SchemaVerdicts:
    """The metaschema check's outcome by schema text (`json.dumps` of the parsed schema): None
    (valid) or the problem (" at 'path': message"). Refusals are kept too, so a schema is checked
    once however often it comes (an agent sends the same tools every turn); least recently used
    dropped first past VERDICT_ENTRIES or VERDICT_CHARS. Thread-safe (the schema workers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._chars = 0
        self.checks = 0  # schemas checked (misses)
        self.hits = 0

    def verdict(self, schema: dict[str, Any], text: str) -> str | None:
        with self._lock:
            if text in self._verdicts:
                self._verdicts.move_to_end(text)
                self.hits += 1
                return self._verdicts[text]
        problem = _metaschema_problem(schema)  # outside the lock: other schemas go on
        with self._lock:
            if text not in self._verdicts:
                self._chars += len(text)
            self._verdicts[text] = problem
            while len(self._verdicts) > 1 and (
                len(self._verdicts) > VERDICT_ENTRIES or self._chars > VERDICT_CHARS
            ):
                self._chars -= len(self._verdicts.popitem(last=False)[0])
            self.checks += 1
        return problem


def _metaschema_problem(schema: dict[str, Any]) -> str | None:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        at = f" at '{path}'" if path else ""
        return f"{at}: {exc.message}"
    return None


VERDICTS = SchemaVerdicts()


def _schema_text(schema: Any, where: str) -> str:
    """The schema's JSON text, once its shape, depth and size are checked (400 otherwise)."""
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}' must be a JSON schema object", where, "invalid_type")
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:  # first: json.dumps recurses
        raise bad_request(f"'{where}' nests deeper than {MAX_SCHEMA_DEPTH} levels", where)
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise bad_request(
            f"'{where}' is {len(text)} bytes; schemas are limited to {MAX_SCHEMA_BYTES}", where
        )
    return text


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """A JSON schema we can hand to the grammar compiler; 400 naming `where` otherwise.
    Pure Python and up to ~0.4 s for a 64 KB schema the first time: the HTTP handlers call the
    parsers that reach it on a schema worker (completions.parse_off_loop), never on the loop."""
    text = _schema_text(schema, where)
    problem = VERDICTS.verdict(schema, text)
    if problem is not None:
        raise bad_request(f"'{where}' is not a valid JSON schema{problem}", where)
    return schema


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`tools` -> OpenAI tool objects, validated (names unique, parameters a schema)."""
    value = body.get("tools")
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", "tools", "invalid_type")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' takes at most {MAX_TOOLS} functions", "tools")
    _check_tools_size(value)
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"'{where}' must be a function tool", where, "invalid_type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"'{where}.function' must be an object", where, "invalid_type")
        tools.append({"type": "function", "function": _function(fn, f"{where}.function")})
    names = [t["function"]["name"] for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise bad_request(f"tool name {dupes[0]!r} is defined twice", "tools")
    return tools


def _check_tools_size(value: list[Any]) -> None:
    """400 before any metaschema check when the parameter schemas add up to more than
    MAX_TOOLS_SCHEMA_BYTES (a malformed tool is left to `parse_tools` to name)."""
    total = 0
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if isinstance(params, dict):
            total += len(_schema_text(params, f"tools[{i}].function.parameters"))
        if total > MAX_TOOLS_SCHEMA_BYTES:
            raise bad_request(
                f"the tools' parameter schemas add up to more than {MAX_TOOLS_SCHEMA_BYTES} bytes",
                "tools",
            )


def _function(fn: dict[str, Any], where: str) -> dict[str, Any]:
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        raise bad_request(
            f"'{where}.name' must be 1-64 letters, digits, '_', '.' or '-'", f"{where}.name"
        )
    out: dict[str, Any] = {"name": name}
    desc = fn.get("description")
    if desc is not None:
        if not isinstance(desc, str):
            raise bad_request(f"'{where}.description' must be a string", f"{where}.description")
        out["description"] = desc
    params = fn.get("parameters")
    if params is not None:
        out["parameters"] = check_schema(params, f"{where}.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{where}.strict' must be a boolean", f"{where}.strict", "invalid_type")
    return out


def parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> ToolChoice:
    value = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(
            "'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type"
        )
    parallel = True if parallel is None else parallel
    if value is None:
        return ToolChoice("auto" if tools else "none", None, parallel)
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(
                "'tool_choice' must be none, auto, required or a function", "tool_choice"
            )
        if value == "required" and not tools:
            raise bad_request("tool_choice 'required' needs 'tools'", "tool_choice")
        return ToolChoice(value, None, parallel)
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or value.get("type", "function") != "function":
        raise bad_request(
            "'tool_choice' must be none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
    return ToolChoice("named", name, parallel)


def _closed(params: dict[str, Any]) -> dict[str, Any]:
    """A function's declared parameters are all it takes: an object schema that lists
    `properties` and says nothing of others gets `additionalProperties: false` (as OpenAI's
    strict function calling does), so a forced call cannot ramble on in invented keys."""
    if "properties" in params and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "const": fn["name"]},
            "arguments": _closed(fn.get("parameters") or ANY_OBJECT),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_schema(tools: list[dict[str, Any]], choice: ToolChoice) -> str:
    """The JSON schema (text) a forced tool call is generated under."""
    fns = [t["function"] for t in tools]
    if choice.mode == "named":
        fns = [fn for fn in fns if fn["name"] == choice.name]
    schemas = [_call_schema(fn) for fn in fns]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return json.dumps(schema)


def tool_calls_from_json(text: str) -> list[ToolCall] | None:
    """The generated `{"name", "arguments"}` object as tool calls; None if it does not parse
    (generation cut short by max_tokens)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", {})
        calls.append(ToolCall(new_call_id(), item["name"], json.dumps(args)))
    return calls


def parse_response_format(value: Any, where: str = "response_format") -> str | None:
    """`response_format` -> the JSON schema text to constrain to, or None (plain text)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request(f"'{where}' must be an object with a 'type'", where, "invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps(ANY_OBJECT)
    if kind != "json_schema":
        raise bad_request(
            f"'{where}.type' must be text, json_object or json_schema, got {kind!r}", where
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(f"'{where}.json_schema' must be an object", where, "invalid_type")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not TOOL_NAME_RE.match(name)):
        raise bad_request(f"'{where}.json_schema.name' must be 1-64 letters, digits, _ or -", where)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{where}.json_schema.strict' must be a boolean", where, "invalid_type")
    schema = spec.get("schema", ANY_OBJECT)
    return json.dumps(check_schema(schema, f"{where}.json_schema.schema"))
