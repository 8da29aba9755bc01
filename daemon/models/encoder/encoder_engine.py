"""The engine of an embedding-only model: the engine thread computes the encoder's batches.

An encoder generates nothing, so it has no decode slots, KV blocks or prompt cache; what it
shares with a chat model's engine is the door and the thread: `EngineBridge` wraps an
`EncoderEngine` as it wraps `engine.Engine` (the same bounded queue of embedding requests,
`max_queue_depth`, 503 `queue_full` past it; the same drain and shutdown; the same step
watchdog, which fails the embedding requests a hung engine held and builds a fresh one on the
same weights: docs/reliability.md, "Step watchdog"). Each step runs one padded forward of at
most `prefill_chunk_size` tokens (rows x longest; one input longer than that runs alone: an
encoder's attention spans the whole input, so it cannot be chunked).
A generation request never reaches it (the HTTP layer answers 400 `model_not_generative`);
`check_admission` refuses one all the same.

The snapshot is honest: no slots, no queue of prompts, a KV budget of 0 blocks, the prompt
cache off; the tokens the encoder computed count as prefill tokens (throughput in the console
and /metrics). Runtime changes (all about slots or the prompt cache) are refused with a reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlxcel.daemon.engine.effective_config import effective_config
from mlxcel.daemon.engine.embedder import MAX_BATCH_ROWS, Embedder, EmbeddingJob, _normalize
from mlxcel.daemon.engine.stats import EngineStats
from mlxcel.daemon.engine.types import FINISH_ABORT, AdmissionRejected, GenerationRequest
from mlxcel.shared.config import KV_BLOCK_SIZE, ServingConfig
from mlxcel.shared.protocol import EV_CONFIG
from mlxcel.shared.snapshot import (
    ConfigChange,
    EffectiveConfig,
    EngineSnapshot,
    KVInfo,
    PromptCacheInfo,
)

log = logging.getLogger("mlxcel.engine")

NOT_GENERATIVE = "model_not_generative"


def pool_hidden(hidden: mx.array, lengths: mx.array, mode: str) -> mx.array:
    """One vector per row of right-padded hidden states (batch, length, width), the row's
    first `lengths[i]` positions real (sentence-transformers' Pooling modes)."""
    width = hidden.shape[1]
    keep = (mx.arange(width)[None, :] < lengths[:, None])[..., None]
    if mode == "cls":
        return hidden[:, 0, :]
    if mode == "lasttoken":
        index = (lengths - 1).astype(mx.int32)[:, None, None]
        return mx.take_along_axis(hidden, index, axis=1)[:, 0, :]
    if mode == "max":
        return mx.where(keep, hidden, -1e9).max(axis=1)
    sums = (hidden * keep).sum(axis=1)
    count = lengths.astype(mx.float32)[:, None]
    if mode == "mean_sqrt_len":
        return sums / mx.sqrt(count)
    return sums / count  # mean


class EncoderEmbedder(Embedder):
    """The embedder of an encoder: a padded bidirectional forward with the padding masked,
    the model's pooling, L2 normalisation when its sentence-transformers files ask for it."""

    def __init__(self, model: Any) -> None:  # no super(): there is no output head to split
        self.backbone = None
        self.model = model
        self.sentence = model.sentence
        self.max_rows = MAX_BATCH_ROWS
        self.jobs: deque[EmbeddingJob] = deque()
        self.num_tokens = 0
        self.num_batches = 0

    def pool(self, rows: list[list[int]]) -> list[np.ndarray]:
        vectors = np.array(embed_rows(self.model, rows))
        return [vectors[i] for i in range(len(rows))]

    def _long_chunk(self, job: EmbeddingJob, budget: int) -> int:
        """An input over the step's budget: alone, in one forward (not chunkable)."""
        long = job.long
        assert long is not None
        ids = job.inputs[long.index]
        job.vectors[long.index] = self.pool([ids])[0]
        job.long = None
        return len(ids)


def embed_rows(model: Any, rows: list[list[int]]) -> mx.array:
    """The sentence vectors (float32) of token lists, right-padded into one forward."""
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
    counts = mx.array(lengths, dtype=mx.int32)
    hidden = model(ids, counts).astype(mx.float32)
    sentence = model.sentence
    vectors = pool_hidden(hidden, counts, sentence.pooling)
    if sentence.normalize:
        vectors = _normalize(vectors)
    mx.eval(vectors)
    return vectors


class EncoderEngine:
    """What `EngineBridge` drives for an embedding-only model (engine thread; see the module
    doc). `can_batch`, `runner` and the generation members exist only to answer the callers
    that ask every engine."""

    serves_embeddings = True
    degraded = None

    def __init__(
        self,
        model: Any,
        config: ServingConfig,
        context_length: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.config = config
        self.context_length = context_length
        self.clock = clock
        self.can_batch = True
        self.vocab_size = int(model.args.vocab_size)
        self.grammars = None  # no constrained decoding: nothing is generated
        self.stats = EngineStats(clock)
        self.embedder = EncoderEmbedder(model)
        self.effective = self._effective()
        self.shutting_down = False
        self.on_output: Callable[[str, Any], None] = lambda rid, out: None
        self.on_event: Callable[[str, dict[str, Any]], None] = lambda name, data: None
        self.on_flush: Callable[[], None] = lambda: None
        self._snapshot = self._build_snapshot()

    def _effective(self) -> EffectiveConfig:
        eff = effective_config(
            self.config,
            can_batch=True,
            batch_reason=None,
            context_length=self.context_length,
            prompt_cache_bytes=0,
            kv_budget_bytes=0,
        )
        return dataclasses.replace(eff, prompt_cache=False, ctx_per_slot=self.context_length)

    # -- what the bridge reads (any thread) ---------------------------------------------------

    @property
    def num_running(self) -> int:
        return 0

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def num_embedding_jobs(self) -> int:
        return len(self.embedder.jobs)

    @property
    def has_work(self) -> bool:
        return bool(self.embedder.jobs)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # -- generation: refused -------------------------------------------------------------------

    def check_admission(self, request: GenerationRequest, num_waiting: int) -> None:
        raise AdmissionRejected(
            NOT_GENERATIVE, "this is an embedding model: it serves only the embedding routes"
        )

    def add_request(self, request: GenerationRequest) -> None:
        self.check_admission(request, 0)

    def abort(self, request_id: str, reason: str = FINISH_ABORT, error: str | None = None) -> bool:
        return False  # it holds no generation request

    def abort_all(self, reason: str = FINISH_ABORT) -> None:
        self.embedder.fail_all(AdmissionRejected("shutting_down", "the engine stopped"))

    # -- embeddings ------------------------------------------------------------------------------

    def add_embedding(self, inputs: list[list[int]], future: Any) -> None:
        self.embedder.add(inputs, future)

    def fail_embeddings(self, exc: BaseException) -> None:
        """Fail every embedding request this engine holds, queued or in its forward, with
        `exc` (`Engine.fail_embeddings`: the step watchdog, on an engine it gave up on)."""
        self.embedder.fail_all(exc)

    def step(self) -> None:
        """One forward within `prefill_chunk_size` tokens; publish; hand the results over."""
        budget = self.effective.prefill_chunk_size
        computed = self.embedder.run_batch(budget)
        if computed:
            self.stats.record_prefill(self.clock(), computed, 0)
        self.stats.steps += 1
        self._publish()
        self.flush()

    def flush(self) -> None:
        self.on_flush()

    # -- runtime control -----------------------------------------------------------------------

    def reconfigure(self, changes: dict[str, Any]) -> list[ConfigChange]:
        """Every runtime key (parallel, max_batch_prefill, max_batch_prefill_tokens,
        prompt_cache, speculative) is about decode slots or the prompt cache: refused, with
        the reason."""
        results = []
        for name, value in changes.items():
            key = name.replace("-", "_")
            previous = getattr(self.effective, key, None)
            change = ConfigChange(
                key,
                value,
                False,
                previous,
                previous,
                f"{key}: an embedding model has no decode slots, KV or prompt cache",
            )
            results.append(change)
            log.info("config refused: %s", change)
            self.on_event(EV_CONFIG, change.to_dict())
        self._publish()
        return results

    def reset_prompt_cache(self, tier: str = "all") -> dict[str, Any]:
        return {"entries_freed": 0, "bytes_freed": 0}  # it has none, in memory or on disk

    # -- the snapshot ----------------------------------------------------------------------------

    def publish(self) -> None:
        """Replace the snapshot now (`Engine.publish`)."""
        self._publish()

    def _publish(self) -> None:
        self._snapshot = self._build_snapshot()

    def _build_snapshot(self) -> EngineSnapshot:
        now = self.clock()
        return EngineSnapshot(
            time=now,
            config=self.effective,
            slots=(),
            queue=(),
            kv=KVInfo(block_size=KV_BLOCK_SIZE, blocks_total=0, budget_bytes=0),
            prompt_cache=PromptCacheInfo(enabled=False),
            latency=self.stats.latency(now),
            counters=self.stats.counters(),
        )
