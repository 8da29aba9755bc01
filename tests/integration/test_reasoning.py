"""Thinking models: the reasoning kept apart from the answer (docs/api.md, "Reasoning").

The parsers on text split anywhere (think tags, gpt-oss harmony channels), the detection per
model, and the whole path on a tiny thinking model (tests/tool_model.py make_think_model: a
bigram model whose greedy output is `<think>XZ</think>QJ`, steered by `logit_bias`) through
the official `openai` SDK: `reasoning_content` apart from `content`, streamed and not,
thinking off, the budget (the engine forces `</think>`), a JSON schema on the answer only,
and the prompt cache across turns whose reasoning the template drops.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlxcel.daemon.engine.constraints import ReasoningTracker
from mlxcel.daemon.engine.types import ReasoningSpec
from mlxcel.daemon.server import reasoning
from mlxcel.daemon.server.openai_schema import parse_chat_request
from mlxcel.daemon.server.reasoning import HarmonyParser, ThinkParser
from tool_model import make_think_model

THINK_TEXT = "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4."
HARMONY_TEXT = (
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
)
USER = [{"role": "user", "content": "What is 2+2?"}]


def feed_cut(parser: reasoning.ReasoningParser, text: str, cuts: list[int]) -> tuple[str, str]:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    thought, content = "", ""
    for a, b in itertools.pairwise(bounds):
        r, c = parser.feed(text[a:b])
        thought, content = thought + r, content + c
    r, c = parser.finish()
    return thought + r, content + c


# --- the parsers --------------------------------------------------------------------------


@given(cuts=st.lists(st.integers(0, len(THINK_TEXT)), max_size=12))
def test_think_tags_split_anywhere_still_separate(cuts: list[int]) -> None:
    got = feed_cut(ThinkParser("<think>", "</think>"), THINK_TEXT, cuts)
    assert got == ("Let me see: 2+2.\n", "It is 4.")


@given(cuts=st.lists(st.integers(0, len(HARMONY_TEXT)), max_size=12))
def test_harmony_channels_split_anywhere_still_separate(cuts: list[int]) -> None:
    assert feed_cut(HarmonyParser(), HARMONY_TEXT, cuts) == ("User asks 2+2. Easy.", "It is 4.")


def test_one_shot_split_matches_the_stream_per_character() -> None:
    text = THINK_TEXT
    assert ThinkParser("<think>", "</think>").split(text) == feed_cut(
        ThinkParser("<think>", "</think>"), text, list(range(len(text)))
    )


def test_a_prompt_that_opened_the_reasoning_starts_inside_it() -> None:
    parser = ThinkParser("<think>", "</think>", open=True)
    assert feed_cut(parser, "\nhmm</think>ok", [2, 6, 9]) == ("hmm", "ok")
    # unterminated (max_tokens): all of it reasoning, a partial end tag included
    assert ThinkParser("<think>", "</think>", open=True).split("hmm </thi") == ("hmm </thi", "")


def test_text_without_a_leading_tag_is_content_unchanged() -> None:
    for text in ("plain <think> text </think>", "  spaced", "<thin", "a</think>b"):
        assert ThinkParser("<think>", "</think>").split(text) == ("", text)
    assert HarmonyParser().split("no channels here") == ("", "no channels here")


@pytest.mark.parametrize(
    "call",
    [
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"c":1}<|call|>',
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"c":1}',
    ],
    ids=["recipient-in-channel", "recipient-in-role-call-token-not-rendered"],
)
def test_harmony_function_messages_are_tool_calls_not_content(call: str) -> None:
    text = "<|channel|>analysis<|message|>Need weather.<|end|>" + call
    for step in (1, 3, len(text)):
        parser = HarmonyParser()
        assert feed_cut(parser, text, list(range(0, len(text), step))) == ("Need weather.", "")
        assert parser.take_calls() == [("get_weather", '{"c":1}')]
    plain = HarmonyParser()  # a commentary message to no function is content
    assert plain.split("<|channel|>commentary<|message|>Working on it.<|end|>") == (
        "",
        "Working on it.",
    )
    assert plain.take_calls() == []


def test_tracker_counts_reasoning_tokens_between_the_tags() -> None:
    spec = ReasoningSpec(start_ids=(7,), end_ids=(8,), close_ids=(8,))
    tracker = ReasoningTracker(spec)
    for token in (7, 1, 2, 3, 8, 4, 5):
        tracker.add(token)
    assert (tracker.state, tracker.reasoning_tokens) == ("answer", 3)
    no_start = ReasoningTracker(spec)
    for token in (1, 7, 2):  # a start tag after the answer began is not reasoning
        no_start.add(token)
    assert no_start.reasoning_tokens == 0


# --- detection and request fields ---------------------------------------------------------


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_think_model(tmp_path_factory.mktemp("think") / "llama")


def test_detection_finds_think_tags_harmony_and_nothing_in_plain_models(
    think_dir: Path, tmp_path: Path
) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlxcel.daemon.models.tiny import write_tiny_tokenizer

    fmt = reasoning.detect(load_tokenizer(think_dir))
    assert fmt is not None and (fmt.kind, fmt.start, fmt.end) == ("think", "<think>", "</think>")
    assert len(fmt.start_ids) == len(fmt.end_ids) == 1 and fmt.close_ids == fmt.end_ids

    plain = tmp_path / "plain"
    write_tiny_tokenizer(plain)
    assert reasoning.detect(load_tokenizer(plain)) is None

    harmony = tmp_path / "harmony"
    write_tiny_tokenizer(harmony, reasoning.HARMONY_MARKERS)
    template = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>{% endfor %}"
    (harmony / "chat_template.jinja").write_text(template)
    fmt = reasoning.detect(load_tokenizer(harmony))
    assert fmt is not None and fmt.kind == "harmony" and fmt.opens_in([1, 2])
    vocab = load_tokenizer(harmony).get_vocab()  # the answer's header: <|channel|>final<|message|>
    assert (fmt.end_ids[0], fmt.end_ids[-1]) == (vocab["<|channel|>"], vocab["<|message|>"])
    assert (
        fmt.close_ids[0] == vocab["<|end|>"] and fmt.close_ids[-len(fmt.end_ids) :] == fmt.end_ids
    )
    assert fmt.plan([1], None).spec().open


def test_request_fields_reach_the_template_and_budget() -> None:
    req = parse_chat_request({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert req.template_kwargs == {"enable_thinking": False} and req.reasoning_budget is None
    req = parse_chat_request({"messages": USER, "reasoning_effort": "none"})
    assert req.template_kwargs == {"enable_thinking": False} and req.reasoning_budget == 0
    req = parse_chat_request({"messages": USER, "reasoning_effort": "high", "reasoning_budget": 9})
    assert req.template_kwargs == {"reasoning_effort": "high"} and req.reasoning_budget == 9
    for bad in (
        {"reasoning_effort": "max"},
        {"reasoning_budget": -2},
        {"chat_template_kwargs": {"add_generation_prompt": False}},
        {"chat_template_kwargs": ["x"]},
    ):
        with pytest.raises(Exception, match=r"reasoning|template") as info:
            parse_chat_request({"messages": USER, **bad})
        assert getattr(info.value, "status", None) == 400


# --- the daemon, on the thinking model ----------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, think_dir: Path) -> Any:
    from daemon_helpers import embedded_daemon

    with embedded_daemon(tmp_path_factory, think_dir) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Any) -> Any:
    from daemon_helpers import openai_client

    return openai_client(daemon)


@pytest.fixture(scope="module")
def ids(think_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(think_dir / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in ("X", "Z", "Q", "J", "<think>", "</think>")}


def chat(client: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", USER)
    return client.chat.completions.create(model="llama", temperature=0, **kwargs)


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_reasoning_is_apart_from_the_answer(client: Any) -> None:
    resp = chat(client, max_tokens=20)
    message = resp.choices[0].message
    assert reasoning_of(message) == "XZ"
    assert message.content == "QJ"
    assert resp.usage.completion_tokens_details.reasoning_tokens == 2
    assert resp.choices[0].finish_reason == "stop"


def test_streamed_reasoning_comes_in_reasoning_content_deltas(client: Any) -> None:
    stream = chat(client, max_tokens=20, stream=True, stream_options={"include_usage": True})
    thought, content, usage = "", "", None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning_content")
        thought += piece or ""
        assert not (piece and delta.content), "a delta is reasoning or content"
        content += delta.content or ""
    assert (thought, content) == ("XZ", "QJ")
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == 2


def test_a_template_that_opens_the_reasoning_itself(client: Any) -> None:
    resp = chat(client, max_tokens=20, extra_body={"chat_template_kwargs": {"think_open": True}})
    message = resp.choices[0].message
    assert (reasoning_of(message), message.content) == ("XZ", "QJ")
    assert resp.usage.completion_tokens_details.reasoning_tokens == 2
    # the prompt holds the <think>: the model did not generate it (X Z </think> Q J, the EOS)
    assert resp.usage.completion_tokens == 6


def test_thinking_off_reaches_the_template(client: Any) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    resp = chat(client, max_tokens=20, extra_body=off)
    message = resp.choices[0].message
    # the template closed an empty reasoning in the prompt: the model answers at once
    assert (reasoning_of(message), message.content) == (None, "QJ")
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0
    resp = chat(client, max_tokens=20, reasoning_effort="none")
    assert (reasoning_of(resp.choices[0].message), resp.choices[0].message.content) == (None, "QJ")


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_the_budget_closes_the_reasoning_after_exactly_n_tokens(
    client: Any, ids: dict[str, int], budget: int
) -> None:
    # The template opens <think>; X and Z outbid everything: the model would reason to the end.
    bias = {str(ids["X"]): 100, str(ids["Z"]): 100}
    body = {"chat_template_kwargs": {"think_open": True}}
    resp = chat(
        client, max_tokens=16, logit_bias=bias, extra_body={**body, "reasoning_budget": budget}
    )
    message = resp.choices[0].message
    thought = reasoning_of(message) or ""
    assert resp.usage.completion_tokens_details.reasoning_tokens == budget
    assert len(thought) == budget and set(thought) <= {"X", "Z"}  # one token per letter
    # budget tokens, </think> (forced), then the answer up to max_tokens
    assert message.content and set(message.content) <= {"X", "Z"}
    assert len(message.content) == 16 - budget - 1
    unbounded = chat(client, max_tokens=16, logit_bias=bias, extra_body=body)
    assert len(reasoning_of(unbounded.choices[0].message) or "") == 16
    assert not unbounded.choices[0].message.content
    assert unbounded.usage.completion_tokens_details.reasoning_tokens == 16


def test_a_json_schema_applies_to_the_answer_only(client: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    resp = chat(
        client,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    message = resp.choices[0].message
    assert reasoning_of(message) == "XZ"  # free text, then </think>
    assert set(json.loads(message.content)) == {"ok"}
    assert resp.choices[0].finish_reason == "stop"


def test_a_forced_tool_call_comes_after_the_reasoning(client: Any) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 4}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = chat(client, max_tokens=60, tools=tools, tool_choice=choice)
    message = resp.choices[0].message
    assert reasoning_of(message) == "XZ"
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert "city" in json.loads(message.tool_calls[0].function.arguments)


def test_the_prompt_cache_hits_across_turns_whose_reasoning_the_template_drops(
    client: Any,
) -> None:
    first = chat(client, max_tokens=20, messages=[{"role": "user", "content": "Tell me a story"}])
    answer = first.choices[0].message
    history = [
        {"role": "user", "content": "Tell me a story"},
        # as a client echoes it: reasoning and all; the template keeps only the answer
        {"role": "assistant", "content": f"<think>{reasoning_of(answer)}</think>{answer.content}"},
        {"role": "user", "content": "And then?"},
    ]
    second = chat(client, max_tokens=20, messages=history)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the first turn's whole prompt is the second's prefix; its KV is reused
    assert cached >= first.usage.prompt_tokens - 1, (cached, first.usage.prompt_tokens)
    assert reasoning_of(second.choices[0].message) == "XZ"


# --- the engine on its own: both runners, the server's default budget ---------------------


@pytest.fixture(scope="module")
def think_model(think_dir: Path) -> Any:
    from mlxcel.daemon.models import load_model

    return load_model(str(think_dir))


def engine_tokens(
    model: Any, can_batch: bool, sampling: Any, config: Any = None, max_tokens: int = 12
) -> list[int]:
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.engine.types import GenerationRequest
    from mlxcel.shared.config import ServingConfig

    engine = Engine(
        model.model,
        config or ServingConfig(prompt_cache=False),
        can_batch=can_batch,
        available_bytes=1 << 30,
        tokenizer=model.tokenizer,
    )
    tokens: list[int] = []
    engine.on_output = lambda rid, out: tokens.append(out.token_id) if out.token_id else None
    prompt = model.tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    engine.add_request(GenerationRequest("r", tuple(prompt), max_tokens, sampling))
    for _ in range(200):
        if not engine.has_work:
            break
        engine.step()
    return tokens


@pytest.mark.parametrize("can_batch", [True, False], ids=["batch-runner", "solo-runner"])
def test_the_engine_gates_the_grammar_and_forces_the_close_on_either_runner(
    think_model: Any, ids: dict[str, int], can_batch: bool
) -> None:
    from mlxcel.daemon.engine.types import ReasoningSpec, SamplingParams

    x, z, end = ids["X"], ids["Z"], ids["</think>"]
    spec = ReasoningSpec((ids["<think>"],), (end,), (end,), open=False, budget=3)
    bias = {x: 100.0, z: 100.0}
    tokens = engine_tokens(
        think_model, can_batch, SamplingParams(temperature=0.0, logit_bias=bias, reasoning=spec)
    )
    # X/Z outbid <think>: the reasoning never starts, nothing is forced
    assert end not in tokens and set(tokens) <= {x, z}
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    sampling = SamplingParams(temperature=0.0, json_schema=json.dumps(schema), reasoning=spec)
    tokens = engine_tokens(think_model, can_batch, sampling, max_tokens=40)
    text = think_model.tokenizer.decode(tokens)
    assert tokens[:4] == [ids["<think>"], x, z, end]  # the grammar waited for </think>
    json.loads(text.split("</think>", 1)[1])
    open_spec = ReasoningSpec((ids["<think>"],), (end,), (end,), open=True, budget=3)
    sampling = SamplingParams(temperature=0.0, logit_bias=bias, reasoning=open_spec)
    tokens = engine_tokens(think_model, can_batch, sampling)
    assert tokens[3] == end and set(tokens[:3]) <= {x, z}  # 3 reasoning tokens, then forced


def test_the_server_default_budget_applies_when_the_request_sets_none(
    think_model: Any, ids: dict[str, int]
) -> None:
    from mlxcel.daemon.engine.types import ReasoningSpec, SamplingParams
    from mlxcel.shared.config import ServingConfig, build_config

    config = ServingConfig(prompt_cache=False, reasoning_budget=2)
    assert build_config({"reasoning_budget": "-1"}).reasoning_budget is None  # unbounded
    assert build_config({"reasoning_budget": "7"}).reasoning_budget == 7
    end = ids["</think>"]
    bias = {ids["X"]: 100.0, ids["Z"]: 100.0}
    for budget, closes_at in ((None, 2), (-1, None), (4, 4)):
        spec = ReasoningSpec((ids["<think>"],), (end,), (end,), open=True, budget=budget)
        sampling = SamplingParams(temperature=0.0, logit_bias=bias, reasoning=spec)
        tokens = engine_tokens(think_model, True, sampling, config)
        assert (tokens.index(end) if end in tokens else None) == closes_at, budget


def test_markup_that_is_special_tokens_still_reaches_the_parser(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from daemon_helpers import embedded_daemon, openai_client
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model_dir = make_think_model(tmp_path_factory.mktemp("think-special") / "llama", special=True)
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.convert_tokens_to_ids("<think>") in tokenizer.all_special_ids  # skipped text
    with embedded_daemon(tmp_path_factory, model_dir) as d:
        resp = chat(openai_client(d), max_tokens=20)
    message = resp.choices[0].message
    assert (reasoning_of(message), message.content) == ("XZ", "QJ")


@pytest.mark.parametrize("include_usage", [False, True])
def test_reasoning_chunks_from_the_template_are_the_chunks_built_whole(include_usage: bool) -> None:
    from mlxcel.daemon.server.openai_format import ResponseShape, TextChunkSSE, sse

    shape = ResponseShape("chat", "chatcmpl-1", "m", created=1)
    fast = TextChunkSSE(shape, include_usage, reasoning=True)
    for text in ('say "hi"\n', "é\u2028\U0001f600", "\\"):
        assert fast(text) == sse(shape.chunk("", None, include_usage, reasoning=text))
        assert json.loads(fast(text)[6:])["choices"][0]["delta"] == {"reasoning_content": text}


def test_a_gated_row_and_a_plain_row_share_a_batch(think_model: Any, ids: dict[str, int]) -> None:
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.engine.types import GenerationRequest, ReasoningSpec, SamplingParams
    from mlxcel.shared.config import ServingConfig

    end = ids["</think>"]
    bias = {ids["X"]: 100.0, ids["Z"]: 100.0}
    spec = ReasoningSpec((ids["<think>"],), (end,), (end,), open=True, budget=2)
    engine = Engine(
        think_model.model,
        ServingConfig(prompt_cache=False, parallel=2, max_batch_prefill=2),
        available_bytes=1 << 30,
        tokenizer=think_model.tokenizer,
    )
    tokens: dict[str, list[int]] = {"gated": [], "plain": []}
    engine.on_output = lambda rid, out: tokens[rid].append(out.token_id) if out.token_id else None
    prompt = tuple(think_model.tokenizer.apply_chat_template(USER, add_generation_prompt=True))
    for rid, reasoning_spec in (("gated", spec), ("plain", None)):
        sampling = SamplingParams(temperature=0.0, logit_bias=bias, reasoning=reasoning_spec)
        engine.add_request(GenerationRequest(rid, prompt, 8, sampling))
    seen_both = False
    for _ in range(100):
        if not engine.has_work:
            break
        engine.step()
        seen_both = seen_both or engine.num_running == 2
    assert seen_both
    assert tokens["gated"][2] == end and end not in tokens["gated"][:2]
    assert end not in tokens["plain"] and len(tokens["plain"]) == 8  # no mask leaked to it
