"""The one door between the asyncio loop and the engine thread (docs/ARCHITECTURE.md).

The loop thread calls `compile_schema` (awaited: a request's JSON schema is compiled on the
bridge's grammar worker, never on the loop), `submit`, `RequestStream.abort`, `reconfigure`,
`reset_prompt_cache`, `snapshot` and `shutdown`; commands go through a locked inbox that the
engine thread (`mlxcel-engine`) drains between steps. Outputs and events come back in order,
batched: the engine thread collects what a step produced and hands it over with one
`loop.call_soon_threadsafe` per step (not one per token), so the engine never blocks on a slow
client and the loop wakes once per step. A stream's consumer may take every output that is
ready at once (`RequestStream.next_batch`): when the loop runs behind the engine, one wake-up,
one detokenising pass and one write serve several tokens.

The step watchdog (`step_timeout`; docs/reliability.md, "Step watchdog") is a thread of its
own: an engine step (or a command between steps) that runs past the timeout is taken as hung.
Its running requests end with an error, requests that have sent nothing yet wait again, and a
fresh engine (`make_engine`, on the same loaded weights) takes over on a new engine thread;
the hung thread is abandoned, and whatever it produces if it ever returns is dropped. Until it
returns `problem` says so (`/health` answers 503). Without `make_engine`, or after
`MAX_ENGINE_RESTARTS` hung engines, the process exits with `EXIT_ENGINE_HUNG` so that its
service unit starts it again.

Why one module: `EngineBridge` owns the engine thread: its inbox, its loop, the streams'
delivery, the step watchdog and the restart on fresh state; each of them reads or replaces the
thread's state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.group import group_of
from mlxcel.daemon.engine.memory import release_idle_memory
from mlxcel.daemon.engine.stats import Observation
from mlxcel.daemon.engine.types import (
    FINISH_ABORT,
    FINISH_ERROR,
    AdmissionRejected,
    GenerationRequest,
    TokenOutput,
)
from mlxcel.shared.protocol import EV_REJECTED
from mlxcel.shared.snapshot import ConfigChange, EngineSnapshot

if TYPE_CHECKING:
    from mlxcel.shared.config import ServingConfig

log = logging.getLogger("mlxcel.engine")


# --- the commands of the bridge's inbox (loop -> engine thread, applied between steps) ---


@dataclass(frozen=True, slots=True)
class Submit:
    """Queue a request (`Engine.add_request`)."""

    kind: ClassVar[str] = "submit"
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Abort:
    """Cancel a request (`Engine.abort`); its final output has finish reason `reason`."""

    kind: ClassVar[str] = "abort"
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Embed:
    """Embed token lists (`Engine.add_embedding`); the vectors or the error go to `future`."""

    kind: ClassVar[str] = "embed"
    inputs: list[list[int]]
    future: concurrent.futures.Future[Any]


@dataclass(frozen=True, slots=True)
class Publish:
    """Replace the engine's snapshot now (a rejection, a wake)."""

    kind: ClassVar[str] = "publish"


@dataclass(frozen=True, slots=True)
class Call:
    """Run `fn` on the engine thread; its result or exception goes to `future`."""

    kind: ClassVar[str] = "call"
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]


Command = Submit | Abort | Embed | Publish | Call

Listener = Callable[[str, dict[str, Any]], None]
IDLE_REFRESH_S = 1.0  # an idle engine republishes its snapshot this often (60 s windows age)
# After work, an engine idle this long gives memory back (engine/memory.py
# `release_idle_memory`), once per idle period: long enough that an agent's next turn, seconds
# away, finds the heap pages still mapped (faulting them in again costs ~2.5-11 us a page here)
IDLE_RELEASE_S = 30.0
DRAIN_POLL_S = 0.05
# The GIL switch interval while an engine runs (Python's default is 5 ms). Each step the engine
# thread gives the GIL up while MLX computes and must get it back from the loop thread; with
# the default it waits up to 5 ms each time behind a busy loop (measured: 64 streams on a tiny
# model, 3.9k -> 5.4-7.3k tok/s; scripts/bench_host.py).
ENGINE_SWITCH_INTERVAL_S = 0.0005
MAX_ENGINE_RESTARTS = 3  # hung engines abandoned in one process before it exits instead
EXIT_ENGINE_HUNG = 75  # the exit status then (EX_TEMPFAIL): the service unit restarts it
EXIT_GRACE_S = 1.0  # for the failed streams' errors to reach their clients before the exit
MakeEngine = Callable[["ServingConfig"], Engine]  # the engine's current config -> a fresh Engine


class EngineHung(RuntimeError):
    """A command the hung engine thread held when the watchdog replaced it."""


class RequestStream:
    """Async iterator of a request's TokenOutputs; the last one has finish_reason and usage."""

    def __init__(self, request: GenerationRequest, bridge: EngineBridge) -> None:
        self.request = request
        self._bridge = bridge
        self._ready: deque[TokenOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._want = 1  # outputs the waiting reader asked for
        self._done = False
        self._aborted = False
        self.delivered = False  # an output reached the reader's side (loop thread)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenOutput:
        if self._done:
            raise StopAsyncIteration
        if not self._ready:
            await self._wait()
        output = self._ready.popleft()
        if output.finished:
            self._done = True
        return output

    async def next_batch(self, min_outputs: int = 1) -> list[TokenOutput]:
        """Every output ready once at least `min_outputs` are (or the final one is; it comes
        last); [] once finished."""
        if self._done:
            return []
        ready = self._ready
        if len(ready) < min_outputs and not (ready and ready[-1].finished):
            self._want = min_outputs
            try:
                while len(ready) < min_outputs and not (ready and ready[-1].finished):
                    await self._wait()
            finally:
                self._want = 1  # also when the reader is cancelled while it waits
        outputs = list(ready)
        ready.clear()
        if outputs[-1].finished:
            self._done = True
        return outputs

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def abort(self, reason: str = FINISH_ABORT) -> None:
        """Cancel the request (idempotent); a final output with finish_reason `reason` follows
        ("stop" when the caller matched a stop string, else "abort")."""
        if not self._aborted and not self._done:
            self._aborted = True
            self._bridge._post(Abort(self.request_id, reason))

    def _push(self, output: TokenOutput) -> None:
        self.delivered = True
        self._ready.append(output)
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if len(self._ready) >= self._want or output.finished:
            waiter.set_result(None)


DISK_CLOSE_TIMEOUT_S = 10.0  # a stopping engine's queued prompt-cache writes may take this


class EngineBridge:
    def __init__(
        self,
        engine: Engine,
        *,
        make_engine: MakeEngine | None = None,
        step_timeout: float | None = None,
    ) -> None:
        """`make_engine` builds the engine that replaces a hung one; `step_timeout` (seconds;
        None: the engine config's `step_timeout`) is how long a step may run."""
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: deque[Command] = deque()
        self._num_pending_submits = 0
        self._num_pending_embeds = 0  # embed commands not applied by the engine yet
        self._streams: dict[str, RequestStream] = {}
        self._listeners: list[Listener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine_ident: int | None = None  # the engine thread's id, once it runs
        self._stop = False
        self._grammar_pool: concurrent.futures.ThreadPoolExecutor | None = None
        # (callback, args) produced on the engine thread, handed to the loop once per step
        self._pending: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        # the step watchdog's view of the engine thread
        self.make_engine = make_engine
        self.step_timeout = step_timeout
        self._generation = 0  # bumped when a hung engine thread is abandoned
        self._busy_since: float | None = None  # monotonic start of the work in hand
        # when the engine last worked, and whether memory was given back since (_run)
        self._worked_at = time.monotonic()
        self._released = True
        self._in_hand: list[Command] = []  # the commands the engine thread took
        self._abandoned: list[threading.Thread] = []  # hung engine threads, maybe alive
        self._hang: str | None = None  # what the watchdog saw last
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()  # set by shutdown: the watchdog ends at once
        self._wire(engine)

    def _wire(self, engine: Engine) -> None:
        engine.on_output = self._on_output
        engine.on_event = self._on_event
        engine.on_flush = self._hand_over
        engine.on_wake = lambda: self._post(Publish())  # e.g. a disk read is done

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        self._start_thread()
        timeout = self._step_timeout
        if timeout is not None and self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, args=(timeout,), name="mlxcel-watchdog", daemon=True
            )
            self._watchdog.start()

    def _start_thread(self) -> None:
        generation = self._generation
        self._thread = threading.Thread(
            target=self._run, args=(generation,), name="mlxcel-engine", daemon=True
        )
        self._thread.start()

    @property
    def _step_timeout(self) -> float | None:
        if self.step_timeout is not None:
            return self.step_timeout
        timeout = getattr(self.engine.config, "step_timeout", None)
        return timeout if isinstance(timeout, (int, float)) and timeout > 0 else None

    @property
    def problem(self) -> str | None:
        """Why this engine is not healthy (`/health` answers 503 with it), or None: a
        distributed group that lost a rank, or a hung step whose thread has not returned."""
        group = group_of(self.engine)
        if group is not None and group.degraded is not None:
            return group.degraded
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        if self._abandoned and self._hang is not None:
            return self._hang
        return None

    async def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop admitting; with `drain` let running and queued requests finish within
        `timeout`, then abort the rest and stop the engine thread."""
        self.engine.shutting_down = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while drain and (self.num_running or self.num_waiting) and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._thread is not None:
            if self._thread.is_alive():
                await self._call(self.engine.abort_all)
            with self._cond:
                self._stop = True
                self._cond.notify()
            thread = self._thread
            await loop.run_in_executor(None, thread.join, 10.0)
            if self._thread is thread:
                self._thread = None
        self._watch_stop.set()
        if self._watchdog is not None:  # it holds this bridge, so the engine and the weights
            await loop.run_in_executor(None, self._watchdog.join, 5.0)
            self._watchdog = None
        disk = getattr(self.engine, "disk", None)
        if disk is not None:  # its queued writes finish (a few seconds at most); idempotent
            await loop.run_in_executor(None, disk.close, DISK_CLOSE_TIMEOUT_S)
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            self._grammar_pool = None

    # -- requests ----------------------------------------------------------------------------

    async def compile_schema(self, schema: str | None) -> None:
        """Compile a JSON schema (constrained decoding) on the grammar worker, off the loop, so
        that `submit` finds it compiled (or its refusal cached, which `submit` raises). A
        cached schema costs a lookup; one worker, so the same schema is compiled once."""
        grammars = self.engine.grammars
        if schema is None or grammars.cached(schema):
            return
        if self._grammar_pool is None:
            self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="mlxcel-grammar"
            )
        await asyncio.get_running_loop().run_in_executor(self._grammar_pool, grammars.warm, schema)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request (loop thread). Raises AdmissionRejected synchronously. A JSON schema
        is a cache lookup here once `compile_schema` was awaited (the HTTP handlers do); a
        direct caller that did not gets it compiled here, outside the engine's lock."""
        if request.sampling.json_schema is not None:
            self.engine.grammars.warm(request.sampling.json_schema)
        with self._cond:
            try:
                if self._thread is None or self._stop:
                    raise AdmissionRejected("shutting_down", "the engine is not running")
                if request.request_id in self._streams:
                    raise AdmissionRejected(
                        "invalid_request", f"duplicate request id {request.request_id!r}"
                    )
                waiting = self.engine.num_waiting + self._num_pending_submits
                self.engine.check_admission(request, waiting)
            except AdmissionRejected as exc:
                self.engine.stats.record_rejection(exc.reason)
                self._inbox.append(Publish())  # the snapshot shows the rejection promptly
                self._on_event(
                    EV_REJECTED,
                    {
                        "request_id": request.request_id,
                        "reason": exc.reason,
                        "message": exc.message,
                    },
                )
                raise
            stream = RequestStream(request, self)
            self._streams[request.request_id] = stream
            self._num_pending_submits += 1
            self._inbox.append(Submit(request))
            self._cond.notify()
        return stream

    async def embed(self, inputs: list[list[int]]) -> Any:
        """The embedding vectors of token lists, an (n, width) float32 numpy array, computed on
        the engine thread between decode steps (embedder.py). Raises AdmissionRejected
        (`queue_full` past `max_queue_depth` embedding requests, `shutting_down`) at once, and
        `runner_api.EmbeddingUnsupported` when the model serves none; cancelling the awaiting
        task drops the inputs not computed yet."""
        with self._cond:
            if self._thread is None or self._stop or self.engine.shutting_down:
                raise AdmissionRejected("shutting_down", "the engine is not running")
            if self.engine.num_embedding_jobs + self._num_pending_embeds >= max(
                self.engine.config.max_queue_depth, 1
            ):
                self.engine.stats.record_rejection("queue_full")
                raise AdmissionRejected(
                    "queue_full",
                    f"{self.engine.config.max_queue_depth} embedding requests are queued "
                    "already; retry later",
                )
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._num_pending_embeds += 1
            self._inbox.append(Embed(inputs, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def embedding_width(self) -> int | None:
        """The length of the model's embedding vectors (its hidden size), when its config
        says; None otherwise (the first result tells)."""
        width = getattr(getattr(self.engine.model, "args", None), "hidden_size", None)
        return width if isinstance(width, int) and not isinstance(width, bool) else None

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def stream_interval(self) -> int:
        """Tokens a reader takes per piece (`stream_interval` option; 1: each as it comes)."""
        return self.engine.config.stream_interval

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._num_pending_submits

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    def record_rejection(self, reason: str) -> None:
        """Count a request the HTTP layer refused before `submit` (bad input, over the
        context) in the engine's one rejection counter, which the snapshot (console, status)
        and /metrics both read."""
        with self._cond:
            self.engine.stats.record_rejection(reason)
            self._inbox.append(Publish())
            self._cond.notify()

    def rejections(self) -> dict[str, int]:
        """The rejection counts now (the snapshot's may be a step old)."""
        return self.engine.stats.counters().rejections_by_reason

    def drain_observations(self) -> list[Observation]:
        """Histogram samples since the last call (see stats.py), for the metrics exporter."""
        return self.engine.stats.drain_observations()

    # -- runtime control ---------------------------------------------------------------------

    async def reconfigure(self, changes: dict[str, Any]) -> list[ConfigChange]:
        return await self._call(lambda: self.engine.reconfigure(changes))

    async def reset_prompt_cache(self, tier: str = "all") -> dict[str, Any]:
        return await self._call(lambda: self.engine.reset_prompt_cache(tier))

    async def cancel(self, request_id: str) -> bool:
        """Abort a waiting or running request by id between steps (its slot and KV are free
        when this returns); False when the engine does not hold it (unknown or finished).
        Its client gets a final output with finish_reason "abort" and the usage."""
        return bool(await self._call(lambda: self.engine.abort(request_id, FINISH_ABORT)))

    def add_listener(self, callback: Listener) -> None:
        """`callback(name, data)` on the loop thread for request_finished, request_rejected,
        config_changed and cache_reset."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    # -- the step watchdog -------------------------------------------------------------------

    def _watch(self, timeout: float) -> None:
        """Watchdog thread: replace the engine when its work in hand outruns `timeout`."""
        period = min(1.0, timeout / 4)
        while not self._watch_stop.wait(period):
            with self._cond:
                since, generation = self._busy_since, self._generation
            if since is not None and time.monotonic() - since > timeout:
                self._replace_hung(generation, time.monotonic() - since, timeout)

    def _replace_hung(self, generation: int, elapsed: float, timeout: float) -> None:
        """Abandon the hung engine thread: its commands fail, its running requests end with
        an error and the rest wait again, on a fresh engine (or the process exits)."""
        with self._cond:
            if generation != self._generation or self._stop:
                return
            self._generation += 1
            old, thread = self.engine, self._thread
            if thread is not None:
                self._abandoned.append(thread)
            in_hand, self._in_hand = self._in_hand, []
            self._busy_since = None
            self._pending = []  # the hung thread's undelivered outputs: those requests retry
            # submits still in the inbox go to the fresh engine as they are
            queued = {item.request.request_id for item in self._inbox if isinstance(item, Submit)}
            self._num_pending_submits = len(queued)
        restarts = getattr(old.stats, "engine_restarts", 0) + 1
        message = f"an engine step ran over {elapsed:.0f} s (step_timeout {timeout:g} s)"
        log.error(
            "step watchdog: %s (hung engine %d of %d)", message, restarts, MAX_ENGINE_RESTARTS
        )
        for hook in ("on_output", "on_event", "on_flush", "on_wake"):  # it may yet return
            setattr(old, hook, lambda *args: None)
        hung = EngineHung(message)
        for item in in_hand:
            if isinstance(item, (Call, Embed)) and not item.future.done():
                item.future.set_exception(hung)
        old.fail_embeddings(hung)
        fresh = None
        if self.make_engine is not None and restarts <= MAX_ENGINE_RESTARTS:
            fresh = self._build_engine(old.config, timeout)
        if fresh is None:
            self._hang = f"engine step hung for over {timeout:g} s; the daemon restarts"
            with self._cond:
                self._thread = None  # nothing runs the inbox now: new requests are refused
            self._send(self._settle_hung, f"{message}; the daemon restarts", queued, False)
            self._exit_later(message)
            return
        self._hang = f"engine step hung for over {timeout:g} s; a fresh engine serves"
        fresh.stats = old.stats  # the counters go on (Prometheus sees no reset)
        fresh.stats.engine_restarts = restarts
        fresh.shutting_down = old.shutting_down
        self._wire(fresh)
        with self._cond:
            self.engine = fresh
            self._start_thread()
        self._send(self._settle_hung, f"{message}; the engine was restarted", queued, True)

    def _build_engine(self, config: Any, timeout: float) -> Engine | None:
        """`make_engine(config)` on a thread of its own, given `timeout` (MLX itself may be
        what hangs); None when it fails or does not return."""
        built: list[Engine] = []

        def build() -> None:
            try:
                built.append(self.make_engine(config))  # type: ignore[misc]
            except Exception:
                log.exception("step watchdog: a fresh engine could not be built")

        worker = threading.Thread(target=build, name="mlxcel-engine-build", daemon=True)
        worker.start()
        worker.join(timeout)
        if not built and worker.is_alive():
            log.error("step watchdog: building a fresh engine took over %g s", timeout)
        return built[0] if built else None

    def _settle_hung(self, message: str, queued: set[str], retry: bool) -> None:
        """Loop thread, after every output the hung engine handed over: a request whose
        client got something ends with `message`; the others wait again on the fresh engine
        (those in `queued` never left the inbox)."""
        resubmit: list[GenerationRequest] = []
        for request_id, stream in list(self._streams.items()):
            if retry and request_id in queued:
                continue
            if retry and not stream.delivered and not stream._aborted:
                resubmit.append(stream.request)
                continue
            self._streams.pop(request_id, None)
            prompt_tokens = len(stream.request.prompt_ids)
            stream._push(
                TokenOutput(None, FINISH_ERROR, prompt_tokens=prompt_tokens, error=message)
            )
        if resubmit:
            with self._cond:
                self._inbox.extend(Submit(request) for request in resubmit)
                self._num_pending_submits += len(resubmit)
                self._cond.notify()
            log.warning("step watchdog: %d waiting request(s) resubmitted", len(resubmit))

    def _exit_later(self, message: str) -> None:
        """No fresh engine: exit (after the errors went out) for the service unit to restart."""
        log.critical("step watchdog: %s; exiting with status %d", message, EXIT_ENGINE_HUNG)
        time.sleep(EXIT_GRACE_S)
        logging.shutdown()
        os._exit(EXIT_ENGINE_HUNG)

    # -- plumbing ----------------------------------------------------------------------------

    def _post(self, item: Command) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and await its result."""
        if self._thread is None:
            return fn()  # not started: nothing else touches the engine
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(Call(fn, future))
        return await asyncio.wrap_future(future)

    def _on_output(self, request_id: str, output: TokenOutput) -> None:
        if self._abandoned and threading.current_thread() in self._abandoned:
            return  # a hung engine that returned: its requests were failed or resubmitted
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if output.finished:
            self._streams.pop(request_id, None)
        if threading.get_ident() == self._engine_ident:  # once per token: the short path
            self._pending.append((stream._push, (output,)))
        else:
            self._deliver(stream._push, output)

    def _on_event(self, name: str, data: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            self._deliver(listener, name, data)

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        """On the engine thread: kept for the next hand-over; elsewhere: sent now."""
        if self._loop is None or threading.current_thread() in self._abandoned:
            return
        if threading.current_thread() is self._thread:
            self._pending.append((fn, args))
            return
        self._send(self._run_callbacks, [(fn, args)])

    def _hand_over(self) -> None:
        """Engine thread: everything produced since the last hand-over, in one loop callback."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._send(self._run_callbacks, pending)

    def _send(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    @staticmethod
    def _run_callbacks(callbacks: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> None:
        for fn, args in callbacks:
            try:
                fn(*args)
            except Exception:  # one failing listener must not starve the others
                log.exception("delivering an engine output failed")

    def _run(self, generation: int) -> None:
        self._engine_ident = threading.get_ident()
        engine = self.engine
        while True:
            release = False
            with self._cond:
                while (
                    not self._inbox
                    and not engine.has_work
                    and not self._stop
                    and generation == self._generation
                ):
                    if not self._cond.wait(IDLE_REFRESH_S):
                        engine.publish()
                    # on every wake: a console's snapshot requests wake it every second
                    idle = time.monotonic() - self._worked_at
                    if not self._released and idle >= IDLE_RELEASE_S:
                        release = True
                        break
                if self._stop or generation != self._generation:
                    break
                if not release:
                    items = list(self._inbox)
                    self._inbox.clear()
                    self._in_hand = items
                    self._busy_since = time.monotonic()
            if release:  # outside the lock (a submit never waits for it); the inbox stays
                self._release_idle_memory()
                continue
            try:
                for item in items:
                    self._apply(item)
                if items:
                    engine.flush()  # e.g. aborts: their final outputs, after a fresh snapshot
                if engine.has_work:
                    engine.step()
                    self._worked_at, self._released = time.monotonic(), False
            except Exception:  # never let the engine thread die with requests in flight
                log.exception("engine loop error")
            with self._cond:
                if generation != self._generation:
                    break  # the watchdog gave up on this thread: what it made is dropped
                self._busy_since = None
                self._in_hand = []
            self._hand_over()
        if generation != self._generation:
            log.warning("the hung engine step returned; its thread ends, its outputs dropped")

    def _release_idle_memory(self) -> None:
        """The engine has been idle IDLE_RELEASE_S since it last worked: give back what its
        work left resident (once, until it works again)."""
        self._released = True
        try:
            before, after = release_idle_memory()
        except Exception:  # a failed release must not end the engine thread
            log.exception("giving memory back after idling failed")
            return
        level = logging.INFO if before - after >= 64 << 20 else logging.DEBUG
        log.log(
            level,
            "idle %.0f s: %d MiB given back (resident %d -> %d MiB)",
            IDLE_RELEASE_S,
            (before - after) >> 20,
            before >> 20,
            after >> 20,
        )

    def _apply(self, item: Command) -> None:
        try:
            if isinstance(item, Submit):
                self.engine.add_request(item.request)
                with self._cond:
                    self._num_pending_submits -= 1
            elif isinstance(item, Abort):
                self.engine.abort(item.request_id, item.reason)
            elif isinstance(item, Embed):
                with self._cond:
                    self._num_pending_embeds -= 1
                self.engine.add_embedding(item.inputs, item.future)
            elif isinstance(item, Publish):
                self.engine.publish()
            elif isinstance(item, Call):
                try:
                    result = item.fn()
                except Exception as exc:
                    self.engine.flush()
                    item.future.set_exception(exc)
                else:
                    # its final outputs, a snapshot that shows them (a cancelled request's slot
                    # is free in the next status) and its events reach the loop before its result
                    self.engine.flush()
                    item.future.set_result(result)
        except Exception:
            log.exception("engine command %s failed", item.kind)
