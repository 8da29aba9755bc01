"""Several models resident (docs/tuning.md, "Several models resident") on a whole in-process
daemon with real engines and sockets:

- an LRU eviction frees the evicted model's memory (the process RSS drops by most of its
  weights);
- a pinned model is never the one evicted for another, nor unloaded by keep-alive; `unload` of
  it is refused naming `unpin`; when pinned models hold every place the load is a 503 and the
  residents keep serving; `pin` / `unpin` from the CLI and the control socket;
- `models_memory`: the least recently used unpinned model is retired to make room in the
  budget; a model that cannot fit beside the pinned ones is a 503 that names the budget, its
  need and what is pinned, before anything is evicted, and the residents keep serving.

Two models answering interleaved requests without a load between them is
tests/integration/test_models_multi.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from daemon_helpers import EventReader, chat_body, control, embedded_daemon, http_json, wait_until
from mlxcel.daemon.models.pull import pull
from mlxcel.shared.config import format_size


def _ask(url: str, model: str) -> tuple[int, dict[str, Any]]:
    status, _, body = http_json(
        url + "/v1/chat/completions", chat_body("hi", 4, stream=False, model=model)
    )
    return status, body


def _listing(sock: Path) -> dict[str, Any]:
    return control(sock, "model.list")["result"]


def _held(sock: Path) -> set[str]:
    return {m["name"] for m in _listing(sock)["models"]}


def _tiny(tmp_path: Path, name: str, seed: int) -> Path:
    from mlxcel.daemon.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / name, seed=seed)
    pull(str(path), name=name, progress=None)
    return path


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_an_lru_eviction_frees_the_evicted_models_memory(
    mlxcel_home: Path,
    tiny_model_dir: Path,
    slow_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`big` (~168 MB of float32 weights) is the least recently used of two residents; a
    request for a third model evicts it, and this process's RSS drops by most of its weights."""
    pull(str(slow_model_dir), name="big", link=True, progress=None)
    _tiny(tmp_path, "two", 1)
    with embedded_daemon(tmp_path_factory, tiny_model_dir, max_loaded_models=2) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        assert _ask(url, "big")[0] == 200
        assert _ask(url, first)[0] == 200  # `big` is now the least recently used
        big = next(m for m in _listing(sock)["models"] if m["name"] == "big")
        weights = big["weights_bytes"]
        assert weights > 150e6, big
        loaded_rss = _rss()
        events = EventReader(sock)
        try:
            assert _ask(url, "two")[0] == 200
            wait_until(lambda: events.of("model_unloaded"), 30, what="big unloaded")
        finally:
            events.close()
        (unloaded,) = events.of("model_unloaded")
        assert unloaded["model"] == "big" and unloaded["reason"] == "switch", unloaded
        assert _held(sock) == {first, "two"}
        dropped = loaded_rss - _rss()
        assert dropped >= 0.75 * weights, (format_size(dropped), format_size(weights))
        assert _ask(url, first)[0] == 200 and _ask(url, "two")[0] == 200


def test_a_pinned_model_is_never_evicted_nor_unloaded_by_keep_alive(
    mlxcel_home: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mlxcel.daemon.cli import main

    _tiny(tmp_path, "two", 1)
    _tiny(tmp_path, "three", 2)
    with embedded_daemon(tmp_path_factory, tiny_model_dir, max_loaded_models=2) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        # `models pin` loads the model first (it was not resident), then pins it.
        assert main(["models", "pin", "two", "--socket", str(sock)]) == 0
        assert "pinned two" in capsys.readouterr().out
        assert _held(sock) == {first, "two"}
        two = next(m for m in _listing(sock)["models"] if m["name"] == "two")
        assert two["pinned"] is True and two["expires_in_s"] is None, two
        daemon_info = control(sock, "status")["result"]["daemon"]["host"]
        assert {m["name"]: m["pinned"] for m in daemon_info["models"]} == {
            first: False,
            "two": True,
        }

        # The LRU choice skips the pinned model: `two` is the least recently used, `first` goes.
        assert _ask(url, first)[0] == 200
        assert _ask(url, "three")[0] == 200
        assert _held(sock) == {"two", "three"}
        assert _ask(url, "two")[0] == 200 and _ask(url, "three")[0] == 200

        # Every place held by a pinned model: a clear 503, nothing evicted, both serve on.
        assert control(sock, "model.pin", {"name": "three"})["result"]["pinned"] is True
        unloads = _listing(sock)["unloads"]
        status, body = _ask(url, first)
        assert status == 503 and body["error"]["code"] == "no_room_for_model", body
        message = body["error"]["message"]
        assert "max_loaded_models" in message and "two" in message and "unpin" in message
        assert _held(sock) == {"two", "three"} and _listing(sock)["unloads"] == unloads
        assert _ask(url, "two")[0] == 200 and _ask(url, "three")[0] == 200
        refused = control(sock, "model.load", {"name": first})["error"]
        assert refused["code"] == "no_room_for_model", refused
        assert control(sock, "model.unpin", {"name": "three"})["result"]["pinned"] is False

        # Keep-alive: both get a 1 s keep-alive of their own (Ollama's `keep_alive`); the
        # unpinned `three` is unloaded after it, the pinned `two` stays.
        for name in ("two", "three"):
            done = http_json(
                url + "/api/generate",
                {"model": name, "prompt": "hi", "stream": False, "keep_alive": "1s",
                 "options": {"num_predict": 2}},
            )  # fmt: skip
            assert done[0] == 200, done
        asked = time.monotonic()
        wait_until(lambda: "three" not in _held(sock), 15, 0.05, "three unloaded by keep-alive")
        time.sleep(max(0.0, asked + 2.0 - time.monotonic()))  # two's keep-alive is long gone
        assert _held(sock) == {"two"}, "the pinned model was unloaded by keep-alive"
        (two,) = _listing(sock)["models"]
        assert two["pinned"] and two["keep_alive_s"] == 1.0 and two["expires_in_s"] is None
        (ps,) = http_json(url + "/api/ps")[2]["models"]
        assert ps["expires_at"].startswith("2999"), ps  # Ollama's view: kept until unloaded

        # An explicit unload of a pinned model is refused, naming `unpin`; so is Ollama's.
        refused = control(sock, "model.unload", {"name": "two"})["error"]
        assert refused["code"] == "model_pinned" and "unpin" in refused["message"], refused
        assert main(["unload", "two", "--socket", str(sock)]) == 1
        assert "mlxcel-daemon unpin two" in capsys.readouterr().err
        status, _, gone = http_json(url + "/api/generate", {"model": "two", "keep_alive": 0})
        assert status == 400 and "unpin" in gone["error"], gone
        assert control(sock, "model.unload", {})["result"] == {"unloaded": [], "pinned": ["two"]}
        assert _held(sock) == {"two"} and _ask(url, "two")[0] == 200

        # Unpinned, its own keep-alive applies again (counted from the unpin).
        assert main(["unpin", "two", "--socket", str(sock)]) == 0
        assert "unpinned two" in capsys.readouterr().out
        wait_until(lambda: not _held(sock), 15, 0.05, "two unloaded once unpinned")


def test_models_memory_retires_the_lru_model_and_refuses_what_cannot_fit(
    mlxcel_home: Path,
    tiny_model_dir: Path,
    slow_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from mlxcel.daemon.models.footprint import resident_weight_bytes
    from mlxcel.daemon.models.loader import backend_name

    _tiny(tmp_path, "two", 1)
    _tiny(tmp_path, "three", 2)
    pull(str(slow_model_dir), name="big", link=True, progress=None)
    tiny = resident_weight_bytes(tiny_model_dir, backend_name())
    budget = int(tiny * 2.5)  # two tiny models fit, three do not
    config = {"max_loaded_models": 3, "models_memory": budget}
    with embedded_daemon(tmp_path_factory, tiny_model_dir, **config) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        listing = _listing(sock)
        assert listing["models_memory"] == budget
        assert listing["resident_weights_bytes"] == tiny, (listing, tiny)  # the same figure
        assert _ask(url, "two")[0] == 200
        assert _held(sock) == {first, "two"}
        # A third would pass the budget: the least recently used (`first`) is retired for it,
        # though max_loaded_models has room.
        assert _ask(url, "three")[0] == 200
        assert _held(sock) == {"two", "three"}
        assert _listing(sock)["resident_weights_bytes"] <= budget

        # `big` cannot fit even with every unpinned model gone: a 503 naming the budget, its
        # need and the pinned model, sent before anything is evicted.
        assert control(sock, "model.pin", {"name": "two"})["result"]["pinned"] is True
        unloads = _listing(sock)["unloads"]
        events = EventReader(sock)
        try:
            status, body = _ask(url, "big")
            assert status == 503 and body["error"]["code"] == "no_room_for_model", body
            message = body["error"]["message"]
            need = format_size(resident_weight_bytes(slow_model_dir, backend_name()))
            assert f"models_memory ({format_size(budget)})" in message, message
            assert need in message and "pinned" in message and "two (" in message, message
            assert _held(sock) == {"two", "three"} and _listing(sock)["unloads"] == unloads
            assert _ask(url, "two")[0] == 200 and _ask(url, "three")[0] == 200
            wait_until(lambda: events.of("model_load_failed"), what="the refusal's event")
            assert not events.of("model_unloaded")
        finally:
            events.close()

        # `first` fits once the unpinned `three` is retired for it; then, with both resident
        # models pinned, nothing can make room for `three`.
        assert _ask(url, first)[0] == 200
        assert _held(sock) == {"two", first}
        assert control(sock, "model.pin", {"name": first})["result"]["pinned"] is True
        status, body = _ask(url, "three")
        assert status == 503 and body["error"]["code"] == "no_room_for_model", body
        assert "models_memory" in body["error"]["message"]
        assert _held(sock) == {"two", first}
        assert _ask(url, "two")[0] == 200 and _ask(url, first)[0] == 200


def test_models_memory_parses_like_the_other_sizes() -> None:
    from mlxcel.daemon.cli import build_parser
    from mlxcel.shared.config import ConfigError, ServingConfig, build_config

    assert ServingConfig().models_memory is None  # only the free-memory check
    assert build_config({"models_memory": "24GiB"}).models_memory == 24 << 30
    assert build_config({"models_memory": 1000}).models_memory == 1000
    for off in ("none", "off", "0", 0, ""):
        assert build_config({"models_memory": off}).models_memory is None
    with pytest.raises(ConfigError, match="models_memory"):
        build_config({"models_memory": "lots"})
    args = build_parser().parse_args(["start", "--models-memory", "8GiB"])
    assert args.models_memory == "8GiB"
    for argv in (["pin", "a"], ["models", "pin", "a"], ["unpin", "a"], ["models", "unpin", "a"]):
        args = build_parser().parse_args(argv)
        assert (args.host_command, args.name) == (argv[-2], "a")


def test_the_console_marks_a_pinned_model() -> None:
    from mlxcel.tui.models_panel import model_rows

    listing = {
        "keep_alive_s": 60.0,
        "models": [
            {"name": "a", "state": "loaded", "pinned": True, "expires_in_s": None},
            {"name": "b", "state": "loaded", "pinned": False, "expires_in_s": 12.0},
        ],
    }
    (_, cells_a), (_, cells_b) = model_rows(listing)
    assert (cells_a[1], cells_a[6]) == ("loaded, pinned", "never")
    assert (cells_b[1], cells_b[6]) == ("loaded", "12 s")
