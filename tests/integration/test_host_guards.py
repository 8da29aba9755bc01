"""The model host's guards (issue #31; docs/reliability.md, docs/models.md), in a whole
in-process daemon on tiny random-weight models:

- a switch whose load fails with any error (here a ValueError from a config.json the engine
  rejects) loads the evicted model back: the request gets one clear `model_load_failed`;
- a GGUF file with a bad header is refused before anything is evicted;
- the memory check counts what the weights take on this backend (a 4-bit model expanded to
  float32 on the CPU) and refuses, with a 507, one that cannot fit, before evicting;
- `model.unload` of a model whose request will not end aborts it after `UNLOAD_WAIT_S` and
  holds no lock meanwhile (another model loads and answers);
- at most `max_queue_depth` requests wait for a model to load; the next one gets a 503 with
  `Retry-After`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from daemon_helpers import chat_body, control, embedded_daemon, http_json, wait_until
from mlxcel.daemon.hosting import host as model_host
from mlxcel.daemon.models.pull import pull
from repo_paths import TESTS

LONG_CONTEXT = 32768  # a tiny model with room for a generation that outlasts the test


def _ask(url: str, model: str, max_tokens: int = 4, timeout: float = 60.0) -> tuple[int, Any]:
    status, _, body = http_json(
        url + "/v1/chat/completions",
        chat_body("hi", max_tokens, stream=False, model=model),
        timeout=timeout,
    )
    return status, body


def _host(sock: Path) -> dict[str, Any]:
    return control(sock, "model.list")["result"]


def _held(sock: Path) -> list[str]:
    return [m["name"] for m in _host(sock)["models"]]


def _quantize(src: Path, dst: Path, bits: int = 4) -> Path:
    from mlx_lm import convert

    convert(str(src), mlx_path=str(dst), quantize=True, q_bits=bits, q_group_size=32)
    return dst


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.daemon.models.tiny import make_tiny_model

    path = tmp_path_factory.mktemp("long") / "llama"
    return make_tiny_model(path, "llama", seed=3, max_position_embeddings=LONG_CONTEXT)


def test_a_load_failing_with_any_error_loads_the_evicted_model_back(
    mlxcel_home: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from mlxcel.daemon.models.tiny import make_tiny_model

    # Its files are sound; the engine's setup raises ValueError (negative dimensions).
    bad = make_tiny_model(tmp_path / "bad", seed=1, max_position_embeddings=-5)
    pull(str(bad), name="bad", progress=None)
    with embedded_daemon(tmp_path_factory, tiny_model_dir) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        status, body = _ask(url, "bad")
        assert status == 500, body
        assert body["error"]["code"] == "model_load_failed"
        assert "cannot load model 'bad'" in body["error"]["message"]
        assert "ValueError" in body["error"]["message"]
        # The evicted model is back before the error is answered, and serves.
        host = _host(sock)
        assert [m["name"] for m in host["models"]] == [first]
        assert (host["loads"], host["unloads"], host["load_failures"]) == (2, 1, 1)
        status, body = _ask(url, first)
        assert status == 200 and body["model"] == first
        assert _host(sock)["loads"] == 2  # answered by the reloaded model, no other load


def test_a_gguf_with_a_bad_header_is_refused_before_the_model_is_evicted(
    mlxcel_home: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import sys

    sys.path.insert(0, str(TESTS))
    from tiny_gguf import write_tiny_gguf

    crafted = write_tiny_gguf(tiny_model_dir, tmp_path / "crafted.gguf")
    raw = bytearray(crafted.read_bytes())
    raw[:4] = b"GGUX"  # a bad magic
    crafted.write_bytes(bytes(raw))
    with embedded_daemon(tmp_path_factory, tiny_model_dir) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        before = _host(sock)["models"][0]["loaded_at"]
        reply = control(sock, "model.load", {"name": str(crafted)})
        assert reply["error"]["code"] == "model_load_failed", reply
        assert "GGUF" in reply["error"]["message"] or "gguf" in reply["error"]["message"]
        host = _host(sock)
        assert (host["loads"], host["unloads"], host["load_failures"]) == (1, 0, 1)
        assert host["models"][0]["loaded_at"] == before  # never evicted
        assert _ask(url, first)[0] == 200


def test_the_footprint_is_what_the_weights_take_on_this_backend(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import sys

    from mlxcel.daemon.models.footprint import resident_weight_bytes
    from mlxcel.daemon.models.loader import load_model

    sys.path.insert(0, str(TESTS))
    from tiny_gguf import write_tiny_gguf

    q4 = _quantize(tiny_model_dir, tmp_path / "q4")
    q8 = _quantize(tiny_model_dir, tmp_path / "q8", bits=8)
    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    for path in (tiny_model_dir, q4, q8, gguf):
        loaded = load_model(str(path)).info.weights_bytes  # the CPU dequantizes to float32
        assert resident_weight_bytes(path, "cpu") == loaded, path
    q4_file = sum(f.stat().st_size for f in q4.glob("*.safetensors"))
    from mlxcel.daemon.forward.forward_plan import kernels_refuse

    if kernels_refuse({(4, 64, "affine")}) is None:  # kept packed (docs/models.md)
        assert resident_weight_bytes(q4, "cpu") < 2 * q4_file
    else:  # dequantized to float32
        assert resident_weight_bytes(q4, "cpu") > 4 * q4_file
    assert resident_weight_bytes(q4, "metal") <= q4_file  # stays quantized off the CPU


def test_a_quantized_model_that_cannot_fit_expanded_is_refused_before_eviction(
    mlxcel_home: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import psutil
    from mlxcel.daemon.models.tiny import make_tiny_model

    # The native steps off: quantized weights are then expanded to float32 on the CPU (with them
    # on, a llama stays packed and fits: tests/integration/test_forward_plan.py).
    monkeypatch.setenv("MLXCEL_NO_FAST_FORWARD", "1")
    wide = make_tiny_model(tmp_path / "wide", seed=2, hidden_size=256, intermediate_size=1024)
    q4 = _quantize(wide, tmp_path / "wide-q4")
    pull(str(q4), name="wide-q4", progress=None)
    on_disk = sum(f.stat().st_size for f in q4.glob("*.safetensors"))
    with embedded_daemon(tmp_path_factory, tiny_model_dir) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        resident = _host(sock)["models"][0]["weights_bytes"]
        # Room for the 4-bit file (x the headroom) and more, not for its float32 weights.
        available = int(on_disk * model_host.MEMORY_HEADROOM) + 1
        real = psutil.virtual_memory
        fake = SimpleNamespace(virtual_memory=lambda: real()._replace(available=available))
        monkeypatch.setattr(model_host, "psutil", fake)
        status, body = _ask(url, "wide-q4")
        assert status == 507, body
        assert body["error"]["code"] == "insufficient_memory"
        message = body["error"]["message"]
        assert "cannot load model 'wide-q4'" in message and "cpu backend" in message
        assert "MiB" in message and "available" in message
        host = _host(sock)
        assert [m["name"] for m in host["models"]] == [first]  # nothing evicted
        assert (host["loads"], host["unloads"], host["load_failures"]) == (1, 0, 1)
        assert resident + available < 5 * on_disk  # the figures the refusal rests on
        monkeypatch.setattr(model_host, "psutil", psutil)  # not undo(): MLXCEL_HOME stays
        status, body = _ask(url, "wide-q4")
        assert status == 200 and body["model"] == "wide-q4"


def test_unload_aborts_a_request_that_will_not_end_and_holds_no_lock(
    mlxcel_home: Path,
    long_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlxcel.daemon.models.tiny import make_tiny_model

    monkeypatch.setattr(model_host, "UNLOAD_WAIT_S", 8.0)
    pull(str(make_tiny_model(tmp_path / "two", seed=1)), name="two", progress=None)
    with embedded_daemon(tmp_path_factory, long_model_dir, max_loaded_models=2) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        out: dict[str, Any] = {}
        max_tokens = LONG_CONTEXT - 64  # minutes of decoding: only an abort ends it soon
        long = threading.Thread(
            target=lambda: out.update(long=_ask(url, first, max_tokens, timeout=300))
        )
        long.start()
        wait_until(lambda: d.daemon.bridge.num_running == 1, what="the long request running")

        def unload() -> None:
            started = time.monotonic()
            out["unload"] = control(sock, "model.unload", {"name": first})
            out["unload_s"] = time.monotonic() - started

        unloading = threading.Thread(target=unload)
        unloading.start()
        wait_until(
            lambda: any(m["state"] == "unloading" for m in _host(sock)["models"]),
            what="the first model unloading",
        )
        # Meanwhile another model loads and answers: the host lock is free.
        status, body = _ask(url, "two")
        assert status == 200 and body["model"] == "two"
        assert unloading.is_alive(), "the unload ended before its wait was over"
        unloading.join(60)
        long.join(60)
        assert out["unload"]["result"] == {"unloaded": [first]}
        limit = model_host.UNLOAD_WAIT_S + model_host.ABORT_GRACE_S + 15  # generous: busy CPU
        assert out["unload_s"] < limit, out["unload_s"]
        status, body = out["long"]
        assert status == 200, body
        assert body["usage"]["completion_tokens"] < max_tokens  # aborted, not finished
        assert _held(sock) == ["two"]


def test_waiters_for_a_load_are_bounded_and_the_next_gets_a_503(
    mlxcel_home: Path,
    long_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlxcel.daemon.models.tiny import make_tiny_model

    monkeypatch.setattr(model_host, "UNLOAD_WAIT_S", 4.0)
    pull(str(make_tiny_model(tmp_path / "two", seed=1)), name="two", progress=None)
    with embedded_daemon(tmp_path_factory, long_model_dir, max_queue_depth=2) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        results: list[Any] = []
        long = threading.Thread(target=_ask, args=(url, first, LONG_CONTEXT - 64, 300))
        long.start()
        wait_until(lambda: d.daemon.bridge.num_running == 1, what="the long request running")
        waiters = [
            threading.Thread(target=lambda: results.append(_ask(url, "two", 4, 120)))
            for _ in range(2)
        ]
        for waiter in waiters:
            waiter.start()
        wait_until(
            lambda: len(control(sock, "status")["result"]["engine"]["queue"]) == 2,
            what="two requests waiting for the load",
        )
        status, headers, body = http_json(
            url + "/v1/chat/completions", chat_body("hi", 4, stream=False, model="two")
        )
        assert status == 503, body
        assert body["error"]["code"] == "queue_full"
        assert "max_queue_depth" in body["error"]["message"]
        assert 1 <= int(headers["Retry-After"]) <= 60
        status, _, health = http_json(url + "/health")
        assert (status, health["status"]) == (200, "ok")  # the resident model still serves
        for waiter in waiters:
            waiter.join(120)
        long.join(120)
        assert [status for status, _ in results] == [200, 200], results
        assert _held(sock) == ["two"]


def test_unload_frees_a_model_whose_client_stopped_reading(
    long_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A streaming client that reads nothing holds its lease in a blocked write, past the
    abort: the unload frees the model anyway once `ABORT_GRACE_S` is over."""
    import socket

    monkeypatch.setattr(model_host, "UNLOAD_WAIT_S", 2.0)
    monkeypatch.setattr(model_host, "ABORT_GRACE_S", 2.0)
    with embedded_daemon(tmp_path_factory, long_model_dir) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        host_name, port = url.removeprefix("http://").split(":")
        # Big chunks (20 logprobs a token) fill the socket buffers within a few hundred tokens.
        request = chat_body("hi", LONG_CONTEXT - 64, model=first, logprobs=True, top_logprobs=20)
        body = json.dumps(request).encode()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.connect((host_name, int(port)))
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host_name}\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            conn.sendall(head.encode() + body)

            def leases() -> int:
                return sum(r.leases for r in d.daemon.host.resident.values())

            def backlog() -> int:  # outputs its handler, blocked in a write, has not taken
                return sum(len(s._ready) for s in d.daemon.bridge._streams.values())

            wait_until(lambda: leases() == 1, what="the stream holding its lease")
            wait_until(lambda: backlog() > 200, 60, 0.05, "the handler blocked in a write")
            started = time.monotonic()
            reply = control(sock, "model.unload", {"name": first})
            took = time.monotonic() - started
            assert reply["result"] == {"unloaded": [first]}, reply
            assert took < model_host.UNLOAD_WAIT_S + model_host.ABORT_GRACE_S + 5, took
            assert _held(sock) == []
        wait_until(lambda: _ask(url, first)[0] == 200, 60, 0.5, "the model loaded again")


def test_a_second_stop_ends_the_drain_of_every_model_not_only_the_default_one(
    mlxcel_home: Path,
    long_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The stop drains every resident model through one path (hosting/drain.py): a request
    on a model other than the default one that will not end soon is aborted as soon as a
    second stop (a second signal) turns the drain off, not after the drain timeout."""
    from mlxcel.daemon.models.tiny import make_tiny_model

    pull(str(make_tiny_model(tmp_path / "two", seed=1)), name="two", progress=None)
    with embedded_daemon(tmp_path_factory, long_model_dir, max_loaded_models=2) as d:
        url = d.http_url
        first = d.daemon.state.model.name
        assert _ask(url, "two")[0] == 200  # now the default: the most recently loaded
        assert d.daemon.state.model.name == "two"
        host = d.daemon.host
        assert host is not None
        (resident,) = [r for r in host.resident.values() if r.ctx.name == first]
        out: dict[str, Any] = {}
        max_tokens = LONG_CONTEXT - 64  # minutes of decoding: only an abort ends it soon
        long = threading.Thread(
            target=lambda: out.update(long=_ask(url, first, max_tokens, timeout=300))
        )
        long.start()
        wait_until(lambda: resident.bridge.num_running == 1, what="the long request running")
        d.loop.call_soon_threadsafe(d.daemon.request_stop, True, 120.0)
        time.sleep(1.0)
        assert long.is_alive(), "the drain did not wait for the running request"
        started = time.monotonic()
        d.loop.call_soon_threadsafe(d.daemon.request_stop, False)
        thread = d._thread
        assert thread is not None
        thread.join(60)
        took = time.monotonic() - started
        long.join(30)
        assert not thread.is_alive() and took < 20, took
        status, body = out["long"]
        assert status != 200 or body["usage"]["completion_tokens"] < max_tokens, body
