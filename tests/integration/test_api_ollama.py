"""The Ollama API through the official `ollama` package, unmodified, against a real daemon
(tiny model: the point is the plumbing)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import ollama
import pytest
from daemon_helpers import embedded_daemon, http_json
from mlxcel.daemon.server.ollama_api import OLLAMA_API_VERSION
from mlxcel.shared import __version__
from tool_model import make_tool_model

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tool_model(tmp_path_factory.mktemp("toolmodel") / "llama")
    with embedded_daemon(tmp_path_factory, model, parallel=4, prefill_chunk_size=64) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Any) -> ollama.Client:
    return ollama.Client(host=daemon.http_url)


@pytest.fixture(scope="module")
def model(daemon: Any) -> str:
    return daemon.daemon.state.model.name


def test_list_ps_show_version(client: ollama.Client, model: str, daemon: Any) -> None:
    listed, *_others = client.list().models  # the loaded model, then the store's (models.md)
    assert listed.model == model and listed.size and listed.details.family == "llama"
    (loaded,) = client.ps().models
    assert loaded.model == model and loaded.size_vram == 0  # the CPU backend
    shown = client.show(model)
    assert "tools" in shown.capabilities and shown.template.startswith("{%- if tools %}")
    assert shown.modelinfo["llama.context_length"] == 2048
    with urllib.request.urlopen(daemon.http_url + "/api/version") as r:
        assert json.loads(r.read()) == {
            "version": OLLAMA_API_VERSION,
            "mlxcel_version": __version__,
        }


def test_chat_and_its_stream_agree(client: ollama.Client, model: str) -> None:
    whole = client.chat(model=model, messages=ASK, options=GREEDY, stream=False)
    assert whole.done and whole.message.role == "assistant"
    assert whole.eval_count <= 6 and whole.prompt_eval_count > 0
    parts = list(client.chat(model=model, messages=ASK, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


def test_the_latest_tag_names_the_served_model(client: ollama.Client, model: str) -> None:
    tagged = client.chat(model=f"{model}:latest", messages=ASK, options=GREEDY, stream=False)
    assert (
        tagged.message.content
        == client.chat(model=model, messages=ASK, options=GREEDY).message.content
    )
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=f"{model}:7b", messages=ASK, options=GREEDY, stream=False)
    assert err.value.status_code == 404


def test_generate_and_its_stream_agree(client: ollama.Client, model: str) -> None:
    whole = client.generate(model=model, prompt="Hello", options=GREEDY, stream=False)
    parts = list(client.generate(model=model, prompt="Hello", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count
    raw = client.generate(model=model, prompt="Hello", options=GREEDY, raw=True, stream=False)
    assert raw.prompt_eval_count < whole.prompt_eval_count  # no chat template around it


def test_the_server_streams_ndjson_by_default(daemon: Any, model: str) -> None:
    body = json.dumps({"model": model, "messages": ASK, "options": GREEDY}).encode()
    headers = {"Content-Type": "application/json"}  # a form type would get 415
    req = urllib.request.Request(daemon.http_url + "/api/chat", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.read().splitlines()]
    assert len(lines) >= 2 and lines[-1]["done"] and not lines[0]["done"]


def test_num_predict_over_the_context_is_a_ceiling(client: ollama.Client, model: str) -> None:
    r = client.chat(model=model, messages=ASK, options={"num_predict": 10**6}, stream=False)
    assert r.done and r.eval_count > 0


def test_unknown_fields_are_ignored_and_named(daemon: Any, model: str) -> None:
    body = {"model": model, "messages": ASK, "stream": False, "options": GREEDY, "n": 3}
    status, headers, payload = http_json(daemon.http_url + "/api/chat", body)
    assert status == 200 and payload["done"]
    assert headers["X-Mlxcel-Ignored-Fields"] == "n"


def test_tool_history_reaches_the_template(client: ollama.Client, model: str) -> None:
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_name": "get_weather", "content": "21 C and sunny"},
    ]
    plain = client.chat(model=model, messages=ASK, options=GREEDY, stream=False)
    r = client.chat(model=model, messages=history, options=GREEDY, stream=False)
    # The call and its result add their tokens (the template renders both).
    assert r.prompt_eval_count > plain.prompt_eval_count + 20


def test_the_tag_suffix_names_the_same_model(client: ollama.Client, model: str) -> None:
    r = client.chat(model=model + ":latest", messages=ASK, options=GREEDY, stream=False)
    assert r.done


def test_format_schema_constrains_the_output(client: ollama.Client, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"sunny": {"type": "boolean"}, "city": {"enum": ["Paris", "Rome"]}},
        "required": ["sunny", "city"],
        "additionalProperties": False,
    }
    r = client.chat(
        model=model, messages=ASK, format=schema, options={"num_predict": 60}, stream=False
    )
    obj = json.loads(r.message.content)
    assert set(obj) == {"sunny", "city"} and obj["city"] in ("Paris", "Rome")


def test_format_holds_for_raw_generate_too(client: ollama.Client, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = client.generate(
        model=model, prompt="Answer:", raw=True, format=schema, options={"num_predict": 40},
        stream=False,
    )  # fmt: skip
    assert r.done_reason == "stop" and set(json.loads(r.response)) == {"ok"}


def test_an_unknown_model_is_an_ollama_error(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama3:8b", messages=ASK, stream=False)
    assert err.value.status_code == 404 and "not served" in err.value.error


@pytest.mark.parametrize(
    "body",
    [
        {"messages": "hi"},
        {"messages": ASK, "options": "hot"},
        {"messages": ASK, "options": {"temperature": "hot"}},
        {"messages": ASK, "format": "yaml"},
        {"messages": [{"role": "user"}]},
        {"messages": ASK, "stream": "yes"},
    ],
)
def test_bad_chat_bodies_get_ollamas_error_shape(daemon: Any, body: dict[str, Any]) -> None:
    status, _, payload = http_json(daemon.http_url + "/api/chat", body)
    assert status == 400 and isinstance(payload["error"], str) and payload["error"]
