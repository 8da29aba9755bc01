"""`ModelHost`: the models the daemon holds in memory, and the seam between them and the rest.

The host owns every model: the daemon's own (`--model`, `load_first` at start) and each one a
request, `models load` or `pin` names; the daemon's stop drains them all through one path
(`close`, drain.py). This module is longer than the house's ~500 lines because a load, an
eviction and an unload share its lock and its waiters: split, their ordering would be spread
over several modules.

Each resident model has its own `LoadedModel`, `Engine` and `EngineBridge` (so its own KV
budget and prompt cache) and its own `ModelContext` for the HTTP handlers. The engine is not
changed: a switch drains one bridge and starts another.

- A request names a model (`lease(name)`): a resident one is served at once; another local
  one (store, alias, Hugging Face cache) is loaded. While `max_loaded_models` are resident the
  least recently used one is retired first: it takes no new requests, its running and queued
  requests finish, then its engine stops and its memory is freed. Requests waiting meanwhile
  show in the snapshot's queue with the wait reason `model_loading`.
- A model that fails to load (a corrupt or half-pulled directory, a bad GGUF header) is
  refused before anything is evicted when its files are visibly broken, and so is one whose
  weights will not fit in memory on this backend (`footprint.resident_weight_bytes`: what the
  weights take once loaded, packed or expanded as the forward plan keeps them); when it fails
  later, whatever the error, the evicted model is loaded again. Either way the request gets
  one clear error and the daemon keeps serving.
- A retiring model's requests get `UNLOAD_WAIT_S` to finish; then the rest are aborted
  (their clients get a final `abort`), so a client that stops reading cannot pin a model. The
  host lock is never held while requests finish: other leases, loads and unloads go on.
- At most `max_queue_depth` requests wait for a model to load; more get `HostBusy` (a 503
  with `Retry-After`).
- `keep_alive_s`: a model idle that long is unloaded; the next request loads it again.
- A pinned model (`pin`) is never chosen to make room and never unloaded by keep-alive;
  `unload` of it is refused (`ModelPinned`) until it is unpinned. A load that needs room only
  pinned models hold is refused before anything is evicted (`NoRoomForModel`, a 503).
- `cfg.models_memory` (None: only the free-memory check): the resident models' weights
  (`weights_bytes`) plus the new model's (`footprint.resident_weight_bytes`, the figure the
  free-memory check uses) stay within it; the least recently used unpinned models (idle ones
  first) are retired to make room, and a model that cannot fit beside the pinned ones is
  refused before anything is evicted (`NoRoomForModel`).
- `HostBridge` (facade.py) is what `DaemonRuntime`, the control socket and the metrics see:
  the primary (most recently loaded) model's bridge, or an idle snapshot while nothing is
  loaded.

Everything here runs on the event-loop thread; loading runs on a daemon thread of its own
(`mlxcel-load`), so that a stop never waits for a load to finish.

Why one module: `ModelHost` is one state machine under one lock (loading, leases, switching,
keep-alive, eviction, pinning); its facade, metrics, catalogue, residency rules, file vetting
and drain are already modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psutil
from mlxcel.daemon.hosting.drain import StopRequest, drain_bridge
from mlxcel.daemon.hosting.errors import (
    HostBusy,
    ModelLoadError,
    ModelNotFound,
    ModelNotGenerative,
    ModelPinned,
    ModelTooLarge,
    NoRoomForModel,
)
from mlxcel.daemon.hosting.facade import HostBridge
from mlxcel.daemon.hosting.resident import HostCounters, Resident
from mlxcel.daemon.hosting.vetting import (
    MEMORY_HEADROOM,
    one_line,
    over_budget,
    precheck,
    too_large,
)
from mlxcel.shared.config import ServingConfig, format_size
from mlxcel.shared.protocol import (
    EV_MODEL_LOAD_FAILED,
    EV_MODEL_LOADED,
    EV_MODEL_LOADING,
    EV_MODEL_PINNED,
    EV_MODEL_SWITCHED,
    EV_MODEL_UNLOADED,
    EV_MODEL_UNPINNED,
)
from mlxcel.shared.snapshot import QueueEntry

if TYPE_CHECKING:
    from mlxcel.daemon.engine.bridge import EngineBridge
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.models.loader import LoadedModel
    from mlxcel.daemon.server.http_app import ModelContext

log = logging.getLogger("mlxcel.daemon")

WAIT_MODEL_LOADING = "model_loading"
RETIRE_POLL_S = 0.02
UNLOAD_WAIT_S = 30.0  # a retiring model's requests get this long to finish, then are aborted
ABORT_GRACE_S = 5.0  # after the abort, for their handlers to end their leases; then freed anyway


Loader = Callable[[str], tuple["LoadedModel", "Engine", "EngineBridge"]]  # spec -> the three
MakeContext = Callable[["LoadedModel", "EngineBridge"], "ModelContext"]
EventSink = Callable[[str, dict[str, Any]], None]
T = TypeVar("T")


async def in_daemon_thread(fn: Callable[[str], T], arg: str, name: str = "mlxcel-load") -> T:
    """`fn(arg)` on a daemon thread of its own, awaited. Not `asyncio.to_thread`: the loop's
    executor is joined when the loop closes, so a stop would wait for a load to finish."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # the waiter was cancelled (a stop while loading)
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            result: Any = fn(arg)
            ok = True
        except BaseException as exc:  # handed to the waiter, whatever it is
            result, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


class ModelHost:
    def __init__(
        self,
        cfg: ServingConfig,
        loader: Loader,
        make_context: MakeContext | None,
        keep_alive_s: float | None = None,
        max_loaded: int = 1,
        fixed: bool = False,
    ) -> None:
        self.cfg = cfg
        self.keep_alive_s = keep_alive_s
        self.max_loaded = max(1, max_loaded)
        self.fixed = fixed  # serve only the first model (a distributed group)
        self._loader = loader
        self.make_context = make_context
        self.resident: dict[str, Resident] = {}
        self.counters = HostCounters()
        self.loading: str | None = None
        self.started = False
        self.closing = False
        self.facade = HostBridge(self)
        self._lock = asyncio.Lock()
        self._waiting: dict[int, QueueEntry] = {}
        self._next_wait = 0
        self._last_key: str | None = None  # the model requests without a name go to
        self._known: dict[str, str] = {}  # every name a model was loaded under -> its key
        self._sinks: list[EventSink] = []
        self._on_primary: list[Callable[[Resident | None], None]] = []
        self._reaper: asyncio.Task[None] | None = None
        self._loads: dict[str, asyncio.Task[Resident]] = {}  # one load task per model

    # -- wiring ------------------------------------------------------------------------------

    def add_event_sink(self, sink: EventSink) -> None:
        self._sinks.append(sink)

    def on_primary_change(self, callback: Callable[[Resident | None], None]) -> None:
        self._on_primary.append(callback)

    def _emit(self, name: str, data: dict[str, Any]) -> None:
        for sink in list(self._sinks):
            sink(name, data)

    @property
    def primary(self) -> Resident | None:
        live = [r for r in self.resident.values() if not r.retiring]
        pool = live or list(self.resident.values())
        return max(pool, key=lambda r: r.loaded_at) if pool else None

    def _primary_changed(self) -> None:
        primary = self.primary
        for callback in list(self._on_primary):
            callback(primary)

    async def load_first(self, spec: str) -> Resident:
        """The daemon's own model (`--model`) at start, resident like any other. Loaded as it
        comes: none of the checks a request's load makes before evicting anything (nothing is
        resident yet); whatever the loader raises is the start's one-line failure."""
        started = time.monotonic()
        loaded, _engine, bridge = await in_daemon_thread(self._loader, spec)
        bridge.start()
        resident = self._register(spec, loaded, bridge, time.monotonic() - started)
        self.started = True
        if self.keep_alive_s is not None:
            self._start_reaper()
        return resident

    def _start_reaper(self) -> None:
        if self._reaper is None and not self.fixed and not self.closing:
            self._reaper = asyncio.create_task(self._reap_idle())

    def set_keep_alive(self, ctx: Any, seconds: float | None) -> None:
        """A request's keep-alive for the model serving it (`ctx`): it stays loaded until idle
        that long (None: forever), then unloads as `keep_alive_s` does; it holds until the
        model is unloaded. A distributed group keeps its model whatever is asked."""
        for resident in self.resident.values():
            if resident.ctx is ctx and not self.fixed:
                resident.own_keep_alive = (seconds,)
                if seconds is not None:
                    self._start_reaper()

    def _register(
        self, spec: str, loaded: LoadedModel, bridge: EngineBridge, load_s: float
    ) -> Resident:
        assert self.make_context is not None
        ctx = self.make_context(loaded, bridge)
        # Not ctx.names: that holds the daemon's --model, which names the first model only.
        names = {spec, loaded.info.name, Path(loaded.info.path).name}
        ctx.names = frozenset(n for n in names if n)
        self._known.update(dict.fromkeys(ctx.names, spec))
        resident = Resident(spec, spec, loaded, bridge, ctx, time.time(), load_s)
        self.resident[spec] = resident
        self._last_key = spec
        self.counters.loads += 1
        self.counters.load_seconds += load_s
        self.counters.last_load_s = load_s
        bridge.add_listener(self.facade.forward)
        self._primary_changed()
        return resident

    # -- names -------------------------------------------------------------------------------

    def find_resident(self, name: str) -> Resident | None:
        bare = name.removesuffix(":latest")
        for resident in self.resident.values():
            if name in resident.ctx.names or bare in resident.ctx.names:
                return resident
        return None

    def resolve(self, name: str | None, allow_paths: bool = False) -> str:
        """The key `name` loads as: a resident's, or a local model's (store, alias, Hugging
        Face cache). Raw paths only from the control socket (`allow_paths`)."""
        if name is None or not name.strip():
            key = self._last_key
            if key is None:
                raise ModelNotFound("no model has been loaded yet")
            return key
        resident = self.find_resident(name)
        if resident is not None:
            return resident.key
        if self.fixed:
            raise ModelNotFound(f"model {name!r} is not served here (a distributed group)")
        known = self._known.get(name) or self._known.get(name.removesuffix(":latest"))
        if known is not None and ("/" in known) and Path(known).expanduser().exists():
            return known  # a path loaded before (the daemon's --model, say), by any of its names
        from mlxcel.daemon.models import registry

        try:
            target = registry.resolve_alias(name)
        except ModelLoadError as exc:
            raise ModelNotFound(str(exc)) from None
        resident = self.find_resident(target)
        if resident is not None:
            return resident.key
        if target in registry.ALIASES and registry.local_model_dir(target) is not None:
            return target  # a built-in one not pulled yet is a 404 with the pull command
        if registry.is_store_name(target) and registry.model_dir(target).is_dir():
            return target  # a broken entry gets its clear error at load
        if registry.is_hf_repo_id(target) and registry.hf_cached_snapshot(target) is not None:
            return target
        if allow_paths and Path(target).expanduser().exists():
            return str(Path(target).expanduser().resolve())
        raise ModelNotFound(
            f"model {name!r} is not served here nor available locally; pull it with "
            f"`mlxcel-daemon models pull {name}` (see `mlxcel-daemon models list`)"
        )

    # -- leases (HTTP requests) --------------------------------------------------------------

    def kind_of(self, key: str) -> str:
        """ "embedding" for an embedding-only model (resident, or a local directory whose
        config.json is an encoder's), else "chat"; reads at most one config.json."""
        resident = self.resident.get(key)
        if resident is not None:
            return str(getattr(resident.loaded.info, "kind", "chat"))
        from mlxcel.daemon.models import registry
        from mlxcel.daemon.models.encoder import is_encoder_config

        path = registry.local_model_dir(key)
        if path is None and registry.is_hf_repo_id(key):
            path = registry.hf_cached_snapshot(key)
        if path is None:
            path = Path(key).expanduser()
        try:
            if path.is_dir() and is_encoder_config(registry.read_config(path)):
                return "embedding"
        except (ModelLoadError, OSError):
            pass  # the load says what is wrong with it
        return "chat"

    @contextlib.asynccontextmanager
    async def lease(
        self, name: str | None, request_id: str | None = None, *, generative: bool = False
    ) -> AsyncIterator[Any]:
        """The `ModelContext` of model `name` (loaded first if need be), held until exit.
        `generative`: a generation route; an embedding model is refused (`ModelNotGenerative`)
        before anything loads."""
        key = self.resolve(name)
        if generative and self.kind_of(key) == "embedding":
            raise ModelNotGenerative(
                f"model {name or key!r} is an embedding model: it serves /v1/embeddings, "
                "/api/embed and /api/embeddings, not text generation"
            )
        resident = await self._acquire(key, request_id)
        if name and name not in resident.ctx.names:
            resident.ctx.names = resident.ctx.names | {name.removesuffix(":latest")}
        try:
            yield resident.ctx
        finally:
            resident.leases -= 1
            resident.last_used = time.monotonic()

    async def _acquire(self, key: str, request_id: str | None) -> Resident:
        resident = self.resident.get(key)
        if resident is not None and not resident.retiring:
            resident.leases += 1
            resident.last_used = time.monotonic()
            return resident
        limit = max(1, self.cfg.max_queue_depth)
        if len(self._waiting) >= limit:
            raise HostBusy(
                f"{len(self._waiting)} requests already wait for a model to load (the limit "
                f"is max_queue_depth, {limit}); retry later",
                self.retry_after_s(),
            )
        token = self._next_wait
        self._next_wait += 1
        rid = request_id or f"pending-{token}"
        self._waiting[token] = QueueEntry(rid, 0, WAIT_MODEL_LOADING, time.monotonic())
        try:
            while True:
                await self.ensure_loaded(key)
                resident = self.resident.get(key)
                if resident is not None and not resident.retiring:
                    resident.leases += 1
                    resident.last_used = time.monotonic()
                    return resident
        finally:
            del self._waiting[token]

    def retry_after_s(self) -> int:
        """What a refused waiter is told to wait: about one model load (1-60 s)."""
        last = self.counters.last_load_s
        return min(60, max(1, math.ceil(last if last is not None else 5.0)))

    def waiting_entries(self) -> tuple[QueueEntry, ...]:
        now = time.monotonic()
        return tuple(dataclasses.replace(e, age_s=now - e.age_s) for e in self._waiting.values())

    @property
    def num_waiting_for_load(self) -> int:
        """Requests waiting for their model to load (`waiting_entries` lists them)."""
        return len(self._waiting)

    # -- load / unload -----------------------------------------------------------------------

    async def ensure_loaded(self, key: str) -> Resident:
        """Load `key` unless resident, retiring others first as the limits ask. The load runs
        as one task per model that every waiter shares: a client that disconnects while it
        waits does not cancel a switch half done."""
        resident = self.resident.get(key)
        if resident is not None and not resident.retiring:
            return resident
        task = self._loads.get(key)
        if task is None:
            task = asyncio.create_task(self._load_serialized(key))
            self._loads[key] = task
            task.add_done_callback(lambda done: self._load_done(key, done))
        return await asyncio.shield(task)

    def _load_done(self, key: str, task: asyncio.Task[Resident]) -> None:
        if self._loads.get(key) is task:
            del self._loads[key]
        if not task.cancelled():
            task.exception()  # retrieved here too: every waiter may have gone

    async def _load_serialized(self, key: str) -> Resident:
        """One load at a time (the host lock). The lock is let go while the models evicted
        for this one finish their requests, and taken again to load it."""
        evicted: list[str] = []
        need: int | None = None
        vetted = False
        try:
            while True:
                async with self._lock:
                    resident = self.resident.get(key)
                    if resident is not None and not resident.retiring:
                        return resident
                    if self.closing:
                        raise ModelLoadError("the daemon is shutting down")
                    self.loading = key
                    if not vetted:
                        previous = self.primary.key if self.primary else None
                        self._emit(EV_MODEL_LOADING, {"model": key, "replacing": previous})
                        need = await self._vet(key)  # before anything is evicted
                        vetted = True
                    try:
                        blocking = self._make_room(key, need, evicted)
                    except NoRoomForModel as exc:  # a pin while models were evicted for it
                        self._load_failed(key, str(exc))
                        await self._restore(evicted)
                        raise
                    if not blocking:
                        return await self._load_locked(key, evicted)
                await self._wait_gone(blocking)
        finally:
            if self.loading == key:
                self.loading = None

    async def _vet(self, key: str) -> int | None:
        """Refuse `key` before anything is evicted: broken files (a bad config.json,
        safetensors or GGUF header), weights that cannot fit even with every resident model
        unloaded (`ModelTooLarge`), or room that only pinned models hold (`NoRoomForModel`).
        Returns the bytes its weights will take here (None: unknown)."""
        from mlxcel.daemon.models.loader import backend_name, resolve_spec

        backend = backend_name()
        try:
            need = await asyncio.to_thread(precheck, resolve_spec, key, backend)
            if need is not None:
                available = psutil.virtual_memory().available
                freeable = sum(r.weights_bytes for r in self.resident.values())
                if need * MEMORY_HEADROOM > available + freeable:
                    raise ModelTooLarge(too_large(key, need, backend, available, freeable))
            self._check_room(key, need, backend)
        except ModelLoadError as exc:
            self._load_failed(key, str(exc))
            raise
        except Exception as exc:  # an unreadable file, say: one line, nothing evicted
            message = f"cannot load model {key!r}: {one_line(exc)}"
            self._load_failed(key, message)
            raise ModelLoadError(message) from exc
        return need

    async def _load_locked(self, key: str, evicted: list[str]) -> Resident:
        started = time.monotonic()
        loaded: LoadedModel | None = None
        _engine: Engine | None = None
        bridge: EngineBridge | None = None
        failure: str | None = None
        try:
            loaded, _engine, bridge = await in_daemon_thread(self._loader, key)
            assert bridge is not None and loaded is not None  # (mypy: unpacking does not narrow)
            bridge.start()
            resident = self._register(key, loaded, bridge, time.monotonic() - started)
        except Exception as exc:  # whatever failed (MemoryError, MLX, OSError): serve on
            if isinstance(exc, ModelLoadError):
                failure = str(exc)
            else:
                failure = f"cannot load model {key!r}: {one_line(exc)}"
                log.warning("loading model %s raised", key, exc_info=exc)
        if failure is not None:
            # Out of the except block: the traceback (and the half-loaded weights its frames
            # hold) is gone before the evicted model is loaded back.
            self._load_failed(key, failure)
            await self._discard(key, bridge)
            loaded = _engine = bridge = None
            await self._release_memory()
            await self._restore(evicted)
            raise ModelLoadError(failure)
        info = resident.loaded.info
        log.info("model %s loaded in %.2f s (%s, %s)", key, resident.load_s, info.family, info.path)
        self._emit(
            EV_MODEL_LOADED,
            {"model": key, "load_s": resident.load_s, "weights_bytes": info.weights_bytes},
        )
        if evicted:
            self._emit(
                EV_MODEL_SWITCHED, {"from": evicted[0], "to": key, "load_s": resident.load_s}
            )
        return resident

    async def _discard(self, key: str, bridge: EngineBridge | None) -> None:
        """What a failed load left (a started bridge, a half registration) goes."""
        resident = self.resident.get(key)
        if resident is not None and bridge is not None and resident.bridge is bridge:
            del self.resident[key]
            self._primary_changed()
        if bridge is not None:
            with contextlib.suppress(Exception):
                bridge.remove_listener(self.facade.forward)
                await bridge.shutdown(drain=False)

    @staticmethod
    async def _release_memory() -> None:
        from mlxcel.daemon.models.loader import release_memory

        with contextlib.suppress(Exception):
            await asyncio.to_thread(release_memory)

    def _load_failed(self, key: str, message: str) -> None:
        self.counters.load_failures += 1
        log.warning("model %s failed to load: %s", key, message)
        self._emit(EV_MODEL_LOAD_FAILED, {"model": key, "error": message})

    def _make_room(self, key: str, need: int | None, evicted: list[str]) -> list[Resident]:
        """The residents `key`'s load waits for: the same model still unloading, models already
        retiring, or the least recently used unpinned one (idle ones first), retired now for
        it ([] when there is room). `NoRoomForModel` when only pinned models are left and the
        place or `models_memory` they hold is what is missing."""
        same = self.resident.get(key)
        if same is not None and same.retiring:
            return [same]
        if not self.resident or (
            len(self.resident) < self.max_loaded
            and self._budget_allows(need)
            and self._memory_allows(need)
        ):
            return []
        retiring = [r for r in self.resident.values() if r.retiring]
        if retiring:
            return retiring
        candidates = [r for r in self.resident.values() if not r.pinned]
        if not candidates:
            self._check_room(key, need, memory=False)
            return []  # only the free-memory estimate says no, with all it can free freed: try
        victim = min(candidates, key=lambda r: (r.busy, r.last_used))
        self._begin_retire(victim, "switch")
        evicted.append(victim.key)
        return [victim]

    def _memory_allows(self, need: int | None) -> bool:
        return need is None or need * MEMORY_HEADROOM <= psutil.virtual_memory().available

    def _budget_allows(self, need: int | None) -> bool:
        """The resident weights plus `need` within `models_memory` (None: no budget)."""
        budget = getattr(self.cfg, "models_memory", None)
        if budget is None or need is None:
            return True
        return sum(r.weights_bytes for r in self.resident.values()) + need <= budget

    def _check_room(
        self, key: str, need: int | None, backend: str = "", memory: bool = True
    ) -> None:
        """Raise `NoRoomForModel` when `key` cannot be loaded even with every unpinned model
        unloaded because of what the pinned ones hold: all `max_loaded_models` places, or
        `models_memory` (or, with `memory`, the free memory) it needs beside them."""
        pinned = [r for r in self.resident.values() if r.pinned and r.key != key]
        if not pinned:
            budget = getattr(self.cfg, "models_memory", None)
            if budget is not None and need is not None and need > budget:
                raise NoRoomForModel(over_budget(key, need, budget, []))
            return
        held = sum(r.weights_bytes for r in pinned)
        names = ", ".join(f"{r.key} ({format_size(r.weights_bytes)})" for r in pinned)
        hint = f"; unpin one (`mlxcel-daemon unpin {pinned[0].key}`) to make room"
        if len(pinned) >= self.max_loaded:
            raise NoRoomForModel(
                f"cannot load model {key!r}: all {self.max_loaded} places "
                f"(max_loaded_models) are held by pinned models: {names}{hint}"
            )
        budget = getattr(self.cfg, "models_memory", None)
        if budget is not None and need is not None and held + need > budget:
            raise NoRoomForModel(over_budget(key, need, budget, pinned) + hint)
        if memory and need is not None:
            others = sum(r.weights_bytes for r in self.resident.values() if not r.pinned)
            available = psutil.virtual_memory().available + others
            if need * MEMORY_HEADROOM > available:
                raise NoRoomForModel(
                    f"cannot load model {key!r}: it needs "
                    f"{format_size(need * MEMORY_HEADROOM)} of memory ({format_size(need)} of "
                    f"weights as the {backend} backend holds them, x{MEMORY_HEADROOM} "
                    f"headroom) and {format_size(available)} is available with every unpinned "
                    f"model unloaded; the pinned models hold {format_size(held)}: {names}{hint}"
                )

    async def _restore(self, evicted: list[str]) -> None:
        """A load failed after others were evicted for it: load the first one back."""
        if not evicted or evicted[0] in self.resident:
            return
        log.info("loading %s back after the failed switch", evicted[0])
        started = time.monotonic()
        loaded: LoadedModel | None = None
        _engine: Engine | None = None
        bridge: EngineBridge | None = None
        try:
            loaded, _engine, bridge = await in_daemon_thread(self._loader, evicted[0])
            assert bridge is not None and loaded is not None  # (mypy: unpacking does not narrow)
            bridge.start()
            self._register(evicted[0], loaded, bridge, time.monotonic() - started)
        except Exception as exc:
            message = str(exc) if isinstance(exc, ModelLoadError) else one_line(exc)
            self._load_failed(evicted[0], message)
            await self._discard(evicted[0], bridge)
            loaded = _engine = bridge = None
            await self._release_memory()

    def _begin_retire(self, resident: Resident, reason: str) -> asyncio.Task[None]:
        """Mark `resident` retiring (no new requests) and free it in a task of its own."""
        if resident.retire_task is None:
            resident.retiring = True
            self._primary_changed()
            resident.retire_task = asyncio.create_task(self._retire_now(resident, reason))
        return resident.retire_task

    async def _retire(self, resident: Resident, reason: str) -> None:
        await asyncio.shield(self._begin_retire(resident, reason))

    async def _wait_gone(self, residents: list[Resident]) -> None:
        tasks = [r.retire_task for r in residents if r.retire_task is not None]
        await asyncio.gather(*(asyncio.shield(t) for t in tasks), return_exceptions=True)

    async def _retire_now(self, resident: Resident, reason: str) -> None:
        """Running and queued requests finish within UNLOAD_WAIT_S, the rest are aborted;
        then stop the engine and free it. Holds no lock."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UNLOAD_WAIT_S
        while resident.busy and loop.time() < deadline:
            await asyncio.sleep(RETIRE_POLL_S)
        bridge = resident.bridge
        if resident.busy:
            log.warning(
                "model %s: %d requests still held after %.0f s; aborting them to unload it",
                resident.key,
                max(resident.leases, bridge.num_running + bridge.num_waiting),
                UNLOAD_WAIT_S,
            )
            with contextlib.suppress(Exception):
                await bridge.shutdown(drain=False)  # their clients get a final "abort"
            deadline = loop.time() + ABORT_GRACE_S
            while resident.leases > 0 and loop.time() < deadline:
                await asyncio.sleep(RETIRE_POLL_S)
            if resident.leases > 0:
                log.warning("model %s freed with %d leases held", resident.key, resident.leases)
        try:
            self.facade.keep_observations(bridge.drain_observations())
            self.facade.remember(bridge.snapshot())
        except Exception:
            log.exception("model %s: reading its last figures failed", resident.key)
        bridge.remove_listener(self.facade.forward)
        try:
            await bridge.shutdown(drain=False)
        except Exception:
            log.exception("model %s: stopping its engine failed", resident.key)
        if self.resident.get(resident.key) is resident:
            del self.resident[resident.key]
        weights = resident.loaded.info.weights_bytes
        # dropped so the weights can go (the resident is out of the table, never used again)
        resident.loaded = resident.bridge = resident.ctx = None  # type: ignore[assignment]
        del bridge  # the last reference to its engine and weights before the memory goes
        self._primary_changed()
        from mlxcel.daemon.models.loader import release_memory

        await asyncio.to_thread(release_memory)
        self.counters.unloads += 1
        log.info("model %s unloaded (%s)", resident.key, reason)
        self._emit(
            EV_MODEL_UNLOADED,
            {"model": resident.key, "reason": reason, "weights_bytes": weights},
        )

    async def load(self, name: str) -> dict[str, Any]:
        """`model.load`: load `name` (a path too) and make it the default for requests."""
        key = self.resolve(name, allow_paths=True)
        resident = await self.ensure_loaded(key)
        self._last_key = key
        return resident.state(self.keep_alive_s)

    async def unload(self, name: str | None) -> dict[str, Any]:
        """`model.unload`: unload `name` (default: every unpinned resident model) after its
        requests; a pinned `name` is refused (`ModelPinned`)."""
        if self.fixed:
            raise ModelNotFound("a distributed group serves its one model: it cannot be unloaded")
        kept: list[str] = []
        if name:
            resident = self.find_resident(name)
            if resident is None:
                raise ModelNotFound(f"model {name!r} is not loaded")
            if resident.pinned:
                raise ModelPinned(
                    f"model {resident.key!r} is pinned: unpin it first "
                    f"(`mlxcel-daemon unpin {resident.key}`), then unload it"
                )
            victims = [resident]
        else:
            victims = [r for r in self.resident.values() if not r.pinned]
            kept = [r.key for r in self.resident.values() if r.pinned]
        # Marked now (no new requests), freed in their own tasks: no lock is held while
        # their requests finish (at most UNLOAD_WAIT_S), so other models serve and load.
        tasks = [self._begin_retire(victim, "request") for victim in victims]
        await asyncio.gather(*(asyncio.shield(t) for t in tasks))
        result: dict[str, Any] = {"unloaded": [v.key for v in victims]}
        if kept:
            result["pinned"] = kept  # unload of every model leaves the pinned ones
        return result

    async def pin(self, name: str) -> dict[str, Any]:
        """`model.pin`: load `name` unless resident (as `load` does, a path too), then pin it:
        it is never evicted for another model nor unloaded by keep-alive until `unpin`."""
        key = self.resolve(name, allow_paths=True)
        while True:
            resident = await self.ensure_loaded(key)
            if self.resident.get(key) is resident and not resident.retiring:
                break
        if not resident.pinned:
            resident.pinned = True
            log.info("model %s pinned", key)
            self._emit(EV_MODEL_PINNED, {"model": key})
        return resident.state(self.keep_alive_s)

    async def unpin(self, name: str) -> dict[str, Any]:
        """`model.unpin`: the resident model `name` may be evicted and keep-alive unloads it
        again; its keep-alive counts from now."""
        resident = self.find_resident(name)
        if resident is None or resident.retiring:
            raise ModelNotFound(f"model {name!r} is not loaded")
        if resident.pinned:
            resident.pinned = False
            resident.last_used = time.monotonic()
            log.info("model %s unpinned", resident.key)
            self._emit(EV_MODEL_UNPINNED, {"model": resident.key})
        return resident.state(self.keep_alive_s)

    def _reap_period(self) -> float:
        """A quarter of the shortest keep-alive in force, between 50 ms and 1 s."""
        spans = [
            self.keep_alive_s,
            *(r.keep_alive(self.keep_alive_s) for r in self.resident.values()),
        ]
        finite = [s for s in spans if s is not None]
        return min(1.0, max(0.05, min(finite, default=4.0) / 4))

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(self._reap_period())
            if self._lock.locked():
                continue
            now = time.monotonic()
            for resident in list(self.resident.values()):
                idle = now - resident.last_used
                keep_alive = resident.keep_alive(self.keep_alive_s)
                if keep_alive is None or resident.busy or resident.retiring or resident.pinned:
                    continue
                if idle >= keep_alive and resident.key in self.resident:
                    await self._retire(resident, "keep_alive")

    async def close(self, stop: StopRequest) -> None:
        """Daemon stop: no more loads; every resident model lets its requests finish as
        `stop` says (read while they drain: a second signal hurries them), then its engine
        stops (`drain_bridge`, a distributed group's ranks too)."""
        self.closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        residents = list(self.resident.values())
        await asyncio.gather(*(drain_bridge(r.bridge, stop) for r in residents))

    # -- reads -------------------------------------------------------------------------------

    def states(self) -> list[dict[str, Any]]:
        out = [r.state(self.keep_alive_s) for r in self.resident.values()]
        if self.loading is not None and self.loading not in self.resident:
            out.append({"name": self.loading, "state": "loading"})
        return out

    def status(self) -> dict[str, Any]:
        c = self.counters
        return {
            "models": self.states(),
            "default": self._last_key,
            "max_loaded_models": self.max_loaded,
            "models_memory": getattr(self.cfg, "models_memory", None),
            "resident_weights_bytes": sum(r.weights_bytes for r in self.resident.values()),
            "keep_alive_s": self.keep_alive_s,
            "loads": c.loads,
            "unloads": c.unloads,
            "load_failures": c.load_failures,
            "load_seconds_total": round(c.load_seconds, 3),
            "last_load_s": None if c.last_load_s is None else round(c.last_load_s, 3),
        }
