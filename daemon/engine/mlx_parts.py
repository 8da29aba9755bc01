"""The engine's default mlx parts: the runner for a model, its probe, the memory available.

`Engine` builds these when none are injected; tests and other runners inject their own (see
runner_api.py), so `core.py` imports no mlx.
"""

from __future__ import annotations

from typing import Any

from mlxcel.daemon.engine import mlx_support
from mlxcel.daemon.engine.runner import BatchRunner
from mlxcel.daemon.engine.runner_api import ModelProbe, Runner
from mlxcel.daemon.engine.solo_runner import SoloRunner
from mlxcel.daemon.engine.speculative import SpecPolicy
from mlxcel.shared.config import ServingConfig
from mlxcel.shared.switches import switch_flag

NO_PACKED_ENV = "MLXCEL_NO_PACKED_STEP"  # set: two forwards per step (decode, prefill chunk)


def probe(model: Any) -> ModelProbe:
    return mlx_support.probe_model(model)


def available_bytes(model: Any, parallel: int) -> int:
    return mlx_support.available_memory_bytes(model, parallel)


def make_runner(
    model: Any,
    config: ServingConfig,
    *,
    can_batch: bool,
    split_head: bool = True,
    packed: bool | None = None,
    draft: Any | None = None,
    vocab_size: int | None = None,
) -> Runner:
    """`BatchRunner` (one packed forward per step unless `packed` is False or MLXCEL_NO_PACKED_STEP
    is set) for a family that can batch, with speculative decoding unless `config.speculative`
    is off, and `draft` (a draft model's module) as its drafter; else `SoloRunner` (which
    never speculates)."""
    if not can_batch:
        return SoloRunner(model, config.prefill_chunk_size)
    if packed is None:
        packed = not switch_flag(NO_PACKED_ENV)
    runner = BatchRunner(model, config.prefill_chunk_size, split_head, packed=packed)
    # a step's tokens: every decoding row, then the prefill chunk up to the chunk size
    runner.step_tokens = config.prefill_chunk_size
    if draft is not None:
        from mlxcel.daemon.engine.draft_model import DraftModel

        runner.drafter = DraftModel(draft, vocab_size or 1 << 31)
    mode = config.speculative
    if mode == "draft" and draft is None:
        mode = "ngram"  # no draft model for this model: prompt lookup (the effective config says)
    if mode != "off":
        runner.speculation = SpecPolicy(mode)
    return runner
