"""The model host in a real `mlxcel-daemon` subprocess (docs/models.md), on a ~42M-parameter
random llama whose 168 MB of float32 weights stand well above RSS noise:

- `--keep-alive 2s`: after idling, the model is unloaded, RSS drops by at least its weights,
  `/health` stays 200, and the next request loads it again and answers;
- load / unload 20 times under light traffic: RSS stays within 10 %, no request is lost;
- `models rm` refuses the loaded model, `--force` unloads it first; `ps` and `models list`
  say what is loaded.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from daemon_helpers import (
    chat_body,
    cli,
    control,
    http_json,
    rss_bytes,
    running_daemon,
    wait_until,
)

BIG = "big"


@pytest.fixture(scope="module")
def big_model_dir(slow_model_dir: Path) -> Path:
    return slow_model_dir  # conftest's ~42M-parameter llama


def _home_with_big(tmp_path: Path, big_model_dir: Path) -> Path:
    home = tmp_path / "home"
    done = cli(home, "models", "pull", str(big_model_dir), "--name", BIG)
    assert done.returncode == 0, done.stderr
    return home


def _chat(url: str, max_tokens: int = 8, **extra: object) -> tuple[int, dict]:
    status, _, body = http_json(
        url + "/v1/chat/completions", chat_body("Tell me a story.", max_tokens, False, **extra)
    )
    return status, body


def test_keep_alive_unloads_the_idle_model_and_frees_its_memory(
    tmp_path: Path, big_model_dir: Path
) -> None:
    home = _home_with_big(tmp_path, big_model_dir)
    with running_daemon(home, Path(BIG), "--keep-alive", "2s") as d:
        assert _chat(d.http_url)[0] == 200
        host = d.status()["daemon"]["host"]
        assert host["keep_alive_s"] == 2.0
        (model,) = host["models"]
        weights = model["weights_bytes"]
        assert weights > 150e6 and model["expires_in_s"] is not None
        loaded_rss = rss_bytes(d.pid)
        # `unloads` counts (and `model_unloaded` is sent) once the memory has been given back.
        wait_until(lambda: d.status()["daemon"]["host"]["unloads"] == 1, 30, 0.1, "unloaded")
        assert d.status()["daemon"]["host"]["models"] == []
        unloaded_rss = rss_bytes(d.pid)
        assert loaded_rss - unloaded_rss >= weights, (loaded_rss, unloaded_rss, weights)
        assert http_json(d.http_url + "/health")[0] == 200  # ready to load, not an error
        snap = d.status()
        assert snap["daemon"]["host"]["unloads"] == 1
        assert all(s["state"] == "idle" for s in snap["engine"]["slots"])
        status, body = _chat(d.http_url)
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        host = d.status()["daemon"]["host"]
        assert [m["name"] for m in host["models"]] == [BIG] and host["loads"] == 2
        assert host["last_load_s"] > 0
        assert "keep_alive" in d.log_text()
        status_text = cli(home, "status").stdout
        assert f"  models:  {BIG} (loaded, " in status_text and "keep-alive 2s" in status_text


def test_load_unload_twenty_times_under_traffic_and_rm(tmp_path: Path, big_model_dir: Path) -> None:
    home = _home_with_big(tmp_path, big_model_dir)
    # With the CPU fast forward on (its default), as users run it.
    with running_daemon(home, Path(BIG)) as d:
        results: list[tuple[int, dict]] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                results.append(_chat(d.http_url, model=BIG))

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        samples = []
        try:
            for _ in range(20):
                unloaded = control(d.socket, "model.unload", {"name": BIG})
                assert "result" in unloaded or unloaded["error"]["code"] == "not_found"
                assert control(d.socket, "model.load", {"name": BIG})["result"]["name"] == BIG
                samples.append(rss_bytes(d.pid))
        finally:
            stop.set()
            thread.join(120)
        host = d.status()["daemon"]["host"]
        assert host["unloads"] >= 20 and host["loads"] >= 21
        assert results and all(s == 200 for s, _ in results), [b for s, b in results if s != 200]
        assert all(b["usage"]["completion_tokens"] == 8 for _, b in results)
        base = samples[2]  # after the allocator warmed up
        assert max(abs(s - base) for s in samples[2:]) <= 0.10 * base, samples

        ps = cli(home, "ps")
        assert ps.returncode == 0 and ps.stdout.startswith(f"{BIG}  loaded  llama  weights")
        listing = cli(home, "models", "list", "--no-hf-cache")
        assert [line.split()[6] for line in listing.stdout.splitlines()[1:]] == ["yes"]  # LOADED
        refused = cli(home, "models", "rm", BIG)
        assert refused.returncode == 1
        assert "is loaded in the running daemon" in refused.stderr
        assert (home / "data" / "models" / BIG).is_dir()
        forced = cli(home, "models", "rm", BIG, "--force")
        assert forced.returncode == 0, forced.stderr
        assert f"unloaded {BIG}" in forced.stdout and f"removed {BIG}" in forced.stdout
        assert not (home / "data" / "models" / BIG).exists()
        assert d.status()["daemon"]["host"]["models"] == []
        status, body = _chat(d.http_url, model=BIG)
        assert status == 404 and body["error"]["code"] == "model_not_found"
        # A built-in alias that is not pulled is no download behind a request: a 404 saying how.
        status, body = _chat(d.http_url, model="smollm2")
        assert status == 404 and "mlxcel-daemon models pull smollm2" in body["error"]["message"]
