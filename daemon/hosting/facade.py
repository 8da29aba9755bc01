"""`HostBridge`: the host seen as one bridge, by `DaemonRuntime`, the control socket and the
metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlxcel.shared.config import runtime_change
from mlxcel.shared.snapshot import ConfigChange, EngineSnapshot, SlotInfo

if TYPE_CHECKING:
    from mlxcel.daemon.hosting.host import ModelHost


class HostBridge:
    """The bridge-shaped view of the host for `DaemonRuntime`, the control socket and the
    metrics: the primary model's bridge plus the requests waiting for a model to load; an
    idle snapshot of the last model while none is loaded."""

    def __init__(self, host: ModelHost) -> None:
        self._host = host
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._observations: list[Any] = []
        self._last: EngineSnapshot | None = None
        self._rejections: dict[str, int] = {}

    # events from every resident bridge go to our listeners
    def forward(self, name: str, data: dict[str, Any]) -> None:
        for callback in list(self._listeners):
            callback(name, data)

    def add_listener(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    def keep_observations(self, observations: list[Any]) -> None:
        self._observations.extend(observations)

    def remember(self, snapshot: EngineSnapshot) -> None:
        self._last = snapshot

    def _bridge(self) -> Any:
        primary = self._host.primary
        return None if primary is None else primary.bridge

    @property
    def engine(self) -> Any:
        """The primary model's engine (None while none is loaded)."""
        bridge = self._bridge()
        return None if bridge is None else bridge.engine

    def snapshot(self) -> EngineSnapshot | None:
        bridge = self._bridge()
        waiting = self._host.waiting_entries()
        if bridge is not None:
            snap = bridge.snapshot()
            return dataclasses.replace(snap, queue=snap.queue + waiting) if waiting else snap
        last = self._last
        if last is None:
            return None
        return dataclasses.replace(
            last,
            time=time.time(),
            slots=tuple(SlotInfo(s.id) for s in last.slots),
            queue=waiting,
            kv=dataclasses.replace(last.kv, blocks_used=0, blocks_cached=0),
            prompt_cache=dataclasses.replace(last.prompt_cache, entries=0, bytes=0),
        )

    @property
    def num_running(self) -> int:
        return sum(r.bridge.num_running for r in self._host.resident.values())

    @property
    def num_waiting(self) -> int:
        waiting = sum(r.bridge.num_waiting for r in self._host.resident.values())
        return waiting + self._host.num_waiting_for_load

    def drain_observations(self) -> list[Any]:
        out, self._observations = self._observations, []
        for resident in self._host.resident.values():
            out += resident.bridge.drain_observations()
        return out

    def rejections(self) -> dict[str, int] | None:
        bridge = self._bridge()
        return dict(self._rejections) if bridge is None else bridge.rejections()

    def record_rejection(self, reason: str) -> None:
        bridge = self._bridge()
        if bridge is None:
            self._rejections[reason] = self._rejections.get(reason, 0) + 1
        else:
            bridge.record_rejection(reason)

    async def reconfigure(self, values: dict[str, Any]) -> list[ConfigChange]:
        """Applied to every resident model and kept for the ones loaded later."""
        host = self._host
        residents = list(host.resident.values())
        if not residents:
            return [self._offline_change(k, v) for k, v in values.items()]
        results = [await r.bridge.reconfigure(values) for r in residents]
        primary = host.primary
        changes = results[residents.index(primary)] if primary in residents else results[0]
        for change in changes:
            if change.applied:
                key, parsed = runtime_change(change.key, change.requested)
                host.cfg = host.cfg.replace(**{key: parsed})
        return changes

    def _offline_change(self, key: str, value: Any) -> ConfigChange:
        from mlxcel.shared.config import ConfigError

        try:
            name, parsed = runtime_change(key, value)
        except ConfigError as exc:
            return ConfigChange(key, value, False, None, None, str(exc))
        previous = getattr(self._host.cfg, name)
        self._host.cfg = self._host.cfg.replace(**{name: parsed})
        return ConfigChange(key, value, True, parsed, previous, "applies when a model loads")

    async def reset_prompt_cache(self, tier: str = "all") -> dict[str, Any]:
        total = {"entries_freed": 0, "bytes_freed": 0}
        for resident in list(self._host.resident.values()):
            result = await resident.bridge.reset_prompt_cache(tier)
            for k, v in result.items():  # the disk tier's counts where it is on
                total[k] = total.get(k, 0) + int(v)
        return total

    async def cancel(self, request_id: str) -> bool:
        for resident in list(self._host.resident.values()):
            if await resident.bridge.cancel(request_id):
                return True
        return False
