"""End-to-end checks on the real default model (SmolLM2-135M-Instruct from its Q4_1 GGUF).

Skipped with a reason when the model has not been pulled (`mlxcel-daemon models pull`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest
from mlxcel.daemon.forward.blas import fast_blas_env, find_system_openblas
from mlxcel.daemon.models import LoadedModel, load_model
from mlxcel.daemon.models.registry import read_manifest
from repo_paths import TESTS

QUESTION = "What is the capital of France?"
CLI = (sys.executable, "-m", "mlxcel.daemon.cli.model_commands")


@pytest.fixture(scope="module")
def default_model(default_model_dir: Path) -> LoadedModel:
    return load_model(str(default_model_dir))


def _chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_paris(default_model: LoadedModel) -> None:
    text = mlx_lm.generate(
        default_model.model, default_model.tokenizer, _chat_ids(default_model, QUESTION), 12
    )
    assert "Paris" in text
    assert text.strip().startswith("The capital of France is Paris")


def test_default_model_info(default_model: LoadedModel) -> None:
    info = default_model.info
    assert info.family == "llama" and info.can_batch and info.batch_reason is None
    assert info.context_length == 8192
    assert info.num_params == 134_515_008
    assert info.eos_token_ids == (2,)
    if info.backend == "cpu" and info.quantization is None:  # dequantized (no native kernels)
        assert info.dtype == "float32" and info.weights_bytes == 4 * info.num_params
    elif info.backend == "cpu":  # kept packed: 4-bit layers, an 8-bit embedding, f32 scales
        assert info.forward and info.forward.startswith("weights 4/8-bit g32")
        assert info.weights_bytes < info.num_params
        # the status line and the console header name the bits, not float32 alone
        assert info.dtype_label == "4/8-bit + float32", info.dtype_label


def test_gguf_and_converted_dir_give_identical_greedy_tokens(default_model_dir: Path) -> None:
    manifest = read_manifest(default_model_dir) or {}
    if "gguf" not in manifest:
        pytest.skip("this model directory keeps no source GGUF")
    gguf = default_model_dir / manifest["gguf"]
    # In a child with the OpenBLAS fast path: greedy decoding on the reference BLAS is ~10x
    # slower than the whole test needs to be.
    script = TESTS / "child_scripts" / "models_e2e_compare.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(default_model_dir), str(gguf)],
        capture_output=True,
        text=True,
        env=fast_blas_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    direct, converted = result["gguf"], result["dir"]
    assert (direct["source"], converted["source"]) == ("gguf", "dir")
    assert direct["ids"] == converted["ids"] and direct["haiku"] == converted["haiku"]
    assert direct["tokens"] == converted["tokens"]
    assert direct["logits"] == converted["logits"]  # the same dequantized weights, bit for bit


def test_cli_run_answers_paris(default_model_dir: Path) -> None:
    proc = subprocess.run(
        [*CLI, "run", QUESTION, "--model", str(default_model_dir), "--max-tokens", "16"],
        capture_output=True,
        text=True,
        env=fast_blas_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    if find_system_openblas() is not None:
        assert "/openblas" in proc.stderr


def test_a_request_for_a_pulled_model_switches_while_smollm2_serves(
    default_model_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The issue's daemon test (docs/models.md): a tiny random llama pulled from a local
    directory under another name, asked for by name while SmolLM2 streams two answers."""
    from concurrent.futures import ThreadPoolExecutor

    from daemon_helpers import EventReader, chat_body, cli, http_json, running_daemon, wait_until

    home = tmp_path / "home"
    pulled = cli(home, "models", "pull", str(tiny_model_dir), "--name", "tiny-other")
    assert pulled.returncode == 0 and "copied into the store" in pulled.stdout, pulled.stderr
    with running_daemon(home, default_model_dir, "--parallel", "2") as d:
        url = d.http_url + "/v1/chat/completions"
        smol = d.status()["daemon"]["model"]
        status, _, ref = http_json(url, chat_body(QUESTION, 48, stream=False))
        assert status == 200 and "Paris" in ref["choices"][0]["message"]["content"]

        def stream() -> tuple[str, dict]:
            import urllib.request

            from daemon_helpers import sse_events

            body = json.dumps(chat_body(QUESTION, 48)).encode()
            req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as resp:
                events = sse_events(resp.read())
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2])
            return text, events[-2]

        reader = EventReader(d.socket)
        try:
            with ThreadPoolExecutor(3) as pool:
                streams = [pool.submit(stream) for _ in range(2)]
                wait_until(
                    lambda: all(s["state"] != "idle" for s in d.status()["engine"]["slots"]),
                    60,
                    what="both SmolLM2 streams running",
                )
                other = pool.submit(
                    http_json, url, chat_body(QUESTION, 16, stream=False, model="tiny-other")
                )
                waiting = wait_until(
                    lambda: [q["wait_reason"] for q in d.status()["engine"]["queue"]], 60
                )
                assert waiting == ["model_loading"]
                for future in streams:  # the SmolLM2 answers finish intact
                    text, last = future.result(300)
                    assert text == ref["choices"][0]["message"]["content"]
                    assert last["usage"]["completion_tokens"] == 48 and last["model"] == smol
                status, _, answer = other.result(300)
            assert status == 200, answer
            assert answer["model"] == "tiny-other" and answer["usage"]["completion_tokens"] == 16
            assert "Paris" not in answer["choices"][0]["message"]["content"]
            wait_until(lambda: "model_switched" in reader.names(), 30)
        finally:
            reader.close()
        assert dict(reader.events)["model_switched"]["to"] == "tiny-other"
        _, _, models = http_json(d.http_url + "/v1/models")
        assert [m["id"] for m in models["data"] if m["loaded"]] == ["tiny-other"]
        snap = d.status()  # what mlxcel-top renders
        assert snap["daemon"]["model"] == "tiny-other"
        (resident,) = snap["daemon"]["host"]["models"]
        assert resident["name"] == "tiny-other" and resident["weights_bytes"] > 0
        ps = cli(home, "ps")
        assert ps.returncode == 0 and ps.stdout.startswith("tiny-other  loaded  llama  weights")
        assert "loads 2, unloads 1" in ps.stdout
