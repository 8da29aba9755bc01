"""The control protocol (docs/api.md, "Control API"): newline-delimited JSON over a Unix socket.

Request  {"id": 1, "method": "...", "params": {...}}
Reply    {"id": 1, "result": {...}}  or  {"id": 1, "error": {"code": "...", "message": "..."}}
Event    {"event": "...", "data": {...}}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LINE_BYTES = 1 << 20  # a longer control line closes the connection

# Method names (docs/api.md, "Control API"); the daemon's handler for each is in the table of
# daemon/server/control_server.py, keyed by these.
M_HELLO = "hello"
M_STATUS = "status"
M_CONFIG_GET = "config.get"
M_CONFIG_SET = "config.set"
M_CONFIG_SAVE = "config.save"
M_CACHE_RESET = "cache.reset"
M_REQUEST_CANCEL = "request.cancel"
M_REQUEST_INFO = "request.info"
M_MODEL_LIST = "model.list"
M_MODEL_LOAD = "model.load"
M_MODEL_UNLOAD = "model.unload"
M_MODEL_PIN = "model.pin"
M_MODEL_UNPIN = "model.unpin"
M_LOGS_SUBSCRIBE = "logs.subscribe"
M_LOGS_UNSUBSCRIBE = "logs.unsubscribe"
M_HISTORY = "history"
M_SUBSCRIBE = "subscribe"
M_UNSUBSCRIBE = "unsubscribe"
M_SHUTDOWN = "shutdown"

METHODS = (
    M_HELLO,
    M_STATUS,
    M_CONFIG_GET,
    M_CONFIG_SET,
    M_CONFIG_SAVE,
    M_CACHE_RESET,
    M_REQUEST_CANCEL,
    M_REQUEST_INFO,
    M_MODEL_LIST,
    M_MODEL_LOAD,
    M_MODEL_UNLOAD,
    M_MODEL_PIN,
    M_MODEL_UNPIN,
    M_LOGS_SUBSCRIBE,
    M_LOGS_UNSUBSCRIBE,
    M_HISTORY,
    M_SUBSCRIBE,
    M_UNSUBSCRIBE,
    M_SHUTDOWN,
)

# Error codes (strings, stable across versions).
E_PARSE = "parse_error"
E_INVALID = "invalid_request"
E_METHOD = "method_not_found"
E_PARAMS = "invalid_params"
E_INTERNAL = "internal_error"
E_VERSION = "protocol_version"
E_NOT_FOUND = "not_found"

# Event names pushed to subscribers.
EV_SNAPSHOT = "snapshot"
EV_CONFIG = "config_changed"
EV_REJECTED = "request_rejected"
EV_FINISHED = "request_finished"
EV_CANCELLED = "request_cancelled"
EV_CACHE_RESET = "cache_reset"
EV_SHUTDOWN = "shutdown"
# Model host events (docs/models.md): {model, ...}; a switch is model_switched {from, to}.
EV_MODEL_LOADING = "model_loading"
EV_MODEL_LOADED = "model_loaded"
EV_MODEL_UNLOADED = "model_unloaded"
EV_MODEL_SWITCHED = "model_switched"
EV_MODEL_LOAD_FAILED = "model_load_failed"
EV_MODEL_PINNED = "model_pinned"  # {model}: kept resident until unpinned
EV_MODEL_UNPINNED = "model_unpinned"
EV_LOG = "log"  # one daemon log line, to a logs.subscribe connection


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str, req_id: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.req_id = req_id


@dataclass(frozen=True)
class Request:
    id: Any
    method: str
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "method": self.method, "params": self.params}


@dataclass(frozen=True)
class Reply:
    id: Any
    result: Any = None
    error: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"id": self.id, "error": self.error}
        return {"id": self.id, "result": self.result}


@dataclass(frozen=True)
class Event:
    event: str
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event, "data": self.data}


def encode(message: Request | Reply | Event | dict[str, Any]) -> bytes:
    obj = message if isinstance(message, dict) else message.to_dict()
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def error_reply(req_id: Any, code: str, message: str) -> Reply:
    return Reply(id=req_id, error={"code": code, "message": message})


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def decode_request(line: bytes) -> Request:
    """Parse one request line; raises ProtocolError with the id when it can be read.

    NaN and infinities are refused: they are not JSON, and a reply or event that echoed
    one could not be encoded (encode() uses allow_nan=False)."""
    try:
        obj = json.loads(
            line.decode("utf-8"), parse_float=_finite_float, parse_constant=_no_constant
        )
    except UnicodeDecodeError:
        raise ProtocolError(E_PARSE, "line is not valid UTF-8") from None
    except (ValueError, RecursionError):  # also an integer over Python's 4300-digit limit
        raise ProtocolError(E_PARSE, "line is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError(E_INVALID, "a request must be a JSON object")
    req_id = obj.get("id")
    if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, (int, str))):
        raise ProtocolError(E_INVALID, "id must be an integer or a string")
    method = obj.get("method")
    if not isinstance(method, str):
        raise ProtocolError(E_INVALID, "method must be a string", req_id)
    params = obj.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ProtocolError(E_PARAMS, "params must be an object", req_id)
    if method not in METHODS:
        raise ProtocolError(E_METHOD, f"unknown method {method!r}", req_id)
    return Request(id=req_id, method=method, params=params)


def decode_message(line: bytes) -> Reply | Event:
    """Client side: parse a reply or an event line."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, a 4300+ digit integer
        raise ProtocolError(E_PARSE, f"bad line from daemon: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(E_INVALID, "a message must be a JSON object")
    if "event" in obj:
        data = obj.get("data")
        return Event(event=str(obj["event"]), data=data if isinstance(data, dict) else {})
    if "id" not in obj:
        raise ProtocolError(E_INVALID, "a reply needs an id")
    return Reply(id=obj["id"], result=obj.get("result"), error=obj.get("error"))
