"""Ranks 1..n-1 of a group: `python -m mlxcel.daemon.distributed.worker` (started by rank 0,
with `MLX_RANK` and `MLX_HOSTFILE` set and the group's key on stdin; docs/distributed.md).

A worker has no HTTP, no socket and no scheduler of its own: it joins the group, receives the
serving config, loads its shard, builds the same engine as rank 0 and then, for every message
rank 0 sends, applies the recorded commands to its engine and runs the step. It exits 0 on
rank 0's `stop`, and 1 when rank 0 is gone (its collective raises). A message that fails
authentication, is replayed, or is not one of the messages that travel (`wire.py`) is logged
and dropped: nothing of it runs.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from mlxcel.daemon.distributed import wire

log = logging.getLogger("mlxcel.distributed")


def serve_rank() -> int:
    from mlxcel.daemon.forward.blas import ensure_fast_blas

    ensure_fast_blas()  # same BLAS as rank 0 (the env is inherited; a no-op then)
    import mlx.core as mx
    from mlxcel.daemon.distributed import launch
    from mlxcel.daemon.distributed.channel import Channel
    from mlxcel.daemon.engine.core import Engine

    with launch.guarded(None):  # rank 0 gone or silent before the group is up: this ends
        key = launch.read_group_key()
        group = launch.join_group()
        rank = group.rank()
        log.info("rank %d of %d joined (pid %d)", rank, group.size(), os.getpid())
        channel = Channel(group, key)
        while True:  # only an authentic setup starts the load (a stop ends the rank)
            setup = receive(channel, launch.figures())
            if setup is not None and setup["kind"] in ("setup", "stop"):
                break
            if setup is not None:
                log.warning("distributed: %s before the setup, ignored", setup["kind"])
        if setup["kind"] == "stop":
            log.info("rank %d: stop from rank 0", rank)
            return 0
        cfg, mode = setup["config"], setup["mode"]
        loaded = launch.load_shard(cfg, mode, group)
        engine = launch.build_engine(channel, loaded, cfg, Engine)
        engine.local_policy = False  # rank 0 serves FIFO too: the same decisions on every rank
    log.info("rank %d ready: %s parallel, %s", rank, mode, loaded.info.name)
    steps, step_us = 0, 0
    while True:
        message = receive(channel, launch.figures(steps, step_us))
        if message is None or message["kind"] == "setup":
            continue
        for name, args in message["commands"]:
            if name not in wire.COMMANDS:  # the decoder passes no other; never getattr one
                log.error("unknown command %r from rank 0", name)
                continue
            try:
                getattr(engine, name)(*args)
            except Exception:
                log.exception("command %s failed (rank 0 ran it too)", name)
        kind = message["kind"]
        if kind == "stop":
            log.info("rank %d: stop from rank 0", rank)
            return 0
        if kind == "step":
            mx.random.seed(message["seed"])
            start = time.perf_counter()
            engine.step()
            step_us = int((time.perf_counter() - start) * 1e6)
            steps += 1


def receive(channel: Any, figures: Any) -> dict[str, Any] | None:
    """The next message from rank 0; None (logged) for one that was dropped."""
    from mlxcel.daemon.distributed.wire import ChannelError

    try:
        message: dict[str, Any] = channel.exchange(None, figures)
    except ChannelError as exc:
        log.error("distributed: %s", exc)
        return None
    return message


def main() -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{os.environ.get('MLX_RANK', '?')} %(name)s: "
        "%(message)s",
    )
    try:
        return serve_rank()
    except KeyboardInterrupt:
        return 1
    except Exception as exc:
        log.error("FATAL %s", str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
