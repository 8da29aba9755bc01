"""Synchronous admission checks: what is refused before it is queued (docs/internals.md).

Plain Python, called by `EngineBridge.submit` on the loop thread; it only reads values the
engine thread replaces whole (the effective config) or never changes (the KV block total).
"""

from __future__ import annotations

import math

from mlxcel.daemon.engine.kv_budget import KVBudget
from mlxcel.daemon.engine.types import AdmissionRejected, GenerationRequest
from mlxcel.shared.snapshot import EffectiveConfig


def check_request(
    request: GenerationRequest,
    eff: EffectiveConfig,
    kv: KVBudget,
    *,
    vocab_size: int,
    num_waiting: int,
    shutting_down: bool,
) -> None:
    """Raise AdmissionRejected (reason, message, http_status) or return."""
    total = len(request.prompt_ids) + request.max_tokens
    if shutting_down:
        raise AdmissionRejected("shutting_down", "the engine is shutting down")
    if not request.prompt_ids:
        raise AdmissionRejected("invalid_request", "the prompt is empty")
    if request.max_tokens < 1:
        raise AdmissionRejected("invalid_request", "max_tokens must be at least 1")
    _check_token_ids(request, vocab_size)
    _check_sampling(request)
    if total > eff.ctx_per_slot:
        raise AdmissionRejected(
            "too_long",
            f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) "
            f"= {total} exceeds the context per slot ({eff.ctx_per_slot} tokens)",
        )
    if kv.never_fits(total):
        raise AdmissionRejected(
            "kv_never_fits",
            f"prompt + max_tokens = {total} tokens needs {kv.blocks_for(total)} KV "
            f"blocks; the KV budget holds {kv.total_blocks}",
        )
    if num_waiting >= eff.max_queue_depth:
        raise AdmissionRejected(
            "queue_full", f"the queue is full ({eff.max_queue_depth} waiting requests)"
        )


def _check_token_ids(request: GenerationRequest, vocab_size: int) -> None:
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
        raise AdmissionRejected("invalid_request", f"prompt token ids must be in [0, {vocab_size})")
    bias = request.sampling.logit_bias or {}
    if any(not 0 <= int(t) < vocab_size for t in bias):
        raise AdmissionRejected(
            "invalid_request", f"logit_bias token ids must be in [0, {vocab_size})"
        )


MAX_TOP_LOGPROBS = 20


def _check_sampling(request: GenerationRequest) -> None:
    """Values the runners cannot use would fail a whole batch step: refuse them here."""
    sp = request.sampling
    if not 0 <= sp.top_logprobs <= MAX_TOP_LOGPROBS:
        raise AdmissionRejected(
            "invalid_request", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"
        )
    if not (math.isfinite(sp.repetition_penalty) and sp.repetition_penalty > 0):
        raise AdmissionRejected("invalid_request", "repetition_penalty must be a positive number")
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(sp, name)):
            raise AdmissionRejected("invalid_request", f"{name} must be a finite number")
