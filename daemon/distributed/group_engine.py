"""Rank 0's engine for a group: the lockstep with the other ranks, the watchdog, `degraded`.

`DistributedEngine` is the engine the bridge drives, unchanged in every rule (scheduler,
prefix cache, KV accounting); it only records the commands the bridge applies (new requests,
aborts, runtime changes, cache resets) and, before each step, broadcasts them with a sampling
seed (`Channel.exchange`). Each worker applies the same commands to its own `Engine` and runs
the same `step()` (`worker.py`), so every rank runs the same forwards in the same order and
samples the same tokens. While idle, rank 0 exchanges an empty message every
`HEARTBEAT_S`, so a rank that is gone is noticed without traffic.

Faults: a lost peer makes the exchange (or a forward's collective) raise; a rank that stops
answering leaves rank 0 waiting, and the watchdog thread notices a step or exchange older than
`distributed_timeout`. Either way the group turns `degraded`: every request in flight ends with
finish_reason `error` and a message saying what happened, new requests get 503, status,
/health and the console say `degraded`, and `mlxcel-daemon restart` starts the group anew.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlxcel.daemon.distributed.channel import Channel, RankFigures, memory_bytes
from mlxcel.daemon.distributed.wire import ChannelError, check_travels
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import FINISH_ERROR, AdmissionRejected, TokenOutput
from mlxcel.shared.config import ConfigError, parse_option
from mlxcel.shared.protocol import EV_CONFIG
from mlxcel.shared.snapshot import ConfigChange, GroupInfo, RankInfo

if TYPE_CHECKING:
    from mlxcel.daemon.distributed.launch import Ranks

log = logging.getLogger("mlxcel.distributed")

HEARTBEAT_S = 1.0
WATCHDOG_PERIOD_S = 0.25
ENGINE_THREAD = "mlxcel-engine"
STOP_WAIT_S = 5.0
RESTART_HINT = "run `mlxcel-daemon restart` to start the group again"


def step_seed() -> int:
    return random.getrandbits(62)


def _turns_speculation_on(changes: dict[str, Any]) -> bool:
    """A `speculative` change to a mode other than off (a bad value is left to the engine's
    own check, which refuses it on every rank)."""
    if "speculative" not in changes:
        return False
    try:
        return parse_option("speculative", changes["speculative"]) != "off"
    except ConfigError:
        return False


class DistributedEngine(Engine):
    local_policy = False  # every rank must take the same decisions: no lanes, deadlines
    serves_embeddings = False  # the ranks step in lockstep: no forward on rank 0 alone

    def __init__(
        self,
        *args: Any,
        channel: Channel,
        hosts: list[str],
        mode: str,
        backend: str,
        timeout_s: float,
        **kwargs: Any,
    ) -> None:
        self.channel = channel
        self.hosts = hosts
        self.mode = mode
        self.backend = backend
        self.timeout_s = timeout_s
        self.degraded: str | None = None
        self.bridge: Any = None
        self.ranks: Ranks | None = None  # the processes rank 0 started
        self.describe_fault: Callable[[], str | None] = lambda: None
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._busy_since: float | None = None
        self._last_exchange = time.monotonic()
        self._step_us = 0
        self._steps = 0
        self._comm_s: float | None = None  # moving mean of rank 0's wait per step exchange
        self._lock = threading.Lock()  # the degraded transition (engine thread vs watchdog)
        self._watchdog: threading.Thread | None = None
        self._stopped = threading.Event()
        super().__init__(*args, **kwargs)

    # -- the commands the bridge applies: recorded for the other ranks, then run here -------

    def add_request(self, request: Any) -> None:
        self._record("add_request", request)
        super().add_request(request)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        self._record("abort", request_id, reason, error)
        return super().abort(request_id, reason, error)

    def reconfigure(self, changes: dict[str, Any]) -> list[ConfigChange]:
        if _turns_speculation_on(changes):
            changes = dict(changes)
            requested = changes.pop("speculative")
            refused = ConfigChange(
                "speculative",
                requested,
                False,
                "off",
                "off",
                "a group runs without speculative decoding (every rank must run the same steps, "
                "and its policy decides on rank 0's timings)",
            )
            self.on_event(EV_CONFIG, refused.to_dict())
            return [refused, *self.reconfigure(changes)] if changes else [refused]
        if self.mode == "pipeline" and "prompt_cache" in changes:
            changes = dict(changes)
            requested = changes.pop("prompt_cache")
            refused = ConfigChange(
                "prompt_cache",
                requested,
                False,
                False,
                False,
                "a pipeline group runs without the prompt cache (each rank's KV differs in size)",
            )
            self.on_event(EV_CONFIG, refused.to_dict())
            return [refused, *self.reconfigure(changes)] if changes else [refused]
        self._record("reconfigure", changes)
        return super().reconfigure(changes)

    def reset_prompt_cache(self, tier: str = "all") -> dict[str, Any]:
        self._record("reset_prompt_cache")
        return super().reset_prompt_cache(tier)  # a group has no disk tier: RAM either way

    def check_admission(self, request: Any, num_waiting: int) -> None:
        if self.degraded is not None:
            exc = AdmissionRejected("degraded", f"distributed group degraded: {self.degraded}")
            exc.http_status = 503
            raise exc
        super().check_admission(request, num_waiting)
        try:
            check_travels(request)
        except ChannelError as exc:
            raise AdmissionRejected(
                "invalid_request", f"the request cannot be sent to the other ranks: {exc}"
            ) from None

    def _record(self, name: str, *args: Any) -> None:
        if self.degraded is None:
            self._pending.append((name, args))

    # -- the step --------------------------------------------------------------------------

    def step(self) -> None:
        if self.degraded is None:
            seed = step_seed()
            if self._exchange("step", seed):
                mx.random.seed(seed)  # every rank samples from the same random state
                start = time.perf_counter()
                self._busy_since = time.monotonic()
                try:
                    super().step()
                finally:
                    self._busy_since = None
                    self._step_us = int((time.perf_counter() - start) * 1e6)
                    self._steps += 1
                return
        self._fail_all()  # degraded: nothing runs; whatever is left ends with the reason
        self._publish()
        self.flush()

    def _publish(self) -> None:
        super()._publish()
        idle = not self.has_work and self._busy_since is None
        if (
            idle
            and self.degraded is None
            and time.monotonic() - self._last_exchange >= HEARTBEAT_S
            and threading.current_thread().name == ENGINE_THREAD
        ):
            self._exchange("ping")

    def _exchange(self, kind: str, seed: int = 0) -> bool:
        """Send the recorded commands and `kind` to every rank; False (and degraded) when the
        group is broken."""
        message = {"kind": kind, "commands": self._pending, "seed": seed}
        self._pending = []
        self._busy_since = time.monotonic()
        try:
            self.channel.exchange(message, self._figures())
        except Exception as exc:  # a lost peer: "[ring] connection to a peer was lost"
            self._busy_since = None
            self._degrade(str(exc).strip() or type(exc).__name__)
            return False
        self._busy_since = None
        self._last_exchange = time.monotonic()
        if kind == "step":
            wait = self.channel.last_exchange_s
            self._comm_s = wait if self._comm_s is None else 0.9 * self._comm_s + 0.1 * wait
        return True

    def _figures(self) -> RankFigures:
        return RankFigures(memory_bytes(), self._step_us, os.getpid(), self._steps)

    # -- faults ----------------------------------------------------------------------------

    def _degrade(self, cause: str) -> None:
        """Engine thread: the group is broken; fail every request with the reason."""
        with self._lock:
            if self.degraded is None:
                detail = self.describe_fault()
                self.degraded = f"{detail or cause}; {RESTART_HINT}"
                log.error("distributed group degraded: %s", self.degraded)
        self._fail_all()

    def _fail_all(self) -> None:
        error = f"distributed group degraded: {self.degraded}"
        for seq in list(self.waiting) + list(self.running.values()):
            super().abort(seq.request_id, FINISH_ERROR, error)

    def start_watchdog(self, bridge: Any) -> None:
        """Watch for a step or exchange that takes longer than the timeout (a rank that
        stopped answering: rank 0 would wait in a collective for ever)."""
        self.bridge = bridge
        self._watchdog = threading.Thread(
            target=self._watch, name="mlxcel-distributed-watchdog", daemon=True
        )
        self._watchdog.start()

    def stop_watchdog(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(WATCHDOG_PERIOD_S):
            since = self._busy_since
            if self.degraded is not None:
                continue
            exited = self.describe_fault() is not None  # a rank that rank 0 started is gone
            if exited or (since is not None and time.monotonic() - since > self.timeout_s):
                self._degrade_stuck()

    def _degrade_stuck(self) -> None:
        """Watchdog thread: the engine thread waits on a rank that does not answer. End every
        open stream with an error now (the engine thread may never come back)."""
        with self._lock:
            if self.degraded is not None:
                return
            detail = self.describe_fault()
            cause = detail or f"a rank did not answer within {self.timeout_s:g} s"
            self.degraded = f"{cause}; {RESTART_HINT}"
        log.error("distributed group degraded: %s", self.degraded)
        error = f"distributed group degraded: {self.degraded}"
        streams = getattr(self.bridge, "_streams", {})  # every open stream, queued ones too
        for request_id, stream in list(streams.items()):
            prompt = len(stream.request.prompt_ids)
            seq = self.running.get(request_id)
            generated = seq.generated if seq is not None else 0
            cached = seq.cached_tokens if seq is not None else 0
            out = TokenOutput(None, FINISH_ERROR, prompt, cached, generated, error)
            self.on_output(request_id, out)

    # -- shutdown and status -----------------------------------------------------------------

    def stop_group(self) -> None:
        """After the engine thread stopped (or gave up on it): end ranks 1..n-1, by a stop
        message when the group still works, else by killing the processes rank 0 started."""
        told = self.stop_ranks()
        if self.ranks is not None:
            self.ranks.stop(STOP_WAIT_S if told else 0.0)
        log.info("distributed group stopped (%s)", "by message" if told else "killed")

    def stop_ranks(self) -> bool:
        """Tell the other ranks to exit (after the engine thread stopped); False when the
        group is broken and they cannot hear it."""
        self.stop_watchdog()
        if self.degraded is not None or self._busy_since is not None:
            return False
        try:
            self.channel.exchange({"kind": "stop", "commands": [], "seed": 0}, self._figures())
        except Exception:
            return False
        return True

    def group_info(self) -> GroupInfo:
        ranks = []
        for rank, host in enumerate(self.hosts):
            fig = self.channel.figures[rank]
            if rank == 0:
                fig = self._figures()
            ranks.append(
                RankInfo(
                    rank=rank,
                    host=host,
                    pid=fig.pid if fig else None,
                    memory_bytes=fig.memory_bytes if fig else None,
                    step_ms=fig.step_us / 1000 if fig and fig.steps else None,
                    steps=fig.steps if fig else 0,
                )
            )
        return GroupInfo(
            size=len(self.hosts),
            mode=self.mode,
            backend=self.backend,
            status="ok" if self.degraded is None else "degraded",
            reason=self.degraded,
            comm_ms=None if self._comm_s is None else self._comm_s * 1000,
            timeout_s=self.timeout_s,
            ranks=tuple(ranks),
        )
