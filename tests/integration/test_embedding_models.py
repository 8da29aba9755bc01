"""Embedding-only models served (docs/models.md "Embedding models", docs/api.md
"Embeddings"): a tiny random-weight BERT directory (tests/encoder_fixtures.py) as the daemon's
`--model`, answered on /v1/embeddings (the `openai` SDK, float and base64), /api/embed (the
`ollama` SDK) and /api/embeddings with the encoder's vectors; every generation route naming it
is a 400 `model_not_generative` in its dialect's envelope, and the daemon keeps serving; a chat
daemon loads the encoder by name on an embedding request and refuses it, without loading it,
on a chat request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from daemon_helpers import control, embedded_daemon, openai_client
from encoder_fixtures import read_dir, reference_vector

TEXTS = ["the cat sat on the mat", "dogs sleep", "central bank interest rates rise"]
WIDTH = 32


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, encoder_dir: Path) -> Any:
    with embedded_daemon(tmp_path_factory, encoder_dir, prefill_chunk_size=64) as d:
        yield d


@pytest.fixture(scope="module")
def expected(encoder_dir: Path) -> np.ndarray:
    """The numpy reference's vectors of TEXTS (cls pooling, normalised)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))
    config, weights = read_dir(encoder_dir)
    return np.array(
        [reference_vector(config, weights, tok.encode(t).ids, "cls", True) for t in TEXTS]
    )


def token_ids(encoder_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))
    return [tok.encode(t).ids for t in TEXTS]


def post(daemon: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(daemon.http_url + path, json=body, timeout=60)


def test_openai_sdk_float_and_base64(daemon: Any, expected: np.ndarray, encoder_dir: Path) -> None:
    client = openai_client(daemon)
    floats = client.embeddings.create(model="bge-tiny", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in floats.data])
    assert got.shape == (3, WIDTH)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert floats.usage.prompt_tokens == sum(len(ids) for ids in token_ids(encoder_dir))
    default = client.embeddings.create(model="bge-tiny", input=TEXTS)  # the SDK asks base64
    np.testing.assert_allclose(np.array([d.embedding for d in default.data]), got, atol=1e-6)
    alone = client.embeddings.create(model="bge-tiny", input=TEXTS[2])
    np.testing.assert_allclose(alone.data[0].embedding, got[2], atol=1e-5)


def test_ollama_sdk_embed_and_legacy(daemon: Any, expected: np.ndarray) -> None:
    import ollama

    client = ollama.Client(host=daemon.http_url)
    result = client.embed(model="bge-tiny", input=TEXTS)
    np.testing.assert_allclose(np.array(result.embeddings), expected, atol=1e-4)
    legacy = client.embeddings(model="bge-tiny", prompt=TEXTS[0])
    np.testing.assert_allclose(legacy.embedding, expected[0], atol=1e-4)


def test_ollama_truncate_keeps_the_closing_sep(daemon: Any, encoder_dir: Path) -> None:
    long_text = " ".join(["cat"] * 200)  # 202 tokens, the model takes 64
    cut = post(daemon, "/api/embed", {"model": "bge-tiny", "input": long_text})
    assert cut.status_code == 200, cut.text
    assert cut.json()["prompt_eval_count"] == 64
    from tokenizers import Tokenizer

    config, weights = read_dir(encoder_dir)
    ids = Tokenizer.from_file(str(encoder_dir / "tokenizer.json")).encode(long_text).ids
    want = reference_vector(config, weights, [*ids[:63], ids[-1]], "cls", True)
    np.testing.assert_allclose(cut.json()["embeddings"][0], want, atol=1e-4)
    refused = post(daemon, "/v1/embeddings", {"model": "bge-tiny", "input": long_text})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("path", "body", "envelope"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "openai"),
        ("/v1/completions", {"prompt": "hi"}, "openai"),
        ("/v1/responses", {"input": "hi"}, "openai"),
        (
            "/v1/messages",
            {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            "anthropic",
        ),
        (
            "/v1/messages/count_tokens",
            {"messages": [{"role": "user", "content": "hi"}]},
            "anthropic",
        ),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, "ollama"),
        ("/api/generate", {"prompt": "hi"}, "ollama"),
    ],
)
def test_generation_routes_refused(daemon: Any, path: str, body: dict, envelope: str) -> None:
    for model in ("bge-tiny", None):  # named, and the default model
        sent = dict(body, model=model) if model else dict(body)
        response = post(daemon, path, sent)
        assert response.status_code == 400, response.text
        data = response.json()
        if envelope == "openai":
            assert data["error"]["code"] == "model_not_generative"
            assert data["error"]["param"] == "model"
        elif envelope == "anthropic":
            assert data["type"] == "error"
            assert "embedding model" in data["error"]["message"]
        else:
            assert "embedding model" in data["error"]
    assert post(daemon, "/v1/embeddings", {"input": "cat"}).status_code == 200  # still serving


def test_openai_sdk_chat_refused(daemon: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        openai_client(daemon).chat.completions.create(
            model="bge-tiny", messages=[{"role": "user", "content": "hi"}]
        )
    assert err.value.code == "model_not_generative"


def test_health_metrics_models_status(daemon: Any) -> None:
    assert httpx.get(daemon.http_url + "/health").json()["status"] == "ok"
    metrics = httpx.get(daemon.http_url + "/metrics")
    assert metrics.status_code == 200 and "mlxcel_kv_blocks_total" in metrics.text
    models = httpx.get(daemon.http_url + "/v1/models").json()["data"]
    assert models[0]["id"].endswith("bge-tiny") and models[0]["context_length"] == 64
    status = control(daemon.socket_path, "status")
    engine = status["result"]["engine"] if "result" in status else status["engine"]
    assert engine["slots"] == [] and engine["prompt_cache"]["enabled"] is False
    tags = httpx.get(daemon.http_url + "/api/tags").json()
    assert tags["models"]
    for path in ("/slots", "/v1/cache/stats", "/api/ps"):
        assert httpx.get(daemon.http_url + path).status_code == 200, path
    assert httpx.get(daemon.http_url + "/slots").json() == []
    reset = httpx.post(daemon.http_url + "/v1/cache/reset")
    assert reset.status_code == 200, reset.text
    show = post(daemon, "/api/show", {"model": "bge-tiny"})
    assert show.status_code == 200, show.text
    changed = control(daemon.socket_path, "config.set", {"parallel": 2})
    assert "embedding model" in str(changed)  # refused, with the reason
    assert post(daemon, "/api/embed", {"input": "cat"}).status_code == 200  # still serving


def test_chat_daemon_loads_encoder_by_name(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, encoder_dir: Path
) -> None:
    """A chat daemon: the encoder in the store (`models pull DIR --link`'s entry) is loaded on
    an embedding request naming it; a chat request naming it is refused before any load."""
    from mlxcel.daemon.models.pull import pull

    home = tmp_path_factory.mktemp("store-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLXCEL_HOME", str(home))
    try:
        pull(str(encoder_dir), link=True, progress=None)
        with embedded_daemon(tmp_path_factory, tiny_model_dir, max_loaded_models=2) as d:
            refused = post(
                d,
                "/v1/chat/completions",
                {"model": "bge-tiny", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "model_not_generative"
            loaded = httpx.get(d.http_url + "/v1/models").json()["data"]
            assert [m["id"] for m in loaded if m.get("loaded")] == [str(tiny_model_dir)]
            got = post(d, "/v1/embeddings", {"model": "bge-tiny", "input": TEXTS})
            assert got.status_code == 200, got.text
            assert len(got.json()["data"][0]["embedding"]) == WIDTH
            chat = post(
                d,
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "model": str(tiny_model_dir),
                },
            )
            assert chat.status_code == 200, chat.text
    finally:
        mp.undo()


def test_nomic_bert_served(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A nomic_bert directory (nomic-embed-text's family) as --model: /api/embed gives the
    vectors of nomic's model computed in numpy; chat is refused."""
    from encoder_fixtures import make_nomic_dir, nomic_reference_hidden
    from tokenizers import Tokenizer

    path = make_nomic_dir(tmp_path_factory.mktemp("nomic") / "nomic-tiny")
    config, weights = read_dir(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    with embedded_daemon(tmp_path_factory, path) as d:
        got = post(d, "/api/embed", {"model": "nomic-tiny", "input": TEXTS})
        assert got.status_code == 200, got.text
        for text, vector in zip(TEXTS, got.json()["embeddings"], strict=True):
            hidden = nomic_reference_hidden(config, weights, tok.encode(text).ids).mean(0)
            np.testing.assert_allclose(vector, hidden / np.linalg.norm(hidden), atol=1e-4)
        chat = post(d, "/api/chat", {"model": "nomic-tiny", "messages": []})
        assert chat.status_code == 400 and "embedding model" in chat.json()["error"]
