"""The engine loop: one `step()` = schedule → execute → update (after vLLM v1).

Runs on the engine thread only (see bridge.py). Each step admits a new prefill cohort when
none is running, runs one decode step for every decoding row and one prefill chunk for the
cohort, then emits tokens, finishes sequences (KV → prompt cache), frees KV and publishes an
immutable snapshot.

Why one module: `Engine` is the step's transaction over one state (waiting, running, the KV
budget, the prompt cache, the runner); the policies it applies are already modules of their own
(`scheduler.py`, `admission.py`, `kv_budget.py`, `prefix_cache.py`, `lanes.py`,
`effective_config.py`, `snapshot_builder.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxcel.daemon.engine.admission import check_request
from mlxcel.daemon.engine.constraints import GrammarCache, GrammarError, ReasoningGate
from mlxcel.daemon.engine.disk_cache import CHUNK_TOKENS as DISK_CHUNK_TOKENS
from mlxcel.daemon.engine.effective_config import (
    apply_change,
    default_prompt_cache_bytes,
    effective_config,
)
from mlxcel.daemon.engine.kv_budget import KVBudget, resolve_budget_bytes
from mlxcel.daemon.engine.lanes import DEFAULT_AGING_S, lane_rank, queue_order
from mlxcel.daemon.engine.prefix_cache import PrefixCache
from mlxcel.daemon.engine.runner_api import (
    DecodeOutput,
    EmbeddingUnsupported,
    ModelProbe,
    PrefillProgress,
    RowSpec,
    Runner,
    speculation_of,
)
from mlxcel.daemon.engine.scheduler import WaitingView, plan_admission
from mlxcel.daemon.engine.snapshot_builder import build_snapshot
from mlxcel.daemon.engine.speculative import SpecPolicy
from mlxcel.daemon.engine.stats import EngineStats
from mlxcel.daemon.engine.types import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_STOP,
    FINISH_TIMEOUT,
    AdmissionRejected,
    GenerationRequest,
    TokenOutput,
)
from mlxcel.shared.config import KV_BLOCK_SIZE, ServingConfig
from mlxcel.shared.protocol import EV_CACHE_RESET, EV_CONFIG, EV_FINISHED
from mlxcel.shared.snapshot import ConfigChange, EngineSnapshot, cache_kind

if TYPE_CHECKING:
    from mlxcel.daemon.engine.embedder import Embedder  # imports mlx: annotations only

log = logging.getLogger("mlxcel.engine")

MAX_KV_OFFERS = 16  # finished sequences whose KV copy for the prompt cache may wait
MAX_KV_OFFER_BYTES = 512 << 20  # the decode-batch caches that waiting copies keep alive
# embeddings (embedder.py): a batch runs in a step without a prefill chunk, or after this many
# steps in a row that had one; and computes at least this many tokens whatever decodes
EMBED_MAX_WAIT_STEPS = 4
# a prefill of a higher lane runs without the lower lanes' decode rows at most this many steps
# in a row (docs/tuning.md, "Priority lanes"): a long high prompt cannot stall them for long
MAX_HELD_STEPS = 4
EMBED_MIN_BUDGET = 32

OutputSink = Callable[[str, TokenOutput], None]
EventSink = Callable[[str, dict[str, Any]], None]


@dataclass
class Sequence:
    """One request's life in the engine (engine thread only)."""

    request: GenerationRequest
    arrival: float
    state: str = "waiting"  # waiting | prefill | decode
    slot: int = -1
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated: int = 0
    kv_blocks: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    wait_reason: str = "prefill_cap"
    block_hashes: list[int] | None = None  # the prompt's chain hashes, computed once
    # the disk tier (disk_cache.py): "" not looked up | reading | done; what a read brought
    disk_state: str = ""
    disk_tokens: int = 0
    disk_payload: Any = None
    deadline: float | None = None  # the clock time it ends with FINISH_TIMEOUT (engine/lanes.py)
    # preemption (engine/lanes.py): the tokens emitted so far, and the request as it came in
    # (`request` is then that request continued: its prompt + those tokens, fewer max_tokens)
    output_ids: list[int] = field(default_factory=list)
    original: GenerationRequest | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def usage_prompt_len(self) -> int:
        """The prompt the client sent (a resumed request's own prompt is longer)."""
        return len((self.original or self.request).prompt_ids)

    def output(
        self,
        token: int | None,
        finish: str | None = None,
        error: str | None = None,
        logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None,
    ):
        logprob, top = logprobs if logprobs is not None and token is not None else (None, ())
        prompt = self.usage_prompt_len
        cached = min(self.cached_tokens, prompt)
        return TokenOutput(token, finish, prompt, cached, self.generated, error, logprob, top)


def _share_gap(gaps: list[float], start: int) -> None:
    """`gaps[start:]` are one row's tokens of this step: the first holds the gap since its last
    token, the others 0; each gets an equal share (its time per token)."""
    n = len(gaps) - start
    if n > 1:
        share = sum(gaps[start:]) / n
        gaps[start:] = [share] * n


def _resumable(seq: Sequence) -> bool:
    """Whether a row resumed from its tokens gives what it would have: no grammar or
    reasoning state to carry over (a seeded row's random stream resumes: `seed_draws`)."""
    sp = seq.request.sampling
    return sp.json_schema is None and sp.reasoning is None


class Engine:
    # A distributed group's lockstep cannot run a forward on one rank alone.
    serves_embeddings = True
    # Lanes, deadlines and preemption decide on rank 0's clock and fields the other ranks do not
    # see: a distributed group serves its queue FIFO and leaves timeouts to nobody.
    local_policy = True

    def __init__(
        self,
        model: Any,
        config: ServingConfig,
        can_batch: bool = True,
        batch_reason: str | None = None,
        context_length: int | None = None,
        *,
        available_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        split_head: bool = True,
        tokenizer: Any | None = None,
        packed: bool | None = None,
        runner: Runner | None = None,
        probe: ModelProbe | None = None,
        disk_tier: Any | None = None,
        draft: Any | None = None,
    ) -> None:
        """`runner` and `probe` default to the mlx ones for `model` (mlx_parts.py); with
        both injected, and `available_bytes`, the engine runs without mlx. `disk_tier` (a
        disk_cache.DiskTier) keeps the prompt cache's entries on disk too. `draft`: a draft
        model of the same tokenizer (its mlx module) for `speculative = draft`."""
        self.model = model
        self.config = config
        self.can_batch = can_batch
        self.batch_reason = batch_reason
        self.context_length = context_length
        self.clock = clock
        if runner is None or probe is None or available_bytes is None:
            from mlxcel.daemon.engine import mlx_parts as mlx_runtime  # the default, mlx parts

            if available_bytes is None:
                available_bytes = mlx_runtime.available_bytes(model, config.parallel)
            if probe is None:
                probe = mlx_runtime.probe(model)
            if runner is None:
                runner = mlx_runtime.make_runner(
                    model,
                    config,
                    can_batch=can_batch,
                    split_head=split_head,
                    packed=packed,
                    draft=draft,
                    vocab_size=probe.vocab_size,
                )
        # whether `speculative = draft` can run: the runner holds a draft model
        self.has_draft = getattr(runner, "drafter", None) is not None
        self.vocab_size = probe.vocab_size
        # JSON-schema grammars by schema text (needs the model's tokenizer)
        self.grammars = GrammarCache(tokenizer, probe.vocab_size)
        bytes_per_block = probe.kv_bytes_per_token * KV_BLOCK_SIZE
        budget = resolve_budget_bytes(config.kv_cache_budget, available_bytes)
        self.kv = KVBudget.from_budget(budget, bytes_per_block)
        cache_bytes = config.prompt_cache_bytes
        if cache_bytes is None:
            cache_bytes = default_prompt_cache_bytes(available_bytes)
        self.effective = self._effective(cache_bytes)
        self.prefix_cache = PrefixCache(cache_bytes, KV_BLOCK_SIZE, self.effective.prompt_cache)
        self.runner: Runner = runner
        self.runner.keep_prompt_kv = self.effective.prompt_cache
        self.disk: Any = None
        # a disk read finished: the engine thread wakes (the bridge sets this) and takes it
        self.on_wake: Callable[[], None] = lambda: None
        self.attach_disk_tier(disk_tier)
        self.stats = EngineStats(clock)
        self.waiting: deque[Sequence] = deque()
        self._deadlines: dict[str, Sequence] = {}  # requests with a deadline, waiting or running
        self.running: dict[str, Sequence] = {}
        self.on_output: OutputSink = lambda rid, out: None
        self.on_event: EventSink = lambda name, data: None
        # called after each flush: the bridge hands what the step produced so far to the loop
        self.on_flush: Callable[[], None] = lambda: None
        self.shutting_down = False
        self._finals: list[tuple[str, TokenOutput, dict[str, Any]]] = []
        # finished sequences' KV offered to the prompt cache, copied at the next step that
        # stalls nobody (`_settle_kv_offers`)
        self._kv_offers: list[tuple[list[int], list[Any]]] = []
        self._kv_offer_step = -1  # the last step that added an offer
        self._kv_offers_bytes = 0  # what the waiting offers keep alive (an upper bound)
        self._held_steps = 0  # steps in a row the decode rows sat out for a higher-lane prefill
        self._embedder: Embedder | None = None  # built at the first embedding request
        self._embed_refusal: str | None = None  # why this model serves no embeddings
        self._embed_waited = 0  # steps in a row whose prefill chunk made the embeddings wait
        self._snapshot = self._build_snapshot()

    def attach_disk_tier(self, disk_tier: Any | None) -> None:
        """Keep the prompt cache on disk too (a disk_cache.DiskTier; before the engine runs)."""
        self.disk = disk_tier
        if disk_tier is not None:
            disk_tier.on_read_done = lambda: self.on_wake()

    def _effective(self, prompt_cache_bytes: int):
        return effective_config(
            self.config,
            can_batch=self.can_batch,
            batch_reason=self.batch_reason,
            context_length=self.context_length,
            prompt_cache_bytes=prompt_cache_bytes,
            kv_budget_bytes=self.kv.budget_bytes,
            has_draft=self.has_draft,
        )

    # -- thread-safe reads ------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        """Something to step for; requests that only wait for their disk reads are not (the
        read's end wakes the engine thread)."""
        if self.running or self.num_embedding_jobs:
            return True
        if self.disk is not None and self.disk.has_reads:
            return True  # a finished read to hand to its request
        return any(seq.disk_state != "reading" for seq in self.waiting)

    @property
    def reading_disk(self) -> bool:
        """Some waiting request waits for its prefix from the disk tier."""
        return any(seq.disk_state == "reading" for seq in self.waiting)

    @property
    def num_embedding_jobs(self) -> int:
        """Embedding requests queued or computing (any thread: a length read)."""
        embedder = self._embedder
        return len(embedder.jobs) if embedder is not None else 0

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def check_admission(self, request: GenerationRequest, num_waiting: int) -> None:
        """Raise AdmissionRejected for a request that must not be queued (any thread)."""
        check_request(
            request,
            self.effective,
            self.kv,
            vocab_size=self.vocab_size,
            num_waiting=num_waiting,
            shutting_down=self.shutting_down,
        )
        schema = request.sampling.json_schema
        if schema is not None:
            try:
                self.grammars.compile(schema)  # compiled here, off the engine thread, and cached
            except GrammarError as exc:
                raise AdmissionRejected("invalid_request", str(exc)) from None

    # -- commands (engine thread) --------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        seq = Sequence(request, self.clock())
        timeout = request.timeout_s or getattr(self.config, "request_timeout", None)
        if timeout:
            seq.deadline = seq.arrival + timeout
            self._deadlines[request.request_id] = seq
        schema = request.sampling.json_schema
        if schema is not None:
            try:
                self.grammars.compile(schema)  # cached when it came through the bridge
            except GrammarError as exc:
                self._finish(seq, FINISH_ERROR, None, error=str(exc))
                return
        self.waiting.append(seq)

    def abort(self, request_id: str, reason: str = FINISH_ABORT, error: str | None = None) -> bool:
        """Cancel a waiting or running request; its slot and KV are free on return."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._finish(seq, reason, None, error=error)
                return True
        running = self.running.get(request_id)
        if running is None:
            return False
        self.runner.remove(request_id)
        self._finish(running, reason, None, error=error)
        return True

    def abort_all(self, reason: str = FINISH_ABORT) -> None:
        for seq in list(self.waiting) + list(self.running.values()):
            self.abort(seq.request_id, reason)
        if self._embedder is not None:
            self._embedder.fail_all(AdmissionRejected("shutting_down", "the engine stopped"))

    def add_embedding(self, inputs: list[list[int]], future: Any) -> None:
        """Queue the token lists of one embedding request; `future` (a concurrent.futures
        Future) gets their vectors, an (n, width) float32 array, or the error. The batches run
        in `step` (`_embed_turn`)."""
        if not self.serves_embeddings:
            self._embed_refusal = "a distributed group serves no embeddings"
        if self._embedder is None and self._embed_refusal is None:
            # the one mlx import of this module, at the first embedding request
            from mlxcel.daemon.engine.embedder import Embedder

            try:
                self._embedder = Embedder(self.model, self.can_batch)
            except EmbeddingUnsupported as exc:
                self._embed_refusal = str(exc)
        if self._embedder is None:
            if not future.cancelled() and future.set_running_or_notify_cancel():
                future.set_exception(EmbeddingUnsupported(self._embed_refusal))
            return
        self._embedder.add(inputs, future)

    def reconfigure(self, changes: dict[str, Any]) -> list[ConfigChange]:
        results = []
        for name, value in changes.items():
            self.config, change = apply_change(
                self.config,
                self.effective,
                name,
                value,
                can_batch=self.can_batch,
                has_draft=self.has_draft,
            )
            self.effective = self._effective(self.effective.prompt_cache_bytes)
            if change.applied and change.key == "prompt_cache":
                self._drop_kv_offers()
                self.prefix_cache.set_enabled(self.effective.prompt_cache)
                self.kv.num_cached = self.prefix_cache.num_blocks
                self.runner.keep_prompt_kv = self.effective.prompt_cache
            if change.applied and change.key == "speculative":
                self._set_speculation(self.effective.speculative)
            results.append(change)
            log.info("config %s: %s", "applied" if change.applied else "refused", change)
            self.on_event(EV_CONFIG, change.to_dict())
        self._publish()
        return results

    def _set_speculation(self, mode: str) -> None:
        """The runner's speculation policy for `mode` (between steps): none when off, the same
        policy (its measured costs and rows) when the mode does not change, else a new one. A
        runner without the member (an injected one) is left alone."""
        runner = self.runner
        if not hasattr(runner, "speculation"):
            return
        current = runner.speculation
        if mode == "off":
            runner.speculation = None
        elif current is None or current.mode != mode:
            runner.speculation = SpecPolicy(mode)
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and mode != "draft":
            drafter.reset()  # its rows' draft KV is freed

    def reset_prompt_cache(self, tier: str = "all") -> dict[str, Any]:
        """Clear the RAM tier, and the disk tier too unless `tier` is "ram"."""
        self._drop_kv_offers()
        entries, freed = self.prefix_cache.clear()
        self.kv.num_cached = 0
        result: dict[str, Any] = {"entries_freed": entries, "bytes_freed": freed}
        if self.disk is not None:
            disk_entries, disk_bytes = self.disk.clear() if tier != "ram" else (0, 0)
            result["disk_entries_freed"], result["disk_bytes_freed"] = disk_entries, disk_bytes
        self.on_event(EV_CACHE_RESET, result)
        self._publish()
        return result

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> None:
        """One transaction: admit → decode → prefill chunk → an embedding batch → publish."""
        if self.disk is not None and self.disk.has_reads:
            self._take_disk_reads()  # also those whose request went away meanwhile
        if not (self.running or self.waiting):  # only embeddings to compute, if anything
            if self.num_embedding_jobs:
                self._embed_turn(prefilled=False)
            self._publish()
            self.flush()
            return
        prefilled = False
        if self._deadlines and self.local_policy:
            self._expire()
        try:
            self._expect_joins()  # a row preempted to make room keeps its slot for the row
            self._admit()
            self._expect_joins()  # rows ending this step keep theirs for those still to come
            outputs = self.runner.decode(hold=self._decode_yields())
            if self.runner.tokens_after_chunk:
                # A packed step whose decode rows were computed then and there: finishing the
                # chunk (caches evaluated, rows joining the decode batch) before their tokens go
                # out gives each of them one long gap this step, not a long one and then another
                # for the finishing. (A queued forward's tokens go out at once, as below.)
                progress = self.runner.prefill_chunk()
                self._apply_decode(outputs)
                self.flush()
            else:
                self._apply_decode(outputs)
                self.flush()  # finished requests hear it before the prefill chunk runs
                progress = self.runner.prefill_chunk()
            self._apply_prefill(progress)
            prefilled = bool(progress.uid_to_computed)
            self._settle_kv_offers(prefilled=prefilled)
        except Exception as exc:  # a failed forward must not take the engine down
            log.exception("engine step failed; failing the running requests")
            self._drop_kv_offers()
            self.runner.reset()
            for seq in list(self.running.values()):
                self._finish(seq, FINISH_ERROR, None, error=f"engine error: {exc}")
        self.stats.steps += 1
        if self.num_embedding_jobs:
            self._embed_turn(prefilled)
        self._publish()
        self.flush()

    def _expect_joins(self) -> None:
        """Tell the runner whether rows are about to join the decode batch (requests waiting,
        or a cohort prefilling): rows that leave it meanwhile keep their slots for them."""
        self.runner.expect_joins = bool(self.waiting) or bool(self.runner.prefill_uids)

    def _embed_turn(self, prefilled: bool) -> None:
        """One embedding batch within the step's token budget (`prefill_chunk_size` less the
        decoding rows, as a prefill chunk gets), so a decoding row's gap grows by at most what
        a chunk would add. A step that ran a prefill chunk already made its rows wait that
        long: the batch waits for the next step, `EMBED_MAX_WAIT_STEPS` at most in a row."""
        if prefilled and self._embed_waited < EMBED_MAX_WAIT_STEPS:
            self._embed_waited += 1
            return
        self._embed_waited = 0
        embedder = self._embedder
        if embedder is None:  # the callers ask for a turn only while it holds jobs
            return
        budget = self.effective.prefill_chunk_size - len(self.runner.decode_uids)
        embedder.run_batch(max(budget, EMBED_MIN_BUDGET))

    def flush(self) -> None:
        """Deliver the final outputs of finished requests, after a snapshot that shows them;
        then `on_flush` (every output so far leaves the engine thread)."""
        if self._finals:
            finals, self._finals = self._finals, []
            self._publish()
            for request_id, output, event in finals:
                self.on_output(request_id, output)
                self.on_event(EV_FINISHED, event)
        self.on_flush()

    def _expire(self) -> None:
        """End every request whose deadline passed, waiting or running: its slot and KV are
        free before this step admits anyone."""
        now = self.clock()
        for seq in [s for s in self._deadlines.values() if s.deadline and s.deadline <= now]:
            assert seq.deadline is not None  # the filter above
            timeout = seq.deadline - seq.arrival
            error = f"the request did not finish within its timeout ({timeout:g} s)"
            if not self.abort(seq.request_id, FINISH_TIMEOUT, error):
                self._deadlines.pop(seq.request_id, None)

    def _order_waiting(self) -> None:
        """Lanes first, then arrival, with aging (engine/lanes.py); FIFO when all share one."""
        lanes = {seq.request.lane for seq in self.waiting}
        if len(lanes) < 2 or not self.local_policy:
            return
        aging = float(getattr(self.config, "priority_aging", DEFAULT_AGING_S) or 0.0)
        seqs = list(self.waiting)
        order = queue_order([(s.request.lane, s.arrival) for s in seqs], self.clock(), aging)
        self.waiting = deque(seqs[i] for i in order)

    def _preempt_for(self, head: Sequence, free_slots: int) -> int:
        """Make room for `head` by preempting running requests of lower lanes (docs/tuning.md
        "Priority lanes"): a slot when none is free, and KV blocks when the budget cannot hold
        it; the most recently arrived of the lowest lane first, decoding ones whose resumption
        gives exactly their tokens. Nothing is preempted unless that makes room. Returns how
        many were."""
        if not getattr(self.config, "preemption", True) or not self.local_policy:
            return 0
        need_blocks = self.kv.blocks_for(head.prompt_len + head.request.max_tokens)
        free_blocks = self.kv.num_free_after_eviction
        short_blocks = 0 if free_blocks is None else max(need_blocks - free_blocks, 0)
        if free_slots and not short_blocks:
            return 0
        rank = lane_rank(head.request.lane)
        candidates = sorted(
            (
                seq
                for seq in self.running.values()
                if seq.state == "decode" and lane_rank(seq.request.lane) > rank and _resumable(seq)
            ),
            key=lambda s: (lane_rank(s.request.lane), s.arrival),
            reverse=True,
        )
        victims: list[Sequence] = []
        for seq in candidates:
            if (free_slots or victims) and short_blocks <= 0:
                break
            victims.append(seq)
            short_blocks -= self.kv.blocks_of(seq.request_id)
        if not victims or short_blocks > 0:
            return 0  # not enough to preempt: nobody is
        self._preempt_all(victims, head)
        return len(victims)

    def _decode_yields(self) -> bool:
        """Whether this step's decode rows sit out so that a prefill of a higher lane runs
        alone (its first token as soon as on an idle engine): every decoding row is of a lower
        lane than the cohort's best; at most `MAX_HELD_STEPS` steps in a row."""
        held = False
        cohort, decoding = self.runner.prefill_uids, self.runner.decode_uids
        if (
            cohort
            and decoding
            and self._held_steps < MAX_HELD_STEPS
            and self.local_policy
            and getattr(self.config, "preemption", True)
        ):
            lanes = {uid: lane_rank(seq.request.lane) for uid, seq in self.running.items()}
            best = min((lanes[uid] for uid in cohort if uid in lanes), default=None)
            held = best is not None and all(lanes[u] > best for u in decoding if u in lanes)
        self._held_steps = self._held_steps + 1 if held else 0
        return held

    def _preempt_cohort_for(self, head: Sequence) -> bool:
        """A higher-lane `head` does not wait for a prefill cohort of lower lanes to finish:
        the cohort's rows wait again (behind it) and their prefill is redone later. A row in
        prefill has sampled nothing since it was admitted, so it resumes exactly as any
        preempted row. False (nothing done) when a cohort row's lane is not below the head's."""
        if not getattr(self.config, "preemption", True) or not self.local_policy:
            return False
        rank = lane_rank(head.request.lane)
        cohort = [self.running[uid] for uid in self.runner.prefill_uids if uid in self.running]
        if not cohort or any(lane_rank(seq.request.lane) <= rank for seq in cohort):
            return False
        self._preempt_all(cohort, head)
        return True

    def _preempt_all(self, victims: list[Sequence], head: Sequence) -> None:
        """Preempt `victims` for `head` (the head of the queue): they wait right behind it, in
        their order of arrival, ahead of the requests that came after them (those of their
        lane wait behind them, FIFO as before; lanes sort by arrival)."""
        for behind, victim in enumerate(sorted(victims, key=lambda s: s.arrival), 1):
            self._preempt(victim, head, behind)

    def _preempt(self, victim: Sequence, head: Sequence, position: int) -> None:
        """Move `victim`'s KV into the prompt cache (so its resumption prefills only what the
        cache's whole blocks do not hold; evicted like any entry when the budget needs the
        room) and free its slot; it waits again, continued: its prompt and the tokens it
        produced, its remaining max_tokens, a seeded row's random stream past the draws it
        took; it waits at `position` in the queue. A row still in prefill has produced
        nothing since it was admitted."""
        original = victim.original or victim.request
        if victim.state == "decode" and victim.output_ids:
            caches = self.runner.decode_kv(victim.request_id)
            if caches is not None:  # what it holds: the client's prompt and every token since
                # copied when it stalls nobody (`_settle_kv_offers`): after the first token of
                # the request it makes room for, and before any admission looks it up
                self._offer_kv(list(original.prompt_ids) + victim.output_ids, caches)
        self.runner.remove(victim.request_id)
        self.running.pop(victim.request_id, None)
        self.kv.release(victim.request_id)
        victim.original = original
        emitted = len(victim.output_ids)
        sampling = original.sampling
        if sampling.seed is not None and not sampling.greedy:
            sampling = dataclasses.replace(sampling, seed_draws=sampling.seed_draws + emitted)
        victim.request = dataclasses.replace(
            original,
            prompt_ids=original.prompt_ids + tuple(victim.output_ids),
            max_tokens=original.max_tokens - emitted,
            sampling=sampling,
        )
        victim.state, victim.slot = "waiting", -1
        victim.cached_tokens = victim.prefilled_tokens = 0
        victim.block_hashes, victim.disk_state, victim.disk_tokens = None, "", 0
        victim.disk_payload = None
        self.waiting.insert(position, victim)
        self.stats.preemptions += 1
        log.info(
            "preempted %s (%s) for %s (%s)",
            victim.request_id,
            victim.request.lane,
            head.request_id,
            head.request.lane,
        )

    def _admit(self) -> None:
        eff = self.effective
        if not self.waiting:
            return
        self._order_waiting()
        self._settle_kv_offers(force=True)  # the lookups below see every finished sequence
        if self.disk is not None:
            self._take_disk_reads()
        free_slots = max(eff.parallel - len(self.running), 0)
        cohort_busy = bool(self.runner.prefill_uids)
        if cohort_busy and self._preempt_cohort_for(self.waiting[0]):
            cohort_busy = False
            free_slots = max(eff.parallel - len(self.running), 0)
        if not cohort_busy:
            free_slots += self._preempt_for(self.waiting[0], free_slots)
        # only cohort candidates need their cached prefix, and only when a cohort can start
        num_candidates = min(eff.max_batch_prefill, free_slots) if not cohort_busy else 0
        views = []
        for i, seq in enumerate(self.waiting):
            cached, defer = 0, False
            if i < num_candidates or (self.disk is not None and i < eff.max_batch_prefill):
                found = self.prefix_cache.match(seq.request.prompt_ids, self._hashes(seq))
                cached = max(found.num_tokens if found else 0, seq.disk_tokens)
                if self.disk is not None and not seq.disk_state:
                    self._look_up_disk(seq, cached)
                defer = i < num_candidates and self._shares_pending_prefix(seq, cached, i)
            total = seq.prompt_len + seq.request.max_tokens
            reading = seq.disk_state == "reading"
            views.append(
                WaitingView(seq.prompt_len - cached, self.kv.blocks_for(total), defer, reading)
            )
        plan = plan_admission(
            views,
            free_slots=free_slots,
            max_rows=eff.max_batch_prefill,
            token_cap=eff.max_batch_prefill_tokens,
            free_blocks=self.kv.num_free_after_eviction,
            cohort_busy=cohort_busy,
        )
        admitted = [self.waiting.popleft() for _ in range(plan.num_admit)]
        for seq, reason in zip(self.waiting, plan.wait_reasons, strict=True):
            seq.wait_reason = reason
        if admitted:
            self.runner.start_cohort([self._start(seq) for seq in admitted])

    def _look_up_disk(self, seq: Sequence, cached: int) -> None:
        """Start reading the prompt's prefix from the disk tier when it holds at least a
        chunk more than the RAM tier; the request waits (`disk_read`) until it is read."""
        seq.disk_state = "done"
        if not self.prefix_cache.enabled:
            return
        num, keys = self.disk.match(seq.request.prompt_ids)
        if num >= cached + DISK_CHUNK_TOKENS:
            seq.disk_state = "reading"
            self.disk.start_read(seq.request_id, seq.request.prompt_ids, keys)

    def _take_disk_reads(self) -> None:
        """Hand the finished disk reads to their requests (a request gone meanwhile leaves
        its read to the RAM tier)."""
        reads = self.disk.take_reads()
        if not reads:
            return
        by_id = {seq.request_id: seq for seq in self.waiting}
        serve = self.prefix_cache.enabled  # turned off while the read ran: nothing is served
        for read in reads:
            seq = by_id.get(read.tag)
            payload = self.disk.payload(read) if read.layers is not None and serve else None
            if seq is not None:
                seq.disk_state = "done"
                if payload is not None:
                    seq.disk_tokens, seq.disk_payload = read.num_tokens, payload
            elif payload is not None:
                self._promote(read.tokens, payload)

    def _promote(self, tokens: tuple[int, ...], payload: Any) -> None:
        """A prefix read from disk into the RAM tier, where it fits: the conversation's next
        turn finds it there."""
        cache = self.prefix_cache
        if cache.enabled and not cache.covers(tokens):
            room = self.kv.num_free_after_eviction
            cache.insert(tokens, payload, payload.nbytes, max_blocks=room)
            self.kv.num_cached = cache.num_blocks

    def _shares_pending_prefix(self, seq: Sequence, cached: int, position: int) -> bool:
        """True when a request ahead of `seq` in the queue shares enough uncached prompt with
        it (at least one block, and at least half of what `seq` must compute) that `seq` had
        better wait for that prefill, whose prompt KV enters the cache, than compute the same
        prefix again in the same cohort. A short common start (a chat template's system
        prompt) is not worth a wait: it is computed in parallel and cached afterwards."""
        if not self.prefix_cache.enabled or position == 0:
            return False
        mine = self._hashes(seq)
        gain_needed = max(KV_BLOCK_SIZE, (seq.prompt_len - cached) // 2)
        need = -(-(cached + gain_needed) // KV_BLOCK_SIZE)  # full blocks shared
        if len(mine) < need:
            return False
        for ahead in itertools.islice(self.waiting, position):
            theirs = self._hashes(ahead)
            if len(theirs) >= need and theirs[need - 1] == mine[need - 1]:
                return True  # chain hashes: an equal hash at block n means n equal blocks
        return False

    def _hashes(self, seq: Sequence) -> list[int]:
        if seq.block_hashes is None:
            seq.block_hashes = self.prefix_cache.prompt_hashes(seq.request.prompt_ids)
        return seq.block_hashes

    def _start(self, seq: Sequence) -> RowSpec:
        """Admit one sequence: prompt-cache lookup, KV reservation, a slot."""
        prompt = seq.request.prompt_ids
        found = self.prefix_cache.lookup(prompt, self._hashes(seq))
        seq.cached_tokens = found.num_tokens if found else 0
        payload = found.entry.payload if found else None
        fresh = seq.disk_payload is not None and self.prefix_cache.enabled
        if fresh and seq.disk_tokens > seq.cached_tokens:
            seq.cached_tokens, payload = seq.disk_tokens, seq.disk_payload  # from disk
            self._promote(tuple(prompt[: seq.disk_tokens]), payload)
        seq.disk_payload = None
        total = seq.prompt_len + seq.request.max_tokens
        shortfall = self.kv.blocks_for(total) - (self.kv.num_free or 0)
        if self.kv.total_blocks is not None and shortfall > 0:
            self.prefix_cache.evict_blocks(shortfall)
            self.kv.num_cached = self.prefix_cache.num_blocks
        seq.kv_blocks = self.kv.reserve(seq.request_id, total)
        seq.slot = min(set(range(len(self.running) + 1)) - {s.slot for s in self.running.values()})
        seq.state = "prefill"
        self.running[seq.request_id] = seq
        self.stats.record_admission(seq.prompt_len, seq.cached_tokens)
        return RowSpec(
            uid=seq.request_id,
            compute_tokens=list(prompt[seq.cached_tokens :]),
            cached_tokens=list(prompt[: seq.cached_tokens]),
            cached_payload=payload,
            sampling=seq.request.sampling,
            stop_token_ids=seq.request.stop_token_ids,
            max_tokens=seq.request.max_tokens,
            constraint=self._row_constraint(seq.request.sampling),
        )

    def _row_constraint(self, sampling: Any) -> Any:
        """The row's grammar (`json_schema`), behind a ReasoningGate when the row reasons
        (`sampling.reasoning`) and either has a grammar or a reasoning budget (the request's,
        else the server's `reasoning_budget`): the grammar applies to the answer only, and
        the budget closes the reasoning (docs/api.md, "Reasoning"). Other rows: unchanged."""
        schema = sampling.json_schema
        grammar = self.grammars.row(schema) if schema is not None else None
        spec = sampling.reasoning
        if spec is None:
            return grammar
        budget = spec.budget
        if budget is None:
            budget = getattr(self.config, "reasoning_budget", None)
        if budget is not None and budget < 0:  # -1: unbounded (overrides a server default)
            budget = None
        if grammar is None and budget is None:
            return None
        return ReasoningGate(spec, budget, grammar, self.vocab_size)

    def _apply_decode(self, outputs: list[DecodeOutput]) -> None:
        if outputs:
            self.stats.record_decode_step(self._decode_rows(outputs))
            self._apply_tokens(outputs)

    def _decode_rows(self, outputs: list[DecodeOutput]) -> int:
        """The rows a decode step computed: one output each, except where speculative decoding
        runs, whose verification steps give a row several (consecutive) outputs."""
        if speculation_of(self.runner) is None:
            return len(outputs)
        return 1 + sum(a.uid != b.uid for a, b in itertools.pairwise(outputs))

    def _apply_tokens(self, outputs: list[DecodeOutput]) -> None:
        """Emit sampled tokens; finish the rows that ended (their KV → the prompt cache)."""
        now = self.clock()
        self.stats.record_tokens(now, len(outputs))
        running, emit = self.running, self.on_output
        gaps: list[float] = []  # inter-token latencies, recorded once for the step
        # a row's tokens are consecutive; one that got several this step (speculative decoding)
        # shares the step's gap among them: `run` is (its uid, its first gap's index)
        run: tuple[str | None, int] = (None, 0)
        for out in outputs:
            seq = running.get(out.uid)
            if seq is None:
                continue
            seq.generated += 1
            seq.output_ids.append(out.token)
            if seq.first_token_at is None:
                seq.first_token_at = now
                kind = cache_kind(seq.prompt_len, seq.cached_tokens, KV_BLOCK_SIZE)
                self.stats.record_first_token(now, now - seq.arrival, kind)
            else:
                if out.uid != run[0]:
                    _share_gap(gaps, run[1])
                    run = (out.uid, len(gaps))
                gaps.append(now - (seq.last_token_at or now))
            seq.last_token_at = now
            if out.finish_reason is None:
                if out.logprobs is None:  # the common case, without seq.output's branches
                    emit(
                        seq.request_id,
                        TokenOutput(
                            out.token, None, seq.usage_prompt_len, seq.cached_tokens, seq.generated
                        )
                        if seq.original is None
                        else seq.output(out.token),
                    )
                else:
                    emit(seq.request_id, seq.output(out.token, logprobs=out.logprobs))
                continue
            if out.kv_caches is not None and out.kv_tokens is not None:
                self._offer_kv(out.kv_tokens, out.kv_caches)
            token = None if out.finish_reason == FINISH_STOP else out.token
            self._finish(seq, out.finish_reason, token, logprobs=out.logprobs)
        if gaps:
            _share_gap(gaps, run[1])
            self.stats.record_inter_tokens(now, gaps)

    def _apply_prefill(self, progress: PrefillProgress) -> None:
        for uid, computed in progress.uid_to_computed.items():
            if uid in self.running:
                self.running[uid].prefilled_tokens += computed
        for uid in progress.graduated:
            if uid in self.running:
                self.running[uid].state = "decode"
        computed = sum(progress.uid_to_computed.values())
        self.stats.record_prefill(self.clock(), computed, progress.padded_tokens)
        if progress.first_tokens:
            self._apply_tokens(progress.first_tokens)
            if progress.prompt_kv or progress.settle is not None:
                # the first tokens leave before the prompts' KV is copied (~0.1 s per 6k-token
                # SmolLM2 prompt) and before the decode batch's merged KV is evaluated (a copy
                # of every running row's): all of it time to first token otherwise
                self.flush()
        if progress.settle is not None:
            progress.settle()
        for _uid, tokens, caches in progress.prompt_kv:
            self._keep_kv(tokens, caches)  # requests sharing this prompt's prefix may reuse it

    def _settle_kv_offers(self, force: bool = False, prefilled: bool = False) -> None:
        """Copy the finished sequences' KV into the prompt cache, when it stalls nobody.

        A copy takes ~15 ms per SmolLM2 row of 350 tokens on a 2-core CPU; done in the step
        where rows finish, it lengthens the inter-token gap of every row still decoding. So it
        waits for a step that is long or idle anyway: one that admits requests (`force`: their
        lookups must see it), one that ran a prefill chunk, or one after which no row decodes;
        and never more than `MAX_KV_OFFERS` of them, or than `MAX_KV_OFFER_BYTES` of the old
        decode-batch caches they keep alive (`_offer_kv`)."""
        if not self._kv_offers:
            return
        due = force or prefilled or len(self._kv_offers) > MAX_KV_OFFERS
        due = due or self._kv_offers_bytes > MAX_KV_OFFER_BYTES
        if not due and self.runner.decode_uids:
            return
        offers = self._drop_kv_offers()
        for tokens, caches in offers:
            self._keep_kv(tokens, caches)

    def _offer_kv(self, tokens: list[int], caches: list[Any]) -> None:
        """A finished sequence's KV for the prompt cache, copied later (`_settle_kv_offers`).
        Until then its caches are lazy views of the decode batch's cache as it was in this step
        (the batch has since been filtered into a new one), which they keep alive: counted, as
        the KV the running rows have reserved, once per step that offers."""
        if self._kv_offer_step != self.stats.steps:
            self._kv_offer_step = self.stats.steps
            self._kv_offers_bytes += self.kv.num_used * self.kv.bytes_per_block
        self._kv_offers.append((tokens, caches))

    def _drop_kv_offers(self) -> list[tuple[list[int], list[Any]]]:
        offers, self._kv_offers = self._kv_offers, []
        self._kv_offer_step, self._kv_offers_bytes = -1, 0
        return offers

    def _keep_kv(self, tokens: list[int], caches: list[Any]) -> None:
        """Offer the KV of `tokens` (a finished prompt or sequence) to the prompt cache; it is
        reused to the token, and counted in whole blocks."""
        cache = self.prefix_cache
        if not cache.enabled or not tokens or cache.covers(tokens):
            return
        payload = self.runner.kv_payload(caches, len(tokens))
        room = self.kv.num_free_after_eviction
        cache.insert(tokens, payload, payload.nbytes, max_blocks=room)
        self.kv.num_cached = cache.num_blocks
        if self.disk is not None:
            self.disk.offer(tokens, payload.layers)  # written on the disk tier's own thread

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        token: int | None,
        error: str | None = None,
        logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None,
    ) -> None:
        self.running.pop(seq.request_id, None)
        self._deadlines.pop(seq.request_id, None)
        self.kv.release(seq.request_id)
        now = self.clock()
        self.stats.record_finish(reason, now - seq.arrival)
        event = {
            "request_id": seq.request_id,
            "finish_reason": reason,
            "prompt_tokens": seq.usage_prompt_len,
            "cached_tokens": seq.cached_tokens,
            "completion_tokens": seq.generated,
            "ttft_s": None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            "duration_s": now - seq.arrival,
            "error": error,
        }
        output = seq.output(token, reason, error, logprobs)
        self._finals.append((seq.request_id, output, event))

    def fail_embeddings(self, exc: BaseException) -> None:
        """Fail every queued embedding request with `exc` (the bridge's watchdog, on an engine
        it gave up on)."""
        if self._embedder is not None:
            self._embedder.fail_all(exc)

    def publish(self) -> None:
        """Replace the snapshot now, between steps (the bridge: after a rejection, on a wake,
        every `IDLE_REFRESH_S` when idle)."""
        self._publish()

    def _publish(self) -> None:
        self._snapshot = self._build_snapshot()

    def _build_snapshot(self) -> EngineSnapshot:
        return build_snapshot(self, self.clock())
