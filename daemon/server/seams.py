"""The typed seams between the serving side (HTTP handlers, `DaemonRuntime`, the control socket,
the metrics) and the engines (docs/internals.md, "EngineBridge API").

`EngineBridge` (one model's engine thread) satisfies both protocols; `hosting.facade.HostBridge`
(every resident model seen as one) satisfies `ControlBridge`. Plain Python: the engine types
are imported for annotations only, so importing this imports no mlx.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mlxcel.shared.snapshot import ConfigChange, EngineSnapshot

if TYPE_CHECKING:
    from mlxcel.daemon.engine.bridge import RequestStream
    from mlxcel.daemon.engine.types import GenerationRequest

Listener = Callable[[str, dict[str, Any]], None]


@runtime_checkable
class RequestBridge(Protocol):
    """What a request handler and its `Generation` use of the model it runs on."""

    def submit(self, request: GenerationRequest) -> RequestStream: ...

    async def compile_schema(self, schema: str | None) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    def record_rejection(self, reason: str) -> None: ...


@runtime_checkable
class ControlBridge(Protocol):
    """What `DaemonRuntime`, the control socket and the metrics use of the engines."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def snapshot(self) -> EngineSnapshot | None:
        """None only before the first model was loaded (`HostBridge`)."""
        ...

    def rejections(self) -> dict[str, int] | None: ...

    def record_rejection(self, reason: str) -> None: ...

    def drain_observations(self) -> list[Any]: ...

    async def reconfigure(self, values: dict[str, Any]) -> list[ConfigChange]: ...

    async def reset_prompt_cache(self, tier: str = "all") -> dict[str, Any]:
        """Clear the prompt cache: both tiers, or "ram" only (docs/api.md)."""
        ...

    async def cancel(self, request_id: str) -> bool: ...

    def add_listener(self, callback: Listener) -> None: ...

    def remove_listener(self, callback: Listener) -> None: ...
