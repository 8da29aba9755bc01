"""The model host in a whole in-process daemon on tiny random-weight models (docs/models.md):
a request naming another local model switches to it (the running requests finish first, the
new one waits as `model_loading`, the swap is an event on the control socket), `/v1/models`,
`/api/ps` and the status follow; a broken model gives one clear error and the daemon keeps
serving the one it has; control `model.load` / `model.unload`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import EventReader, chat_body, control, http_json, sse_events, wait_until
from mlxcel.daemon.models.pull import pull
from mlxcel.daemon.models.registry import model_dir
from mlxcel.tui.models_panel import model_rows


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny llama with other weights (seed 1): its answers differ from the first."""
    from mlxcel.daemon.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("other") / "llama", "llama", seed=1)


@pytest.fixture
def daemon(mlxcel_home: Path, tiny_model_dir: Path, other_model_dir: Path) -> Iterator[Any]:
    """A daemon on the tiny model (by path) whose store also holds `tiny-b`."""
    from embedded import EmbeddedDaemon, paths_under
    from mlxcel.shared.config import ServingConfig

    pull(str(other_model_dir), name="tiny-b", progress=None)
    paths = paths_under(mlxcel_home)  # the layout MLXCEL_HOME gives: the registry's store
    cfg = ServingConfig(model=str(tiny_model_dir), port=0, parallel=2)
    with EmbeddedDaemon(cfg, paths, paths.socket_path) as d:
        yield d


def _chat(url: str, text: str, max_tokens: int, **extra: Any) -> tuple[int, Any]:
    status, _, body = http_json(
        url + "/v1/chat/completions", chat_body(text, max_tokens, stream=False, **extra)
    )
    return status, body


def _stream(url: str, text: str, max_tokens: int) -> list[Any]:
    import urllib.request

    body = json.dumps(chat_body(text, max_tokens)).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return sse_events(resp.read())


def _status(d: Any) -> dict[str, Any]:
    return control(d.socket_path, "status")["result"]


def test_a_request_for_another_model_switches_after_the_running_ones(daemon: Any) -> None:
    url = daemon.http_url
    first = daemon.daemon.state.model.name
    status, before = _chat(url, "Tell me a story about the sea.", 24)
    assert status == 200
    reader = EventReader(daemon.socket_path)
    try:
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(_stream, url, "Tell me a story.", 1500) for _ in range(2)]
            wait_until(
                lambda: sum(s["state"] != "idle" for s in _status(daemon)["engine"]["slots"]) == 2,
                what="both streams running",
            )
            switched = pool.submit(_chat, url, "Tell me a story about the sea.", 24, model="tiny-b")
            queue = wait_until(
                lambda: [q for q in _status(daemon)["engine"]["queue"] if q["wait_reason"]],
                what="the request for tiny-b in the queue",
            )
            assert queue[0]["wait_reason"] == "model_loading"
            assert not any(s.done() for s in streams)  # it waits for them
            for stream in streams:
                events = stream.result(timeout=120)
                assert events[-1] == "[DONE]"
                usage = events[-2]["usage"]
                assert usage["completion_tokens"] == 1500
                finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
                assert finish[-1] == "length" and all(e["model"] == first for e in events[:-1])
            status, answer = switched.result(timeout=120)
        assert status == 200, answer
        assert answer["model"] == "tiny-b" and answer["usage"]["completion_tokens"] == 24
        assert (
            answer["choices"][0]["message"]["content"] != before["choices"][0]["message"]["content"]
        )
        wait_until(lambda: "model_switched" in reader.names(), what="the switch event")
    finally:
        reader.close()
    assert reader.names() == ["model_loading", "model_unloaded", "model_loaded", "model_switched"]
    switch = dict(reader.events)["model_switched"]
    assert switch["from"] == first and switch["to"] == "tiny-b"
    # /v1/models, /api/ps and the status all name the new model.
    _, _, listing = http_json(url + "/v1/models")
    loaded = [m["id"] for m in listing["data"] if m["loaded"]]
    assert loaded == ["tiny-b"]
    _, _, ps = http_json(url + "/api/ps")
    assert [m["name"] for m in ps["models"]] == ["tiny-b"]
    assert (
        ps["models"][0]["size"] == _status(daemon)["daemon"]["host"]["models"][0]["weights_bytes"]
    )
    snap = _status(daemon)
    host = snap["daemon"]["host"]
    assert snap["daemon"]["model"] == "tiny-b"
    assert [m["name"] for m in host["models"]] == ["tiny-b"]
    assert (host["loads"], host["unloads"], host["load_failures"]) == (2, 1, 0)
    assert host["models"][0]["weights_bytes"] > 0 and host["last_load_s"] > 0
    # Prometheus names the loaded model and counts the loads, unloads and load time.
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as resp:
        metrics = resp.read().decode()
    assert 'mlxcel_model_loaded{model="tiny-b"} 1.0' in metrics
    assert "mlxcel_model_loads_total 2.0" in metrics and "mlxcel_model_unloads_total 1.0" in metrics
    assert "mlxcel_models_loaded 1.0" in metrics and "mlxcel_model_load_seconds_total" in metrics
    # A request without a model name goes to the model now loaded; the first one comes back.
    assert _chat(url, "hi", 4)[1]["model"] == "tiny-b"
    status, back = _chat(url, "Tell me a story about the sea.", 24, model=first)
    assert status == 200 and back["choices"] == before["choices"]


def test_unknown_model_is_404_and_serving_goes_on(daemon: Any) -> None:
    status, body = _chat(daemon.http_url, "hi", 4, model="no-such-model")
    assert status == 404
    assert body["error"]["code"] == "model_not_found"
    assert "mlxcel-daemon models pull no-such-model" in body["error"]["message"]
    _, _, ollama = http_json(
        daemon.http_url + "/api/chat",
        {"model": "nope:latest", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert "nor available locally" in ollama["error"]
    assert _chat(daemon.http_url, "hi", 4)[0] == 200


def test_a_corrupt_model_is_a_clear_error_and_the_current_one_keeps_serving(
    daemon: Any, tiny_model_dir: Path
) -> None:
    url = daemon.http_url
    first = daemon.daemon.state.model.name
    # Cut short: refused before anything is unloaded.
    pull(str(tiny_model_dir), name="cut", progress=None)
    weights = model_dir("cut") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    status, body = _chat(url, "hi", 4, model="cut")
    assert status == 500 and body["error"]["code"] == "model_load_failed"
    assert (
        "cannot load model 'cut'" in body["error"]["message"]
        and "truncated" in body["error"]["message"]
    )
    assert "\n" not in body["error"]["message"]
    host = _status(daemon)["daemon"]["host"]
    assert [m["name"] for m in host["models"]] == [first] and host["unloads"] == 0
    assert _chat(url, "hi", 4)[0] == 200
    # Files that look whole but mlx-lm cannot build: the current model is loaded back.
    pull(str(tiny_model_dir), name="odd", progress=None)
    config = json.loads((model_dir("odd") / "config.json").read_text())
    (model_dir("odd") / "config.json").write_text(json.dumps({**config, "model_type": "nope"}))
    status, body = _chat(url, "hi", 4, model="odd")
    assert status == 500 and body["error"]["message"].startswith("cannot load model 'odd'")
    status, again = _chat(url, "hi", 4)
    assert status == 200 and again["model"] == first
    host = _status(daemon)["daemon"]["host"]
    assert [m["name"] for m in host["models"]] == [first]
    assert host["load_failures"] == 2
    assert http_json(url + "/health")[0] == 200


def test_control_load_unload_and_list(daemon: Any) -> None:
    sock = daemon.socket_path
    assert control(sock, "model.load", {"name": "tiny-b"})["result"]["name"] == "tiny-b"
    listing = control(sock, "model.list")["result"]
    assert [m["name"] for m in listing["models"]] == ["tiny-b"]
    assert listing["default"] == "tiny-b" and listing["max_loaded_models"] == 1
    available = {m["name"]: m for m in listing["available"]}  # the store, on disk
    assert available["tiny-b"]["family"] == "llama" and available["tiny-b"]["size_bytes"] > 0
    assert control(sock, "model.load", {"name": "missing"})["error"]["code"] == "not_found"
    assert control(sock, "model.load", {})["error"]["code"] == "invalid_params"
    assert control(sock, "model.unload", {"name": "tiny-b"})["result"] == {"unloaded": ["tiny-b"]}
    assert control(sock, "model.unload", {"name": "tiny-b"})["error"]["code"] == "not_found"
    snap = _status(daemon)
    assert snap["daemon"]["host"]["models"] == [] and snap["engine"]["queue"] == []
    # Nothing loaded: /health is still 200, a request loads the default model again.
    assert http_json(daemon.http_url + "/health")[:3:2] == (200, {"status": "ok", "model": None})
    started = time.monotonic()
    status, body = _chat(daemon.http_url, "hi", 4)
    assert status == 200 and body["model"] == "tiny-b", body
    assert time.monotonic() - started > 0
    assert [m["name"] for m in control(sock, "model.list")["result"]["models"]] == ["tiny-b"]


def test_keep_alive_durations_parse() -> None:
    from mlxcel.shared.config import ConfigError, build_config

    assert build_config({}).keep_alive is None  # forever
    cases = {"2s": 2.0, "5m": 300.0, "1h": 3600.0, "1.5": 1.5, "0": 0.0, "250ms": 0.25}
    for text, seconds in cases.items():
        assert build_config({"keep_alive": text}).keep_alive == seconds
    for text in ("forever", "never", "-1", -1):
        assert build_config({"keep_alive": text}).keep_alive is None
    with pytest.raises(ConfigError, match="keep_alive must be a duration"):
        build_config({"keep_alive": "soon"})
    assert build_config({"max_loaded_models": "3"}).max_loaded_models == 3
    with pytest.raises(ConfigError, match="max_loaded_models must be >= 1"):
        build_config({"max_loaded_models": 0})


def test_ollama_loads_on_an_empty_generate_and_unloads_on_keep_alive_0(daemon: Any) -> None:
    url = daemon.http_url
    status, _, loaded = http_json(url + "/api/generate", {"model": "tiny-b", "stream": False})
    assert status == 200 and loaded["done_reason"] == "load"
    assert [m["name"] for m in http_json(url + "/api/ps")[2]["models"]] == ["tiny-b"]
    status, _, gone = http_json(url + "/api/generate", {"model": "tiny-b", "keep_alive": 0})
    assert status == 200 and (gone["done"], gone["done_reason"]) == (True, "unload")
    assert http_json(url + "/api/ps")[2]["models"] == []
    import ollama

    client = ollama.Client(host=url)
    assert client.chat(model="tiny-b", messages=[{"role": "user", "content": "hi"}]).done
    stopped = client.chat(model="tiny-b", messages=[], keep_alive=0)
    assert stopped.done_reason == "unload" and stopped.message.content == ""
    assert http_json(url + "/api/ps")[2]["models"] == []


def _loaded(url: str) -> dict[str, Any]:
    return {m["name"]: m for m in http_json(url + "/api/ps")[2]["models"]}


def test_ollama_keep_alive_duration_keeps_the_model_that_long_then_unloads(daemon: Any) -> None:
    """A request's `keep_alive` (the daemon's is forever here) becomes its model's: loaded at
    least that long after the request, then unloaded as --keep-alive does; negative: forever;
    a bad one is a 400 and the daemon serves on."""
    import ollama

    url = daemon.http_url
    client = ollama.Client(host=url)
    hi = [{"role": "user", "content": "hi"}]
    assert client.chat(model="tiny-b", messages=hi, keep_alive="-1").done
    assert _loaded(url)["tiny-b"]["expires_at"].startswith("2999")  # forever
    assert client.chat(model="tiny-b", messages=hi, keep_alive="2s", options={"num_predict": 2})
    answered = time.monotonic()
    listing = control(daemon.socket_path, "model.list")["result"]
    (entry,) = listing["models"]
    assert entry["name"] == "tiny-b" and entry["keep_alive_s"] == 2.0, entry
    assert model_rows(listing)[0][1][6].endswith(" s")  # the console: "unloads in", not never
    assert not _loaded(url)["tiny-b"]["expires_at"].startswith("2999")
    wait_until(lambda: not _loaded(url), timeout=15, poll=0.05, what="tiny-b unloaded")
    assert time.monotonic() - answered >= 1.9  # not before its keep-alive ran out
    assert _status(daemon)["daemon"]["host"]["keep_alive_s"] is None  # the daemon's: forever
    # The next request loads it again, with the daemon's keep-alive (forever) unless it asks.
    done = http_json(url + "/api/generate", {"model": "tiny-b", "prompt": "hi", "stream": False})
    assert done[0] == 200 and done[2]["done"]
    assert _loaded(url)["tiny-b"]["expires_at"].startswith("2999")
    status, _, err = http_json(
        url + "/api/chat", {"model": "tiny-b", "messages": hi, "keep_alive": "soon"}
    )
    assert status == 400 and "keep_alive" in err["error"], err
    assert client.chat(model="tiny-b", messages=hi).done  # serving on


def test_ollama_keep_alive_values() -> None:
    from mlxcel.daemon.server.errors import APIError
    from mlxcel.daemon.server.ollama_api import keep_alive_seconds

    cases = {"5m": 300.0, "1h30m": 5400.0, "1m30s": 90.0, 30: 30.0, 0: 0.0, "250ms": 0.25}
    for value, seconds in cases.items():
        assert keep_alive_seconds(value) == seconds, value
    for value in (-1, "-1", "-5m", "-1h0m0s"):
        assert keep_alive_seconds(value) is None, value
    for value in ("soon", "5x", "", True, [1]):
        with pytest.raises(APIError):
            keep_alive_seconds(value)
