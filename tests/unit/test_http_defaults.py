"""Defaults the HTTP layer derives from the engine's state."""

from __future__ import annotations

import dataclasses

from mlxcel.daemon.server.completions import default_max_tokens
from mlxcel.shared.snapshot import (
    Counters,
    EffectiveConfig,
    EngineSnapshot,
    KVInfo,
    LatencyInfo,
    PromptCacheInfo,
)


def _snapshot(ctx_per_slot: int, blocks_total: int | None) -> EngineSnapshot:
    config = EffectiveConfig(4, 4, 4, None, 4, 4096, 512, True, 0, None, 64, ctx_per_slot)
    return EngineSnapshot(
        time=0.0,
        config=config,
        slots=(),
        queue=(),
        kv=KVInfo(block_size=32, blocks_total=blocks_total),
        prompt_cache=PromptCacheInfo(),
        latency=LatencyInfo(),
        counters=Counters(),
    )


def test_without_max_tokens_the_rest_of_the_context() -> None:
    assert default_max_tokens(_snapshot(2048, None), 48) == 2000
    assert default_max_tokens(_snapshot(2048, 1000), 48) == 2000


def test_a_small_kv_budget_bounds_the_default() -> None:
    # 10 blocks of 32 tokens: a 100-token prompt can still generate 220 tokens.
    assert default_max_tokens(_snapshot(8192, 10), 100) == 220
    snap = _snapshot(8192, 2)
    assert default_max_tokens(snap, 100) == 1  # never fits: the engine refuses it with a reason
    assert dataclasses.replace(snap.kv, blocks_total=None).blocks_total is None
