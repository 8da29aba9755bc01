"""The members a distributed group's engine adds to an engine (`DistributedEngine`,
daemon/distributed/group_engine.py): the bridge, the runtime and the daemon's stop ask any
engine for them through `group_of`, which answers None for a single-process one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mlxcel.shared.snapshot import GroupInfo


@runtime_checkable
class EngineGroup(Protocol):
    """Rank 0's engine of a group of processes (docs/distributed.md)."""

    # why the group stopped working (a rank lost, a step past `distributed_timeout`), or None
    degraded: str | None

    def stop_group(self) -> None:
        """End ranks 1..n-1 (after the engine thread stopped or was given up on)."""
        ...

    def group_info(self) -> GroupInfo:
        """The group's ranks and state, for `status` and the console."""
        ...


def group_of(engine: object) -> EngineGroup | None:
    """`engine` as a group's engine, or None for an engine of one process (or none)."""
    return engine if isinstance(engine, EngineGroup) else None
