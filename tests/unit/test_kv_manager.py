"""KV block accounting: reservations, the prompt cache's share, never-fits."""

from __future__ import annotations

from mlxcel.daemon.engine.kv_budget import (
    AUTO_BUDGET_FRACTION,
    KVBudget,
    blocks_for,
    resolve_budget_bytes,
)


def test_blocks_round_up_to_32_tokens() -> None:
    assert [blocks_for(n) for n in (0, 1, 32, 33, 64, 65)] == [0, 1, 1, 2, 2, 3]


def test_budget_resolution() -> None:
    assert resolve_budget_bytes(None, 10**9) is None
    assert resolve_budget_bytes(12345, 10**9) == 12345
    assert resolve_budget_bytes("auto", 10**9) == int(10**9 * AUTO_BUDGET_FRACTION)


def test_reservations_and_cached_blocks_share_the_total() -> None:
    kv = KVBudget.from_budget(10 * 1000, 1000)
    assert (kv.total_blocks, kv.budget_bytes) == (10, 10_000)
    assert kv.never_fits(321) and not kv.never_fits(320)
    assert kv.reserve("a", 100) == 4  # ceil(100 / 32)
    kv.num_cached = 3
    assert (kv.num_used, kv.num_free, kv.num_free_after_eviction) == (4, 3, 6)
    assert kv.release("a") == 4 and kv.release("a") == 0
    assert kv.num_free == 7


def test_unbounded_budget() -> None:
    kv = KVBudget.from_budget(None, 1000)
    assert kv.total_blocks is None and kv.num_free is None
    assert not kv.never_fits(10**9) and kv.num_free_after_eviction is None
