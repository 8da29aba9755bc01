"""A decode row that leaves while a request waits keeps its slot, and the joining row's KV is
written into it in place (`RowBatch.fill`), not merged by copying the whole batch; tokens stay
those of each request run alone."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from engine_checks import alone, greedy
from engine_driver import Driver
from mlxcel.daemon.engine.runner import MAX_VACANT_STEPS, VACANT, RowBatch
from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams
from platform_marks import cpu_only


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(5 + (seed * 31 + i * 7) % 200 for i in range(n))


class _Merges:
    """Counts `RowBatch.extend` calls: a merge that copies every row's KV."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        extend = RowBatch.extend

        def counted(batch: RowBatch, other: Any) -> None:
            self.count += 1
            extend(batch, other)

        monkeypatch.setattr(RowBatch, "extend", counted)


def _buffer(d: Driver) -> int:
    """The address of the decode batch's first-layer keys (evaluated; no view kept)."""
    keys = d.engine.runner._decode.prompt_cache[0].keys
    mx.eval(keys)
    return int(np.asarray(keys).ctypes.data)


@cpu_only  # bit-exact batched == alone: a CPU guarantee (docs/platforms.md)
def test_a_waiting_request_takes_the_slot_a_finished_row_left_in_place(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = [
        greedy("short", _prompt(40, 1), 4),
        greedy("long", _prompt(80, 2), 30),  # 128 columns: no growth while "next" joins
        greedy("next", _prompt(20, 3), 12),  # waits for a slot; shorter than the batch
    ]
    d = Driver(tiny, parallel=2, max_batch_prefill=2, prompt_cache=False)
    d.add(*requests)
    while "next" not in d.engine.runner.decode_uids:
        if "short" in d.finals and VACANT in d.engine.runner._decode.uids:
            before = _buffer(d)
            merges = _Merges(monkeypatch)
        d.step()
    assert merges.count == 0  # it joined without a merge of the batch
    assert _buffer(d) == before  # the batch's keys were written in place
    assert VACANT not in d.engine.runner._decode.uids
    d.run()
    assert d.tokens == alone(tiny, requests)


@cpu_only
def test_a_seeded_row_taking_a_slot_draws_what_it_draws_alone(tiny: Any) -> None:
    sampled = SamplingParams(temperature=0.9, seed=7)
    requests = [
        greedy("short", _prompt(30, 4), 3),
        GenerationRequest("long", _prompt(70, 5), 30, sampled),
        GenerationRequest("next", _prompt(25, 6), 15, SamplingParams(temperature=0.9, seed=11)),
    ]
    d = Driver(tiny, parallel=2, max_batch_prefill=2, prompt_cache=False)
    d.add(*requests).run()
    assert d.tokens == alone(tiny, requests)


def test_a_row_longer_than_the_batch_merges_and_the_vacancy_is_compacted(tiny: Any) -> None:
    """A joining row with more tokens than the batch has columns cannot take the slot: it
    merges as before, and the vacancy no row took is filtered out within a few steps, though
    the joining row's prefill (16-token chunks) takes longer."""
    requests = [
        greedy("short", _prompt(10, 7), 3),
        greedy("long", _prompt(12, 8), 40),
        greedy("next", _prompt(120, 9), 10),
    ]
    d = Driver(tiny, parallel=2, max_batch_prefill=1, prefill_chunk_size=16, prompt_cache=False)
    d.add(*requests)
    steps_with_vacancy = 0
    while d.engine.has_work:
        d.step()
        if VACANT in d.engine.runner._decode.uids:
            steps_with_vacancy += 1
    assert 0 < steps_with_vacancy <= MAX_VACANT_STEPS + 1
    assert d.tokens == alone(tiny, requests)


def test_without_a_waiting_request_a_finished_row_is_filtered_out(tiny: Any) -> None:
    requests = [greedy("short", _prompt(30, 10), 3), greedy("long", _prompt(30, 11), 20)]
    d = Driver(tiny, parallel=2, max_batch_prefill=2, prompt_cache=False)
    d.add(*requests)
    while "short" not in d.finals:
        d.step()
    assert d.engine.runner._decode.uids == ["long"]
