"""Embeddings on the engine thread: pooled hidden states of the model's backbone.

`POST /v1/embeddings` and Ollama's `/api/embed` (docs/api.md, "Embeddings") queue their token
lists here through `EngineBridge.embed`; `Engine.step` runs one batch per step, after the
decode step and only when no prefill chunk ran in it (or after `EMBED_MAX_WAIT_STEPS` that
did), so an embedding request never stalls the decoding rows longer than one prefill chunk
would. A batch holds at most the step's token budget (`prefill_chunk_size` less the decoding
rows): several short inputs right-padded into one forward (rows x longest within the budget),
or one chunk of an input longer than the budget, which then runs over several steps on a KV
cache of its own.

The vector of an input: the mean over its tokens of the backbone's output (the hidden states
after the final norm, the input of the output layer: the same split as the prefill's first
token, `mlx_support.detect_head`), L2-normalised, as llama.cpp's `--embeddings` with mean
pooling. Right padding cannot leak into a row: attention is causal, so no real token sees the
padding after it, and the padding's positions are left out of the mean. The forward is a fresh
one (no cache, or the long input's own) and never touches the running rows' KV or the prompt
cache.

With runner.py, solo_runner.py, mlx_support.py and memory.py, an engine module that imports mlx
(`core.py` imports it only when the first embedding request arrives).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlxcel.daemon.engine.mlx_support import detect_head, generation_stream
from mlxcel.daemon.engine.runner_api import EmbeddingUnsupported

log = logging.getLogger("mlxcel.engine")

MAX_BATCH_ROWS = 64  # inputs in one padded forward, whatever the budget allows


@dataclass(eq=False)
class _Long:
    """An input longer than a step's budget, computed chunk by chunk on its own cache."""

    index: int
    cache: list[Any]
    done: int = 0  # tokens computed
    total: mx.array | None = None  # the running sum of its hidden states (float32)


@dataclass(eq=False)
class EmbeddingJob:
    """One request's inputs (token id lists) and the future its vectors go to."""

    inputs: list[list[int]]
    future: concurrent.futures.Future[np.ndarray]
    vectors: list[np.ndarray | None] = field(default_factory=list)
    order: deque[int] = field(default_factory=deque)  # inputs not started, shortest first
    long: _Long | None = None

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)
        self.order = deque(sorted(range(len(self.inputs)), key=lambda i: len(self.inputs[i])))

    @property
    def done(self) -> bool:
        return not self.order and self.long is None

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()


class Embedder:
    """The embedding work of one model (engine thread only)."""

    def __init__(self, model: Any, can_batch: bool = True) -> None:
        split = detect_head(model)
        if split is None:
            raise EmbeddingUnsupported(
                "this model's hidden states cannot be taken apart from its output layer, so it "
                "serves no embeddings"
            )
        self.backbone = split[0]
        self.model = model
        # families that cannot batch run one input per forward: no padding to reason about
        self.max_rows = MAX_BATCH_ROWS if can_batch else 1
        self.jobs: deque[EmbeddingJob] = deque()
        self.num_tokens = 0  # computed since start (for the log and tests)
        self.num_batches = 0

    @property
    def pending(self) -> bool:
        return bool(self.jobs)

    def add(self, inputs: list[list[int]], future: concurrent.futures.Future[np.ndarray]) -> None:
        job = EmbeddingJob(inputs, future)
        if job.done:  # no inputs
            self._complete(job)
            return
        self.jobs.append(job)

    def fail_all(self, exc: BaseException) -> None:
        jobs, self.jobs = self.jobs, deque()
        for job in jobs:
            _set_exception(job.future, exc)

    def run_batch(self, budget: int) -> int:
        """One forward of at most `budget` tokens (rows x longest); the tokens computed. A
        forward that raises fails every waiting job (their futures get the error)."""
        while self.jobs and self.jobs[0].cancelled:  # the client went away
            self.jobs.popleft()
        if not self.jobs:
            return 0
        budget = max(budget, 1)
        head = self.jobs[0]
        try:
            with mx.stream(generation_stream):
                if head.long is None and head.order and len(head.inputs[head.order[0]]) > budget:
                    index = head.order.popleft()
                    head.long = _Long(index, make_prompt_cache(self.model))
                if head.long is not None:
                    computed = self._long_chunk(head, budget)
                else:
                    computed = self._short_batch(budget)
        except Exception as exc:
            # A short batch takes inputs of several jobs off their queues before the forward:
            # every waiting job fails, none is answered with fewer vectors than it sent.
            log.exception("embedding forward failed")
            self.fail_all(RuntimeError(f"embedding forward failed: {exc}"))
            return 0
        self.num_tokens += computed
        self.num_batches += 1
        while self.jobs and (self.jobs[0].done or self.jobs[0].cancelled):
            self._complete(self.jobs.popleft())
        return computed

    # -- forwards ------------------------------------------------------------------------------

    def _short_batch(self, budget: int) -> int:
        """Inputs that fit the budget, from the head job on, right-padded into one forward."""
        picked: list[tuple[EmbeddingJob, int]] = []
        longest = 0
        for job in self.jobs:
            if job.cancelled or job.long is not None:
                break
            while job.order and len(picked) < self.max_rows:
                n = len(job.inputs[job.order[0]])
                if n > budget or (len(picked) + 1) * max(longest, n) > budget:
                    break
                picked.append((job, job.order.popleft()))
                longest = max(longest, n)
            if job.order or len(picked) >= self.max_rows:
                break  # the rest waits for the next step, in order
        rows = [job.inputs[i] for job, i in picked]
        vectors = self.pool(rows)
        for (job, i), vector in zip(picked, vectors, strict=True):
            job.vectors[i] = vector
        return sum(len(r) for r in rows)

    def pool(self, rows: list[list[int]]) -> list[np.ndarray]:
        """Mean-pooled, L2-normalised backbone outputs of `rows` in one padded forward."""
        lengths = [len(r) for r in rows]
        width = max(lengths)
        tokens = mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
        hidden = self.backbone(tokens).astype(mx.float32)  # causal mask: padding comes last
        keep = mx.arange(width)[None, :] < mx.array(lengths)[:, None]
        sums = (hidden * keep[..., None]).sum(axis=1)
        means = sums / mx.array(lengths, dtype=mx.float32)[:, None]
        out = np.array(_normalize(means))
        return [out[i] for i in range(len(rows))]

    def _long_chunk(self, job: EmbeddingJob, budget: int) -> int:
        long = job.long
        assert long is not None
        ids = job.inputs[long.index]
        piece = ids[long.done : long.done + budget]
        hidden = self.backbone(mx.array([piece], dtype=mx.int32), cache=long.cache)
        part = hidden.astype(mx.float32)[0].sum(axis=0)
        long.total = part if long.total is None else long.total + part
        mx.eval(long.total)
        long.done += len(piece)
        if long.done >= len(ids):
            mean = long.total / float(len(ids))
            job.vectors[long.index] = np.array(_normalize(mean[None])[0])
            job.long = None  # its cache goes with it
        return len(piece)

    # -- results -------------------------------------------------------------------------------

    @staticmethod
    def _complete(job: EmbeddingJob) -> None:
        if job.cancelled or not job.future.set_running_or_notify_cancel():
            return
        vectors = [v for v in job.vectors if v is not None]
        if len(vectors) != len(job.vectors):  # never a short answer
            job.future.set_exception(RuntimeError("embedding lost an input's vector"))
            return
        width = vectors[0].shape[0] if vectors else 0
        result = np.stack(vectors) if vectors else np.zeros((0, width), np.float32)
        job.future.set_result(result.astype(np.float32, copy=False))


def _normalize(x: mx.array) -> mx.array:
    norm = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
    return x / mx.maximum(norm, 1e-12)


def _set_exception(future: concurrent.futures.Future[Any], exc: BaseException) -> None:
    # Done already: cancelled by its client, or failed by the step watchdog as a command the
    # hung engine thread held (bridge.py) before it fails the engine's jobs, this one among
    # them (`set_running_or_notify_cancel` raises on a finished future).
    if not future.done() and future.set_running_or_notify_cancel():
        future.set_exception(exc)
