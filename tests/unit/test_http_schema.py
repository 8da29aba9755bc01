"""OpenAI body validation and stop-string matching (no model needed)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlxcel.daemon.server.openai_format import ResponseShape, TextChunkSSE, sse
from mlxcel.daemon.server.openai_schema import (
    APIError,
    SamplingDefaults,
    parse_chat_request,
    parse_completion_request,
)
from mlxcel.daemon.server.textstream import StopMatcher

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, **fields}


def test_defaults_follow_openai() -> None:
    req = parse_chat_request(chat())
    opts = req.options
    assert opts.sampling.temperature == 1.0 and opts.sampling.top_p == 1.0
    assert opts.max_tokens is None and not opts.stream and not opts.include_usage
    assert opts.stop == () and opts.sampling.logit_bias == {}


def test_the_daemons_sampling_defaults_fill_only_what_a_request_leaves_out() -> None:
    daemon = SamplingDefaults.with_set({"temperature": 0.2, "top_p": 0.9, "top_k": 40})
    assert daemon == SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.0)
    left_out = parse_chat_request(chat(), defaults=daemon).options.sampling
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p) == (
        0.2,
        0.9,
        40,
        0.0,
    )
    sent = parse_chat_request(
        chat(temperature=0, top_p=1, top_k=-1, min_p=0.1), defaults=daemon
    ).options.sampling
    assert (sent.temperature, sent.top_p, sent.top_k, sent.min_p) == (0.0, 1.0, 0, 0.1)
    text = parse_completion_request({"prompt": "hi", "top_p": 0.5}, defaults=daemon)
    assert (text.options.sampling.temperature, text.options.sampling.top_p) == (0.2, 0.5)


def test_all_supported_fields_are_parsed() -> None:
    req = parse_chat_request(
        chat(
            model="m",
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=7,
            temperature=0,
            top_p=0.5,
            top_k=40,
            min_p=0.1,
            seed=-1,
            stop="END",
            logit_bias={"5": -100, "9": 2.5},
            ignore_eos=True,
            user="u",
            n=1,
            frequency_penalty=0,
            presence_penalty=0.0,
            logprobs=False,
            parallel_tool_calls=True,
            store=False,
            response_format={"type": "text"},
        )
    )
    o, s = req.options, req.options.sampling
    assert (o.model, o.stream, o.include_usage, o.max_tokens, o.ignore_eos) == (
        "m",
        True,
        True,
        7,
        True,
    )
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.0, 0.5, 40, 0.1)
    assert s.seed == 2**64 - 1 and o.stop == ("END",) and s.logit_bias == {5: -100.0, 9: 2.5}


def test_messages_are_normalised_for_the_template() -> None:
    req = parse_chat_request(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None, "name": "bot"},
            ]
        }
    )
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]


BAD_CHAT = [
    ([], "invalid_type"),
    ({"messages": []}, "invalid_type"),
    ({"messages": "hi"}, "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, "invalid_type"),
    ({"messages": [{"role": "user"}]}, "invalid_value"),
    ({"messages": [{"role": "system", "content": None}]}, "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "invalid_value"),
    ({"messages": [{"role": "assistant", "refusal": 5}]}, "invalid_type"),
    ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "invalid_type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "invalid_type"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}],
                }
            ]
        },
        "invalid_value",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "unsupported_value",
    ),
    (chat(max_tokens=-1), "invalid_value"),
    (chat(max_tokens=0), "invalid_value"),
    (chat(max_tokens="10"), "invalid_type"),
    (chat(max_tokens=1.5), "invalid_type"),
    (chat(max_tokens=True), "invalid_type"),
    (chat(temperature=2.5), "invalid_value"),
    (chat(temperature="hot"), "invalid_type"),
    (chat(top_p=1.5), "invalid_value"),
    (chat(top_k=-2), "invalid_value"),
    (chat(min_p=-0.1), "invalid_value"),
    (chat(seed=1.5), "invalid_type"),
    (chat(stop=["a", "b", "c", "d", "e"]), "invalid_value"),
    (chat(stop=[""]), "invalid_value"),
    (chat(stop=5), "invalid_type"),
    (chat(logit_bias={"x": 1}), "invalid_value"),
    (chat(logit_bias={"5": 101}), "invalid_value"),
    (chat(logit_bias=[1]), "invalid_type"),
    (chat(stream="yes"), "invalid_type"),
    (chat(stream_options={"bogus": True}), "invalid_value"),
    (chat(n=2), "unsupported_value"),
    (chat(n="1"), "invalid_type"),
    (chat(frequency_penalty=2.5), "invalid_value"),
    (chat(presence_penalty="x"), "invalid_type"),
    (chat(repetition_penalty=0), "invalid_value"),
    (chat(logprobs="yes"), "invalid_type"),
    (chat(logprobs=True, top_logprobs=21), "invalid_value"),
    (chat(top_logprobs=3), "invalid_value"),
    (chat(tools=[{"type": "function"}]), "invalid_type"),
    (chat(tools={"f": {}}), "invalid_type"),
    (chat(response_format={"type": "xml"}), "invalid_value"),
    (chat(response_format={"type": "json_schema"}), "invalid_type"),
    (chat(functions=[]), "unsupported_value"),
    (chat(modalities=["audio"]), "unsupported_value"),
    (chat(model=3), "invalid_type"),
]

STRICT_ONLY = [
    (chat(temperatur=0.5), "unknown_field"),
    (chat(prompt="x"), "unknown_field"),
    ({"messages": [{"role": "user", "content": "x", "mood": "sunny"}]}, "unknown_field"),
]


@pytest.mark.parametrize(("body", "code"), BAD_CHAT)
def test_bad_chat_bodies_are_refused(body: Any, code: str) -> None:
    with pytest.raises(APIError) as err:
        parse_chat_request(body)
    assert err.value.status == 400 and err.value.code == code
    envelope = err.value.body()["error"]
    assert envelope["message"] and envelope["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "code"), BAD_CHAT + STRICT_ONLY)
def test_strict_api_refuses_unknown_fields_too(body: Any, code: str) -> None:
    with pytest.raises(APIError) as err:
        parse_chat_request(body, strict=True)
    assert err.value.status == 400 and err.value.code == code


@pytest.mark.parametrize(("body", "code"), STRICT_ONLY)
def test_unknown_fields_are_ignored_and_listed_by_default(body: Any, code: str) -> None:
    req = parse_chat_request(body)
    top = set(body) - {"messages"}
    assert set(req.options.ignored) == top


def test_new_fields_reach_the_options() -> None:
    req = parse_chat_request(
        chat(
            presence_penalty=0.5,
            frequency_penalty=-1,
            repetition_penalty=1.3,
            logprobs=True,
            top_logprobs=5,
            response_format={"type": "json_object"},
            parallel_tool_calls=False,
            mirostat=2,
        )
    )
    o, s = req.options, req.options.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.3)
    assert (o.logprobs, o.top_logprobs) == (True, 5)
    assert o.json_schema == '{"type": "object"}' and o.ignored == ("mirostat",)
    assert req.tool_choice.parallel is False


def test_openai_history_with_tool_calls_is_accepted() -> None:
    messages = [
        {"role": "user", "content": "weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    req = parse_chat_request({"messages": messages})
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert req.messages[1]["content"] == ""
    assert req.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hello", "hello"), ([1, 2, 3], [1, 2, 3]), (["hello"], "hello"), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    assert parse_completion_request({"prompt": prompt}).prompt == expected


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"prompt": ""}, "invalid_value"),
        ({"prompt": []}, "invalid_type"),
        ({"prompt": ["a", "b"]}, "unsupported_value"),
        ({"prompt": [1, -2]}, "invalid_value"),
        ({"prompt": [1, "a"]}, "invalid_type"),
        ({"prompt": None}, "invalid_type"),
        ({"prompt": "x", "echo": True}, "unsupported_value"),
        ({"prompt": "x", "best_of": 3}, "unsupported_value"),
        ({"prompt": "x", "logprobs": 21}, "invalid_value"),
        ({"prompt": "x", "n": 3}, "unsupported_value"),
    ],
)
def test_bad_completion_bodies_are_refused(body: dict[str, Any], code: str) -> None:
    with pytest.raises(APIError) as err:
        parse_completion_request(body)
    assert err.value.status == 400 and err.value.code == code


def test_completion_unknown_fields_refused_only_when_strict() -> None:
    body = {"prompt": "x", "messages": MSG, "max_completion_tokens": 5}
    assert parse_completion_request(body).options.ignored == ("messages", "max_completion_tokens")
    with pytest.raises(APIError) as err:
        parse_completion_request(body, strict=True)
    assert err.value.code == "unknown_field"


def test_completion_logprobs_is_a_count() -> None:
    opts = parse_completion_request({"prompt": "x", "logprobs": 3}).options
    assert (opts.logprobs, opts.top_logprobs) == (True, 3)
    opts = parse_completion_request({"prompt": "x", "logprobs": 0}).options
    assert (opts.logprobs, opts.top_logprobs) == (True, 0)


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(p) for p in pieces) + matcher.flush()


def test_stop_string_across_pieces_returns_the_text_before_it() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("hello S") == "hello "  # "S" may start the stop string: held back
    assert m.feed("T") == ""
    assert m.feed("OP and more") == ""
    assert m.stopped and m.flush() == ""


def test_a_false_start_is_released() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("ST") == ""
    assert m.feed("ART") == "START"
    assert not m.stopped


def test_earliest_of_several_stops_wins() -> None:
    assert feed_all(StopMatcher(("world", "lo w")), ["hello world"]) == "hel"


def test_no_stops_passes_everything_through() -> None:
    m = StopMatcher(())
    assert m.feed("abc") == "abc" and m.flush() == ""


@given(
    text=st.text(alphabet="abcXY", max_size=40),
    stop=st.text(alphabet="abcXY", min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streamed_output_equals_the_text_before_the_first_stop(
    text: str, stop: str, cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out = feed_all(StopMatcher((stop,)), pieces)
    idx = text.find(stop)
    assert out == (text if idx < 0 else text[:idx])


class ReferenceStopMatcher:
    """The plain algorithm (the whole text kept, searched from the emitted mark): the oracle
    for StopMatcher, which keeps only the text not emitted yet."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.text, self.emitted, self.stopped = stops, "", 0, False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, self.emitted)) >= 0]
        if hits:
            end, self.stopped = min(hits)[0], True
        else:
            pending = self.text[self.emitted :]
            held = next(
                (
                    k
                    for k in range(min(self.hold, len(pending)), 0, -1)
                    if any(s.startswith(pending[-k:]) for s in self.stops)
                ),
                0,
            )
            end = len(self.text) - held
        out, self.emitted = self.text[self.emitted : end], end
        return out

    def flush(self) -> str:
        return "" if self.stopped else self.text[self.emitted :]


@given(
    pieces=st.lists(st.text(alphabet="abXY", max_size=6), max_size=12),
    stops=st.lists(st.text(alphabet="abXY", min_size=1, max_size=4), max_size=3),
)
def test_each_piece_is_what_the_plain_algorithm_emits(pieces: list[str], stops: list[str]) -> None:
    ours, ref = StopMatcher(tuple(stops)), ReferenceStopMatcher(tuple(stops))
    for piece in pieces:
        assert ours.feed(piece) == ref.feed(piece)
        assert ours.stopped == ref.stopped
    assert ours.flush() == ref.flush()


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("include_usage", [False, True])
@given(text=st.text(min_size=1, max_size=12))
def test_a_text_chunk_from_the_template_is_the_full_encoding(
    kind: str, include_usage: bool, text: str
) -> None:
    shape = ResponseShape(kind, "chatcmpl-1", 'a "model" \u00e9')
    template = TextChunkSSE(shape, include_usage)
    for piece in (text, ' "\\\n\x00 \u00e9\u6f22\U0001f600\ud800', "\ue000mlxcel-text\ue000"):
        assert template(piece) == sse(shape.chunk(piece, None, include_usage))
