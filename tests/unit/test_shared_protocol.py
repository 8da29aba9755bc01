"""Control-protocol codec and snapshot round trips (docs/api.md, "Control API")."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlxcel.shared.protocol import (
    E_METHOD,
    E_PARAMS,
    E_PARSE,
    Event,
    ProtocolError,
    Reply,
    Request,
    decode_message,
    decode_request,
    encode,
    error_reply,
)
from mlxcel.shared.snapshot import (
    ConfigChange,
    Counters,
    DaemonInfo,
    EffectiveConfig,
    EngineSnapshot,
    KVInfo,
    LatencyInfo,
    PromptCacheInfo,
    QueueEntry,
    SlotInfo,
    Snapshot,
)


def test_request_round_trip() -> None:
    req = Request(7, "config.set", {"changes": {"parallel": 2}})
    line = encode(req)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_request(line) == req


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"not json\n", E_PARSE),
        (b"\xff\xfe\n", E_PARSE),
        (b'{"id": 1, "method": "nope"}\n', E_METHOD),
        (b'{"id": 1, "method": "status", "params": [1]}\n', E_PARAMS),
    ],
)
def test_bad_requests(line: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_request(line)
    assert exc.value.code == code


def test_error_reply_keeps_id() -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_request(b'{"id": 5, "method": "bogus"}')
    assert exc.value.req_id == 5
    reply = error_reply(5, exc.value.code, exc.value.message)
    assert json.loads(encode(reply)) == {
        "id": 5,
        "error": {"code": E_METHOD, "message": exc.value.message},
    }


def test_client_side_decoding() -> None:
    assert decode_message(b'{"id": 1, "result": {"a": 1}}') == Reply(1, {"a": 1})
    assert decode_message(b'{"event": "snapshot", "data": {}}') == Event("snapshot", {})


@given(st.binary(max_size=200))
def test_decode_request_never_crashes(data: bytes) -> None:
    try:
        req = decode_request(data)
    except ProtocolError:
        return
    assert isinstance(req.method, str) and isinstance(req.params, dict)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=20,
    )
)
def test_decode_any_json_never_crashes(obj: object) -> None:
    try:
        decode_request(json.dumps(obj).encode())
    except ProtocolError:
        pass


def _snapshot() -> Snapshot:
    engine = EngineSnapshot(
        time=1.5,
        config=EffectiveConfig(4, 8, 8, "clamped", 4, 4096, 512, True, 1 << 30, None, 64, 2048),
        slots=(SlotInfo(0, "decode", "req-1", 10, 5, 10, 3, 64, 1, 0.25, 12.5, 1.0), SlotInfo(1)),
        queue=(QueueEntry("req-2", 300, "kv_budget", 0.5),),
        kv=KVInfo(blocks_total=None, blocks_used=3),
        prompt_cache=PromptCacheInfo(entries=1, bytes=100),
        latency=LatencyInfo(
            ttft_p50_s=0.1, ttft_by_cache={"hit": (0.1, 0.2), "miss": (None, None)}
        ),
        counters=Counters(requests_by_finish_reason={"stop": 2}),
    )
    return Snapshot(DaemonInfo("0.1.0", 123, 5.0, "m", "cpu", "float32", None, None), engine)


def test_snapshot_round_trip_through_json() -> None:
    snap = _snapshot()
    assert Snapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap


def test_snapshot_has_no_prompt_text_field() -> None:
    fields = json.dumps(_snapshot().to_dict())
    assert "prompt_text" not in fields and "messages" not in fields


def test_config_change_round_trip() -> None:
    ch = ConfigChange("parallel", 8, True, 1, 4, "clamped: model cannot batch")
    assert ConfigChange.from_dict(ch.to_dict()) == ch
