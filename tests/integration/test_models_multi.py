"""`--max-loaded-models 2` (docs/models.md): two models stay resident side by side, each with
its own engine; a third evicts the least recently used one; `model.unload` of one leaves the
other serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemon_helpers import chat_body, control, embedded_daemon, http_json
from mlxcel.daemon.models.pull import pull


def _ask(url: str, model: str) -> tuple[int, dict]:
    status, _, body = http_json(
        url + "/v1/chat/completions", chat_body("hi", 4, stream=False, model=model)
    )
    return status, body


def _held(sock: Path) -> list[str]:
    return [m["name"] for m in control(sock, "model.list")["result"]["models"]]


def test_two_models_stay_resident_and_a_third_evicts_the_least_recent(
    mlxcel_home: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from mlxcel.daemon.models.tiny import make_tiny_model

    for seed, name in ((1, "two"), (2, "three")):
        pull(str(make_tiny_model(tmp_path / name, seed=seed)), name=name, progress=None)
    with embedded_daemon(tmp_path_factory, tiny_model_dir, max_loaded_models=2) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        assert _ask(url, "two")[0] == 200
        assert sorted(_held(sock)) == sorted([first, "two"])
        listing = control(sock, "model.list")["result"]
        assert listing["unloads"] == 0 and listing["max_loaded_models"] == 2
        status, body = _ask(url, first)  # still resident: answered without a load
        assert status == 200 and body["model"] == first
        assert control(sock, "model.list")["result"]["loads"] == 2
        assert _ask(url, "three")[0] == 200  # "two" is the least recently used
        assert sorted(_held(sock)) == sorted([first, "three"])
        assert control(sock, "model.unload", {"name": "three"})["result"] == {"unloaded": ["three"]}
        assert _held(sock) == [first] and _ask(url, first)[0] == 200
        _, _, models = http_json(url + "/v1/models")
        assert [m["id"] for m in models["data"] if m["loaded"]] == [first]


def test_a_switch_goes_on_when_its_client_leaves(
    mlxcel_home: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The request that asked for another model disconnects while the running one streams:
    the switch still happens (one shared load task), nothing is left half done."""
    import socket
    import threading

    from daemon_helpers import wait_until
    from mlxcel.daemon.models.tiny import make_tiny_model

    pull(str(make_tiny_model(tmp_path / "two", seed=1)), name="two", progress=None)
    with embedded_daemon(tmp_path_factory, tiny_model_dir) as d:
        sock, url = d.socket_path, d.http_url
        first = d.daemon.state.model.name
        long = threading.Thread(
            target=http_json, args=(url + "/v1/chat/completions", chat_body("hi", 1500, False))
        )
        long.start()
        wait_until(lambda: d.daemon.bridge.num_running == 1, what="the long request running")
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(chat_body("hi", 4, stream=False, model="two")).encode()
        with socket.create_connection((host, int(port))) as conn:
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            conn.sendall(head.encode() + body)
            wait_until(
                lambda: control(sock, "status")["result"]["engine"]["queue"],
                what="the request for two waiting",
            )
        # It left; the running request finishes, then the model it asked for is loaded.
        long.join(120)
        wait_until(lambda: _held(sock) == ["two"], 60, what="two loaded")
        assert control(sock, "status")["result"]["engine"]["queue"] == []
        assert _ask(url, "two")[0] == 200 and _ask(url, first)[0] == 200
