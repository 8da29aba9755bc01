"""Control-protocol lines a hostile peer can write that plain JSON fuzzing misses
(tests/unit/test_shared_protocol.py fuzzes bytes and ordinary JSON): integers past Python's
4300-digit conversion limit, NaN and infinities, deep nesting, lone surrogates. decode_request
raises only ProtocolError, and whatever it accepts can be echoed in a reply or an event
(encode() refuses NaN, so one accepted NaN would break every subscriber's push loop).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlxcel.shared.protocol import ProtocolError, Reply, decode_message, decode_request, encode

hostile_atoms = st.one_of(
    st.integers(4200, 6000).map(lambda n: "9" * n),  # around the int-to-str digit limit
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", '"\\ud800"', '"\\udfff x"']),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
    st.text(max_size=8).map(json.dumps),
)


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    where = draw(st.sampled_from(["id", "method", "params", "value"]))
    atom = draw(hostile_atoms)
    if where == "id":
        text = f'{{"id": {atom}, "method": "status"}}'
    elif where == "method":
        text = f'{{"id": 1, "method": {atom}}}'
    elif where == "params":
        text = f'{{"id": 1, "method": "config.set", "params": {atom}}}'
    else:
        text = (
            f'{{"id": 1, "method": "config.set", "params": {{"values": {{"parallel": {atom}}}}}}}'
        )
    return text.encode()


@settings(max_examples=300)
@given(lines())
def test_hostile_lines_are_protocol_errors_or_answerable(line: bytes) -> None:
    try:
        req = decode_request(line)
    except ProtocolError as exc:
        assert exc.code in {"parse_error", "invalid_request", "invalid_params", "method_not_found"}
        encode(Reply(exc.req_id, error={"code": exc.code, "message": exc.message}))
        return
    # Accepted: the daemon must be able to echo the id and the values back.
    assert isinstance(req.method, str) and isinstance(req.params, dict)
    # (NaN and infinities must have been refused: encode() would raise on them.)
    encoded = encode(Reply(req.id, result={"echo": req.params}))
    assert decode_message(encoded).id == req.id


@given(st.integers(4301, 20_000))  # Python parses up to 4300 digits
def test_a_client_reading_a_huge_integer_gets_a_protocol_error(digits: int) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_message(b'{"id": ' + b"7" * digits + b', "result": {}}')
    assert exc.value.code == "parse_error"
