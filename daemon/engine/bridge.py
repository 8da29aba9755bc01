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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from mlxcel.daemon.engine.engine import Engine
from mlxcel.daemon.engine.stats import Observation
from mlxcel.daemon.engine.types import (
    FINISH_ABORT,
    AdmissionRejected,
    GenerationRequest,
    TokenOutput,
)
from mlxcel.shared.protocol import EV_REJECTED
from mlxcel.shared.snapshot import ConfigChange, EngineSnapshot

log = logging.getLogger("mlxcel.engine")

Listener = Callable[[str, dict[str, Any]], None]
IDLE_REFRESH_S = 1.0  # an idle engine republishes its snapshot this often (60 s windows age)
DRAIN_POLL_S = 0.05
# The GIL switch interval while an engine runs (Python's default is 5 ms). Each step the engine
# thread gives the GIL up while MLX computes and must get it back from the loop thread; with
# the default it waits up to 5 ms each time behind a busy loop (measured: 64 streams on a tiny
# model, 3.9k -> 5.4-7.3k tok/s; scripts/bench_host.py).
ENGINE_SWITCH_INTERVAL_S = 0.0005


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
            self._bridge._post(("abort", self.request_id, reason))

    def _push(self, output: TokenOutput) -> None:
        self._ready.append(output)
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if len(self._ready) >= self._want or output.finished:
            waiter.set_result(None)


DISK_CLOSE_TIMEOUT_S = 10.0  # a stopping engine's queued prompt-cache writes may take this


class EngineBridge:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, ...]] = deque()
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
        engine.on_output = self._on_output
        engine.on_event = self._on_event
        engine.on_flush = self._hand_over
        engine.on_wake = lambda: self._post(("publish",))  # e.g. a disk read is done

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="mlxcel-engine", daemon=True)
        self._thread.start()

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
            await loop.run_in_executor(None, self._thread.join, 10.0)
            self._thread = None
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
                self._inbox.append(("publish",))  # the snapshot shows the rejection promptly
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
            self._inbox.append(("submit", request))
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
            self._inbox.append(("embed", inputs, future))
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
            self._inbox.append(("publish",))
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

    # -- plumbing ----------------------------------------------------------------------------

    def _post(self, item: tuple[Any, ...]) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and await its result."""
        if self._thread is None:
            return fn()  # not started: nothing else touches the engine
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(("call", fn, future))
        return await asyncio.wrap_future(future)

    def _on_output(self, request_id: str, output: TokenOutput) -> None:
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
        if self._loop is None:
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

    def _run(self) -> None:
        self._engine_ident = threading.get_ident()
        engine = self.engine
        while True:
            with self._cond:
                while not self._inbox and not engine.has_work and not self._stop:
                    if not self._cond.wait(IDLE_REFRESH_S):
                        engine._publish()
                if self._stop:
                    break
                items = list(self._inbox)
                self._inbox.clear()
            try:
                for item in items:
                    self._apply(item)
                if items:
                    engine.flush()  # e.g. aborts: their final outputs, after a fresh snapshot
                if engine.has_work:
                    engine.step()
            except Exception:  # never let the engine thread die with requests in flight
                log.exception("engine loop error")
            self._hand_over()

    def _apply(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        try:
            if kind == "submit":
                self.engine.add_request(item[1])
                with self._cond:
                    self._num_pending_submits -= 1
            elif kind == "abort":
                self.engine.abort(item[1], item[2])
            elif kind == "embed":
                with self._cond:
                    self._num_pending_embeds -= 1
                self.engine.add_embedding(item[1], item[2])
            elif kind == "publish":
                self.engine._publish()
            elif kind == "call":
                future = item[2]
                try:
                    result = item[1]()
                except Exception as exc:
                    self._hand_over()
                    future.set_exception(exc)
                else:
                    self._hand_over()  # its events reach the loop before its result
                    future.set_result(result)
        except Exception:
            log.exception("engine command %s failed", kind)
