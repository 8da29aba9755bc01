"""OpenAI's Responses API (`POST /v1/responses` and the stored responses' routes) through the
official `openai` package, unmodified, against the in-process daemon on a tiny random model
with a tool-capable template: the point is the plumbing (docs/api.md, "Responses")."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from daemon_helpers import embedded_daemon, http_json, openai_client, wait_until
from mlxcel.daemon.server.response_store import ResponseStore, StoredResponse, json_size
from mlxcel.daemon.server.responses_api import RESPONSES
from mlxcel.shared.config import KV_BLOCK_SIZE
from openai.types.responses import Response
from pydantic import BaseModel
from tool_model import make_think_model, make_tool_model

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
HOSTED = [{"type": "web_search"}, {"type": "local_shell"}, {"type": "custom", "name": "patch"}]
SYSTEM = "You answer questions about the weather, briefly and politely. " * 6  # several blocks


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tool_model(tmp_path_factory.mktemp("toolmodel") / "llama")
    with embedded_daemon(tmp_path_factory, model, parallel=2, prefill_chunk_size=64) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Any) -> openai.OpenAI:
    return openai_client(daemon)


@pytest.fixture(scope="module")
def model(daemon: Any) -> str:
    return daemon.daemon.state.model.name


def store_of(daemon: Any) -> ResponseStore:
    return daemon.daemon._runner.app[RESPONSES]


def post(daemon: Any, body: Any, path: str = "/v1/responses") -> tuple[int, dict[str, str], Any]:
    return http_json(daemon.http_url + path, body)


def delete(daemon: Any, path: str) -> tuple[int, Any]:
    req = urllib.request.Request(daemon.http_url + path, method="DELETE")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_string_input_is_a_valid_response(client: openai.OpenAI, model: str) -> None:
    raw = client.responses.with_raw_response.create(
        model=model, input="What is the weather in Paris?", max_output_tokens=6, temperature=0
    )
    r = Response.model_validate(raw.http_response.json())  # the SDK's own types, validated
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status in ("completed", "incomplete") and r.error is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text
    assert 0 < r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.store is True and r.tools == [] and r.tool_choice == "auto"


def test_item_input_with_instructions(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(
        model=model,
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant", "content": "Hello!"},
            {"type": "reasoning", "summary": []},  # dropped from the prompt
            {"type": "message", "role": "user", "content": "Weather in Rome?"},
        ],
        max_output_tokens=4,
    )
    assert r.instructions == "Be brief." and r.output[0].type == "message"
    # The developer message reaches the prompt (merged into the leading system message: this
    # template, like many, renders only a first system message).
    plain = client.responses.create(
        model=model, instructions="Be brief.", input="Weather in Rome?", max_output_tokens=1
    )
    with_dev = client.responses.create(
        model=model, instructions="Be brief.", max_output_tokens=1,
        input=[{"role": "developer", "content": "Answer in English."},
               {"role": "user", "content": "Weather in Rome?"}],
    )  # fmt: skip
    assert with_dev.usage.input_tokens > plain.usage.input_tokens
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 3 + ["reasoning", "message"]
    assert items.data[0].role == "developer" and items.data[1].content[0].text == "Hi"


def test_stream_events_in_order(client: openai.OpenAI, model: str) -> None:
    stream = client.responses.create(
        model=model, input="Tell me about Paris.", max_output_tokens=8, temperature=0, stream=True
    )
    events = list(stream)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        types[-1],
    ]
    final = events[-1].response
    assert final.status in ("completed", "incomplete") and types[-1] == f"response.{final.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text == events[-4].text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert client.responses.retrieve(final.id).output_text == text  # stored when done


def test_stream_helper_gets_the_final_response(client: openai.OpenAI, model: str) -> None:
    # Constrained to a short JSON object: it completes (max_output_tokens would end it
    # `incomplete`, and the helper wants `response.completed`).
    with client.responses.stream(
        model=model, input="Forecast?", text_format=Forecast, max_output_tokens=64
    ) as s:
        texts = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts)
    assert isinstance(final.output_parsed, Forecast)


def test_chaining_hits_the_prefix_cache(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(
        model=model, instructions=SYSTEM, input="Weather in Paris?", max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model=model, instructions=SYSTEM, previous_response_id=first.id,
        input="And in Rome?", max_output_tokens=4, temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The whole first prompt, to the KV block, came from the cache.
    covered = first.usage.input_tokens // KV_BLOCK_SIZE * KV_BLOCK_SIZE
    assert second.usage.input_tokens_details.cached_tokens >= covered > 0
    # input_items lists the request's own items, not the chained ones
    (item,) = client.responses.input_items.list(second.id).data
    assert item.content[0].text == "And in Rome?"


def test_forced_function_call_then_its_output(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(
        model=model, input="Weather in Paris?", tools=[WEATHER, *HOSTED],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
    )  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert [t.name for t in r.tools] == ["get_weather"]  # the hosted tools were left out
    answer = client.responses.create(
        model=model, previous_response_id=r.id, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"
    (out,) = client.responses.input_items.list(answer.id).data
    assert out.type == "function_call_output" and out.output == "sunny"
    # Stateless (Codex: store false, the whole history sent back each turn).
    again = client.responses.create(
        model=model, store=False, max_output_tokens=4, tools=[WEATHER],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
    )  # fmt: skip
    assert again.output[0].type == "message"


def test_an_image_in_a_tool_output_becomes_a_note(daemon: Any, model: str) -> None:
    """Codex's view_image tool answers with an input_image part: the session goes on (a text
    note in its place), where an image in a user message is a clear 400."""
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    output = [{"type": "input_text", "text": "see:"}, image]
    body = {
        "model": model, "max_output_tokens": 2, "store": False,
        "input": [
            {"role": "user", "content": "Look at a.png"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": output},
        ],
    }  # fmt: skip
    status, _, out = post(daemon, body)
    assert status == 200, out
    user = {"model": model, "input": [{"role": "user", "content": [image]}]}
    status, _, out = post(daemon, user)
    assert status == 400 and out["error"]["code"] == "unsupported_value", out


def test_hosted_tools_are_named_in_the_ignored_header(daemon: Any, model: str) -> None:
    body = {"model": model, "input": "Hi", "max_output_tokens": 2, "tools": HOSTED, "foo": 1}
    status, headers, out = post(daemon, body)
    assert status == 200 and out["tools"] == []
    assert headers["X-Mlxcel-Ignored-Fields"] == (
        "foo, tools.custom, tools.local_shell, tools.web_search"
    )


def test_json_schema_format_parses(client: openai.OpenAI, model: str) -> None:
    r = client.responses.parse(
        model=model, input="Forecast for Rome", text_format=Forecast, max_output_tokens=64
    )
    assert isinstance(r.output_parsed, Forecast)
    assert r.text.format.type == "json_schema" and r.text.format.name == "Forecast"


def test_retrieve_delete_then_404(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input="Hi", max_output_tokens=3)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(r.id)
    assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="Hi", previous_response_id=r.id)


def test_store_false_keeps_nothing(client: openai.OpenAI, model: str, daemon: Any) -> None:
    before = len(store_of(daemon))
    r = client.responses.create(model=model, input="Hi", max_output_tokens=3, store=False)
    assert r.store is False and len(store_of(daemon)) == before
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_the_store_count_bound_evicts_the_oldest(client: openai.OpenAI, model: str, daemon: Any):
    store = store_of(daemon)
    old_max = store.max_count
    store.max_count = 3
    try:
        ids = [client.responses.create(model=model, input="Hi", max_output_tokens=2).id
               for _ in range(4)]  # fmt: skip
        assert len(store) == 3 and ids[0] not in store and all(i in store for i in ids[1:])
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        with pytest.raises(openai.NotFoundError):  # never a silent fresh start
            client.responses.create(model=model, input="Hi", previous_response_id=ids[0])
        assert client.responses.retrieve(ids[1]).id == ids[1]
    finally:
        store.max_count = old_max


def test_the_store_byte_bound() -> None:
    store = ResponseStore(max_bytes=10_000, max_count=100)

    def entry(i: int, text: str) -> StoredResponse:
        items = [{"type": "message", "content": [{"text": text}]}]
        return StoredResponse(f"resp_{i}", {"id": f"resp_{i}"}, items, items, json_size(items))

    for i in range(5):
        assert store.put(entry(i, "x" * 3000))
    assert [f"resp_{i}" in store for i in range(5)] == [False, False, True, True, True]
    assert store.bytes <= 10_000 and store.bytes == sum(
        store.get(f"resp_{i}").size for i in (2, 3, 4)
    )
    assert not store.put(entry(9, "y" * 20_000)) and "resp_9" not in store  # alone over
    store.delete("resp_3")
    assert store.bytes == sum(store.get(f"resp_{i}").size for i in (2, 4)) and len(store) == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": 42}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * 1001}]},
         "input[0].content"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
         "text.format.schema"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                             "schema": {"type": "nope"}}}}, "text.format.schema"),
        ({"input": "hi", "tools": [{"type": "web_search"}, {"type": "function", "name": "a b"}]},
         "tools[1].name"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
         "tool_choice"),
        ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "previous_response_id": 7}, "previous_response_id"),
        ({"input": "hi", "store": "yes"}, "store"),
        ({"input": "hi", "metadata": {"k": 1}}, "metadata"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(
    daemon: Any, model: str, body: dict[str, Any], param: str
) -> None:
    status, _, out = post(daemon, {"model": model, **body})
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param


def test_a_huge_input_list_is_bounded(daemon: Any, model: str) -> None:
    items = [{"role": "user", "content": "hi"}] * 10_001
    started = time.monotonic()
    status, _, out = post(daemon, {"model": model, "input": items})
    assert status == 400 and out["error"]["param"] == "input"
    assert "at most 10000" in out["error"]["message"] and time.monotonic() - started < 30
    # Under the bound, a list this long is refused by the context check instead.
    status, _, out = post(daemon, {"model": model, "input": items[:9_000]})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("rid", ["resp_" + "0" * 48, "chatcmpl-123", "..%2F..%2Fetc", "x" * 300])
def test_ids_that_are_not_ours_are_404(daemon: Any, model: str, rid: str) -> None:
    for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
        status, _, out = http_json(daemon.http_url + path)
        assert status == 404 and out["error"]["code"] == "response_not_found"
    assert delete(daemon, f"/v1/responses/{rid}")[0] == 404
    assert post(daemon, {}, f"/v1/responses/{rid}/cancel")[0] == 404
    status, _, out = post(daemon, {"model": model, "input": "hi", "previous_response_id": rid})
    assert status == 404 and out["error"]["param"] == "previous_response_id"


def test_cancel_stops_an_in_flight_response(client: openai.OpenAI, model: str, daemon: Any) -> None:
    ctx_per_slot = daemon.daemon.state.model.bridge.snapshot().config.ctx_per_slot
    stream = client.responses.create(
        model=model, input="Write a long story.", max_output_tokens=4000, stream=True,
        temperature=0, extra_body={"ignore_eos": True},  # runs to the context unless stopped
    )  # fmt: skip
    created = next(iter(stream))
    assert created.type == "response.created"
    rid = created.response.id
    assert client.responses.retrieve(rid).status == "in_progress"
    with pytest.raises(openai.BadRequestError) as err:  # not yet a conversation to go on from
        client.responses.create(model=model, input="more", previous_response_id=rid)
    assert err.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(rid)
    assert cancelled.status == "cancelled"
    last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    usage = last.response.usage
    assert usage.output_tokens < (ctx_per_slot - usage.input_tokens) // 2  # stopped early
    assert client.responses.retrieve(rid).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # a finished one cannot be
        client.responses.cancel(rid)


def test_a_vanished_stream_client_is_settled(daemon: Any, model: str) -> None:
    body = {"model": model, "input": "Go on and on.", "max_output_tokens": 4000, "stream": True}
    req = urllib.request.Request(
        daemon.http_url + "/v1/responses", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    resp = urllib.request.urlopen(req, timeout=30)
    head = resp.read1(4096).decode()
    rid = json.loads(head.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"]
    resp.close()  # gone mid-stream
    store = store_of(daemon)
    wait_until(lambda: store.get(rid) is not None and not store.get(rid).in_flight, timeout=30)
    entry = store.get(rid)
    assert entry.response["status"] == "cancelled"
    assert entry.response["usage"]["output_tokens"] < 4000
    bridge = daemon.daemon.state.model.bridge
    wait_until(lambda: all(s.request_id != rid for s in bridge.snapshot().slots), timeout=30)
    status, _, out = post(daemon, {"model": model, "input": "still there?", "max_output_tokens": 2})
    assert status == 200 and out["status"] in ("completed", "incomplete")


def test_concurrent_streams_are_numbered_apart(client: openai.OpenAI, model: str) -> None:
    results: list[list[int]] = []

    def one() -> None:
        events = list(client.responses.create(model=model, input="Hi", max_output_tokens=6,
                                              stream=True))  # fmt: skip
        results.append([e.sequence_number for e in events])

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2 and all(r == list(range(len(r))) for r in results)


def test_a_codex_shaped_request_streams(daemon: Any, model: str) -> None:
    """What Codex CLI sends: store false, stream, instructions, developer and user messages with
    input_text parts, reasoning items from earlier turns, function tools with strict false next
    to hosted, custom and namespace tools, reasoning, include, prompt_cache_key."""
    shell = {
        "type": "function", "name": "shell", "strict": False,
        "description": "Runs a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "array",
                       "items": {"type": "string"}}}, "required": ["command"],
                       "additionalProperties": False},
    }  # fmt: skip
    body = {
        "model": model,
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions>none</permissions>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "abc"},
            {"type": "function_call", "call_id": "call_1", "name": "shell",
             "arguments": "{\"command\": [\"ls\"]}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
        ],
        "tools": [shell, {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
                  {"type": "namespace", "name": "mcp", "tools": []}, {"type": "web_search"}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "7f0c",
        "text": {"verbosity": "low"},
        "max_output_tokens": 4,
    }  # fmt: skip
    req = urllib.request.Request(
        daemon.http_url + "/v1/responses", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        ignored = resp.headers["X-Mlxcel-Ignored-Fields"]
        raw = resp.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    kinds = [b.split("\n", 1)[0].removeprefix("event: ") for b in blocks]
    datas = [json.loads(b.split("\n", 1)[1].removeprefix("data: ")) for b in blocks]
    assert [d["type"] for d in datas] == kinds and kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = Response.model_validate(datas[-1]["response"])
    assert final.store is False and [t.name for t in final.tools] == ["shell"]
    assert ignored == "tools.custom, tools.namespace, tools.web_search"
    assert store_of(daemon).get(final.id) is None


def test_a_streamed_function_call(client: openai.OpenAI, model: str) -> None:
    with client.responses.stream(
        model=model, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=64,
    ) as s:  # fmt: skip
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[2].item.type == "function_call" and events[2].item.status == "in_progress"
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert events[4].arguments == call.arguments == events[3].delta
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_allowed_tools_narrow_the_choice(client: openai.OpenAI, model: str) -> None:
    other = {**WEATHER, "name": "get_time", "description": "The time"}
    r = client.responses.create(
        model=model, input="Weather?", tools=[other, WEATHER], max_output_tokens=64,
        tool_choice={"type": "allowed_tools", "mode": "required",
                     "tools": [{"type": "function", "name": "get_weather"}]},
    )  # fmt: skip
    assert [(i.type, i.name) for i in r.output] == [("function_call", "get_weather")]
    # The model saw only the allowed tool: the same prompt as with that tool alone.
    alone = client.responses.create(
        model=model, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=64
    )
    assert r.usage.input_tokens == alone.usage.input_tokens


def test_strict_api_refuses_unknown_fields(daemon: Any, model: str) -> None:
    state = daemon.daemon.state
    body = {"model": model, "input": "Hi", "max_output_tokens": 1, "frobnicate": True}
    state.strict_api = True
    try:
        status, _, out = post(daemon, body)
        assert status == 400 and out["error"]["code"] == "unknown_field"
        assert out["error"]["param"] == "frobnicate"
        known = {k: v for k, v in body.items() if k != "frobnicate"}
        assert post(daemon, {**known, "user": "u", "prompt_cache_key": "k"})[0] == 200
    finally:
        state.strict_api = False
    status, headers, _ = post(daemon, body)
    assert status == 200 and headers["X-Mlxcel-Ignored-Fields"] == "frobnicate"


# --- a thinking model: its reasoning as a reasoning item ---------------------------------------


@pytest.fixture(scope="module")
def think(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The scripted thinking model (tool_model.make_think_model): greedy output is
    `<think>XZ</think>QJ`, so the reasoning is "XZ" and the answer "QJ"."""
    model = make_think_model(tmp_path_factory.mktemp("think") / "llama")
    with embedded_daemon(tmp_path_factory, model) as d:
        yield d


def test_reasoning_is_a_reasoning_item_apart_from_the_answer(think: Any) -> None:
    client = openai_client(think)
    resp = client.responses.create(model="llama", input="Hi", temperature=0)
    assert [item.type for item in resp.output] == ["reasoning", "message"], resp.output
    reasoning, message = resp.output
    assert [(c.type, c.text) for c in reasoning.content or []] == [("reasoning_text", "XZ")]
    assert reasoning.summary == [] and reasoning.status == "completed"
    assert resp.output_text == message.content[0].text == "QJ"
    chat = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Hi"}], temperature=0
    )
    counted = chat.usage.completion_tokens_details.reasoning_tokens
    assert counted and resp.usage.output_tokens_details.reasoning_tokens == counted
    # Codex sends the reasoning item back with the next turn: accepted, not shown again
    again = client.responses.create(
        model="llama",
        input=[
            {"role": "user", "content": "Hi"},
            reasoning.model_dump(exclude_none=True),
            {"role": "assistant", "content": "QJ"},
            {"role": "user", "content": "Hi"},
        ],
        temperature=0,
        store=False,
    )
    assert again.output_text == "QJ"


def test_streamed_reasoning_comes_in_reasoning_text_events(think: Any) -> None:
    client = openai_client(think)
    with client.responses.stream(model="llama", input="Hi", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done.text == "XZ", kinds
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"], kinds
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_text, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "XZ" and final.output_text == "QJ"


def test_reasoning_effort_none_turns_the_thinking_off(think: Any) -> None:
    client = openai_client(think)
    resp = client.responses.create(
        model="llama", input="Hi", temperature=0, reasoning={"effort": "none"}
    )
    assert [item.type for item in resp.output] == ["message"], resp.output
    assert resp.output_text == "QJ" and resp.reasoning.effort == "none"
