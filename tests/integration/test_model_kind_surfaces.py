"""What the CLI, the footprint, Ollama's /api/show, the console and the rejection counters say
of a GGUF model and of an embedding-only model (docs/models.md "GGUF files" and "Embedding
models", docs/api.md "Embeddings"): `models show`'s `gguf` and `kind`/`embedding` lines and
`models list`'s KIND column, a Q6_K file's GPU footprint (float32 once converted, not its
file size), `capabilities: ["embedding"]`, the KV subtitle of an engine with no KV pool, and
a `model_not_generative` refusal counted as `invalid_request`."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from daemon_helpers import embedded_daemon
from gguf import GGMLQuantizationType as Q
from gguf_builders import arch_keys, tensor_names, write_gguf
from mlxcel.daemon.cli import model_commands as cli_models
from mlxcel.daemon.models import convert_gguf
from mlxcel.daemon.models.footprint import resident_weight_bytes
from mlxcel.tui.format import kv_lines, kv_subtitle
from prometheus_client.parser import text_string_to_metric_families
from tiny_gguf import gguf_metadata

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REJECTED = ("mlxcel_requests_rejected_total", (("reason", "invalid_request"),))


def _gguf(tiny_model_dir: Path, path: Path, qtype_of: Any) -> Path:
    meta: dict[str, Any] = {
        k: v for k, v in gguf_metadata(tiny_model_dir).items() if k.startswith("tokenizer.")
    }
    meta.update(arch_keys("llama", len(meta["tokenizer.ggml.tokens"])))
    return write_gguf(path, "llama", meta, tensor_names("llama"), qtype_of)


def _mixed(name: str) -> Q:  # a Q4_K_M-style file (tests/integration/test_gguf_show.py)
    if name == "blk.0.ffn_down.weight" or name == "output.weight":
        return Q.Q6_K
    return Q.Q5_K if "attn_v" in name else Q.Q4_K


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    capsys.readouterr()
    assert cli_models.main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def test_models_show_prints_the_gguf_source_types_and_what_they_became(
    tiny_model_dir: Path, tmp_path: Path, mlxcel_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = _gguf(tiny_model_dir, tmp_path / "Tiny-Q4_K_M.gguf", _mixed)
    lines = _cli(capsys, "show", str(file))
    assert "  gguf source:   Tiny-Q4_K_M.gguf" in lines
    assert "    attn_v: Q5_K" in lines and "    ffn_down: Q4_K, Q6_K in 1 of 2" in lines
    converted = convert_gguf(file, tmp_path / "converted")
    lines = _cli(capsys, "show", str(converted))
    assert "  gguf source:   Tiny-Q4_K_M.gguf" in lines
    assert "    attn_q: Q4_K -> 4-bit affine, group 32 (float32 scales)" in lines
    assert "    output: Q6_K -> float32" in lines
    assert "  kind:          chat" in lines
    plain = _cli(capsys, "show", str(tiny_model_dir))
    assert not any(line.startswith("  gguf source:") for line in plain)


def test_models_list_and_show_give_an_embedding_models_kind_and_pooling(
    tiny_model_dir: Path,
    encoder_dir: Path,
    mlxcel_home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mlxcel.daemon.models.pull import pull

    pull(str(encoder_dir), link=True, progress=None)
    pull(str(tiny_model_dir), name="tiny-chat", link=True, progress=None)
    header, *rows = _cli(capsys, "list", "--no-hf-cache")
    kind_at = header.split().index("KIND")
    kinds = {row.split()[0]: row.split()[kind_at + 1] for row in rows}  # SIZE is two words
    assert kinds == {"bge-tiny": "embedding", "tiny-chat": "chat"}, rows
    lines = _cli(capsys, "show", "bge-tiny")
    assert "  kind:          embedding" in lines
    assert "  embedding:     32 wide, cls pooling, L2-normalised" in lines


def test_a_q6_k_gguf_takes_its_float32_size_on_a_gpu_backend(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    file = _gguf(tiny_model_dir, tmp_path / "Tiny-Q6_K.gguf", lambda _name: Q.Q6_K)
    converted = convert_gguf(file, tmp_path / "q6k")
    # what the converted weights are (safetensors headers, read as they are on a GPU)
    weights = resident_weight_bytes(converted, "metal")
    assert weights > 4 * file.stat().st_size  # Q6_K (6.56 bits) became float32
    assert resident_weight_bytes(file, "metal") == weights
    assert resident_weight_bytes(file, "cuda") == weights


def _rejected(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (s.name, tuple(sorted(s.labels.items()))) == REJECTED:
                return s.value
    return 0.0


@pytest.fixture(scope="module")
def encoder_daemon(tmp_path_factory: pytest.TempPathFactory, encoder_dir: Path) -> Iterator[Any]:
    with embedded_daemon(tmp_path_factory, encoder_dir, prefill_chunk_size=64) as d:
        yield d


def test_an_embedding_model_served_shows_embedding_and_counts_its_refusals(
    encoder_daemon: Any,
) -> None:
    url = encoder_daemon.http_url
    show = httpx.post(url + "/api/show", json={"model": "bge-tiny"}, timeout=30)
    assert show.status_code == 200 and show.json()["capabilities"] == ["embedding"], show.text
    events: list[tuple[str, dict[str, Any]]] = []
    encoder_daemon.daemon.state.model.runtime.add_event_sink(lambda *e: events.append(e))
    before = _rejected(url)
    for body in ({**CHAT, "model": "bge-tiny"}, CHAT):  # named, and the default model
        refused = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert refused.json()["error"]["code"] == "model_not_generative"
    assert _rejected(url) - before == 2
    reasons = [data["reason"] for name, data in events if name == "request_rejected"]
    assert reasons == ["invalid_request", "invalid_request"]  # the console's event log


def test_the_console_says_an_encoder_has_no_kv_cache(encoder_daemon: Any) -> None:
    kv = encoder_daemon.daemon.state.model.bridge.snapshot().kv
    assert kv.blocks_total == 0
    assert kv_subtitle(kv) == "no KV cache"
    assert kv_lines(kv)[1] == "free 0 / 0 blk"


def test_a_chat_daemon_shows_a_stored_encoder_as_embedding_and_counts_the_refusal(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    encoder_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlxcel.daemon.models.pull import pull

    monkeypatch.setenv("MLXCEL_HOME", str(tmp_path_factory.mktemp("store-home")))
    pull(str(encoder_dir), link=True, progress=None)
    with embedded_daemon(tmp_path_factory, tiny_model_dir, max_loaded_models=2) as d:
        show = httpx.post(d.http_url + "/api/show", json={"model": "bge-tiny"}, timeout=30)
        assert show.status_code == 200 and show.json()["capabilities"] == ["embedding"]
        chat = httpx.post(d.http_url + "/api/show", json={"model": str(tiny_model_dir)})
        assert "completion" in chat.json()["capabilities"], chat.text
        before = _rejected(d.http_url)
        refused = httpx.post(
            d.http_url + "/v1/chat/completions", json={**CHAT, "model": "bge-tiny"}, timeout=30
        )
        assert refused.json()["error"]["code"] == "model_not_generative"
        assert _rejected(d.http_url) - before == 1
