"""Embeddings (docs/api.md, "Embeddings"): `POST /v1/embeddings` through the official `openai`
SDK, Ollama's `/api/embed` through the `ollama` SDK and the legacy `/api/embeddings`; vectors
mean-pooled from the backbone on the engine thread (daemon/engine/embedder.py), batched within
the step's token budget so decoding streams keep their pace. SmolLM2's vectors are
tests/e2e/test_embeddings_smollm2.py's."""

from __future__ import annotations

import base64
import struct
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from daemon_helpers import embedded_daemon, openai_client, wait_until

WIDTH = 64  # the tiny llama's hidden size (daemon/models/tiny.py)
BUDGET = 256  # the module daemon's step token budget (prefill_chunk_size)
MODEL = "llama"  # its folder's name, one of the names it is served under


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Any:
    config = {"parallel": 4, "prefill_chunk_size": BUDGET}
    with embedded_daemon(tmp_path_factory, tiny_model_dir, **config) as d:
        yield d


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def post(daemon: Any, path: str, body: Any, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(daemon.http_url + path, json=body, timeout=timeout)


def vectors_of(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def unit_norms(vectors: np.ndarray) -> None:
    assert vectors.shape[1] == WIDTH
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


# -- the SDKs --------------------------------------------------------------------------------


def test_openai_sdk_string_list_and_its_default_base64(daemon: Any) -> None:
    client = openai_client(daemon)
    one = client.embeddings.create(model=MODEL, input="a cat sat on the mat")
    assert one.object == "list" and len(one.data) == 1 and one.data[0].index == 0
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0
    texts = ["a cat sat on the mat", "stocks fell", "the weather is mild today"]
    # no encoding_format: the SDK asks for base64 and decodes it itself
    default = client.embeddings.create(model=MODEL, input=texts)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    got = np.array([d.embedding for d in default.data], dtype=np.float32)
    want = np.array([d.embedding for d in floats.data], dtype=np.float32)
    unit_norms(got)
    assert np.array_equal(got, want)  # the same float32 values either way
    np.testing.assert_allclose(got[0], np.array(one.data[0].embedding), atol=1e-5)


def test_base64_is_little_endian_float32(daemon: Any) -> None:
    body = {"input": "hello there", "encoding_format": "base64"}
    raw = post(daemon, "/v1/embeddings", body).json()["data"][0]["embedding"]
    decoded = np.array(struct.unpack(f"<{WIDTH}f", base64.b64decode(raw)), dtype=np.float32)
    floats = vectors_of(post(daemon, "/v1/embeddings", {"input": "hello there"}))[0]
    assert np.array_equal(decoded, floats)


def test_ollama_sdk_embed_and_the_legacy_call(daemon: Any) -> None:
    import ollama

    client = ollama.Client(host=daemon.http_url)
    out = client.embed(model=MODEL, input=["a cat sat on the mat", "stocks fell"])
    vectors = np.array(out.embeddings, dtype=np.float32)
    unit_norms(vectors)
    assert out.prompt_eval_count and out.prompt_eval_count > 0
    assert out.total_duration and out.total_duration > 0
    single = client.embed(model=MODEL, input="stocks fell")
    np.testing.assert_allclose(np.array(single.embeddings[0]), vectors[1], atol=1e-5)
    legacy = client.embeddings(model=MODEL, prompt="stocks fell")
    np.testing.assert_allclose(np.array(legacy.embedding), vectors[1], atol=1e-5)
    assert client.embeddings(model=MODEL, prompt="").embedding == []  # Ollama's own answer
    openai_vector = vectors_of(post(daemon, "/v1/embeddings", {"input": "stocks fell"}))[0]
    np.testing.assert_allclose(openai_vector, vectors[1], atol=1e-5)


def test_ollama_truncate(daemon: Any) -> None:
    text = "word " * 3000  # over the tiny model's 2048-token context
    cut = post(daemon, "/api/embed", {"model": MODEL, "input": text})
    assert cut.status_code == 200, cut.text
    assert cut.json()["prompt_eval_count"] == 2048
    refused = post(daemon, "/api/embed", {"model": MODEL, "input": text, "truncate": False})
    assert refused.status_code == 400
    assert "context" in refused.json()["error"]  # Ollama's envelope: {"error": "..."}


# -- the vectors ---------------------------------------------------------------------------


def test_padding_does_not_leak_into_a_row(daemon: Any) -> None:
    rng = np.random.default_rng(1)
    target = [int(t) for t in rng.integers(3, 200, 9)]
    others = [[int(t) for t in rng.integers(3, 200, n)] for n in (1, 40, 3, 120, 17)]
    alone = vectors_of(post(daemon, "/v1/embeddings", {"input": [target]}))[0]
    batch = vectors_of(post(daemon, "/v1/embeddings", {"input": [*others[:2], target, *others]}))
    np.testing.assert_allclose(batch[2], alone, atol=1e-5)
    for i, ids in enumerate(others):  # every row, whatever its length, as when alone
        single = vectors_of(post(daemon, "/v1/embeddings", {"input": ids}))[0]
        np.testing.assert_allclose(batch[3 + i], single, atol=1e-5)


def test_token_ids_equal_the_text(daemon: Any, tokenizer: Any) -> None:
    texts = ["the quick brown fox", "jumps over the lazy dog"]
    ids = [tokenizer.encode(t) for t in texts]
    by_text = post(daemon, "/v1/embeddings", {"input": texts})
    by_ids = post(daemon, "/v1/embeddings", {"input": ids})
    np.testing.assert_allclose(vectors_of(by_ids), vectors_of(by_text), atol=1e-6)
    assert by_ids.json()["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    one = vectors_of(post(daemon, "/v1/embeddings", {"input": ids[0]}))  # one id list
    np.testing.assert_allclose(one[0], vectors_of(by_text)[0], atol=1e-6)


def test_an_input_longer_than_the_step_budget_is_computed_in_chunks(daemon: Any) -> None:
    """A 2000-token input with the module's 256-token step budget runs over eight steps on its
    own cache; its vector equals the one of a single forward within float32 noise."""
    from mlxcel.daemon.engine.embedder import Embedder

    rng = np.random.default_rng(2)
    ids = [int(t) for t in rng.integers(3, 200, 2000)]
    bridge = daemon.daemon.state.model.bridge
    assert bridge.engine.config.prefill_chunk_size == BUDGET
    before = bridge.engine._embedder.num_batches if bridge.engine._embedder else 0
    chunked = vectors_of(post(daemon, "/v1/embeddings", {"input": [ids]}))[0]
    assert bridge.engine._embedder.num_batches - before == 8  # ceil(2000 / 256)
    # one forward over all 2000 tokens, on the engine thread (it owns the model)
    whole = daemon.call(_on_engine, bridge, lambda: Embedder(bridge.engine.model).pool([ids])[0])
    np.testing.assert_allclose(chunked, whole, atol=1e-5)


async def _on_engine(bridge: Any, fn: Any) -> Any:
    return await bridge._call(fn)


def test_fast_forward_equals_the_stock_forward(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused CPU layers (forward/fast_forward.py, native decode/chunk hooks) and mlx-lm's
    own modules give the same vectors within 1e-4."""
    from mlxcel.daemon.engine.embedder import Embedder
    from mlxcel.daemon.forward.fast_forward import is_fast
    from mlxcel.daemon.models import load_model

    rng = np.random.default_rng(3)
    rows = [[int(t) for t in rng.integers(3, 200, n)] for n in (7, 33, 64, 2)]
    fast = load_model(str(tiny_model_dir))
    monkeypatch.setenv("MLXCEL_NO_FAST_FORWARD", "1")
    stock = load_model(str(tiny_model_dir))
    assert is_fast(fast.model) and not is_fast(stock.model)
    got = np.stack(Embedder(fast.model).pool(rows))
    want = np.stack(Embedder(stock.model).pool(rows))
    np.testing.assert_allclose(got, want, atol=1e-4)


# -- bad input -------------------------------------------------------------------------------


BAD_INPUTS = [
    ({"input": ""}, "empty_input"),
    ({"input": ["fine", ""]}, "empty_input"),
    ({"input": [[1, 2], []]}, "empty_input"),
    ({"input": []}, "invalid_value"),
    ({}, "missing_field"),
    ({"input": 123}, "invalid_type"),
    ({"input": [1.5, 2]}, "invalid_type"),
    ({"input": ["text", [1, 2]]}, "invalid_type"),
    ({"input": [[1, 2.5]]}, "invalid_type"),
    ({"input": [True, False]}, "invalid_type"),
    ({"input": {"text": "x"}}, "invalid_type"),
    ({"input": [[1, 10**9]]}, "invalid_token_id"),
    ({"input": [[-1]]}, "invalid_token_id"),
    ({"input": ["x"] * 2049}, "too_many_inputs"),
    ({"input": [[5] * 2049]}, "context_length_exceeded"),
    ({"input": [[5] * 150] * 2001}, "too_many_tokens"),
    ({"input": "x", "dimensions": 32}, "unsupported_dimensions"),
    ({"input": "x", "dimensions": "64"}, "invalid_type"),
    ({"input": "x", "encoding_format": "int8"}, "invalid_value"),
    ({"input": "x", "model": "no-such-model"}, "model_not_found"),
]


@pytest.mark.parametrize(("body", "code"), BAD_INPUTS, ids=[c for _, c in BAD_INPUTS])
def test_bad_input_is_a_clear_400(daemon: Any, body: dict[str, Any], code: str) -> None:
    response = post(daemon, "/v1/embeddings", body)
    assert response.status_code == (404 if code == "model_not_found" else 400), response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and "Traceback" not in response.text


def test_the_index_over_the_context_is_named(daemon: Any) -> None:
    error = post(daemon, "/v1/embeddings", {"input": [[5], [5] * 3000]}).json()["error"]
    assert error["code"] == "context_length_exceeded" and "input[1]" in error["message"]


def test_dimensions_equal_to_the_width_and_user_are_accepted(daemon: Any) -> None:
    body = {"input": "x", "dimensions": WIDTH, "user": "someone"}
    unit_norms(vectors_of(post(daemon, "/v1/embeddings", body)))


def test_bad_ollama_input(daemon: Any) -> None:
    for body in (
        {"model": MODEL, "input": 5},
        {"model": MODEL, "input": ["ok", 5]},
        {"model": MODEL, "input": ["ok", ""]},
        {"model": MODEL, "input": "x", "truncate": "yes"},
        {"model": MODEL, "input": "x", "options": []},
    ):
        response = post(daemon, "/api/embed", body)
        assert response.status_code == 400, (body, response.text)
        assert isinstance(response.json()["error"], str)
    legacy = post(daemon, "/api/embeddings", {"model": MODEL, "prompt": ["a"]})
    assert legacy.status_code == 400 and isinstance(legacy.json()["error"], str)


# -- decoding is not stalled -----------------------------------------------------------------


def _stream_gaps(daemon: Any, started: threading.Event, gaps: list[float]) -> None:
    client = openai_client(daemon)
    stream = client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=1500, stream=True, temperature=0
    )
    last = None
    for _chunk in stream:
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        else:
            started.set()
        last = now
    started.set()


def test_a_large_embedding_request_does_not_stall_a_running_stream(daemon: Any) -> None:
    """While a stream decodes, an embedding request of ~96k tokens (47 steps' budgets) is served
    between its steps: the stream's worst gap stays near what one step's budget of embedding
    costs, not the whole request's time (as one forward would take)."""
    rng = np.random.default_rng(4)
    budget = daemon.daemon.state.model.bridge.engine.config.prefill_chunk_size
    chunk = [[int(t) for t in rng.integers(3, 200, 128)] for _ in range(budget // 128)]
    t0 = time.perf_counter()
    vectors_of(post(daemon, "/v1/embeddings", {"input": chunk}))  # one step's budget, idle
    one_chunk_s = time.perf_counter() - t0
    big = [[int(t) for t in rng.integers(3, 200, 128)] for _ in range(750)]  # 96,000 tokens
    gaps: list[float] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream_gaps, args=(daemon, started, gaps))
    reader.start()
    assert started.wait(60)
    # the stream alone, for a baseline
    wait_until(lambda: len(gaps) >= 100, timeout=60, what="100 gaps of the stream alone")
    alone = max(gaps)
    mark = len(gaps)
    t0 = time.perf_counter()
    vectors = vectors_of(post(daemon, "/v1/embeddings", {"input": big}))
    big_s = time.perf_counter() - t0
    during = gaps[mark:]  # the gaps while the embedding request ran
    reader.join(120)
    assert vectors.shape == (750, WIDTH)
    assert len(during) > 10, "the stream got no steps while the embeddings were computed"
    worst = max(during)
    print(
        f"one budget of embeddings {one_chunk_s * 1e3:.0f} ms, the request {big_s * 1e3:.0f} ms,"
        f" worst gap {worst * 1e3:.0f} ms over {len(during)} gaps ({alone * 1e3:.0f} ms alone)"
    )
    # generous: other processes share the CPU; one forward for the whole request (or a batch
    # over the budget) would hold the stream for seconds
    assert worst < alone + 3 * one_chunk_s + 1.0, (worst, alone, one_chunk_s, big_s)
    assert worst < big_s / 4


def test_a_client_that_goes_away_stops_its_embeddings(daemon: Any) -> None:
    """The handler is cancelled when its client disconnects; the engine drops the inputs it
    has not computed yet instead of running the whole request for nobody."""
    rng = np.random.default_rng(5)
    big = [[int(t) for t in rng.integers(3, 200, 128)] for _ in range(750)]  # ~10 s of work
    engine = daemon.daemon.state.model.bridge.engine
    vectors_of(post(daemon, "/v1/embeddings", {"input": "warm up"}))
    before = engine._embedder.num_tokens
    with pytest.raises(httpx.ReadTimeout):
        post(daemon, "/v1/embeddings", {"input": big}, timeout=1.0)
    wait_until(
        lambda: engine.num_embedding_jobs == 0, timeout=5, poll=0.02, what="no embedding job left"
    )
    assert engine._embedder.num_tokens - before < 96_000 // 2


def test_embedding_requests_past_the_queue_depth_are_refused(tiny: Any) -> None:
    """`max_queue_depth` bounds the embedding requests an engine holds (queue_full, 503)."""
    import asyncio

    from mlxcel.daemon.engine.bridge import EngineBridge
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.engine.types import AdmissionRejected
    from mlxcel.shared.config import ServingConfig

    engine = Engine(tiny.model, ServingConfig(model="x", max_queue_depth=1), context_length=2048)
    bridge = EngineBridge(engine)
    big = [[5] * 128] * 400

    async def main() -> str:
        bridge.start()
        first = asyncio.ensure_future(bridge.embed(big))
        await asyncio.sleep(0)  # posted: queued in the bridge, or held by the engine
        try:
            await bridge.embed([[1, 2]])
        except AdmissionRejected as exc:
            return exc.reason
        finally:
            first.cancel()
            await bridge.shutdown(drain=False)
        return "accepted"

    assert asyncio.run(main()) == "queue_full"


def test_a_failed_forward_fails_every_waiting_job(tiny: Any) -> None:
    """A short batch takes inputs of several jobs at once: when its forward raises, each of
    those jobs gets the error, never a result with fewer vectors than it sent."""
    import concurrent.futures

    from mlxcel.daemon.engine.embedder import Embedder

    embedder = Embedder(tiny.model)
    futures = [concurrent.futures.Future() for _ in range(2)]
    embedder.add([[5, 6, 7], [8, 9]], futures[0])
    embedder.add([[10, 11]], futures[1])

    def broken(rows: list[list[int]]) -> list[np.ndarray]:
        raise MemoryError("out of memory in the forward")

    embedder.pool = broken  # type: ignore[method-assign]
    assert embedder.run_batch(budget=64) == 0
    for future in futures:
        with pytest.raises(RuntimeError, match="embedding forward failed"):
            future.result(timeout=1)
    assert not embedder.pending
