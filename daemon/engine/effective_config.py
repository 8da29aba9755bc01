"""Effective engine settings: clamps, derived values and runtime changes. Pure functions.

`ServingConfig` keeps what the operator asked for; `EffectiveConfig` is what the engine runs
with (e.g. `parallel` clamped to 1 for a family that cannot batch, with the reason).
"""

from __future__ import annotations

from typing import Any

from mlxcel.shared.config import (
    MAX_PARALLEL,
    MIN_CTX_PER_SLOT,
    ConfigError,
    ServingConfig,
    runtime_change,
)
from mlxcel.shared.snapshot import ConfigChange, EffectiveConfig

DEFAULT_CONTEXT_LENGTH = 131072  # when the model does not say
DEFAULT_PROMPT_CACHE_BYTES = 2 * 1024**3


def default_prompt_cache_bytes(available_bytes: int) -> int:
    """docs/configuration.md: 2 GiB, lowered to a quarter of the memory left after the model."""
    return min(DEFAULT_PROMPT_CACHE_BYTES, max(available_bytes // 4, 0))


def effective_config(
    cfg: ServingConfig,
    *,
    can_batch: bool,
    batch_reason: str | None,
    context_length: int | None,
    prompt_cache_bytes: int,
    kv_budget_bytes: int | None,
    has_draft: bool = False,
) -> EffectiveConfig:
    limit = MAX_PARALLEL if can_batch else 1
    parallel = min(cfg.parallel, limit)
    clamp_reason = None
    if parallel < cfg.parallel:
        clamp_reason = batch_reason or "this model family cannot batch"
    ctx = cfg.ctx_size // parallel if cfg.ctx_size else (context_length or DEFAULT_CONTEXT_LENGTH)
    return EffectiveConfig(
        parallel=parallel,
        parallel_requested=cfg.parallel,
        parallel_limit=limit,
        parallel_clamp_reason=clamp_reason,
        max_batch_prefill=min(cfg.max_batch_prefill, limit),
        max_batch_prefill_tokens=cfg.effective_max_batch_prefill_tokens,
        prefill_chunk_size=cfg.prefill_chunk_size,
        prompt_cache=cfg.prompt_cache and can_batch,
        prompt_cache_bytes=prompt_cache_bytes,
        kv_cache_budget=kv_budget_bytes,
        max_queue_depth=cfg.max_queue_depth,
        ctx_per_slot=ctx,
        # the solo runner (a family that cannot batch) has no verification step; without a
        # draft model that shares this model's tokenizer, `draft` drafts by prompt lookup
        speculative=_speculative(cfg.speculative, can_batch, has_draft),
        draft_model=cfg.draft_model if has_draft and can_batch else None,
    )


def _speculative(mode: str, can_batch: bool, has_draft: bool) -> str:
    if not can_batch:
        return "off"
    return "ngram" if mode == "draft" and not has_draft else mode


def _effective_value(eff: EffectiveConfig, key: str) -> Any:
    return getattr(eff, key)


def apply_change(
    cfg: ServingConfig,
    eff: EffectiveConfig,
    name: str,
    value: Any,
    *,
    can_batch: bool,
    has_draft: bool = False,
) -> tuple[ServingConfig, ConfigChange]:
    """Validate one runtime change against the current config; refused changes keep `cfg`."""
    key = name.replace("-", "_")
    previous = _effective_value(eff, key) if key in EffectiveConfig.__dataclass_fields__ else None
    try:
        key, parsed = runtime_change(name, value)
        _check_change(cfg, key, parsed, can_batch=can_batch, has_draft=has_draft)
    except ConfigError as exc:
        return cfg, ConfigChange(key, value, False, previous, previous, str(exc))
    new_cfg = cfg.replace(**{key: parsed})
    reason = None
    if key in ("parallel", "max_batch_prefill") and not can_batch and parsed > 1:
        reason = eff.parallel_clamp_reason or "this model family cannot batch"
        reason = f"clamped to 1: {reason}"
    effective = 1 if reason else parsed
    if key == "speculative" and not can_batch and parsed != "off":
        reason = eff.parallel_clamp_reason or "this model family cannot batch"
        reason, effective = f"stays off: {reason} (no verification step)", "off"
    if key == "max_batch_prefill_tokens":
        effective = new_cfg.effective_max_batch_prefill_tokens
    return new_cfg, ConfigChange(key, value, True, effective, previous, reason)


def _check_change(
    cfg: ServingConfig, key: str, value: Any, *, can_batch: bool, has_draft: bool = False
) -> None:
    if key == "speculative" and value == "draft" and can_batch and not has_draft:
        raise ConfigError(
            "speculative draft: no draft model is loaded for this model (start with "
            "--draft-model NAME, a model of the same tokenizer)"
        )
    if key == "parallel" and cfg.ctx_size and cfg.ctx_size // value < MIN_CTX_PER_SLOT:
        raise ConfigError(
            f"parallel {value} would leave {cfg.ctx_size // value} context tokens per slot "
            f"(ctx_size {cfg.ctx_size}), below the minimum {MIN_CTX_PER_SLOT}"
        )
    if key == "prompt_cache" and value and not can_batch:
        raise ConfigError("prompt_cache: this model family keeps no reusable KV (cannot batch)")
