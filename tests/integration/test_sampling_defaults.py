"""The daemon's sampling defaults (`--temperature`, docs/api.md "Sampling defaults") reach a
request that sends no temperature in every dialect, and a request that sends one keeps it: on
the tiny random llama, greedy text and text sampled at temperature 1 differ."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import control, embedded_daemon, http_json

PROMPT = "Tell me about rivers."
TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_daemon(tmp_path_factory, tiny_model_dir, temperature=0.0) as d:
        yield d


def _post(daemon: Any, path: str, body: dict[str, Any]) -> Any:
    status, _, payload = http_json(daemon.http_url + path, body)
    assert status == 200, payload
    return payload


def chat_text(daemon: Any, **fields: Any) -> str:
    messages = [{"role": "user", "content": PROMPT}]
    body = {"messages": messages, "max_tokens": TOKENS, "ignore_eos": True, **fields}
    return _post(daemon, "/v1/chat/completions", body)["choices"][0]["message"]["content"]


def test_a_request_without_temperature_gets_the_daemons(daemon: Any) -> None:
    greedy = chat_text(daemon, temperature=0)
    assert chat_text(daemon) == greedy
    assert chat_text(daemon, seed=1) == greedy == chat_text(daemon, seed=2)  # no sampling
    # a temperature the request sends wins: at 1, two seeds give two texts, not the greedy one
    sampled = {chat_text(daemon, temperature=1.0, seed=seed) for seed in (1, 2, 3)}
    assert len(sampled - {greedy}) >= 2, (greedy, sampled)


def test_every_dialect_applies_the_default(daemon: Any) -> None:
    greedy = chat_text(daemon, temperature=0)
    messages = [{"role": "user", "content": PROMPT}]
    anthropic = _post(daemon, "/v1/messages", {"messages": messages, "max_tokens": TOKENS})
    assert anthropic["content"][0]["text"] == greedy
    ollama = _post(
        daemon,
        "/api/chat",
        {"messages": messages, "stream": False, "options": {"num_predict": TOKENS}},
    )
    assert ollama["message"]["content"] == greedy
    responses = _post(daemon, "/v1/responses", {"input": PROMPT, "max_output_tokens": TOKENS})
    assert responses["output"][-1]["content"][0]["text"] == greedy
    assert responses["temperature"] == 0.0  # the temperature it used, echoed


def test_status_shows_the_defaults(daemon: Any) -> None:
    reply = control(daemon.socket_path, "status", {})
    assert reply["result"]["daemon"]["sampling"] == {"temperature": 0.0}, reply
