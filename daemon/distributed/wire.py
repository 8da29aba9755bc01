"""What travels on a group's ring, as typed, bounded, authenticated bytes (docs/distributed.md).

Rank 0 sends one message per exchange; nothing else travels (the figures ride beside it as
plain integers). The messages are tagged dicts, the same Python values rank 0's engine records:

- `{"kind": "setup", "config": ServingConfig, "mode": "tensor" | "pipeline"}`: once, at start;
- `{"kind": "step" | "ping" | "stop", "commands": [(name, args), ...], "seed": int}`: before
  every step (`ping` while idle, `stop` at the end), with the commands the bridge applied:
  `("add_request", (GenerationRequest,))`, `("abort", (request_id, reason, error))`,
  `("reconfigure", ({key: scalar},))`, `("reset_prompt_cache", ())`.

`encode` writes them as JSON with every field checked against its type (a prompt's token ids
as raw little-endian uint32 bytes, base64); `decode` accepts only these shapes and sizes and
raises `ChannelError` for anything else (unknown kind or command, a field of the wrong type,
an unknown or secret config field, a payload over the bounds, bytes that are not JSON, a
pickle among them): nothing on the ring is ever unpickled or called by name.

`Sealer` frames each message as `seq (8 bytes) | HMAC-SHA256 (32 bytes) | body`, the MAC over
(group id, seq, body) with the group's secret (`GroupKey`, made by rank 0 at start and given to
the ranks it starts on their stdin). A rank checks the MAC (`hmac.compare_digest`) and that the
sequence number is newer than the last one it accepted before it decodes anything.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import secrets
import types
import typing
from dataclasses import dataclass
from typing import Any

import numpy as np
from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams
from mlxcel.shared.config import ServingConfig

MAX_MESSAGE_BYTES = 64 << 20  # one message's frame; a longer length is refused unread
MAX_PROMPT_TOKENS = 1 << 24  # the largest ctx_size (shared/config.py)
MAX_COMMANDS = 65536  # commands in one step's message
MAX_TEXT = 4 << 20  # one string (a request's JSON schema is the longest)
MAX_STOP_TOKENS = 4096
MAX_LOGIT_BIAS = 1 << 20
MAX_ERROR = 64 << 10  # an abort's error text (rank 0 cuts a longer one)
MAX_ID = 1024  # a request id
INTS = (-(1 << 64), 1 << 64)  # int64 and uint64 (a request's seed is one, docs/api.md)
SEQ_BYTES = 8
MAC_BYTES = 32
KEY_BYTES = 32
GROUP_ID_BYTES = 16

STEP_KINDS = ("step", "ping", "stop")  # and "setup", once
MODES = ("tensor", "pipeline")
COMMANDS = ("add_request", "abort", "reconfigure", "reset_prompt_cache")
# Never on the ring: the workers serve no HTTP (docs/distributed.md).
SECRET_CONFIG_FIELDS = frozenset({"api_key", "readonly_api_key", "api_key_file", "api_keys_file"})
Scalar = bool | int | float | str | None


class ChannelError(ValueError):
    """A message on the ring that is dropped unread or unexecuted; the text says why."""


# -- the group's key -------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupKey:
    """The per-group secret and id, made by rank 0 when it starts the group."""

    group_id: bytes
    secret: bytes = dataclasses.field(repr=False)

    @classmethod
    def new(cls) -> GroupKey:
        return cls(secrets.token_bytes(GROUP_ID_BYTES), secrets.token_bytes(KEY_BYTES))

    def line(self) -> bytes:
        """The line rank 0 writes on a rank's stdin (never argv or the environment)."""
        return f"{self.group_id.hex()} {self.secret.hex()}\n".encode()

    @classmethod
    def from_line(cls, line: bytes) -> GroupKey:
        try:
            group_id, secret = (bytes.fromhex(p) for p in line.decode("ascii").split())
        except (ValueError, UnicodeDecodeError):
            raise ChannelError("no group key on stdin (a rank is started by its rank 0)") from None
        if len(group_id) != GROUP_ID_BYTES or len(secret) != KEY_BYTES:
            raise ChannelError("the group key on stdin has the wrong length")
        return cls(group_id, secret)


class Sealer:
    """Frames and checks one group's messages: MAC over (group id, seq, body), newer seq only."""

    def __init__(self, key: GroupKey) -> None:
        self._key = key
        self._sent = 0  # rank 0: the last sequence number it sent
        self.last_seq = 0  # a receiver: the last sequence number it accepted

    def _mac(self, seq: bytes, body: bytes) -> bytes:
        msg = self._key.group_id + seq + body
        return hmac.new(self._key.secret, msg, hashlib.sha256).digest()

    def seal(self, body: bytes) -> bytes:
        self._sent += 1
        seq = self._sent.to_bytes(SEQ_BYTES, "big")
        return seq + self._mac(seq, body) + body

    def open(self, frame: bytes) -> bytes:
        """The body of an authentic, new frame; ChannelError (nothing decoded) otherwise."""
        failed = "dropped a message that failed authentication from rank 0"
        if len(frame) < SEQ_BYTES + MAC_BYTES:
            raise ChannelError(f"{failed} ({len(frame)} bytes, no MAC)")
        seq, mac = frame[:SEQ_BYTES], frame[SEQ_BYTES : SEQ_BYTES + MAC_BYTES]
        body = frame[SEQ_BYTES + MAC_BYTES :]
        if not hmac.compare_digest(mac, self._mac(seq, body)):
            raise ChannelError(f"{failed} (wrong MAC)")
        number = int.from_bytes(seq, "big")
        if number <= self.last_seq:
            raise ChannelError(
                f"{failed} (sequence number {number} replayed or old, last {self.last_seq})"
            )
        self.last_seq = number
        return body


# -- typed values ----------------------------------------------------------------------------


def _bad(where: str, expected: str, value: Any) -> ChannelError:
    return ChannelError(
        f"dropped a malformed message from rank 0: {where} must be {expected}, "
        f"got {type(value).__name__}"
    )


def _int(value: Any, where: str, lo: int = INTS[0], hi: int = INTS[1]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(where, "an integer", value)
    if not lo <= value <= hi:
        raise ChannelError(f"dropped a malformed message from rank 0: {where} out of bounds")
    return value


def _float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(where, "a number", value)
    return float(value)


def _str(value: Any, where: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise _bad(where, "a string", value)
    if len(value) > limit:
        raise ChannelError(f"dropped a malformed message from rank 0: {where} is too long")
    return value


def _dict(value: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(where, "an object", value)
    unknown = set(value) - keys
    if unknown:
        raise ChannelError(
            f"dropped a malformed message from rank 0: {where} has unknown fields "
            f"{sorted(unknown)[:5]}"
        )
    return value


def _list(value: Any, where: str, limit: int) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(where, "a list", value)
    if len(value) > limit:
        raise ChannelError(f"dropped a malformed message from rank 0: {where} is too long")
    return value


def _decode_hint(value: Any, hint: Any, where: str) -> Any:
    """A JSON value checked against a dataclass field's type (the config's and sampling's
    simple types: scalars, optionals, tuple[str, ...])."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode_hint(value, option, where)
            except ChannelError as exc:
                if "must be" not in str(exc):  # the right type, out of its bounds: say so
                    raise
        names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
        raise _bad(where, names, value)
    if origin is tuple:
        (item, _dots) = typing.get_args(hint)
        items = _list(value, where, 4096)
        return tuple(_decode_hint(v, item, f"{where}[{i}]") for i, v in enumerate(items))
    if hint is bool:
        if not isinstance(value, bool):
            raise _bad(where, "a boolean", value)
        return value
    if hint is int:
        return _int(value, where)
    if hint is float:
        return _float(value, where)
    if hint is str:
        return _str(value, where)
    raise ChannelError(f"dropped a malformed message from rank 0: {where} cannot travel")


def _to_json(value: Any) -> Any:
    if isinstance(value, (tuple, frozenset, set)):
        return [_to_json(v) for v in value]
    return value


_CONFIG_HINTS = {
    f.name: typing.get_type_hints(ServingConfig)[f.name]
    for f in dataclasses.fields(ServingConfig)
    if f.name != "extra" and f.name not in SECRET_CONFIG_FIELDS
}
_SAMPLING_HINTS = {
    f.name: typing.get_type_hints(SamplingParams)[f.name]
    for f in dataclasses.fields(SamplingParams)
    if f.name != "logit_bias"
}


def encode_config(cfg: ServingConfig) -> dict[str, Any]:
    """The serving config without its secrets and `extra` (the workers serve no HTTP)."""
    return {name: _to_json(getattr(cfg, name)) for name in _CONFIG_HINTS}


def decode_config(data: Any) -> ServingConfig:
    data = _dict(data, "config", set(_CONFIG_HINTS))
    values = {k: _decode_hint(v, _CONFIG_HINTS[k], f"config.{k}") for k, v in data.items()}
    try:
        return ServingConfig(**values)
    except Exception as exc:
        raise ChannelError(f"dropped a malformed message from rank 0: config: {exc}") from None


def encode_sampling(sp: SamplingParams) -> dict[str, Any]:
    out = {name: _to_json(getattr(sp, name)) for name in _SAMPLING_HINTS}
    bias = sp.logit_bias
    out["logit_bias"] = None if bias is None else [[int(k), float(v)] for k, v in bias.items()]
    return out


def decode_sampling(data: Any) -> SamplingParams:
    data = _dict(data, "sampling", {*_SAMPLING_HINTS, "logit_bias"})
    values = {
        k: _decode_hint(v, _SAMPLING_HINTS[k], f"sampling.{k}")
        for k, v in data.items()
        if k != "logit_bias"
    }
    bias = data.get("logit_bias")
    if bias is not None:
        pairs = _list(bias, "sampling.logit_bias", MAX_LOGIT_BIAS)
        values["logit_bias"] = {}
        for i, pair in enumerate(pairs):
            pair = _list(pair, f"sampling.logit_bias[{i}]", 2)
            if len(pair) != 2:
                raise _bad(f"sampling.logit_bias[{i}]", "a [token, bias] pair", pair)
            token = _int(pair[0], f"sampling.logit_bias[{i}]")
            values["logit_bias"][token] = _float(pair[1], f"sampling.logit_bias[{i}]")
    return SamplingParams(**values)


def encode_tokens(ids: tuple[int, ...] | list[int]) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<u4").tobytes()).decode("ascii")


def decode_tokens(data: Any, where: str, limit: int = MAX_PROMPT_TOKENS) -> tuple[int, ...]:
    text = _str(data, where, limit=(limit * 4 + 2) // 3 * 4 + 4)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(where, "base64 token ids", data) from None
    if len(raw) % 4:
        raise ChannelError(f"dropped a malformed message from rank 0: {where} is not uint32")
    if len(raw) // 4 > limit:
        raise ChannelError(f"dropped a malformed message from rank 0: {where} is too long")
    return tuple(np.frombuffer(raw, dtype="<u4").tolist())


def check_travels(req: GenerationRequest) -> None:
    """ChannelError when `req` would not reach the other ranks unchanged (rank 0 refuses such a
    request at admission: a step the other ranks drop would break the lockstep)."""
    try:
        text = json.dumps(encode_request(req))
        back = decode_request(json.loads(text))
    except ChannelError as exc:
        raise ChannelError(str(exc).split("rank 0: ", 1)[-1]) from None
    except Exception as exc:  # e.g. a value numpy or JSON cannot write
        raise ChannelError(f"cannot encode the request: {exc}") from None
    if json.dumps(encode_request(back)) != text:  # (NaN != NaN: compare what travels)
        raise ChannelError("the request does not survive the encoding unchanged")


def encode_request(req: GenerationRequest) -> dict[str, Any]:
    return {
        "request_id": req.request_id,
        "prompt_ids": encode_tokens(req.prompt_ids),
        "max_tokens": req.max_tokens,
        "sampling": encode_sampling(req.sampling),
        "stop_token_ids": sorted(int(t) for t in req.stop_token_ids),
        "endpoint": req.endpoint,
    }


_REQUEST_FIELDS = {"request_id", "prompt_ids", "max_tokens", "sampling", "stop_token_ids"}


def decode_request(data: Any) -> GenerationRequest:
    data = _dict(data, "request", {*_REQUEST_FIELDS, "endpoint"})
    missing = _REQUEST_FIELDS - set(data)
    if missing:
        raise ChannelError(f"dropped a malformed message from rank 0: request lacks {missing}")
    stops = _list(data["stop_token_ids"], "request.stop_token_ids", MAX_STOP_TOKENS)
    return GenerationRequest(
        request_id=_str(data["request_id"], "request.request_id", MAX_ID),
        prompt_ids=decode_tokens(data["prompt_ids"], "request.prompt_ids"),
        max_tokens=_int(data["max_tokens"], "request.max_tokens", 0),
        sampling=decode_sampling(data["sampling"]),
        stop_token_ids=frozenset(_int(t, "request.stop_token_ids") for t in stops),
        endpoint=_str(data.get("endpoint", ""), "request.endpoint", 1024),
    )


# -- commands and messages -------------------------------------------------------------------


def _scalar(value: Any, where: str) -> Scalar:
    if value is None or isinstance(value, (bool, int, float)):
        if isinstance(value, int) and not isinstance(value, bool):
            _int(value, where)
        return value
    return _str(value, where, 1024)


def encode_command(name: str, args: tuple[Any, ...]) -> dict[str, Any]:
    if name == "add_request":
        (request,) = args
        return {"cmd": name, "request": encode_request(request)}
    if name == "abort":
        request_id, reason, error = args
        if error is not None:
            error = error[:MAX_ERROR]  # the receiver's bound: a longer one would be dropped
        return {"cmd": name, "request_id": request_id, "reason": reason, "error": error}
    if name == "reconfigure":
        (changes,) = args
        return {"cmd": name, "changes": {str(k): _to_json(v) for k, v in changes.items()}}
    if name == "reset_prompt_cache":
        return {"cmd": name}
    raise ChannelError(f"command {name!r} cannot travel to the other ranks")


def decode_command(data: Any, where: str) -> tuple[str, tuple[Any, ...]]:
    if not isinstance(data, dict):
        raise _bad(where, "an object", data)
    name = data.get("cmd")
    if name == "add_request":
        _dict(data, where, {"cmd", "request"})
        return name, (decode_request(data.get("request")),)
    if name == "abort":
        _dict(data, where, {"cmd", "request_id", "reason", "error"})
        error = data.get("error")
        return name, (
            _str(data.get("request_id"), f"{where}.request_id", MAX_ID),
            _str(data.get("reason"), f"{where}.reason", 64),
            None if error is None else _str(error, f"{where}.error", MAX_ERROR),
        )
    if name == "reconfigure":
        _dict(data, where, {"cmd", "changes"})
        changes = data.get("changes")
        if not isinstance(changes, dict) or len(changes) > 64:
            raise _bad(f"{where}.changes", "an object of at most 64 keys", changes)
        return name, (
            {
                _str(k, f"{where}.changes", 64): _scalar(v, f"{where}.{k}")
                for k, v in changes.items()
            },
        )
    if name == "reset_prompt_cache":
        _dict(data, where, {"cmd"})
        return name, ()
    shown = repr(name)[:40]
    raise ChannelError(f"dropped a malformed message from rank 0: unknown command {shown}")


def encode(message: dict[str, Any]) -> bytes:
    """One message as bytes (rank 0); ChannelError for a value that cannot travel."""
    kind = message.get("kind")
    if kind == "setup":
        data: dict[str, Any] = {
            "kind": kind,
            "mode": message["mode"],
            "config": encode_config(message["config"]),
        }
        decode_config(json.loads(json.dumps(data["config"])))  # the ranks will read it back
    elif kind in STEP_KINDS:
        data = {
            "kind": kind,
            "seed": int(message.get("seed", 0)),
            "commands": [encode_command(n, tuple(a)) for n, a in message.get("commands", [])],
        }
    else:
        raise ChannelError(f"message kind {kind!r} cannot travel to the other ranks")
    body = json.dumps(data, separators=(",", ":")).encode()
    if len(body) + SEQ_BYTES + MAC_BYTES > MAX_MESSAGE_BYTES:
        raise ChannelError(f"a {len(body)}-byte message is over the ring's bound")
    return body


def decode(body: bytes) -> dict[str, Any]:
    """A message from its bytes; ChannelError (never an exception of another kind, and never
    anything run) for whatever is not one of the messages above."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise ChannelError("dropped a malformed message from rank 0: over the size bound")
    try:
        data = json.loads(body.decode("utf-8"))  # NaN and Infinity are floats: data, no code
    except (ValueError, RecursionError):
        raise ChannelError("dropped a malformed message from rank 0: not JSON") from None
    try:
        return _decode_message(data)
    except ChannelError:
        raise
    except Exception as exc:  # a shape the checks above did not foresee: still only dropped
        raise ChannelError(f"dropped a malformed message from rank 0: {exc}") from None


def _decode_message(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _bad("message", "an object", data)
    kind = data.get("kind")
    if kind == "setup":
        _dict(data, "message", {"kind", "mode", "config"})
        mode = data.get("mode")
        if mode not in MODES:
            raise ChannelError(f"dropped a malformed message from rank 0: mode {mode!r:.40}")
        return {"kind": kind, "mode": mode, "config": decode_config(data.get("config"))}
    if kind in STEP_KINDS:
        _dict(data, "message", {"kind", "seed", "commands"})
        commands = _list(data.get("commands"), "commands", MAX_COMMANDS)
        return {
            "kind": kind,
            "seed": _int(data.get("seed"), "seed"),
            "commands": [decode_command(c, f"commands[{i}]") for i, c in enumerate(commands)],
        }
    raise ChannelError(f"dropped a malformed message from rank 0: unknown kind {kind!r:.40}")
