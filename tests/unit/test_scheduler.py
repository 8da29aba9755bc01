"""Cohort selection and admission (docs/tuning.md), pure functions: exhaustive, property tests."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st
from mlxcel.daemon.engine.scheduler import (
    WAIT_KV_BUDGET,
    WAIT_PREFILL_CAP,
    WAIT_SLOTS_FULL,
    WaitingView,
    plan_admission,
    select_prefill_cohort,
)


def reference_cohort(lengths: list[int], max_rows: int, cap: int) -> int:
    """The rule as docs/tuning.md states it, by brute force over every prefix."""
    if not lengths or max_rows < 1:
        return 0
    if cap and 2 * lengths[0] > cap:
        return 1
    best = 1
    for k in range(1, min(max_rows, len(lengths)) + 1):
        if cap and k * max(lengths[:k]) > cap:
            break
        best = k
    return best


def test_cohort_matches_the_rule_exhaustively_on_small_inputs() -> None:
    for n in range(0, 5):
        for lengths in itertools.product(range(1, 7), repeat=n):
            for max_rows in range(0, 6):
                for cap in range(0, 25):
                    got = select_prefill_cohort(lengths, max_rows, cap)
                    assert got == reference_cohort(list(lengths), max_rows, cap), (
                        lengths,
                        max_rows,
                        cap,
                    )


def test_cohort_examples_from_the_spec() -> None:
    # uncapped: max rows bound it
    assert select_prefill_cohort([100] * 8, 4, 0) == 4
    # 4 x 256 = 1024 fits a 1024 cap; a 5th row would not be allowed by max rows anyway
    assert select_prefill_cohort([256, 256, 256, 256, 256], 8, 1024) == 4
    # a long row later in the queue ends the cohort (no reordering around it)
    assert select_prefill_cohort([100, 100, 900, 10], 4, 1000) == 2
    # a head with 2 x len > cap is prefilled alone
    assert select_prefill_cohort([600, 10, 10], 4, 1000) == 1
    # but a head of exactly half the cap may share
    assert select_prefill_cohort([500, 500, 10], 4, 1000) == 2
    assert select_prefill_cohort([], 4, 1000) == 0


@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    st.integers(1, 64),
    st.integers(0, 20000),
)
def test_cohort_properties(lengths: list[int], max_rows: int, cap: int) -> None:
    count = select_prefill_cohort(lengths, max_rows, cap)
    assert 1 <= count <= min(max_rows, len(lengths))
    if count > 1:
        assert not cap or count * max(lengths[:count]) <= cap
    if cap and 2 * lengths[0] > cap:
        assert count == 1
    elif count < min(max_rows, len(lengths)):  # maximal: one more row would break the cap
        assert cap and (count + 1) * max(lengths[: count + 1]) > cap
    assert count == reference_cohort(lengths, max_rows, cap)


views = st.lists(
    st.builds(WaitingView, st.integers(1, 3000), st.integers(1, 200)), min_size=0, max_size=20
)


@given(
    views,
    st.integers(0, 10),
    st.integers(1, 8),
    st.integers(0, 10000),
    st.one_of(st.none(), st.integers(0, 600)),
    st.booleans(),
)
def test_admission_plan_properties(
    waiting: list[WaitingView],
    free_slots: int,
    max_rows: int,
    cap: int,
    free_blocks: int | None,
    busy: bool,
) -> None:
    plan = plan_admission(
        waiting,
        free_slots=free_slots,
        max_rows=max_rows,
        token_cap=cap,
        free_blocks=free_blocks,
        cohort_busy=busy,
    )
    n = plan.num_admit
    assert len(plan.wait_reasons) == len(waiting) - n
    if busy or free_slots == 0:
        assert n == 0
    assert n <= min(free_slots, max_rows)
    assert n <= select_prefill_cohort([w.compute_tokens for w in waiting], max_rows, cap)
    if free_blocks is not None:
        assert sum(w.kv_blocks for w in waiting[:n]) <= free_blocks
    # each reason, judged at its queue position with everyone ahead served first
    for offset, reason in enumerate(plan.wait_reasons):
        i = n + offset
        blocks = sum(w.kv_blocks for w in waiting[: i + 1])
        if i >= free_slots:
            assert reason == WAIT_SLOTS_FULL
        elif free_blocks is not None and blocks > free_blocks:
            assert reason == WAIT_KV_BUDGET
        else:
            assert reason == WAIT_PREFILL_CAP
    # the head is never skipped: if nothing is admitted while a slot is free, the head waits
    # for KV (the cohort rule itself always takes it)
    if waiting and n == 0 and not busy and free_slots > 0:
        assert plan.wait_reasons[0] == WAIT_KV_BUDGET


def test_admission_examples() -> None:
    w = [WaitingView(100, 10), WaitingView(100, 10), WaitingView(100, 10)]
    plan = plan_admission(
        w, free_slots=2, max_rows=4, token_cap=0, free_blocks=None, cohort_busy=False
    )
    assert (plan.num_admit, plan.wait_reasons) == (2, (WAIT_SLOTS_FULL,))
    plan = plan_admission(
        w, free_slots=3, max_rows=4, token_cap=0, free_blocks=25, cohort_busy=False
    )
    assert (plan.num_admit, plan.wait_reasons) == (2, (WAIT_KV_BUDGET,))
    plan = plan_admission(
        w, free_slots=3, max_rows=1, token_cap=0, free_blocks=None, cohort_busy=False
    )
    assert (plan.num_admit, plan.wait_reasons) == (1, (WAIT_PREFILL_CAP, WAIT_PREFILL_CAP))
    plan = plan_admission(
        w, free_slots=3, max_rows=4, token_cap=0, free_blocks=None, cohort_busy=True
    )
    assert (plan.num_admit, plan.wait_reasons) == (0, (WAIT_PREFILL_CAP,) * 3)


def test_a_row_waiting_for_a_shared_prefix_ends_the_cohort_but_never_the_head() -> None:
    kwargs = {"free_slots": 4, "max_rows": 4, "token_cap": 0, "free_blocks": None}
    w = [WaitingView(200, 8), WaitingView(40, 8), WaitingView(210, 8, defer=True)]
    plan = plan_admission(w, **kwargs, cohort_busy=False)
    assert (plan.num_admit, plan.wait_reasons) == (2, (WAIT_PREFILL_CAP,))
    # a head flagged by mistake is still admitted: FIFO, no starvation
    w = [WaitingView(200, 8, defer=True), WaitingView(40, 8, defer=True)]
    plan = plan_admission(w, **kwargs, cohort_busy=False)
    assert (plan.num_admit, plan.wait_reasons) == (1, (WAIT_PREFILL_CAP,))
