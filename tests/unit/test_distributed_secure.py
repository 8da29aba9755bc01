"""The ring between a group's ranks carries typed, authenticated messages (docs/distributed.md):
the codec (every message round-trips; unknown kinds, wrong types, oversize payloads are refused),
the HMAC seal (wrong key, wrong group, a flipped bit, a replay are refused), forged messages on a
real ring to a real worker (dropped and logged, a pickle gadget never runs), and a real group
whose worker holds neither API key."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from daemon_helpers import http_json, pid_running, wait_until
from mlxcel.daemon.distributed import wire
from mlxcel.daemon.distributed.launch import group_config, worker_env
from mlxcel.daemon.distributed.wire import ChannelError, GroupKey, Sealer
from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams
from mlxcel.shared.config import ServingConfig
from test_distributed import free_ports, kill_ranks, rank_pids, start_group

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


# -- unit: the codec -----------------------------------------------------------------------


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_rank_0_refuses_a_request_that_would_not_travel_unchanged() -> None:
    wire.check_travels(REQUEST)
    wire.check_travels(GenerationRequest("r", (1,), 4, SamplingParams(seed=(1 << 64) - 1)))
    wire.check_travels(GenerationRequest("r", (1,), 4, SamplingParams(temperature=float("nan"))))
    huge_seed = GenerationRequest("r", (1, 2), 4, SamplingParams(seed=1 << 70))
    with pytest.raises(ChannelError, match=r"^sampling\.seed out of bounds"):
        wire.check_travels(huge_seed)
    with pytest.raises(ChannelError, match="request_id is too long"):
        wire.check_travels(GenerationRequest("x" * 2000, (1,), 1))


# -- unit: the seal --------------------------------------------------------------------------


@pytest.mark.unit
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


@pytest.mark.unit
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


# -- e2e: forged messages on a real ring, to a real worker ---------------------------------

FORGER = r"""
import json, os, pickle, sys
import mlx.core as mx
from mlxcel.daemon.distributed.channel import Channel, RankFigures
from mlxcel.daemon.distributed.wire import GroupKey, Sealer, encode

key = GroupKey.from_line(sys.stdin.buffer.readline())
marker = sys.argv[1]


class Gadget:  # unpickling this creates the marker file
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))


group = mx.distributed.init(strict=True, backend="ring")
ch = Channel(group, key)
figs = RankFigures(0, 0, os.getpid(), 0)
ping = {"kind": "ping", "commands": [], "seed": 0}
gadget = pickle.dumps({"kind": "setup", "config": Gadget(), "mode": "tensor"})
send = lambda frame: ch.transfer(frame, figs)
send(gadget)  # the old wire format: a bare pickle
send(Sealer(GroupKey.new()).seal(encode(ping)))  # another group's secret
send(Sealer(GroupKey(os.urandom(16), key.secret)).seal(encode(ping)))  # another group id
flipped = bytearray(ch.sealer.seal(encode(ping)))
flipped[-3] ^= 1
send(bytes(flipped))  # one bit changed on the way
frame = ch.sealer.seal(encode(ping))
send(frame)  # authentic (a ping before the setup: ignored)
send(frame)  # the same frame again: a replay
send(ch.sealer.seal(gadget))  # authentic, but a pickle: not a message
send(ch.sealer.seal(json.dumps({"kind": "exec", "argv": ["touch", marker]}).encode()))
send(gadget + b"x" * 3000)  # the old format again, over the inline room
ch.exchange({"kind": "stop", "commands": [], "seed": 0}, figs)  # authentic: the worker exits
print("forger done", flush=True)
"""


@pytest.mark.e2e
def test_forged_ring_messages_are_dropped_logged_and_never_run(tmp_path: Path) -> None:
    ports = free_ports(2)
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    marker = tmp_path / "pwned"
    key = GroupKey.new()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    env.update(MLX_HOSTFILE=str(hostfile), MLXCEL_NO_FAST_FORWARD="1")
    log_path = tmp_path / "rank1.log"
    with open(log_path, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "mlxcel.daemon.distributed.worker"],
            env={**env, "MLX_RANK": "1"},
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    forger = subprocess.Popen(
        [sys.executable, "-c", FORGER, str(marker)],
        env={**env, "MLX_RANK": "0"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert worker.stdin is not None
        worker.stdin.write(key.line())
        worker.stdin.close()
        forged_out, _ = forger.communicate(key.line(), timeout=180)
        code = worker.wait(60)
    finally:
        for proc in (worker, forger):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text(errors="replace")
    assert not marker.exists(), "a pickle from the ring was run"
    assert b"forger done" in forged_out, forged_out.decode(errors="replace")
    assert code == 0, text  # the authentic stop still ended it: no crash on the way
    failed = "distributed: dropped a message that failed authentication from rank 0"
    assert text.count(f"{failed} (wrong MAC)") == 5, text  # pickles, other keys, flipped bit
    assert text.count(f"{failed} (sequence number 2 replayed or old, last 2)") == 1, text
    assert text.count("distributed: dropped a malformed message from rank 0: not JSON") == 1
    assert text.count("dropped a malformed message from rank 0: unknown kind 'exec'") == 1
    assert "ping before the setup, ignored" in text and "stop from rank 0" in text
    assert "Traceback" not in text


# -- e2e: a real group serves, and its worker holds no key ----------------------------------

FULL_KEY = "sk-full-6f1d2c"
READ_KEY = "sk-read-93ab07"


@pytest.mark.e2e
def test_group_serves_with_keys_that_its_worker_never_holds(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    home = tmp_path / "home"
    keys = {"MLXCEL_API_KEY": FULL_KEY, "MLXCEL_READONLY_API_KEY": READ_KEY}
    daemon = start_group(home, tiny_model_dir, 2, **keys)
    pids = rank_pids(daemon)
    try:
        body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}
        url = f"{daemon.http_url}/v1/completions"
        status, _, reply = http_json(url, body, {"Authorization": f"Bearer {FULL_KEY}"})
        refused, _, _ = http_json(url, body)
        # the largest seed the API takes (uint64) travels: the group stays in lockstep
        big = {**body, "temperature": 1.0, "seed": (1 << 64) - 1}
        headers = {"Authorization": f"Bearer {FULL_KEY}"}
        big_status, _, big_reply = http_json(url, big, headers)
        again, _, _ = http_json(url, body, headers)
        worker = psutil.Process(pids[0])
        worker_env_now, argv = worker.environ(), worker.cmdline()
        rank_log = (home / "logs" / "rank1.log").read_text(errors="replace")
        group = daemon.status()["group"]
    finally:
        daemon.stop()
        kill_ranks(pids)
    assert status == 200 and reply["usage"]["completion_tokens"] == 6, reply
    assert refused == 401  # rank 0 does enforce the key it keeps
    assert big_status == 200, big_reply
    assert again == 200
    assert group["status"] == "ok" and group["ranks"][1]["steps"] > 0
    assert worker_env_now.get("MLX_RANK") == "1"  # the right process
    for where in (json.dumps(worker_env_now), json.dumps(argv), rank_log):
        assert FULL_KEY not in where and READ_KEY not in where
    assert not [k for k in worker_env_now if "API_KEY" in k.upper()]
    assert argv[-1].endswith("distributed.worker") and len(argv) == 3  # no secret on argv
    wait_until(lambda: not any(pid_running(p) for p in pids), timeout=10)


@pytest.mark.e2e
def test_a_worker_without_the_group_key_does_not_join(tmp_path: Path) -> None:
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    done = subprocess.run(
        [sys.executable, "-m", "mlxcel.daemon.distributed.worker"],
        env={**env, "MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "FATAL no group key on stdin (a rank is started by its rank 0)" in done.stderr
    assert "Traceback" not in done.stderr
