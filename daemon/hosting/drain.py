"""Stopping a model's engine: the one drain path, at daemon stop, for every resident model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxcel.daemon.engine.bridge import DRAIN_POLL_S  # plain Python: loads no mlx
from mlxcel.daemon.engine.group import group_of

if TYPE_CHECKING:
    from mlxcel.daemon.engine.bridge import EngineBridge

log = logging.getLogger("mlxcel.daemon")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
GROUP_STOP_WAIT_S = 15.0
BROKEN_GROUP_STOP_WAIT_S = 2.0  # an engine thread waiting on a lost rank may never return


@dataclass
class StopRequest:
    """How the daemon stops. Read while it drains: a second signal clears `drain`, and every
    model still draining stops waiting for its requests at once."""

    drain: bool = True
    timeout: float = DEFAULT_DRAIN_TIMEOUT_S


async def drain_bridge(bridge: EngineBridge, stop: StopRequest) -> None:
    """Let `bridge`'s running and queued requests finish (until `stop.timeout` or `stop.drain`
    is cleared), then abort the rest and stop its engine; a distributed group's ranks too."""
    bridge.engine.shutting_down = True  # the engine refuses new work from here on
    deadline = time.monotonic() + stop.timeout
    while stop.drain and (bridge.num_running or bridge.num_waiting):
        group = group_of(bridge.engine)
        if group is not None and group.degraded:  # a broken group: nothing will finish
            break
        if time.monotonic() >= deadline:
            log.warning("drain timeout: aborting %d requests", bridge.num_running)
            break
        await asyncio.sleep(DRAIN_POLL_S)
    group = group_of(bridge.engine)
    if group is None:
        await bridge.shutdown(drain=False)
        return
    stop_group = group.stop_group
    # a distributed group: a broken one loses its ranks first (that frees an engine thread
    # waiting on one); an engine thread that stays stuck must not hang the stop
    loop = asyncio.get_running_loop()
    broken = bool(group.degraded)
    if broken:
        await loop.run_in_executor(None, stop_group)
    with contextlib.suppress(asyncio.TimeoutError):
        wait = BROKEN_GROUP_STOP_WAIT_S if broken else GROUP_STOP_WAIT_S
        await asyncio.wait_for(bridge.shutdown(drain=False), wait)
    await loop.run_in_executor(None, stop_group)
