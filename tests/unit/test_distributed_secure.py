"""The ring between a group's ranks carries typed, authenticated messages (docs/distributed.md):
the codec (every message round-trips; unknown kinds, wrong types, oversize payloads are refused)
and the HMAC seal (wrong key, wrong group, a flipped bit, a replay are refused). Forged
messages on a real ring and a real group whose worker holds no API key are
tests/e2e/test_distributed_secure_ring.py's."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import pytest
from mlxcel.daemon.distributed import wire
from mlxcel.daemon.distributed.launch import group_config, worker_env
from mlxcel.daemon.distributed.wire import ChannelError, GroupKey, Sealer
from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams
from mlxcel.shared.config import ServingConfig

REQUEST = GenerationRequest(
    "req-1",
    (1, 2, 3, 70000, 4_000_000_000),
    17,
    SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=12,
        logit_bias={5: -2.5, 9: 1.0},
        presence_penalty=0.5,
        logprobs=True,
        top_logprobs=3,
        json_schema='{"type": "object"}',
    ),
    frozenset({2, 7}),
    "/v1/chat/completions",
)
CONFIG = ServingConfig(
    model="/models/tiny",
    parallel=3,
    prompt_cache=False,
    prompt_cache_bytes=1 << 20,
    kv_cache_budget=123456,
    allowed_origins=("http://a.example",),
    allowed_hosts=("box.lan",),
    keep_alive=30.0,
    hosts="/tmp/hosts.json",
    distributed_mode="tensor",
)
STEP = {
    "kind": "step",
    "seed": (1 << 62) - 1,
    "commands": [
        ("add_request", (REQUEST,)),
        ("add_request", (GenerationRequest("req-2", (), 1),)),
        ("abort", ("req-1", "abort", None)),
        ("abort", ("req-2", "error", "distributed group degraded: rank 1")),
        ("reconfigure", ({"parallel": 2, "prompt_cache": True, "max_batch_prefill_tokens": None},)),
        ("reset_prompt_cache", ()),
    ],
}


def raw(data: Any) -> bytes:
    return json.dumps(data).encode()


def good_step() -> dict[str, Any]:
    return json.loads(wire.encode(STEP))


# -- the codec -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        {"kind": "setup", "mode": "tensor", "config": CONFIG},
        {"kind": "setup", "mode": "pipeline", "config": ServingConfig()},
        STEP,
        {"kind": "ping", "commands": [], "seed": 0},
        {"kind": "stop", "commands": [], "seed": 0},
    ],
    ids=["setup", "setup-defaults", "step", "ping", "stop"],
)
def test_every_message_round_trips(message: dict[str, Any]) -> None:
    body = wire.encode(message)
    assert b"pickle" not in body and body.startswith(b"{")  # JSON, typed
    assert wire.decode(body) == message


def test_the_config_travels_without_its_keys() -> None:
    cfg = CONFIG.replace(api_key="sk-full", readonly_api_key="sk-read", api_key_file="/k")
    body = wire.encode({"kind": "setup", "mode": "tensor", "config": cfg})
    assert b"sk-full" not in body and b"sk-read" not in body and b'"/k"' not in body
    got = wire.decode(body)["config"]
    assert (got.api_key, got.readonly_api_key, got.api_key_file) == (None, None, None)
    assert got == CONFIG
    # and rank 0 clears them before anything else sees the config
    served = group_config(cfg, "tensor")
    assert (served.api_key, served.readonly_api_key, served.api_key_file) == (None, None, None)


def _with(path: list[Any], value: Any) -> bytes:
    """The good step message with one field replaced."""
    data = good_step()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return raw(data)


REQ = ["commands", 0, "request"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (pickle.dumps({"kind": "stop", "commands": [], "seed": 0}), "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (raw([1, 2]), "message must be an object"),
        (raw({"kind": "exec", "commands": [], "seed": 0}), "unknown kind 'exec'"),
        (raw({"kind": "stop", "commands": [], "seed": 0, "code": "x"}), "unknown fields"),
        (_with(["seed"], "1"), "seed must be an integer"),
        (_with(["seed"], True), "seed must be an integer"),
        (_with(["seed"], 1 << 65), "seed out of bounds"),
        (_with(["seed"], float("nan")), "seed must be an integer, got float"),
        (_with(["commands"], {"cmd": "abort"}), "commands must be a list"),
        (_with(["commands", 0, "cmd"], "__import__"), "unknown command '__import__'"),
        (_with(["commands", 0, "cmd"], "step"), "unknown command 'step'"),
        (_with([*REQ, "max_tokens"], "17"), "request.max_tokens must be an integer"),
        (_with([*REQ, "max_tokens"], -1), "request.max_tokens out of bounds"),
        (_with([*REQ, "prompt_ids"], [1, 2, 3]), "request.prompt_ids must be a string"),
        (_with([*REQ, "prompt_ids"], "AQID"), "request.prompt_ids is not uint32"),
        (_with([*REQ, "prompt_ids"], "%%%%"), "request.prompt_ids must be base64"),
        (_with([*REQ, "sampling", "temperature"], "hot"), "sampling.temperature must be"),
        (_with([*REQ, "sampling", "logprobs"], 1), "sampling.logprobs must be a boolean"),
        (_with([*REQ, "sampling", "hook"], 1), "sampling has unknown fields"),
        (_with([*REQ, "stop_token_ids"], list(range(5000))), "stop_token_ids is too long"),
        (_with(["commands", 2, "reason"], None), "reason must be a string"),
        (_with(["commands", 4, "changes"], {"parallel": [1]}), "must be a string"),
        (raw({"kind": "setup", "mode": "rank0", "config": {}}), "mode 'rank0'"),
        (raw({"kind": "setup", "mode": "tensor", "config": {"api_key": "x"}}), "unknown fields"),
        (raw({"kind": "setup", "mode": "tensor", "config": {"port": "80"}}), "config.port"),
        (raw({"kind": "setup", "mode": "tensor", "config": {"extra": {}}}), "unknown fields"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # nesting: no RecursionError escapes
        (b" " * (wire.MAX_MESSAGE_BYTES + 1), "over the size bound"),
    ],
)
def test_anything_else_is_refused_with_a_channel_error(body: bytes, words: str) -> None:
    with pytest.raises(ChannelError, match=words.replace("(", r"\(")) as info:
        wire.decode(body)
    assert str(info.value).startswith("dropped a malformed message from rank 0")


def test_oversize_values_are_refused() -> None:
    ids = wire.encode_tokens(list(range(10)))
    assert wire.decode_tokens(ids, "p", limit=10) == tuple(range(10))
    with pytest.raises(ChannelError, match="p is too long"):
        wire.decode_tokens(ids, "p", limit=9)
    many = {"kind": "ping", "commands": [{"cmd": "reset_prompt_cache"}] * 70000, "seed": 0}
    with pytest.raises(ChannelError, match="commands is too long"):
        wire.decode(raw(many))
    with pytest.raises(ChannelError, match=r"request\.request_id is too long"):
        wire.decode(_with([*REQ, "request_id"], "x" * 2000))
    huge = GenerationRequest("big", (0,) * 100, 1, SamplingParams(json_schema="x" * (65 << 20)))
    with pytest.raises(ChannelError, match="over the ring's bound"):  # rank 0 does not send it
        wire.encode({"kind": "step", "commands": [("add_request", (huge,))], "seed": 0})


def test_rank_0_refuses_a_request_that_would_not_travel_unchanged() -> None:
    wire.check_travels(REQUEST)
    wire.check_travels(GenerationRequest("r", (1,), 4, SamplingParams(seed=(1 << 64) - 1)))
    wire.check_travels(GenerationRequest("r", (1,), 4, SamplingParams(temperature=float("nan"))))
    huge_seed = GenerationRequest("r", (1, 2), 4, SamplingParams(seed=1 << 70))
    with pytest.raises(ChannelError, match=r"^sampling\.seed out of bounds"):
        wire.check_travels(huge_seed)
    with pytest.raises(ChannelError, match="request_id is too long"):
        wire.check_travels(GenerationRequest("x" * 2000, (1,), 1))


# -- the seal --------------------------------------------------------------------------


def test_the_seal_refuses_other_keys_flipped_bits_and_replays() -> None:
    key = GroupKey.new()
    sender, receiver = Sealer(key), Sealer(key)
    body = wire.encode({"kind": "ping", "commands": [], "seed": 0})
    first = sender.seal(body)
    assert receiver.open(first) == body
    failed = "dropped a message that failed authentication from rank 0"
    with pytest.raises(ChannelError, match=f"{failed} .sequence number 1 replayed or old"):
        receiver.open(first)
    forged = [
        Sealer(GroupKey.new()).seal(body),  # another group's secret
        Sealer(GroupKey(os.urandom(16), key.secret)).seal(body),  # same secret, another group
        first[:-1] + bytes([first[-1] ^ 1]),  # one bit of the body
        first[:8] + b"\0" * 32 + first[40:],  # no MAC
        (5).to_bytes(8, "big") + first[8:],  # a sequence number the MAC was not made over
    ]
    for frame in forged:
        with pytest.raises(ChannelError, match=f"{failed} .wrong MAC"):
            receiver.open(frame)
    for frame in (b"", pickle.dumps("x")[:30]):
        with pytest.raises(ChannelError, match=f"{failed} .* no MAC"):
            receiver.open(frame)
    second, third = sender.seal(body), sender.seal(body)
    assert receiver.open(third) == body
    with pytest.raises(ChannelError, match="sequence number 2 replayed or old, last 3"):
        receiver.open(second)  # older than the last accepted one
    assert receiver.last_seq == 3


def test_the_group_key_line_and_the_worker_env() -> None:
    key = GroupKey.new()
    assert GroupKey.from_line(key.line()) == key
    assert key.secret.hex() not in repr(key)
    for line in (b"", b"\n", b"zz zz\n", b"00 11\n"):
        with pytest.raises(ChannelError):
            GroupKey.from_line(line)
    env = {
        "PATH": "/bin",
        "MLXCEL_API_KEY": "sk-full",
        "MLXCEL_READONLY_API_KEY": "sk-read",
        "MLXCEL_API_KEY_FILE": "/k",
        "MLXCEL_HOME": "/h",
    }
    assert worker_env(env) == {"PATH": "/bin", "MLXCEL_HOME": "/h"}
