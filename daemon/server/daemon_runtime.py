"""The running daemon as the control API sees it: identity, snapshots, runtime config.

Lives on the event-loop thread; reaches the engine only through the EngineBridge.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from mlxcel.daemon.engine.group import group_of
from mlxcel.daemon.forward.blas import blas_label, native_libraries
from mlxcel.daemon.process.option_sources import save_runtime_values
from mlxcel.shared import PROTOCOL_VERSION, __version__
from mlxcel.shared.config import RUNTIME_KEYS, ConfigError, ServingConfig, runtime_change
from mlxcel.shared.protocol import (
    E_INVALID,
    E_NOT_FOUND,
    EV_CANCELLED,
    EV_REJECTED,
    METHODS,
    ProtocolError,
)
from mlxcel.shared.snapshot import DaemonInfo, EngineSnapshot, GroupInfo, ModelHostInfo, Snapshot
from mlxcel.shared.switches import set_switches

if TYPE_CHECKING:
    from mlxcel.daemon.hosting.host import ModelHost
    from mlxcel.daemon.server.seams import ControlBridge

log = logging.getLogger("mlxcel.daemon")

PROCESS_STATS_TTL_S = 1.0
CACHE_TIERS = ("all", "ram")  # what a prompt-cache reset clears: both tiers, or RAM only
EventSink = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class DaemonIdentity:
    """Facts fixed for the daemon's life."""

    model: str
    model_path: str
    family: str
    backend: str
    dtype: str
    blas: str | None
    http_url: str
    socket_path: str
    service: str | None = None
    pid: int = field(default_factory=os.getpid)
    version: str = __version__


def native_summary() -> str:
    """Where each native library of this process came from, for status: `gemm package, ops
    cache`, or `ops none (no C compiler: ...)` (forward/blas.py, docs/platforms.md)."""
    parts = []
    for kind, entry in native_libraries().items():
        origin = entry.get("origin") or "none"
        why = entry.get("why")
        parts.append(f"{kind} {origin} ({why})" if origin == "none" and why else f"{kind} {origin}")
    return ", ".join(parts)


class DaemonRuntime:
    def __init__(
        self,
        bridge: ControlBridge,
        identity: DaemonIdentity,
        config: ServingConfig,
        config_path: Path,
        on_shutdown: Callable[[bool, float | None], None],
    ) -> None:
        self.bridge = bridge
        self.set_identity(identity)
        self.config_path = config_path
        self._on_shutdown = on_shutdown
        self._started = time.monotonic()
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only starts the measurement
        self._proc_stats: tuple[float, int | None, float | None] = (0.0, None, None)
        self._mlx_mem: tuple[int | None, int | None, int | None] = (None, None, None)
        self._cached: tuple[EngineSnapshot, float, dict[str, Any]] | None = None
        self._sinks: list[EventSink] = []
        self.host: ModelHost | None = None  # the resident models (docs/models.md)
        # Seconds a streaming client may read nothing before its stream is cut (stream_write.py).
        self.stream_timeout: float = config.stream_timeout
        # The sampling defaults set (--temperature, ...): name -> value, for status.
        self.sampling = config.sampling_set()
        # What config.save writes: the operator's values, updated by applied changes.
        self._runtime_values: dict[str, Any] = {k: getattr(config, k) for k in RUNTIME_KEYS}
        bridge.add_listener(self._emit)

    # -- events ------------------------------------------------------------------------------

    def add_event_sink(self, sink: EventSink) -> None:
        self._sinks.append(sink)

    def _emit(self, name: str, data: dict[str, Any]) -> None:
        for sink in list(self._sinks):
            sink(name, data)

    def publish(self, name: str, data: dict[str, Any]) -> None:
        """An event from outside the engine (the model host's loads and unloads)."""
        self._emit(name, data)

    def reject(self, request_id: str | None, reason: str, message: str) -> None:
        """Report a request the HTTP layer refused before the engine saw it."""
        self._emit(EV_REJECTED, {"request_id": request_id, "reason": reason, "message": message})

    # -- reads -------------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        ident = self.identity
        return {
            "protocol": PROTOCOL_VERSION,
            "version": ident.version,
            "model": ident.model,
            "pid": ident.pid,
            "backend": ident.backend,
            "dtype": ident.dtype,
            "http_url": ident.http_url,
            "socket": ident.socket_path,
            "methods": list(METHODS),
            "runtime_keys": list(RUNTIME_KEYS),
        }

    def daemon_info(self) -> DaemonInfo:
        now = time.monotonic()
        taken, rss, cpu = self._proc_stats
        if now - taken >= PROCESS_STATS_TTL_S:
            try:
                rss = self._process.memory_info().rss
                cpu = self._process.cpu_percent(None)
            except psutil.Error:
                rss, cpu = None, None
            self._proc_stats = (now, rss, cpu)
            self._mlx_mem = _mlx_memory()
        ident = self.identity
        return DaemonInfo(
            version=ident.version,
            pid=ident.pid,
            uptime_s=now - self._started,
            model=ident.model,
            backend=ident.backend,
            dtype=ident.dtype,
            rss_bytes=rss,
            cpu_percent=cpu,
            http_url=ident.http_url,
            socket_path=ident.socket_path,
            blas=self.blas,
            native=self.native,
            service=ident.service,
            mlx_active_bytes=self._mlx_mem[0],
            mlx_cache_bytes=self._mlx_mem[1],
            mlx_peak_bytes=self._mlx_mem[2],
            host=None if self.host is None else ModelHostInfo.from_dict(self.host.status()),
            switches=set_switches(),
            sampling=self.sampling,
        )

    def group_info(self) -> GroupInfo | None:
        """A distributed group's ranks and state (docs/distributed.md); None: one process."""
        # the bridges have an `engine` (the runtime's fakes in tests may not)
        group = group_of(getattr(self.bridge, "engine", None))
        return group.group_info() if group is not None else None

    def _engine_snapshot(self) -> EngineSnapshot:
        """The engines' snapshot; the runtime is built once the first model is loaded, so there
        is one (`ControlBridge.snapshot` is None only before that)."""
        engine = self.bridge.snapshot()
        if engine is None:
            raise RuntimeError("no model has been loaded yet")
        return engine

    def set_identity(self, identity: DaemonIdentity) -> None:
        """What the daemon serves (its default model's fields change with the model), and the
        figures read from it: the matmul backend in use ("openblas SkylakeX + sgemm avx512",
        "metal", "cuda", ...) and the native kernels."""
        self.identity = identity
        self.blas: str | None = blas_label(identity.backend) if identity.blas else None
        self.native = native_summary() if identity.backend == "cpu" else None

    def snapshot_dict(self) -> dict[str, Any]:
        """`Snapshot.to_dict()`, reused while neither the engine nor the process figures moved."""
        engine = self._engine_snapshot()
        cached = self._cached
        if cached is not None and cached[0] is engine and cached[1] == self._proc_stats[0]:
            return cached[2]
        group = self.group_info()
        data = Snapshot(daemon=self.daemon_info(), engine=engine, group=group).to_dict()
        if group is None:  # a group's figures move without engine steps (degraded, ranks)
            self._cached = (engine, self._proc_stats[0], data)
        return data

    def config_dict(self) -> dict[str, Any]:
        return {
            "effective": self._engine_snapshot().config.to_dict(),
            "runtime_keys": list(RUNTIME_KEYS),
            "saved_values": dict(self._runtime_values),
            "config_file": str(self.config_path),
        }

    # -- changes -----------------------------------------------------------------------------

    async def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        changes = await self.bridge.reconfigure(values)
        for change in changes:
            if change.applied:
                key, parsed = runtime_change(change.key, change.requested)
                self._runtime_values[key] = parsed
                log.info(
                    "config %s: %s -> %s%s",
                    change.key,
                    change.previous,
                    change.effective,
                    f" ({change.reason})" if change.reason else "",
                )
            else:
                log.info("config %s = %r refused: %s", change.key, change.requested, change.reason)
        return {
            "changes": [c.to_dict() for c in changes],
            "effective": self._engine_snapshot().config.to_dict(),
        }

    async def save_config(self) -> dict[str, Any]:
        values = {k: v for k, v in self._runtime_values.items() if v is not None}
        try:
            written = save_runtime_values(self.config_path, values)
        except (ConfigError, OSError) as exc:
            log.warning("config.save refused: %s", exc)
            raise ProtocolError("config_save_failed", str(exc)) from None
        log.info("config saved to %s: %s", self.config_path, values)
        return {"path": str(self.config_path), "saved": {k: values[k] for k in written}}

    async def reset_cache(self, tier: str = "all") -> dict[str, Any]:
        """Clear the prompt cache's RAM and disk tiers, or only RAM (`tier` "ram")."""
        if tier not in CACHE_TIERS:
            raise ProtocolError(
                E_INVALID, f"tier must be one of {', '.join(CACHE_TIERS)}, got {tier!r}"
            )
        result = await self.bridge.reset_prompt_cache(tier)
        log.info("prompt cache reset: %s", result)
        return result

    async def cancel_request(self, request_id: str, by: str) -> dict[str, Any]:
        """Abort one waiting or running request (`request.cancel`); its client's stream ends
        with finish_reason "abort" and the usage; `by` names who asked, for the event log."""
        if not await self.bridge.cancel(request_id):
            raise ProtocolError(
                E_NOT_FOUND, f"no waiting or running request {request_id!r} (finished or unknown)"
            )
        log.info("request %s cancelled by %s", request_id, by)
        self._emit(EV_CANCELLED, {"request_id": request_id, "by": by})
        return {"request_id": request_id, "cancelled": True, "by": by}

    # -- models (model.list / model.load / model.unload / model.pin / model.unpin) -----------

    async def models(self) -> dict[str, Any]:
        """`model.list`: the host's status and the local models on disk (store, HF cache)."""
        import asyncio

        from mlxcel.daemon.hosting.catalogue import local_catalogue

        status = self._require_host().status()
        local = await asyncio.to_thread(local_catalogue)
        status["available"] = [{k: v for k, v in m.to_dict().items() if k != "path"} for m in local]
        return status

    async def load_model(self, name: str) -> dict[str, Any]:
        return await self._loading(self._require_host().load, name)

    async def pin_model(self, name: str) -> dict[str, Any]:
        """`model.pin`: loaded first unless resident, then kept until `model.unpin`."""
        return await self._loading(self._require_host().pin, name)

    async def _loading(self, call: Any, name: str) -> dict[str, Any]:
        from mlxcel.daemon.hosting.errors import ModelNotFound, NoRoomForModel
        from mlxcel.daemon.models.info import ModelLoadError

        try:
            return await call(name)
        except ModelNotFound as exc:
            raise ProtocolError(E_NOT_FOUND, str(exc)) from None
        except NoRoomForModel as exc:  # pinned models or models_memory: nothing was evicted
            raise ProtocolError("no_room_for_model", str(exc)) from None
        except ModelLoadError as exc:
            raise ProtocolError("model_load_failed", str(exc)) from None

    async def unload_model(self, name: str | None) -> dict[str, Any]:
        from mlxcel.daemon.hosting.errors import ModelNotFound, ModelPinned

        try:
            return await self._require_host().unload(name)
        except ModelNotFound as exc:
            raise ProtocolError(E_NOT_FOUND, str(exc)) from None
        except ModelPinned as exc:
            raise ProtocolError("model_pinned", str(exc)) from None

    async def unpin_model(self, name: str) -> dict[str, Any]:
        from mlxcel.daemon.hosting.errors import ModelNotFound

        try:
            return await self._require_host().unpin(name)
        except ModelNotFound as exc:
            raise ProtocolError(E_NOT_FOUND, str(exc)) from None

    def _require_host(self) -> Any:
        if self.host is None:
            raise ProtocolError(E_NOT_FOUND, "no model host in this daemon")
        return self.host

    def request_shutdown(self, drain: bool, timeout: float | None) -> None:
        log.info("shutdown requested over the control socket (drain=%s)", drain)
        self._on_shutdown(drain, timeout)


def _mlx_memory() -> tuple[int | None, int | None, int | None]:
    try:
        from mlxcel.daemon.engine.memory import mlx_memory

        return mlx_memory()
    except Exception:  # no usable MLX here: the figures are unknown, not an error
        return None, None, None
