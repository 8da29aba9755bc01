"""Admission over time on the real engine (a tiny random-weight model), driven through random
arrivals, aborts, `parallel` changes and steps.

tests/unit/test_scheduler.py checks one planning call at a time; this runs `Engine.step()` itself
and checks what only shows over time, on the engine's own state: no deadlock (an idle engine
with a queue admits, and the queue drains once arrivals stop), FIFO admission (each step takes
a prefix of the waiting queue), never more admitted than `parallel` allows, KV reservations
equal to the running requests' blocks and within the budget, back to zero at the end, a
lowered `parallel` evicts nobody, and every request ends exactly once with its full length
unless it was aborted.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.scheduler import WAIT_KV_BUDGET, WAIT_PREFILL_CAP, WAIT_SLOTS_FULL
from mlxcel.daemon.engine.types import GREEDY, AdmissionRejected, GenerationRequest, TokenOutput
from mlxcel.shared.config import KV_BLOCK_SIZE, ServingConfig

CHUNK = 16
REASONS = {WAIT_SLOTS_FULL, WAIT_KV_BUDGET, WAIT_PREFILL_CAP}


@pytest.fixture(scope="module")
def block_bytes(tiny: Any) -> int:
    from mlxcel.daemon.engine.mlx_support import probe_model

    return probe_model(tiny.model).kv_bytes_per_token * KV_BLOCK_SIZE


class Run:
    """One engine under test, with the bookkeeping the checks need."""

    def __init__(self, tiny: Any, parallel: int, max_rows: int, cap: int, budget: int | None):
        cfg = ServingConfig(
            parallel=parallel,
            max_batch_prefill=max_rows,
            max_batch_prefill_tokens=cap,
            prefill_chunk_size=CHUNK,
            kv_cache_budget=budget,
            ctx_size=8192,
        )
        self.engine = Engine(
            tiny.model,
            cfg,
            tiny.info.can_batch,
            tiny.info.batch_reason,
            tiny.info.context_length,
            available_bytes=1 << 30,
        )
        self.finals: dict[str, TokenOutput] = {}
        self.engine.on_output = self._on_output
        self.arrived: list[GenerationRequest] = []
        self.admitted: list[str] = []
        self.aborted: set[str] = set()

    def _on_output(self, rid: str, out: TokenOutput) -> None:
        if out.finished:
            assert rid not in self.finals, f"{rid} finished twice"
            self.finals[rid] = out

    def arrive(self, prompt_len: int, max_tokens: int) -> None:
        n = len(self.arrived)
        ids = tuple((n * 31 + j * 7) % 300 + 1 for j in range(prompt_len))
        request = GenerationRequest(f"r{n}", ids, max_tokens, GREEDY)
        try:  # what the bridge does before queueing: refuse what can never be served
            self.engine.check_admission(request, self.engine.num_waiting)
        except AdmissionRejected:
            return
        self.engine.add_request(request)
        self.arrived.append(request)

    def abort(self, index: int) -> None:
        if index < len(self.arrived):
            rid = self.arrived[index].request_id
            if self.engine.abort(rid):
                self.aborted.add(rid)
            self.engine.flush()

    def set_parallel(self, value: int) -> None:
        running = set(self.engine.running)
        self.engine.reconfigure({"parallel": value})
        assert set(self.engine.running) == running  # lowering evicts nobody

    def step(self) -> None:
        eng = self.engine
        waiting = [s.request_id for s in eng.waiting]
        num_running = len(eng.running)
        parallel = eng.effective.parallel
        eng.step()
        left = [s.request_id for s in eng.waiting]
        taken = len(waiting) - len(left)
        assert left == waiting[taken:], "admission skipped ahead in the queue"
        self.admitted += waiting[:taken]
        if taken:
            assert num_running + taken <= parallel
        if waiting and num_running == 0:
            assert taken >= 1, "an idle engine admitted nothing: deadlock"
        self.check_books()

    def check_books(self) -> None:
        eng, kv = self.engine, self.engine.kv
        expected = sum(
            kv.blocks_for(s.prompt_len + s.request.max_tokens) for s in eng.running.values()
        )
        assert kv.num_used == expected
        if kv.total_blocks is not None:
            assert kv.num_used + kv.num_cached <= kv.total_blocks
        assert {s.wait_reason for s in eng.waiting} <= REASONS

    def drain(self) -> None:
        eng = self.engine
        seqs = [*eng.waiting, *eng.running.values()]
        bound = sum(-(-s.prompt_len // CHUNK) + s.request.max_tokens + 2 for s in seqs)
        for _ in range(bound + 10):
            if not eng.has_work:
                break
            self.step()
        assert not eng.has_work, "the queue did not drain"


events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 120), st.integers(1, 24)),
        st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
        st.tuples(st.just("parallel"), st.integers(1, 6), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    ),
    max_size=30,
)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    events=events,
    parallel=st.integers(1, 6),
    max_rows=st.integers(1, 4),
    cap=st.sampled_from([0, 64, 128, 512]),
    budget_blocks=st.one_of(st.none(), st.integers(5, 24)),
)
def test_admission_over_time_never_deadlocks_and_keeps_its_books(
    tiny: Any,
    block_bytes: int,
    events: list[tuple[str, int, int]],
    parallel: int,
    max_rows: int,
    cap: int,
    budget_blocks: int | None,
) -> None:
    budget = None if budget_blocks is None else budget_blocks * block_bytes
    run = Run(tiny, parallel, max_rows, cap, budget)
    for kind, a, b in events:
        if kind == "arrive":
            run.arrive(a, b)
        elif kind == "abort":
            run.abort(a)
        elif kind == "parallel":
            run.set_parallel(a)
        else:
            for _ in range(a):
                if run.engine.has_work:
                    run.step()
    run.drain()  # arrivals stop: everything queued gets through in bounded time
    assert run.engine.kv.num_used == 0
    arrived = [r.request_id for r in run.arrived]
    assert run.admitted == [rid for rid in arrived if rid in set(run.admitted)]  # FIFO
    assert sorted(run.finals) == sorted(arrived)  # each ends exactly once
    for r in run.arrived:
        final = run.finals[r.request_id]
        if r.request_id in run.aborted:
            assert final.finish_reason == "abort"
        else:
            assert (final.finish_reason, final.completion_tokens) == ("length", r.max_tokens)
