"""`BatchRunner`: the batched forward passes, on mlx-lm's batch machinery.

One prefill cohort at a time (`PromptProcessingBatch`: rows right-padded, merged into a
`BatchKVCache`, a chunk per call) and every decoding row together (`GenerationBatch`: one token
per call, pipelined with `async_eval`: `decode()` returns the token each row sampled in the
previous forward and queues the next forward).

A row's first token is sampled from its last prefill forward when the model's output head can
be split from its backbone (checked numerically at start): the chunk includes the last prompt
token, only the last positions go through the head, and the row joins the decode batch with
that token as its next input. Otherwise (head not separable) the last prompt token is fed by
`GenerationBatch` itself, and the first token comes out of the next `decode()`.

Why one module: `BatchRunner` owns the cohorts, their caches and the batched decode state on
mlx-lm's batch machinery; prefill, merging and the decode step all change that one state, in
the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler
from mlxcel.daemon.engine.mlx_support import (
    KVPayload,
    RowLogprobs,
    RowSampler,
    detect_head,
    drop_last_positions,
    generation_stream,
    make_row_processors,
    make_row_sampler,
    process_rows,
    read_logprobs,
    restore_random_state,
    roomy_caches,
    sample_row,
    sample_rows,
)
from mlxcel.daemon.engine.runner_api import (
    DecodeOutput,
    PrefillProgress,
    RowSpec,
    finish_reason,
)
from mlxcel.daemon.engine.speculative import SpecPolicy
from mlxcel.daemon.engine.types import GREEDY

if TYPE_CHECKING:
    from mlxcel.daemon.engine.draft_model import DraftModel
from mlxcel.daemon.forward.packed_forward import PackedForward
from mlxcel.daemon.mlx_lm_compat import (
    GenerationStep,
    fit_growth_step,
    place_row,
    row_fits,
    shift_cache_index,
)

log = logging.getLogger("mlxcel.engine")

CLEAR_CACHE_EVERY = 256  # decode steps
VACANT = "\x00vacant"  # a decode row whose sequence left, its slot kept for a row about to join
VACANT_SAMPLER = make_row_sampler(GREEDY)  # what a vacant row samples (its tokens are dropped)
MAX_VACANT_STEPS = 4  # decode steps a vacancy waits for a joining row before it is compacted


def _plain(caches: list[Any]) -> bool:
    """Whether `caches` are plain `BatchKVCache`s (not rotating or quantized ones), at least one:
    the caches a vacancy is kept and filled in."""
    return bool(caches) and all(type(c) is BatchKVCache for c in caches)


def stop_sequences(row: RowSpec) -> StopSequences:
    """mlx-lm's matcher set for the tokens that end `row`."""
    return StopSequences([[t] for t in row.stop_ids()])


def filter_batch_cache(cache: BatchKVCache, keep: list[int]) -> None:
    """`BatchKVCache.filter(keep)` in one copy of the kept rows' keys and values.

    mlx-lm's filter gathers the rows, then drops the columns every kept row pads (a view); the
    next `update_and_fetch` cannot update a view in place, so it copies the whole cache again.
    Here each kept row's columns from the common padding on are copied once, into a contiguous
    array the next update writes in place. Same keys, values, offsets and padding."""
    index = mx.array(keep)
    left_padding = cache.left_padding[index]
    shift = min(left_padding.tolist())
    if cache.keys is not None:
        for name in ("keys", "values"):
            array = getattr(cache, name)
            setattr(cache, name, mx.concatenate([array[i : i + 1, :, shift:, :] for i in keep]))
        shift_cache_index(cache, -shift)
    cache.offset = cache.offset[index]
    cache.left_padding = left_padding - shift


class RowBatch(GenerationStep, GenerationBatch):
    """mlx-lm's `GenerationBatch` with our per-row sampling step (`decode_step`; its
    private pipeline state only through `GenerationStep`, daemon/mlx_lm_compat.py).

    `samplers` holds a `RowSampler` per row. Each step: the forward is queued first; rows with a
    grammar consume the token they sampled last and compute their mask while it runs; then each
    row's logits processors (bias, penalties) and mask apply, greedy rows take the argmax and the
    log-softmax is computed only for rows that sample from it or report log-probabilities.
    `Response.logprobs` is the row's `RowLogprobs` or None.
    """

    # when set (by `BatchRunner.decode` for one step): (inputs, caches) -> last logits, the
    # packed forward that also runs the prefill chunk
    packed: Callable[[mx.array, list[Any]], mx.array] | None = None
    prompt_cache: list[Any]  # GenerationBatch's, per layer (declared for the type checker)

    def filter(self, keep: list[int]) -> None:
        caches = self.prompt_cache
        if not keep or not caches or any(type(c) is not BatchKVCache for c in caches):
            super().filter(keep)
            return
        for c in caches:
            filter_batch_cache(c, keep)
        self.prompt_cache = []  # the caches are done: GenerationBatch.filter does the rest
        try:
            super().filter(keep)
        finally:
            self.prompt_cache = caches

    # Vacancies (the runner's `expect_joins`): a row whose sequence ends or is removed while
    # rows are about to join keeps its slot, computed and its tokens dropped, and a joining
    # row's keys and values are copied into it in place (`fill`): one row's KV copied, where
    # filtering the batch and extending it again copy every row's twice (~40 ms for 4
    # SmolLM2 rows of 500 tokens on 2 cores, per preemption and per resumption).
    hold_vacancies = False

    @property
    def vacancies(self) -> list[int]:
        return [i for i, uid in enumerate(self.uids) if uid == VACANT]

    @property
    def members(self) -> list[str]:
        """The rows' request ids, vacancies left out."""
        return [uid for uid in self.uids if uid != VACANT]

    def next(self) -> list[Any]:
        """mlx-lm's `GenerationBatch.next()` (a step; a response per row; the rows that end
        leave), with vacant rows' tokens dropped and rows that end leaving through `leave`."""
        if not self.uids:
            return []
        tokens, logprobs = self.step_rows()
        counts = self.generated_counts()
        responses, ended = [], []
        for i, uid in enumerate(self.uids):
            if uid == VACANT:
                continue
            counts[i] += 1
            reason = "length" if counts[i] >= self.max_tokens[i] else None
            if self.stop_matcher(i).advance(tokens[i]):
                reason = "stop"
            done = reason is not None
            responses.append(
                self.Response(
                    uid=uid,
                    token=tokens[i],
                    logprobs=logprobs[i],
                    finish_reason=reason,
                    prompt_cache=self.extract_cache(i) if done else None,
                    all_tokens=self.tokens[i] if done else None,
                )
            )
            if done:
                ended.append(i)
        if ended:
            self.leave(ended)
        return responses

    def leave(self, rows: list[int]) -> None:
        """Rows whose sequences ended or were removed: vacated while `hold_vacancies` (their
        caches plain `BatchKVCache`s), else filtered out, with every vacancy."""
        if self.hold_vacancies and _plain(self.prompt_cache):
            for i in rows:
                self.uids[i] = VACANT
                self.tokens[i] = []
                self.samplers[i] = VACANT_SAMPLER
                self.logits_processors[i] = []
            return
        gone = set(rows)
        self.filter([i for i, uid in enumerate(self.uids) if i not in gone and uid != VACANT])

    def compact(self) -> None:
        """Filter the vacancies out (a copy of the other rows' KV)."""
        if VACANT in self.uids:
            self.filter([i for i, uid in enumerate(self.uids) if uid != VACANT])

    def fill(self, other: RowBatch) -> list[int]:
        """Move `other`'s rows into this batch's vacancies, as many as fit (`row_fits`: no
        longer than this batch's written columns): each one's keys and values copied into a
        vacant row in place, its state taken over. Returns the rows of `other` placed."""
        slots, caches, theirs = self.vacancies, self.prompt_cache, other.prompt_cache
        if not slots or not (_plain(caches) and _plain(theirs)):
            return []
        placed = []
        for j in range(len(other.uids)):
            if not slots:
                break
            if not row_fits(caches, theirs, j):
                continue
            i = slots.pop(0)
            place_row(caches, i, theirs, j)
            self.take_row(i, other, j)
            placed.append(j)
        return placed

    def decode_step(self) -> tuple[list[int], list[RowLogprobs | None]]:
        inputs, previous = self.begin_step()
        rows: list[RowSampler] = self.samplers
        fit_growth_step(self.prompt_cache)
        if self.packed is not None:
            logits = self.packed(inputs, self.prompt_cache)
        else:
            logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        masks = {}
        constrained = [(e, c) for e, r in enumerate(rows) if (c := r.constraint) is not None]
        if constrained:
            mx.async_eval(logits)  # the forward runs while the grammars compute their masks
            values = inputs.tolist()
            for e, constraint in constrained:
                constraint.advance(values[e])
                masks[e] = constraint.allowed()
        token_context: list[mx.array] = []

        def context_of(e: int):
            def fetch() -> mx.array:
                context = self.token_context(e).update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                return context

            return fetch

        contexts = [context_of(e) if self.logits_processors[e] else None for e in range(len(rows))]
        logits = process_rows(logits, rows, self.logits_processors, contexts, masks)
        sampled, reports = sample_rows(logits, rows)
        self.queue_next(sampled, reports)
        mx.async_eval(sampled, [r for r in reports if r is not None], token_context)
        # The tokens of the previous forward (and their reports), read now.
        current = [r for r in previous if r is not None]
        mx.eval(inputs, current)
        tokens = inputs.tolist()
        for sti, ti in zip(self.tokens, tokens, strict=True):
            sti.append(ti)
        return tokens, read_logprobs(previous)

    def verify_step(self, drafts: list[list[int]]) -> tuple[list[Any], list[int]]:
        """One speculative step (caller: `BatchRunner.decode`, with the pending inputs already
        evaluated and every cache a `BatchKVCache`): each row feeds its pending input and
        `drafts[i]` in one forward; each row keeps the longest prefix of its draft that its own
        sampling (processors, grammar, sampler) reproduces, and the first token it disagrees
        on, or the one after the whole draft, becomes its next input. The KV cache is rolled
        back past the rejected tokens. Returns the responses (one per token a row emits, in
        order) and each row's accepted count.

        The sampler is called once per token the row emits, as the one-token step calls it, so
        a seeded row draws the same random stream with or without speculation."""
        inputs, previous = self.begin_step()
        ys: list[int] = inputs.tolist()
        n = len(self.uids)
        width = 1 + max(len(d) for d in drafts)
        rows_in = [[ys[i], *d, *([ys[i]] * (width - 1 - len(d)))] for i, d in enumerate(drafts)]
        fit_growth_step(self.prompt_cache, width)
        logits = self.model(mx.array(rows_in, dtype=inputs.dtype), cache=self.prompt_cache)
        samplers: list[RowSampler] = self.samplers
        simple = [
            i
            for i in range(n)
            if samplers[i].greedy
            and samplers[i].constraint is None
            and not samplers[i].wants_logprobs
            and not self.logits_processors[i]
        ]
        argmax: dict[int, list[int]] = {}
        if simple:
            picked = logits if len(simple) == n else logits[mx.array(simple)]
            argmax = dict(zip(simple, mx.argmax(picked, axis=-1).tolist(), strict=True))
        accepted: list[int] = []
        nexts: list[int] = []
        reports: list[list[Any]] = []
        for i in range(n):
            if i in argmax:
                chosen, row_reports = argmax[i], [None] * width
                a = 0
                while a < len(drafts[i]) and chosen[a] == drafts[i][a]:
                    a += 1
                nexts.append(chosen[a])
            else:
                a, token, row_reports = self._verify_row(i, inputs, ys[i], logits[i], drafts[i])
                nexts.append(token)
            accepted.append(a)
            reports.append(row_reports)
        drop_last_positions(self.prompt_cache, [width - 1 - a for a in accepted])
        self.queue_next(
            mx.array(nexts, dtype=inputs.dtype), [reports[i][accepted[i]] for i in range(n)]
        )
        return self._emit(ys, drafts, accepted, previous, reports), accepted

    def _verify_row(
        self, i: int, inputs: mx.array, y: int, logits: mx.array, draft: list[int]
    ) -> tuple[int, int, list[Any]]:
        """Row `i`'s drafted tokens checked one by one against its processed logits:
        (accepted count, its next input, the lazy logprobs report of each sampled token)."""
        row: RowSampler = self.samplers[i]
        processors = self.logits_processors[i]
        constraint = row.constraint
        if constraint is not None:
            constraint.advance(y)
        context = self.token_context(i).update_and_fetch(inputs[i : i + 1]) if processors else None
        row_reports: list[Any] = []
        for j in range(len(draft) + 1):
            masks = {0: constraint.allowed()} if constraint is not None else {}
            fetch = None
            if context is not None:
                ctx = (
                    context
                    if j == 0
                    else mx.concatenate([context, mx.array(draft[:j], dtype=context.dtype)])
                )
                fetch = lambda ctx=ctx: ctx  # noqa: E731
            processed = process_rows(logits[j : j + 1], [row], [processors], [fetch], masks)
            sampled, report = sample_rows(processed, [row])
            row_reports.append(report[0])
            token = int(sampled.item())
            if j < len(draft) and token == draft[j]:
                if constraint is not None:
                    constraint.advance(token)
                continue
            if context is not None and j:
                self.token_context(i).update_and_fetch(mx.array(draft[:j], dtype=context.dtype))
            return j, token, row_reports
        raise AssertionError("unreachable: the last position always ends the row's check")

    def _emit(
        self,
        ys: list[int],
        drafts: list[list[int]],
        accepted: list[int],
        previous: list[Any],
        reports: list[list[Any]],
    ) -> list[Any]:
        """Each row's emitted tokens (its input, then its accepted draft) as responses, ending
        a row at its stop token or max_tokens as `GenerationBatch.next` does; rows that ended
        leave the batch."""
        counts = self.generated_counts()
        responses, keep = [], []
        for i, uid in enumerate(self.uids):
            emitted = [ys[i], *drafts[i][: accepted[i]]]
            lazy = [previous[i] if i < len(previous) else None, *reports[i][: accepted[i]]]
            logprobs = read_logprobs(lazy)
            tokens = self.tokens[i]
            base = len(tokens)
            tokens.extend(emitted)
            finish = None
            for e, token in enumerate(emitted):
                counts[i] += 1
                finish = finish_reason(self.stop_matcher(i), token, counts[i], self.max_tokens[i])
                if finish is not None:
                    responses.append(
                        self.Response(
                            uid,
                            token,
                            logprobs[e],
                            finish,
                            self.extract_cache(i),
                            tokens[: base + e + 1],
                        )
                    )
                    break
                responses.append(self.Response(uid, token, logprobs[e], None, None, None))
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


@dataclass
class _Chunk:
    """One prefill chunk of the cohort, its inputs built and its caches prepared."""

    inputs: mx.array  # (rows, longest), right-padded
    lengths: list[int]
    padding: list[int]
    progress: PrefillProgress
    last_hidden: mx.array | None = None  # each row's hidden state at its last chunk token


class _SplitHeadPrefill:
    """Prefill when the output head splits from the backbone: the chunk runs through the
    backbone only, and a row whose prompt is done samples its first token from the hidden
    state at its last position (`BatchRunner._finish_chunk`)."""

    keep_last = 0  # the whole prompt is computed here

    def __init__(self, backbone: Any, head: Any) -> None:
        self.backbone = backbone
        self.head = head

    def run(self, runner: BatchRunner, progress: PrefillProgress) -> None:
        batch = runner._prefill
        assert batch is not None
        chunk = runner._prepare_chunk(batch, runner._plan_chunk(batch, progress), progress)
        hidden = self.backbone(chunk.inputs, cache=batch.prompt_cache)
        chunk.last_hidden = runner._last_positions(hidden, chunk.lengths)
        runner._finish_chunk(chunk)

    def first_tokens(
        self, batch: PromptProcessingBatch, done: list[int], last_hidden: mx.array
    ) -> tuple[mx.array, list[RowLogprobs | None]]:
        """The first token of each row in `done` (indices into `batch`), sampled from the head
        at its last prompt position, evaluated; with each row's logprobs report."""
        logits = self.head(last_hidden[mx.array(done)][:, None, :])[:, -1, :]
        sampled = [
            sample_row(
                logits[j : j + 1], batch.samplers[i], batch.logits_processors[i], batch.tokens[i]
            )
            for j, i in enumerate(done)
        ]
        first = mx.concatenate([token for token, _ in sampled])
        reports = [report for _, report in sampled]
        mx.eval(first, [r for r in reports if r is not None])
        return first, read_logprobs(reports)


class _GenericPrefill:
    """mlx-lm's own path (the head does not split): `PromptProcessingBatch.prompt` runs all
    but the last prompt token; a row with only that token left joins the decode batch, which
    feeds it (`BatchRunner._graduate`), and its first token comes out of the next decode."""

    keep_last = 1  # the last prompt token is fed by GenerationBatch

    def run(self, runner: BatchRunner, progress: PrefillProgress) -> None:
        runner._graduate(progress)
        batch = runner._prefill
        if batch is not None:
            batch.prompt(runner._plan_chunk(batch, progress))
            runner._graduate(progress)


class BatchRunner:
    """Batched prefill of one cohort at a time plus batched decode of every running row.

    A step is `decode()` then `prefill_chunk()`. With a packed forward (`packed`: the model's
    structure is one `PackedForward` handles, and its head splits) and both decoding rows and a
    cohort, `decode()` queues ONE forward for the decode rows and the cohort's chunk and
    `prefill_chunk()` finishes that chunk; otherwise each runs its own forward. `step_tokens`
    bounds a step's tokens: the decoding rows first (one each), the cohort's chunk fills the
    rest (rows x longest, at least one token per cohort row), never more than `chunk_size`
    tokens per row.
    """

    def __init__(
        self, model: Any, chunk_size: int, split_head: bool = True, packed: bool = True
    ) -> None:
        self.model = model
        self.chunk_size = chunk_size
        self.step_tokens: int | None = None  # None: no step budget, `chunk_size` per row
        self._prefill: PromptProcessingBatch | None = None
        self._uid_to_remaining: dict[str, list[int]] = {}
        self._decode = RowBatch.empty(model, greedy_sampler)
        self._num_decode_steps = 0
        self._split = detect_head(model) if split_head else None
        self._mode: _SplitHeadPrefill | _GenericPrefill = (
            _SplitHeadPrefill(*self._split) if self._split is not None else _GenericPrefill()
        )
        self._packed = PackedForward.for_model(model) if packed and self._split else None
        self._pending: _Chunk | None = None  # the chunk queued with this step's decode forward
        self._step_decode_rows = 0  # rows the current step's decode forward computes
        self.num_packed_steps = 0  # steps whose decode rows and prefill chunk ran as one forward
        self.keep_prompt_kv = False  # hand each finished prompt's KV out (the prompt cache)
        # the engine's, each step: rows are about to join the decode batch (requests waiting,
        # or a cohort prefilling), so rows leaving it keep their slots for them (`RowBatch`)
        self.expect_joins = False
        self._vacant_steps = 0  # decode steps the current vacancies have waited
        # speculative decoding (speculative.py): None when off
        self.speculation: SpecPolicy | None = None
        # the draft model (`--speculative draft`, draft_model.py): drafts instead of prompt
        # lookup while the policy's mode is "draft"; None without a draft model
        self.drafter: DraftModel | None = None
        # (rows, width, start, tokens emitted) of the last decode step
        self._last_step: tuple[int, int, float, int] | None = None
        self._step_had_prefill = False
        if self._packed is not None:
            log.info("engine step: one packed forward for decode rows and the prefill chunk")
        else:
            why = "disabled" if not packed else "model structure or head not supported"
            log.info("engine step: two forwards (decode, then prefill chunk): packed %s", why)

    @property
    def packed(self) -> bool:
        """Whether steps with decode rows and a prefill chunk run one forward."""
        return self._packed is not None

    @property
    def prefill_uids(self) -> list[str]:
        return list(self._prefill.uids) if self._prefill is not None else []

    @property
    def decode_uids(self) -> list[str]:
        return self._decode.members

    @property
    def tokens_after_chunk(self) -> bool:
        packed = self._packed
        return self._pending is not None and packed is not None and packed.ran_native

    def start_cohort(self, rows: Sequence[RowSpec]) -> None:
        if self._prefill is not None:
            raise RuntimeError("a prefill cohort is already running")
        caches = [
            roomy_caches(
                self.model,
                r.cached_payload.prefix_caches(len(r.cached_tokens))
                if r.cached_payload is not None
                else None,
                len(r.compute_tokens),
            )
            for r in rows
        ]
        with mx.stream(generation_stream):
            self._prefill = PromptProcessingBatch(
                self.model,
                [r.uid for r in rows],
                caches,
                tokens=[list(r.cached_tokens) for r in rows],
                prefill_step_size=self.chunk_size,
                samplers=[make_row_sampler(r.sampling, r.constraint) for r in rows],
                fallback_sampler=greedy_sampler,
                logits_processors=[make_row_processors(r.sampling) for r in rows],
                stop_sequences=[stop_sequences(r) for r in rows],
                max_tokens=[r.max_tokens for r in rows],
            )
        for r in rows:
            self._uid_to_remaining[r.uid] = list(r.compute_tokens)

    def prefill_chunk(self) -> PrefillProgress:
        """One chunk for every row of the cohort; rows whose prompt is done move to decode.
        After a packed `decode()`, finishes the chunk that ran in its forward."""
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            with mx.stream(generation_stream):
                self._finish_chunk(chunk)
            return chunk.progress
        progress = PrefillProgress()
        if self._prefill is not None:
            with mx.stream(generation_stream):
                self._mode.run(self, progress)
        return progress

    def _plan_chunk(
        self, batch: PromptProcessingBatch, progress: PrefillProgress
    ) -> list[list[int]]:
        """Each row's next chunk under the step budget (the decode rows already counted)."""
        keep_last = self._mode.keep_last
        per_row = self.chunk_size
        if self.step_tokens:
            room = self.step_tokens - self._step_decode_rows
            per_row = min(per_row, max(1, room // len(batch.uids)))
        chunks = []
        for uid in batch.uids:
            remaining = self._uid_to_remaining[uid]
            n = min(per_row, len(remaining) - keep_last)
            chunks.append(remaining[:n])
            self._uid_to_remaining[uid] = remaining[n:]
            progress.uid_to_computed[uid] = n
        progress.padded_tokens += len(chunks) * max(len(c) for c in chunks)
        return chunks

    def _prepare_chunk(
        self, batch: PromptProcessingBatch, chunks: list[list[int]], progress: PrefillProgress
    ) -> _Chunk:
        """As `PromptProcessingBatch.prompt` before its forward: tokens recorded, the caches
        told about the right padding, the padded inputs built."""
        for tokens, chunk in zip(batch.tokens, chunks, strict=True):
            tokens += chunk
        lengths = [len(c) for c in chunks]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        if max(padding):
            for c in batch.prompt_cache:
                c.prepare(lengths=lengths, right_padding=padding)
        inputs = mx.array([c + [0] * (longest - len(c)) for c in chunks])
        return _Chunk(inputs, lengths, padding, progress)

    @staticmethod
    def _last_positions(hidden: mx.array, lengths: list[int]) -> mx.array:
        return hidden[mx.arange(len(lengths)), mx.array([max(n - 1, 0) for n in lengths])]

    def _finish_chunk(self, chunk: _Chunk) -> None:
        """After the chunk's forward: caches evaluated and their padding rolled left; rows
        whose prompt is done sample their first token and move to decode."""
        batch = self._prefill
        assert batch is not None and chunk.last_hidden is not None
        caches = batch.prompt_cache
        mx.eval(chunk.last_hidden, [c.state for c in caches])
        if max(chunk.padding):
            for c in caches:
                c.finalize()
            mx.eval([c.state for c in caches])
        mx.clear_cache()
        done = [i for i, uid in enumerate(batch.uids) if not self._uid_to_remaining[uid]]
        if done:
            self._start_decoding(batch, done, chunk.last_hidden, chunk.progress)

    def _start_decoding(
        self,
        batch: PromptProcessingBatch,
        done: list[int],
        last_hidden: mx.array,
        progress: PrefillProgress,
    ) -> None:
        """Sample the first token of rows whose prompt is done; move the rows to decode."""
        assert isinstance(self._mode, _SplitHeadPrefill)
        first, first_logprobs = self._mode.first_tokens(batch, done, last_hidden)
        firsts = first.tolist()
        uids = [batch.uids[i] for i in done]
        for uid in uids:
            del self._uid_to_remaining[uid]
        rows = batch if len(done) == len(batch.uids) else batch.split(done)
        if rows is batch:
            self._prefill = None
        ended = self._report_first_tokens(rows, uids, firsts, first_logprobs, progress)
        progress.graduated.extend(uids)
        going = [j for j in range(len(uids)) if j not in ended]
        if not going:
            return
        if ended:
            rows.filter(going)
            first = first[mx.array(going)]
        # The first token is already out: one fewer to generate.
        if self._join_decode(rows, first, [m - 1 for m in rows.max_tokens]):
            progress.settle = self._evaluate_decode_kv

    def _report_first_tokens(
        self,
        rows: PromptProcessingBatch,
        uids: list[str],
        firsts: list[int],
        first_logprobs: list[RowLogprobs | None],
        progress: PrefillProgress,
    ) -> list[int]:
        """Each row's first token into `progress` (a row that ends on it hands over its KV;
        one that goes on offers its prompt KV to the cache); returns the rows that ended."""
        ended = []
        for j, (uid, token) in enumerate(zip(uids, firsts, strict=True)):
            finish = finish_reason(rows.stop_sequences[j].matcher(), token, 1, rows.max_tokens[j])
            if finish is not None:
                ended.append(j)
                caches = rows.extract_cache(j)
                progress.first_tokens.append(
                    DecodeOutput(
                        uid, token, finish, list(rows.tokens[j]), caches, first_logprobs[j]
                    )
                )
            else:
                progress.first_tokens.append(
                    DecodeOutput(uid, token, None, None, None, first_logprobs[j])
                )
                if self.keep_prompt_kv:
                    progress.prompt_kv.append((uid, list(rows.tokens[j]), rows.extract_cache(j)))
        return ended

    def _join_decode(self, rows: Any, inputs: mx.array, max_tokens: list[int]) -> bool:
        """Prefilled rows join the decode batch with `inputs` as their next input tokens;
        True when they joined running rows (a merged cache, not yet evaluated).

        Joining rows to running ones copies every layer's keys and values into one merged
        cache (`BatchKVCache.extend`, ~130 ms for 8 SmolLM2 rows of 350 tokens on a 2-core
        CPU). It is evaluated in the step that ran the prefill (long already), rather than in
        the next decode step, which would stall every decoding row once more; after the joining
        rows' first tokens are out (`PrefillProgress.settle`) when they have one, so the copy
        is not in their time to first token."""
        merging = len(self._decode) > 0
        joining = RowBatch(
            self.model,
            rows.uids,
            inputs,
            rows.prompt_cache,
            rows.tokens,
            rows.samplers,
            greedy_sampler,
            rows.logits_processors,
            rows.stop_sequences,
            max_tokens,
        )
        placed = self._decode.fill(joining)
        if len(placed) < len(joining):
            if placed:
                joining.filter([j for j in range(len(joining)) if j not in placed])
            self._decode.extend(joining)
        return merging

    def _evaluate_decode_kv(self) -> None:
        # a layer at a time: each layer's pre-merge arrays are freed before the next layer's
        # merged ones are made (all at once, the peak held both for every layer: +54 MiB of
        # 8 qwen3-1.7B rows of 256 columns, two cohorts of 4 merging)
        with mx.stream(generation_stream):
            for c in self._decode.prompt_cache:
                mx.eval(c.state)

    def _graduate(self, progress: PrefillProgress) -> None:
        """Generic path: rows with only their last prompt token left start decoding (its
        forward runs now; the first token comes out of the next `decode()`)."""
        batch = self._prefill
        assert batch is not None
        done = [i for i, uid in enumerate(batch.uids) if len(self._uid_to_remaining[uid]) == 1]
        if not done:
            return
        uids = [batch.uids[i] for i in done]
        if self.keep_prompt_kv:  # all but the last prompt token, whose forward runs next
            for i in done:
                progress.prompt_kv.append(
                    (batch.uids[i], list(batch.tokens[i]), batch.extract_cache(i))
                )
        last = [self._uid_to_remaining.pop(uid) for uid in uids]
        if len(done) == len(batch.uids):
            rows = batch
            self._prefill = None
        else:
            rows = batch.split(done)
        # As PromptProcessingBatch.generate, with our step: the forward of the last prompt token
        # runs now (the grammar does not consume a prompt token: pending_accept stays False).
        if self._join_decode(rows, mx.array([t[-1] for t in last]), rows.max_tokens):
            self._evaluate_decode_kv()  # no first token this step: nothing to wait for
        for uid in uids:
            progress.uid_to_computed[uid] = progress.uid_to_computed.get(uid, 0) + 1
        progress.padded_tokens += len(uids)
        progress.graduated.extend(uids)

    def decode(self, hold: bool = False) -> list[DecodeOutput]:
        """The tokens of the previous decode forward; queues the next one (packed with the
        cohort's next chunk when the model has a packed forward). With `hold` the decode rows
        sit this step out and the chunk gets the step's whole budget. With speculation on and
        no cohort prefilling, rows may verify drafted tokens instead (`_speculate`): a row
        then gets several tokens, in order, in the list."""
        self._settle_vacancies()
        self._step_decode_rows = 0 if hold else len(self._decode)
        self._time_step(0 if hold else len(self._decode))
        if hold or not self._decode.members:
            return []
        with mx.stream(generation_stream):
            if self._prefill is None and self.speculation is not None:
                responses = self._speculate()
                if responses is not None:
                    return self._outputs(responses)
            if self._packed is not None and self._prefill is not None:
                progress = PrefillProgress()
                chunks = self._plan_chunk(self._prefill, progress)
                self._pending = self._prepare_chunk(self._prefill, chunks, progress)
                self._decode.packed = self._packed_logits
                self.num_packed_steps += 1
            try:
                responses = self._decode.next()
            finally:
                self._decode.packed = None
        return self._outputs(responses)

    def _settle_vacancies(self) -> None:
        """Whether rows leaving this step keep their slots (`RowBatch.hold_vacancies`): while
        rows are about to join (`expect_joins`, the engine's) and no draft model keeps rows in
        the batch's order; vacancies no join took within `MAX_VACANT_STEPS` steps, or with
        none coming, are compacted."""
        batch = self._decode
        batch.hold_vacancies = self.expect_joins and self.drafter is None
        if VACANT not in batch.uids:
            self._vacant_steps = 0
            return
        self._vacant_steps += 1
        speculating = self._prefill is None and self.speculation is not None
        if not batch.hold_vacancies or speculating or self._vacant_steps > MAX_VACANT_STEPS:
            batch.compact()
            self._vacant_steps = 0

    def _outputs(self, responses: list[Any]) -> list[DecodeOutput]:
        self._num_decode_steps += 1
        if any(r.finish_reason for r in responses):
            # the period to the next step may hold the engine's idle wait for new work, not
            # this step's compute: it is not timed
            self._last_step = None
            if self.drafter is not None:
                self.drafter.keep_only(self._decode.uids)  # finished rows' draft KV is freed
        if self._num_decode_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()  # return freed buffers now and then, as mlx-lm's BatchGenerator does
        return [
            DecodeOutput(
                r.uid,
                r.token,
                r.finish_reason,
                kv_tokens=list(r.all_tokens) if r.finish_reason else None,
                kv_caches=r.prompt_cache,
                logprobs=r.logprobs,
            )
            for r in responses
        ]

    def _time_step(self, rows: int) -> None:
        """The period since the last decode step, to the speculation policy: for a step that
        only decoded (no prefill chunk, nobody held), as a plain step or a verification."""
        now = time.perf_counter()
        last, self._last_step = self._last_step, None
        policy = self.speculation
        if policy is None:
            return
        if last is not None and not self._step_had_prefill:
            last_rows, width, started, tokens = last
            policy.record_period(last_rows, width, now - started, tokens)
        self._step_had_prefill = self._prefill is not None
        if rows:
            self._last_step = (rows, 1, now, rows)

    def _speculate(self) -> list[Any] | None:
        """A verification step when the policy finds one worth it (None: decode plainly)."""
        policy, batch = self.speculation, self._decode
        assert policy is not None
        uids = batch.uids
        policy.keep_only(uids)
        if self.drafter is not None:
            self.drafter.keep_only(uids)
        if not policy.worth_trying(uids):
            return None
        if any(type(c) is not BatchKVCache for c in batch.prompt_cache):
            return None
        pending, _ = batch.pending_inputs()
        mx.eval(pending)
        ys = pending.tolist()
        counts = batch.generated_counts()
        # what each row may draft: none past its max_tokens (the pending input is one more
        # token) or when it opted out
        rooms = [
            0
            if not batch.samplers[i].params.speculative
            else max(batch.max_tokens[i] - counts[i] - 1, 0)
            for i in range(len(uids))
        ]
        drafter = self.drafter if policy.mode == "draft" else None
        if drafter is not None:
            drafts = self._model_drafts(drafter, policy, ys, rooms)
            if drafts is None:
                return None
        else:
            drafts = self._lookup_drafts(policy, ys, rooms)
        width = policy.plan(uids, drafts)
        if width <= 1:
            return None
        drafts = [d[: width - 1] for d in drafts]
        responses, accepted = batch.verify_step(drafts)
        policy.counters.steps += 1
        for uid, draft, a in zip(uids, drafts, accepted, strict=True):
            policy.record(uid, len(draft), a)
        if self._last_step is not None:
            emitted = len(uids) + sum(accepted)
            self._last_step = (len(uids), width, self._last_step[2], emitted)
        return responses

    def _lookup_drafts(
        self, policy: SpecPolicy, ys: list[int], rooms: list[int]
    ) -> list[list[int]]:
        """Each row's prompt-lookup draft (speculative.py's `NgramIndex`)."""
        batch = self._decode
        drafts: list[list[int]] = []
        for i, uid in enumerate(batch.uids):
            if rooms[i] <= 0:
                drafts.append([])
                continue
            state = policy.row(uid)
            state.index.sync(batch.tokens[i])
            state.index.append(ys[i])
            draft = state.index.draft(min(state.k, rooms[i]))
            state.looked_up(bool(draft))
            drafts.append(draft)
        return drafts

    def _model_drafts(
        self, drafter: DraftModel, policy: SpecPolicy, ys: list[int], rooms: list[int]
    ) -> list[list[int]] | None:
        """Each row's draft from the draft model, as long as the policy's width makes worth
        it (planned before drafting: the draft model's forwards cost time whatever happens
        to its tokens); None when no width pays."""
        batch = self._decode
        uids = batch.uids
        lengths = [min(policy.row(u).k, room) for u, room in zip(uids, rooms, strict=True)]
        width = policy.width_for(uids, lengths)
        if width <= 1:
            return None
        lengths = [min(n, width - 1) for n in lengths]
        contexts = [[*batch.tokens[i], ys[i]] for i in range(len(uids))]
        drafts = drafter.draft(uids, contexts, lengths)
        for uid, n in zip(uids, lengths, strict=True):
            if n:
                policy.row(uid).looked_up(True)
        return drafts

    def _packed_logits(self, inputs: mx.array, caches: list[Any]) -> mx.array:
        """The decode rows' last logits from one forward that also runs the pending chunk."""
        chunk, batch = self._pending, self._prefill
        assert chunk is not None and batch is not None and self._packed is not None
        decode_hidden, chunk_hidden = self._packed(inputs, caches, chunk.inputs, batch.prompt_cache)
        chunk.last_hidden = self._last_positions(chunk_hidden, chunk.lengths)
        assert isinstance(self._mode, _SplitHeadPrefill)
        return self._mode.head(decode_hidden)[:, -1, :]

    def remove(self, uid: str) -> bool:
        """Drop a row wherever it is; True when it was found."""
        if self._prefill is not None and uid in self._prefill.uids:
            keep = [i for i, u in enumerate(self._prefill.uids) if u != uid]
            self._uid_to_remaining.pop(uid, None)
            if keep:
                self._prefill.filter(keep)
            else:
                self._prefill = None
            return True
        if uid in self._decode.uids:
            self._decode.leave([self._decode.uids.index(uid)])
            if self.drafter is not None:
                self.drafter.keep_only(self._decode.uids)
            return True
        return False

    def decode_kv(self, uid: str) -> list[Any] | None:
        """A decoding row's caches: its prompt and every token it produced (each emitted
        token's forward is queued before the token goes out)."""
        if uid not in self._decode.uids:
            return None
        return self._decode.extract_cache(self._decode.uids.index(uid))

    def kv_payload(self, caches: list[Any], num_tokens: int) -> KVPayload:
        """The first `num_tokens` of `caches` (a row's per-layer caches), copied for the
        prompt cache."""
        return KVPayload.from_caches(caches, num_tokens)

    def reset(self) -> None:
        """Forget every row (after a failed step)."""
        self._prefill = None
        self._pending = None
        self._uid_to_remaining.clear()
        self._decode = RowBatch.empty(self.model, greedy_sampler)
        self._last_step = None
        if self.speculation is not None:
            self.speculation.reset()
        if self.drafter is not None:
            self.drafter.reset()
        restore_random_state()
