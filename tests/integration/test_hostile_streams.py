"""Hostile streaming and Ollama clients (docs/reliability.md), on an in-process daemon:

- a client that stops reading a stream (a tiny receive buffer, never read) is cut after
  `stream_timeout`: its engine request aborted, its model lease released (an unload
  completes at once), in every dialect;
- Ollama `keep_alive` values that are no duration (1e999, NaN, "1e999s", 400 digits) and
  non-finite options are a 400, and the status (control socket, /api/ps) stays encodable;
- `/api/show` answers only for the store and the resident models: paths (`/etc`, `/`, a
  folder holding a 20,000-layer config.json, `../../x`) are a 404 naming the store, at once.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import (
    EventReader,
    control,
    embedded_daemon,
    http_json,
    wait_idle_embedded,
    wait_until,
)

STREAM_TIMEOUT_S = 2.0
MAX_TOKENS = 1900  # far more than fills the buffers: a stream cut early is an abort
CLIENT_RCVBUF = 4096
SERVER_SNDBUF = 4096
TRANSPORT_HIGH_WATER = 1024
STORE_MODEL = "tiny-store"
MARGIN_S = 20.0  # other work shares the 2 cores
ABORT_WITHIN_S = 3.0  # from the cut to the engine's final output: a decode step or two


@pytest.fixture(scope="module")
def daemon(
    slow_model_dir: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("streams-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXCEL_HOME", str(home))  # the store the registry reads
        from mlxcel.daemon.models.pull import pull

        pull(str(tiny_model_dir), name=STORE_MODEL, link=True, progress=None)
        with embedded_daemon(
            tmp_path_factory, slow_model_dir, parallel=4, stream_timeout=STREAM_TIMEOUT_S
        ) as d:
            _small_send_buffers(d)
            yield d


def _small_send_buffers(d: Any) -> None:
    """Small kernel send buffers on the daemon's listening socket (accepted connections
    inherit them), so that a client that reads nothing fills them after a few kB instead of
    the megabytes loopback autotuning allows."""
    for site in d.daemon._runner.sites:
        for sock in site._server.sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SERVER_SNDBUF)


def _small_transport_buffer(d: Any, client: socket.socket) -> None:
    """The daemon's side of `client`'s connection waits for the client once 1 kB is queued in
    user space (asyncio's default: 64 kB): with the small kernel buffers, a stream stalls
    after ~100 tokens, long before it ends. Only buffer sizes change, none of our code."""
    port = client.getsockname()[1]

    def shrink() -> bool:
        runner_server = d.daemon._runner.server
        server = getattr(runner_server, "server", runner_server)  # under the edge guards
        for handler in server.connections:
            transport = handler.transport
            if transport is not None and transport.get_extra_info("peername")[1] == port:
                transport.set_write_buffer_limits(high=TRANSPORT_HIGH_WATER)
                return True
        return False

    wait_until(lambda: d.call(shrink), timeout=10.0, poll=0.01, what="the connection accepted")


def _port(d: Any) -> int:
    return int(d.http_url.rsplit(":", 1)[1])


def _non_reader(d: Any, path: str, body: dict[str, Any]) -> socket.socket:
    """A client that sends a request and never reads a byte of the answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)  # before connect
    sock.connect(("127.0.0.1", _port(d)))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    _small_transport_buffer(d, sock)
    return sock


PROMPT = [{"role": "user", "content": "Tell me a long story about rivers."}]
# One non-reader per dialect, at once. Greedy: the tiny random model's greedy text does not
# reach its end-of-sequence token; OpenAI's log-probabilities make its chunks ~2 kB.
STALLED = {
    "openai": (
        "/v1/chat/completions",
        {
            "messages": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        },
    ),
    "anthropic": (
        "/v1/messages",
        {"messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True},
    ),
    "ollama": (
        "/api/chat",
        {"messages": PROMPT, "options": {"num_predict": MAX_TOKENS, "temperature": 0}},
    ),
}


WHOLE_TOKENS = 200
WHOLE = {**STALLED["openai"][1], "stream": False, "max_tokens": WHOLE_TOKENS}


def _resident_leases(d: Any) -> list[int]:
    reply = control(d.socket_path, "model.list")
    return [m["active_requests"] for m in reply["result"]["models"]]


def test_clients_that_stop_reading_are_cut_and_their_leases_released(
    daemon: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlxcel.http")
    events = EventReader(daemon.socket_path)
    socks: list[socket.socket] = []
    try:
        started = time.monotonic()
        for path, body in STALLED.values():
            socks.append(_non_reader(daemon, path, body))
        # A whole (not streamed) answer of ~400 kB to a client that reads none of it: aiohttp
        # writes it after the handler returned, so it holds no lease (but its connection).
        socks.append(_non_reader(daemon, "/v1/chat/completions", WHOLE))
        # Each request runs, its writes stall once the buffers are full, and the deadline
        # cuts it: it finishes as an abort, long before max_tokens.
        seen: dict[str, float] = {}  # request id -> when its request_finished was first seen

        def all_finished() -> bool:
            for event in events.of("request_finished"):
                seen.setdefault(event["request_id"], time.time())
            return len(seen) >= len(STALLED) + 1

        wait_until(
            all_finished,
            timeout=60.0 + MARGIN_S,
            poll=0.02,
            what="every stalled request finished",
        )
        took = time.monotonic() - started
        finished = {e["request_id"]: e for e in events.of("request_finished")}
        gaps: dict[str, float] = {}
        (whole,) = [e for e in finished.values() if e["completion_tokens"] == WHOLE_TOKENS]
        assert whole["finish_reason"] == "length", whole
        del finished[whole["request_id"]]
        for rid, event in finished.items():
            assert event["finish_reason"] == "abort", event
            assert event["completion_tokens"] < MAX_TOKENS, event
            (cut,) = [
                r
                for r in caplog.records
                if "client stopped reading" in r.getMessage() and rid in r.getMessage()
            ] or [None]
            assert cut is not None, (rid, [r.getMessage() for r in caplog.records])
            # Aborted in the engine at once: its final output follows the cut within a step.
            assert seen[rid] - cut.created < ABORT_WITHIN_S, (rid, seen[rid] - cut.created)
            gaps[rid] = round(seen[rid] - cut.created, 3)
        prefixes = sorted(rid.split("-")[0].split("_")[0] for rid in finished)
        assert prefixes == ["chatcmpl", "msg", "ollama"], prefixes
        wait_idle_embedded(daemon, 5.0)  # slots and KV free
        # The handlers returned: no lease held, so an unload does not wait for them.
        wait_until(lambda: _resident_leases(daemon) == [0], timeout=5.0, what="leases released")
        t0 = time.monotonic()
        reply = control(daemon.socket_path, "model.unload", {})
        assert "result" in reply, reply
        unload_s = time.monotonic() - t0
        assert unload_s < 5.0, unload_s
        tokens = {rid: e["completion_tokens"] for rid, e in finished.items()}
        print(f"done after {took:.1f} s; tokens {tokens}; cut to abort {gaps}")
        print(f"unload {unload_s:.2f} s")
    finally:
        for sock in socks:
            sock.close()
        events.close()
    # The next request loads the model again and is served.
    status, _, answer = http_json(
        daemon.http_url + "/v1/chat/completions", {"messages": PROMPT, "max_tokens": 4}, timeout=120
    )
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")


# --- Ollama keep_alive and options ------------------------------------------------------------


def _raw_post(d: Any, path: str, text: str) -> tuple[int, Any]:
    """POST a body given as raw text (NaN and 1e999 are not JSON a client library writes)."""
    req = urllib.request.Request(
        d.http_url + path, data=text.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


# NaN, Infinity and 1e999 may be refused as JSON already (`read_json`), else by the field's check.
JSON_LEVEL = ("is not JSON", "is out of range")


def _names(message: str, *words: str) -> bool:
    """A clear 400: the field's own message, or the JSON reader's naming the bad number."""
    return all(w in message for w in words) or any(j in message for j in JSON_LEVEL)


def test_the_checks_behind_the_json_reader() -> None:
    """Values a JSON reader may let through (Python's does: NaN, inf, 10**400) reach the
    field checks, which refuse them with the field's name."""
    from mlxcel.daemon.server.anthropic_api import to_openai_body
    from mlxcel.daemon.server.errors import APIError
    from mlxcel.daemon.server.ollama_api import _options, keep_alive_seconds

    for value in (math.inf, -math.inf, math.nan, 1e300, 10**400, "9" * 60 + "h", [], True):
        with pytest.raises(APIError, match=r"keep_alive .*ten years") as info:
            keep_alive_seconds(value)
        assert info.value.status == 400
    assert keep_alive_seconds(-(10**400)) is None and keep_alive_seconds("-5m") is None
    assert keep_alive_seconds("87600h") == 10 * 365 * 86400.0
    for key in ("num_ctx", "temperature", "mirostat_tau"):
        for bad in (math.inf, math.nan):
            with pytest.raises(APIError, match=f"'options.{key}' must be a finite number"):
                _options({"options": {key: bad}})
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bad_budgets = (math.inf, math.nan, 0, 1.5, "1024")
    for thinking in [{"type": "enabled", "budget_tokens": b} for b in bad_budgets] + ["x"]:
        with pytest.raises(APIError, match="thinking"):
            to_openai_body({**base, "thinking": thinking})
    assert to_openai_body({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}})


GENERATE = '{"prompt": "hi", "stream": false, "options": {"num_predict": 2}, "keep_alive": %s}'
BAD_KEEP_ALIVE = [
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    '"1e999s"',
    '"' + "9" * 400 + 'h"',
    '"99999999999h"',
    "1" + "0" * 400,
]


@pytest.mark.parametrize("value", BAD_KEEP_ALIVE, ids=lambda v: v[:12])
def test_keep_alive_that_is_no_duration_is_a_400_and_the_status_still_encodes(
    daemon: Any, value: str
) -> None:
    for path, body in (
        ("/api/generate", GENERATE % value),
        (
            "/api/chat",
            GENERATE.replace('"prompt": "hi"', '"messages": [{"role": "user", "content": "hi"}]')
            % value,
        ),
    ):
        status, answer = _raw_post(daemon, path, body)
        assert status == 400, (path, value, answer)
        assert _names(answer["error"], "keep_alive", "ten years"), answer
    # The model's status still encodes: the control socket and /api/ps answer.
    reply = control(daemon.socket_path, "status")
    assert "result" in reply, reply
    assert "result" in control(daemon.socket_path, "model.list")
    status, _, ps = http_json(daemon.http_url + "/api/ps")
    assert status == 200 and isinstance(ps["models"], list)


def test_keep_alive_in_range_is_taken(daemon: Any) -> None:
    status, answer = _raw_post(daemon, "/api/generate", GENERATE % '"1h30m"')
    assert status == 200 and answer["done"], answer
    (model,) = control(daemon.socket_path, "model.list")["result"]["models"]
    assert model["keep_alive_s"] == 5400.0
    status, answer = _raw_post(daemon, "/api/generate", GENERATE % "-1")  # forever, as Ollama
    assert status == 200
    (model,) = control(daemon.socket_path, "model.list")["result"]["models"]
    assert model["keep_alive_s"] is None


@pytest.mark.parametrize(
    "options",
    [
        '{"num_ctx": 1e999}',
        '{"temperature": NaN}',
        '{"top_p": -Infinity}',
        '{"num_predict": 1e999}',
        '{"seed": NaN}',
        '{"repeat_penalty": Infinity}',
    ],
    ids=lambda v: v[:16],
)
def test_non_finite_ollama_options_are_a_400(daemon: Any, options: str) -> None:
    body = '{"prompt": "hi", "stream": false, "options": ' + options + "}"
    status, answer = _raw_post(daemon, "/api/generate", body)
    assert status == 400, answer
    assert _names(answer["error"], "options.", "finite"), answer


ANTHROPIC = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}'


@pytest.mark.parametrize(
    "body, field",
    [
        (ANTHROPIC % "1e999", "max_tokens"),
        (ANTHROPIC % "NaN", "max_tokens"),
        (ANTHROPIC[:-1] % "4" + ', "temperature": NaN}', "temperature"),
        (ANTHROPIC[:-1] % "4" + ', "temperature": 1e999}', "temperature"),
        (ANTHROPIC[:-1] % "4" + ', "top_p": NaN}', "top_p"),
        (ANTHROPIC[:-1] % "4" + ', "top_k": Infinity}', "top_k"),
        (
            ANTHROPIC[:-1] % "4" + ', "thinking": {"type": "enabled", "budget_tokens": 1e999}}',
            "budget_tokens",
        ),
        (
            ANTHROPIC[:-1] % "4" + ', "thinking": {"type": "enabled", "budget_tokens": NaN}}',
            "budget_tokens",
        ),
        (ANTHROPIC[:-1] % "4" + ', "thinking": "yes"}', "thinking"),
    ],
    ids=lambda v: v if len(v) < 16 else v[-30:],
)
def test_non_finite_anthropic_fields_are_a_400(daemon: Any, body: str, field: str) -> None:
    status, answer = _raw_post(daemon, "/v1/messages", body)
    assert status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert _names(answer["error"]["message"], field), answer


# --- /api/show --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def huge_config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a config.json of 20,000 layers (and a chat template): no model."""
    folder = tmp_path_factory.mktemp("huge-config")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 20000,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text("SECRET TEMPLATE {{ messages }}")
    return folder


def test_show_resolves_only_store_and_resident_models(daemon: Any, huge_config_dir: Path) -> None:
    names = ["/etc", "/", str(huge_config_dir), "../../x", "../" * 12 + "etc", "~", "no-such-model"]
    for name in names:
        t0 = time.monotonic()
        status, _, answer = http_json(daemon.http_url + "/api/show", {"model": name})
        took = time.monotonic() - t0
        assert status == 404, (name, answer)
        assert "is not in the local store" in answer["error"], answer
        assert "models list" in answer["error"], answer
        assert "SECRET" not in json.dumps(answer)
        assert took < 1.0, (name, took)
    # The same names in the generation routes: 404 too, nothing loaded from a path.
    for path in ("/api/chat", "/api/generate"):
        body = {"model": str(huge_config_dir), "messages": PROMPT, "prompt": "hi", "stream": False}
        status, _, answer = http_json(daemon.http_url + path, body)
        assert status == 404, (path, answer)
    # A store model and the resident one are described.
    t0 = time.monotonic()
    status, _, shown = http_json(daemon.http_url + "/api/show", {"model": STORE_MODEL})
    assert status == 200, shown
    assert shown["details"]["family"] == "llama" and shown["model_info"]["llama.context_length"]
    assert time.monotonic() - t0 < 1.0
    resident = control(daemon.socket_path, "model.list")["result"]["models"][0]["name"]
    status, _, shown = http_json(daemon.http_url + "/api/show", {"model": resident})
    assert status == 200 and shown["details"]["family"] == "llama", shown
