"""Per-row penalties and log-probabilities in the real engine on tiny random-weight models:
against mlx-lm's own logits processors, a numpy log-softmax of the model's logits, and rows
without them in the same batch."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams, TokenOutput
from mlxcel.shared.config import ServingConfig

GREEDY = SamplingParams(temperature=0.0)


def run(
    model: Any, requests: list[GenerationRequest], split_head: bool = True, **config: Any
) -> dict[str, list[TokenOutput]]:
    """Every request through one engine; each request's outputs in order."""
    cfg = {"parallel": 8, "max_batch_prefill": 8, "prompt_cache": False, **config}
    engine = Engine(
        model.model,
        ServingConfig(**cfg),
        can_batch=model.info.can_batch,
        batch_reason=model.info.batch_reason,
        context_length=model.info.context_length,
        available_bytes=1 << 30,
        split_head=split_head,
    )
    outs: dict[str, list[TokenOutput]] = {}
    engine.on_output = lambda rid, out: outs.setdefault(rid, []).append(out)
    for r in requests:
        engine.add_request(r)
    for _ in range(5000):
        if not engine.has_work:
            return outs
        engine.step()
    raise AssertionError("the engine did not finish")


def tokens(outs: list[TokenOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def prompt(seed: int, n: int = 30) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randrange(1, 300) for _ in range(n))


def reference(model: Any, p: tuple[int, ...], n: int, **penalties: float) -> list[int]:
    """Greedy tokens from mlx-lm's generate_step with mlx-lm's own penalty processors."""
    processors = make_logits_processors(**penalties)
    steps = generate_step(mx.array(p), model.model, max_tokens=n, logits_processors=processors)
    return [int(tok) for (tok, _), _ in zip(steps, range(n), strict=False)]


PENALTIES = [
    {"repetition_penalty": 1.8},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8},
    {"presence_penalty": 0.7, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
]


@pytest.mark.parametrize("split_head", [True, False])
def test_penalties_match_mlx_lm_and_stay_in_their_row(tiny: Any, split_head: bool) -> None:
    p = prompt(1)
    plain = reference(tiny, p, 16)
    requests = [GenerationRequest("plain", p, 16, GREEDY)]
    for i, penalty in enumerate(PENALTIES):
        sampling = SamplingParams(temperature=0.0, **penalty)
        requests.append(GenerationRequest(f"pen{i}", p, 16, sampling))
    outs = run(tiny, requests, split_head=split_head, prefill_chunk_size=8)
    assert tokens(outs["plain"]) == plain  # the penalised rows beside it change nothing
    for i, penalty in enumerate(PENALTIES):
        expected = reference(tiny, p, 16, **penalty)
        assert expected != plain  # the penalty matters on this prompt
        assert tokens(outs[f"pen{i}"]) == expected, penalty


def test_a_large_presence_penalty_forbids_repeats(tiny: Any) -> None:
    p = prompt(2, 8)
    sampling = SamplingParams(temperature=0.0, presence_penalty=1000.0)
    out = tokens(run(tiny, [GenerationRequest("a", p, 12, sampling)])["a"])
    window = list(p) + out
    for i, tok in enumerate(out):  # mlx-lm's window: the last 20 tokens of the context
        before = window[max(0, len(p) + i - 20) : len(p) + i]
        assert tok not in before


def numpy_logprobs(model: Any, context: list[int]) -> np.ndarray:
    """log-softmax of the model's next-token logits after `context` (float64, numpy)."""
    logits = np.array(model.model(mx.array([context]))[0, -1].astype(mx.float32), np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def check_logprobs(model: Any, p: tuple[int, ...], outs: list[TokenOutput], k: int) -> None:
    context = list(p)
    for out in outs:
        if out.token_id is None:
            continue
        ref = numpy_logprobs(model, context)
        assert out.logprob == pytest.approx(ref[out.token_id], abs=2e-4)
        assert len(out.top_logprobs) == k
        expected = np.argsort(-ref, kind="stable")[:k]
        got_ids = [t for t, _ in out.top_logprobs]
        assert set(got_ids) == set(int(t) for t in expected) or np.allclose(
            sorted(ref[got_ids]), sorted(ref[expected]), atol=1e-5
        )  # ties may pick either id
        for tok, value in out.top_logprobs:
            assert value == pytest.approx(ref[tok], abs=2e-4)
        values = [v for _, v in out.top_logprobs]
        assert values == sorted(values, reverse=True)
        context.append(out.token_id)


@pytest.mark.parametrize("split_head", [True, False])
def test_logprobs_match_a_numpy_log_softmax(tiny: Any, split_head: bool) -> None:
    p, q = prompt(3), prompt(4, 12)
    asks = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)
    requests = [
        GenerationRequest("lp", p, 10, asks),
        GenerationRequest("plain", q, 10, GREEDY),
        GenerationRequest("hot", q, 10, SamplingParams(temperature=0.8, seed=3, top_logprobs=3)),
    ]
    outs = run(tiny, requests, split_head=split_head)
    assert len(tokens(outs["lp"])) == 10
    check_logprobs(tiny, p, outs["lp"], 5)  # the first token (sampled at prefill end) included
    check_logprobs(tiny, q, outs["hot"], 3)  # a sampled row reports its sampled token too
    assert all(o.logprob is None and o.top_logprobs == () for o in outs["plain"])


def test_logprobs_without_top_logprobs(tiny: Any) -> None:
    p = prompt(5)
    outs = run(tiny, [GenerationRequest("a", p, 5, SamplingParams(temperature=0, logprobs=True))])
    assert all(o.logprob is not None and o.top_logprobs == () for o in outs["a"])
    check_logprobs(tiny, p, outs["a"], 0)


@pytest.mark.parametrize("split_head", [True, False])
def test_greedy_tokens_are_the_same_with_and_without_logprobs(tiny: Any, split_head: bool) -> None:
    prompts = [prompt(10 + i, 5 + 7 * i) for i in range(8)]
    asks = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4)
    free = run(tiny, [GenerationRequest(f"r{i}", p, 14, GREEDY) for i, p in enumerate(prompts)])
    mixed = run(
        tiny,
        [
            GenerationRequest(f"r{i}", p, 14, asks if i % 2 else GREEDY)
            for i, p in enumerate(prompts)
        ],
        split_head=split_head,
    )
    every = run(tiny, [GenerationRequest(f"r{i}", p, 14, asks) for i, p in enumerate(prompts)])
    for i in range(8):
        rid = f"r{i}"
        assert tokens(free[rid]) == tokens(mixed[rid]) == tokens(every[rid])
        assert (mixed[rid][0].logprob is not None) == bool(i % 2)


def test_an_all_greedy_batch_computes_no_log_softmax(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = mx.logsumexp

    def counting(*args: Any, **kwargs: Any) -> mx.array:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mx, "logsumexp", counting)
    prompts = [prompt(20 + i) for i in range(4)]
    run(tiny, [GenerationRequest(f"r{i}", p, 8, GREEDY) for i, p in enumerate(prompts)])
    assert calls == []
    run(tiny, [GenerationRequest("a", prompts[0], 8, SamplingParams(temperature=0, logprobs=True))])
    assert calls


def test_solo_runner_penalties_and_logprobs(tiny_solo: Any) -> None:
    assert not tiny_solo.info.can_batch
    p = prompt(6, 12)
    sampling = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, logprobs=True, top_logprobs=2
    )
    outs = run(tiny_solo, [GenerationRequest("a", p, 10, sampling)])["a"]
    assert tokens(outs) == reference(tiny_solo, p, 10, repetition_penalty=1.5)
    plain = run(tiny_solo, [GenerationRequest("b", p, 10, GREEDY)])["b"]
    assert tokens(plain) == reference(tiny_solo, p, 10)
    assert all(o.logprob is not None and len(o.top_logprobs) == 2 for o in outs)
    assert all(o.logprob is None for o in plain)


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_logprobs", 21), ("top_logprobs", -1), ("repetition_penalty", 0.0)],
)
def test_unusable_sampling_values_are_refused(tiny: Any, field: str, value: Any) -> None:
    from mlxcel.daemon.engine.types import AdmissionRejected

    engine = Engine(tiny.model, ServingConfig(), available_bytes=1 << 30)
    request = GenerationRequest("x", (1, 2), 4, SamplingParams(**{field: value}))
    with pytest.raises(AdmissionRejected) as err:
        engine.check_admission(request, 0)
    assert err.value.reason == "invalid_request" and field in err.value.message


def test_solo_runner_queues_the_next_forward_before_reading_a_token(tiny_solo: Any) -> None:
    """As mlx-lm's generate_step: decode() queues the forward of the token it is about to
    return (on the lazy token) before reading it, so the device does not wait for Python."""
    from mlxcel.daemon.engine.runner import RowSpec
    from mlxcel.daemon.engine.solo_runner import SoloRunner

    p = prompt(7, 12)
    runner = SoloRunner(tiny_solo.model, 64)
    generated_at_call: list[int] = []

    class Counting:  # the model, noting how many tokens were read at each forward
        def __getattr__(self, name: str) -> Any:
            return getattr(tiny_solo.model, name)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            row = runner._row
            generated_at_call.append(row.num_generated if row is not None else -1)
            return tiny_solo.model(*args, **kwargs)

    runner.model = Counting()
    runner.start_cohort([RowSpec("a", list(p), [], None, GREEDY, frozenset(), 6)])
    runner.prefill_chunk()
    assert len(runner.decode_uids) == 1
    generated_at_call.clear()
    out = []
    while runner.decode_uids:
        out += [o.token for o in runner.decode()]
    assert out == reference(tiny_solo, p, 6)
    # the forward of token k+1 is queued while token k is still unread (k generated so far)
    # and none is queued after the last one
    assert generated_at_call == [0, 1, 2, 3, 4]
    # a stop token read after the next forward was queued: that forward is dropped with the row
    stop = frozenset({out[2]})
    runner.start_cohort([RowSpec("b", list(p), [], None, GREEDY, stop, 6)])
    runner.prefill_chunk()
    ends = []
    while runner.decode_uids:
        ends += [(o.token, o.finish_reason) for o in runner.decode()]
    assert ends == [(out[0], None), (out[1], None), (out[2], "stop")]
