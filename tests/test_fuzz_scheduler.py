"""Admission over time: the scheduler's pure rules (plan_admission, select_prefill_cohort) and
the KV block manager driven through random arrivals, aborts and `parallel` changes.

tests/test_scheduler.py checks one planning call at a time; this runs the rules as the
engine does, step after step, and checks what only shows over time: no deadlock (the queue
always drains once arrivals stop), FIFO admission, never more running than `parallel`, KV
reservations within the budget and back to zero at the end, no running request evicted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from mlxcel.daemon.engine.kv_manager import KVBlockManager
from mlxcel.daemon.engine.scheduler import (
    WAIT_KV_BUDGET,
    WAIT_PREFILL_CAP,
    WAIT_SLOTS_FULL,
    WaitingView,
    plan_admission,
)

BLOCK = 32
CHUNK = 64


@dataclass
class Req:
    uid: int
    prompt: int
    max_tokens: int
    prefill_left: int = 0
    decode_left: int = 0


@dataclass
class Sim:
    parallel: int
    max_rows: int
    cap: int
    kv: KVBlockManager

    def __post_init__(self) -> None:
        self.waiting: deque[Req] = deque()
        self.running: dict[int, Req] = {}
        self.cohort: set[int] = set()
        self.admitted: list[int] = []
        self.finished: set[int] = set()

    def fits_ever(self, r: Req) -> bool:
        return not self.kv.never_fits(r.prompt + r.max_tokens)

    def step(self) -> None:
        views = [
            WaitingView(r.prompt, self.kv.blocks_for(r.prompt + r.max_tokens)) for r in self.waiting
        ]
        free_slots = max(self.parallel - len(self.running), 0)
        plan = plan_admission(
            views,
            free_slots=free_slots,
            max_rows=self.max_rows,
            token_cap=self.cap,
            free_blocks=self.kv.num_free_after_eviction,
            cohort_busy=bool(self.cohort),
        )
        assert len(plan.wait_reasons) == len(self.waiting) - plan.num_admit
        assert set(plan.wait_reasons) <= {WAIT_SLOTS_FULL, WAIT_KV_BUDGET, WAIT_PREFILL_CAP}
        if self.waiting and not self.running and not self.cohort:
            assert plan.num_admit >= 1, "an idle engine admitted nothing: deadlock"
        for _ in range(plan.num_admit):
            r = self.waiting.popleft()
            self.kv.reserve(str(r.uid), r.prompt + r.max_tokens)
            r.prefill_left = -(-r.prompt // CHUNK)
            r.decode_left = r.max_tokens
            self.running[r.uid] = r
            self.cohort.add(r.uid)
            self.admitted.append(r.uid)
        if plan.num_admit:  # admissions never push past `parallel` (after a lowering, they wait)
            assert len(self.running) <= self.parallel
            assert plan.num_admit <= self.max_rows
        self._check()
        self._advance()

    def _advance(self) -> None:
        for uid in list(self.running):
            r = self.running[uid]
            if uid in self.cohort:
                r.prefill_left -= 1
                if r.prefill_left <= 0:
                    self.cohort.discard(uid)
            else:
                r.decode_left -= 1
                if r.decode_left <= 0:
                    self.finish(uid)

    def finish(self, uid: int) -> None:
        self.running.pop(uid)
        self.cohort.discard(uid)
        self.kv.release(str(uid))
        self.finished.add(uid)

    def abort(self, uid: int) -> None:
        if uid in self.running:
            self.finish(uid)
            return
        for r in list(self.waiting):
            if r.uid == uid:
                self.waiting.remove(r)
                self.finished.add(uid)

    def _check(self) -> None:
        total = self.kv.total_blocks
        assert total is None or self.kv.num_used <= total
        expected = sum(self.kv.blocks_for(r.prompt + r.max_tokens) for r in self.running.values())
        assert self.kv.num_used == expected


events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 700), st.integers(1, 300)),
        st.tuples(st.just("abort"), st.integers(0, 60), st.just(0)),
        st.tuples(st.just("parallel"), st.integers(1, 8), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 5), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    events=events,
    parallel=st.integers(1, 8),
    max_rows=st.integers(1, 6),
    cap=st.sampled_from([0, 256, 512, 1024, 4096]),
    total_blocks=st.one_of(st.none(), st.integers(8, 120)),
)
def test_admission_over_time_never_deadlocks_and_keeps_its_books(
    events: list[tuple[str, int, int]],
    parallel: int,
    max_rows: int,
    cap: int,
    total_blocks: int | None,
) -> None:
    sim = Sim(parallel, max_rows, cap, KVBlockManager(total_blocks, 1, BLOCK))
    num_arrived = 0
    arrival_order: list[int] = []
    for kind, a, b in events:
        if kind == "arrive":
            r = Req(num_arrived, a, b)
            num_arrived += 1
            if sim.fits_ever(r):  # the engine refuses the rest with a 400 up front
                sim.waiting.append(r)
                arrival_order.append(r.uid)
        elif kind == "abort":
            sim.abort(a)
        elif kind == "parallel":
            running_before = set(sim.running)
            sim.parallel = a
            assert set(sim.running) == running_before  # lowering evicts nobody
        else:
            for _ in range(a):
                sim.step()
    # Arrivals stop: everything still queued must get through in bounded time.
    bound = sum(-(-r.prompt // CHUNK) + r.max_tokens + 1 for r in sim.waiting)
    bound += sum(r.prefill_left + r.decode_left + 1 for r in sim.running.values())
    for _ in range(bound + 10):
        if not sim.waiting and not sim.running:
            break
        sim.step()
    assert not sim.waiting and not sim.running, "the queue did not drain"
    assert sim.kv.num_used == 0
    # FIFO: requests were admitted in arrival order (aborted ones simply drop out).
    assert sim.admitted == [u for u in arrival_order if u in set(sim.admitted)]
    assert set(arrival_order) <= sim.finished


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=30),
    parallel=st.integers(1, 8),
    total_blocks=st.integers(20, 80),
)
def test_a_full_queue_is_served_with_at_most_parallel_running(
    lengths: list[int], parallel: int, total_blocks: int
) -> None:
    sim = Sim(parallel, 4, 1024, KVBlockManager(total_blocks, 1, BLOCK))
    for i, n in enumerate(lengths):
        r = Req(i, n, 16)
        if sim.fits_ever(r):
            sim.waiting.append(r)
    most = 0
    for _ in range(10_000):
        if not sim.waiting and not sim.running:
            break
        sim.step()
        most = max(most, len(sim.running))
    assert not sim.waiting and not sim.running and sim.kv.num_used == 0
    assert most <= parallel
