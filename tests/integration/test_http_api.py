"""The OpenAI-compatible HTTP API on the real daemon (real engine, tiny random-weight model).

The official `openai` package is the client where it can be; raw aiohttp where the test needs
the wire (SSE framing, disconnects).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from daemon_helpers import embedded_daemon, openai_client, wait_idle_embedded

LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_daemon(tmp_path_factory, tiny_model_dir, parallel=4, prefill_chunk_size=64) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Any) -> openai.OpenAI:
    return openai_client(daemon)


@pytest.fixture(scope="module")
def model_name(daemon: Any) -> str:
    return daemon.daemon.state.model.name


@pytest.fixture(scope="module")
def tokenizer(daemon: Any) -> Any:
    return daemon.daemon.state.model.tokenizer


def reset_cache(daemon: Any) -> None:
    daemon.call(daemon.daemon.state.model.runtime.reset_cache)


def engine_counters(daemon: Any) -> Any:
    return daemon.daemon.bridge.snapshot().counters


def test_chat_through_the_openai_package(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        temperature=0,
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_matches_the_plain_answer_and_ends_with_usage(
    client: openai.OpenAI, model_name: str, daemon: Any
) -> None:
    kwargs: dict[str, Any] = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Tell me a story about the sea."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    reset_cache(daemon)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    reset_cache(daemon)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_take_a_string_or_token_ids(
    client: openai.OpenAI, model_name: str, tokenizer: Any
) -> None:
    ids = tokenizer.encode("What is the capital of France?")
    by_text = client.completions.create(
        model=model_name, prompt="What is the capital of France?", max_tokens=6, temperature=0
    )
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_ids.usage.completion_tokens == 6


def test_a_repeated_long_prompt_reports_cached_tokens(
    client: openai.OpenAI, model_name: str
) -> None:
    messages = [{"role": "user", "content": "Summarise: " + LONG_TEXT}]
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 32 <= cached < second.usage.prompt_tokens


def test_stop_string_cuts_the_text_before_it(
    client: openai.OpenAI, model_name: str, daemon: Any
) -> None:
    kwargs = {"model": model_name, "prompt": "Write a short poem", "temperature": 0}
    reset_cache(daemon)
    full = client.completions.create(**kwargs, max_tokens=24).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.find(stop)]
    stops_before = engine_counters(daemon).requests_by_finish_reason.get("stop", 0)
    for stream in (False, True):
        reset_cache(daemon)
        if stream:
            chunks = list(
                client.completions.create(**kwargs, max_tokens=24, stop=[stop], stream=True)
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kwargs, max_tokens=24, stop=stop)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (expected, "stop")
    # The engine counts a stop-string finish as "stop", not as a client abort.
    stops = wait_idle_embedded(daemon).counters.requests_by_finish_reason.get("stop", 0)
    assert stops == stops_before + 2


def test_logit_bias_forces_a_token(client: openai.OpenAI, model_name: str, tokenizer: Any) -> None:
    (token,) = tokenizer.encode("a", add_special_tokens=False)
    r = client.completions.create(
        model=model_name, prompt="Hello", max_tokens=6, temperature=0, logit_bias={str(token): 100}
    )
    assert r.choices[0].text == "a" * 6


def test_eos_ends_the_answer_unless_ignore_eos(
    client: openai.OpenAI, model_name: str, tokenizer: Any
) -> None:
    eos = sorted(tokenizer.eos_token_ids)[0]
    kwargs = {
        "model": model_name,
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "logit_bias": {str(eos): 100},
    }
    stopped = client.completions.create(**kwargs)
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("", "stop")
    assert stopped.usage.completion_tokens == 1
    ignored = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 5 and ignored.choices[0].text == ""


def test_the_same_seed_gives_the_same_sample(client: openai.OpenAI, model_name: str) -> None:
    kwargs = {
        "model": model_name,
        "prompt": "Once upon a time",
        "max_tokens": 10,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    assert a == b
    # The contrast: were the seed (or the temperature) ignored, every seed would agree.
    others = {client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2, 3)}
    assert others - {a}, "three other seeds all gave the same text as seed 1234"


def test_concurrent_streams_all_finish(client: openai.OpenAI, model_name: str, daemon: Any) -> None:
    async def one(session: aiohttp.ClientSession, i: int) -> str:
        body = {
            "model": model_name,
            "messages": [{"role": "user", "content": f"Question number {i}?"}],
            "max_tokens": 10,
            "ignore_eos": True,  # sampling at temperature 1 may pick the eos token
            "stream": True,
        }
        async with session.post(daemon.http_url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            lines = [ln.decode().strip() async for ln in r.content if ln.strip()]
        assert lines[-1] == "data: [DONE]"
        return json.loads(lines[-2][len("data: ") :])["choices"][0]["finish_reason"]

    async def main() -> list[str]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(8)))

    assert asyncio.run(main()) == ["length"] * 8
    assert wait_idle_embedded(daemon).kv.blocks_used == 0


def test_a_client_that_disconnects_mid_stream_frees_its_slot(daemon: Any, model_name: str) -> None:
    aborted_before = engine_counters(daemon).requests_by_finish_reason.get("abort", 0)

    async def main() -> None:
        body = {
            "model": model_name,
            "prompt": "Count to a thousand",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        async with aiohttp.ClientSession() as session:
            r = await session.post(daemon.http_url + "/v1/completions", json=body)
            for _ in range(3):
                await r.content.readline()
            r.close()  # drop the connection mid-stream

    asyncio.run(main())
    snap = wait_idle_embedded(daemon)
    assert snap.kv.blocks_used == 0
    assert snap.counters.requests_by_finish_reason.get("abort", 0) == aborted_before + 1


def test_health_models_slots_and_cache_routes(daemon: Any, model_name: str) -> None:
    async def main() -> dict[str, Any]:
        out = {}
        async with aiohttp.ClientSession(daemon.http_url) as s:
            for path in ("/health", "/v1/models", "/slots", "/v1/cache/stats"):
                async with s.get(path) as r:
                    assert r.status == 200, path
                    out[path] = await r.json()
            async with s.post("/v1/cache/reset") as r:
                out["reset"] = await r.json()
        return out

    out = asyncio.run(main())
    assert out["/health"] == {"status": "ok"}
    # The loaded model first; the other local models (docs/models.md) follow, not loaded.
    listed = out["/v1/models"]["data"]
    assert [m["id"] for m in listed if m["loaded"]] == [model_name] == [listed[0]["id"]]
    slots = out["/slots"]
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert {"state", "prompt_tokens", "generated_tokens", "ttft_s"} <= set(slots[0])
    assert not any(k == "prompt" or "text" in k for s in slots for k in s)
    assert {"entries", "bytes", "hits", "lookups"} <= set(out["/v1/cache/stats"]["prompt_cache"])
    assert set(out["reset"]) == {"entries_freed", "bytes_freed"}
