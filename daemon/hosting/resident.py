"""A model held in memory (`Resident`) and the host's load/unload counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxcel.daemon.engine.bridge import EngineBridge
    from mlxcel.daemon.models.loader import LoadedModel
    from mlxcel.daemon.server.http_app import ModelContext


@dataclass
class Resident:
    key: str  # the name requests resolve to
    spec: str  # what was loaded (store name, alias target, path or repo id)
    loaded: LoadedModel
    bridge: EngineBridge
    ctx: ModelContext
    loaded_at: float  # wall clock
    load_s: float
    last_used: float = field(default_factory=time.monotonic)
    leases: int = 0
    retiring: bool = False
    # A request's own keep-alive (Ollama's `keep_alive`): replaces the daemon's for this model
    # until it is unloaded; None in it means forever.
    own_keep_alive: tuple[float | None] | None = None
    retire_task: asyncio.Task[None] | None = None  # set with `retiring`; done once freed
    pinned: bool = False  # never evicted for another model, never unloaded by keep-alive

    @property
    def weights_bytes(self) -> int:
        return int(self.loaded.info.weights_bytes)

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.bridge.num_running > 0 or self.bridge.num_waiting > 0

    def keep_alive(self, default: float | None) -> float | None:
        """How long this model may stay idle: the last request's own keep-alive, else `default`."""
        return default if self.own_keep_alive is None else self.own_keep_alive[0]

    def state(self, keep_alive_s: float | None) -> dict[str, Any]:
        """Its figures; `keep_alive_s` is the daemon's (the model's own one wins)."""
        keep_alive_s = self.keep_alive(keep_alive_s)
        info = self.loaded.info
        idle = time.monotonic() - self.last_used
        expires = None
        if keep_alive_s is not None and not self.busy and not self.pinned:
            expires = max(0.0, keep_alive_s - idle)
        return {
            "name": self.key,
            "names": sorted(self.ctx.names),
            "state": "unloading" if self.retiring else "loaded",
            "pinned": self.pinned,
            "path": info.path,
            "family": info.family,
            "dtype": info.dtype,
            "quantization": info.quantization,
            "forward": info.forward,  # the forward plan's line (forward/forward_plan.py)
            "context_length": info.context_length,
            "weights_bytes": info.weights_bytes,
            "kv_budget_bytes": self.bridge.snapshot().kv.budget_bytes,
            "loaded_at": self.loaded_at,
            "load_s": round(self.load_s, 3),
            "active_requests": self.leases,
            "idle_s": round(0.0 if self.busy else idle, 3),
            "expires_in_s": None if expires is None else round(expires, 3),
            "keep_alive_s": keep_alive_s,  # this model's (a request's own, else the daemon's)
        }


@dataclass
class HostCounters:
    loads: int = 0
    unloads: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0
    last_load_s: float | None = None
