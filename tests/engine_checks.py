"""Engine workloads on tiny random-weight models and the references they are checked against.

`make_prompts` (random token prompts), `greedy` / `req` (greedy requests), `alone` and `cold`
(each request on an engine of its own: what a batched, chunked or cached run must equal),
`staggered` (requests arriving a few steps apart, so later cohorts prefill while others decode),
and `check_native_packed_run` (tests/child_scripts/engine_packed_native.py's result). Used by
the engine tests in tests/integration and tests/e2e.
"""

from __future__ import annotations

import random
from typing import Any

from engine_driver import Driver
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest


def make_prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 150) -> list[tuple[int, ...]]:
    rnd = random.Random(seed)
    return [tuple(rnd.randrange(1, 300) for _ in range(rnd.randrange(lo, hi))) for _ in range(n)]


def greedy(rid: str, prompt: tuple[int, ...], max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, GREEDY)


def alone(model: Any, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    """Each request on its own engine: one slot, no chunking, no prompt cache."""
    out = {}
    for r in requests:
        d = Driver(model, parallel=1, max_batch_prefill=1, prompt_cache=False)
        d.add(r)
        d.run()
        out[r.request_id] = d.tokens[r.request_id]
    return out


def req(rid: str, prompt: tuple[int, ...], max_tokens: int = 10, eos=frozenset()) -> Any:
    """A greedy request that stops at `eos`."""
    return GenerationRequest(rid, prompt, max_tokens, GREEDY, eos)


def cold(model: Any, r: GenerationRequest, **config: Any) -> list[int]:
    """The request alone, no prompt cache."""
    return Driver(model, prompt_cache=False, parallel=1, **config).add(r).run().tokens[r.request_id]


def staggered(d: Driver, requests: list[GenerationRequest], every: int = 3) -> Driver:
    """Requests arrive a few steps apart, so later cohorts prefill while others decode."""
    for r in requests:
        d.add(r)
        for _ in range(every):
            if d.engine.has_work:
                d.step()
    return d.run()


def check_native_packed_run(out: dict[str, Any]) -> None:
    """tests/child_scripts/engine_packed_native.py's result: packed steps on both native steps
    in every budget, right-padded chunks among them, every request's tokens as alone."""
    for budget, run in out["budgets"].items():
        assert run["packed_steps"] > 0, budget
        assert run["calls"]["decode"] > 0 and run["calls"]["chunk"] > 0, (budget, run["calls"])
        assert run["tokens"] == out["alone"], budget
    assert sum(run["calls"]["right_padded"] for run in out["budgets"].values()) > 0
