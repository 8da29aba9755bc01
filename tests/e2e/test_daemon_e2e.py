"""End to end on the real SmolLM2: `mlxcel-daemon start`, the openai package, `stop`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from mlxcel.daemon.process.lifecycle import pid_alive

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def daemon_url(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "MLXCEL_HOME": str(home)}
    env.pop("MLXCEL_SOCKET", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "mlxcel.daemon.cli", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)

    started = cli("start", "--model", str(default_model_dir), "--port", "0")
    assert started.returncode == 0, started.stderr
    state = json.loads((home / "run" / "daemon.json").read_text())
    try:
        yield state["http_url"]
    finally:
        stopped = cli("stop")
        if pid_alive(state["pid"]):
            os.kill(state["pid"], signal.SIGKILL)
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture(scope="module")
def client(daemon_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon_url + "/v1", api_key="unused", max_retries=0)


def test_greedy_answer_is_paris(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_shared_system_prompt_is_served_from_the_cache(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    system = {
        "role": "system",
        "content": "You are a concise assistant for a geography quiz. "
        "Answer with one short sentence, name the country and the city, and never add notes.",
    }
    cached = []
    for question in ("What is the capital of Spain?", "What is the capital of Italy?"):
        r = client.chat.completions.create(
            model=model,
            messages=[system, {"role": "user", "content": question}],
            max_tokens=12,
            temperature=0,
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    # Earlier requests in this module share only the template's opening tokens with the first
    # one ("<|im_start|>system\n"); the second reuses the whole system prompt (40+ tokens),
    # to the token, past the last whole 32-token block.
    assert cached[0] < 16 and cached[1] >= 40 and cached[1] % 32 != 0
