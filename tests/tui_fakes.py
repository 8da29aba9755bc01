"""A canned daemon for the console tests: `CannedDaemon`, a test-only control server on a Unix
socket of its own that speaks the protocol (hello, status, subscribe, logs.subscribe,
config.set, config.save) with deterministic snapshots (`make_snapshot`, `make_config`), so
rendering never depends on model timing; `fixed_clock` / `T0`, the snapshot tests' clock; the
`utc` fixture (import it into a test module: autouse, log stamps in UTC). Used by the console
tests (tests/unit/test_tui_*.py, tests/integration/test_tui_history.py) and the tests that need
a snapshot to render or export."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from mlxcel.shared import PROTOCOL_VERSION
from mlxcel.shared.protocol import Event, Reply, decode_request, encode
from mlxcel.shared.snapshot import (
    ConfigChange,
    Counters,
    DaemonInfo,
    EffectiveConfig,
    EngineSnapshot,
    KVInfo,
    LatencyInfo,
    PromptCacheInfo,
    QueueEntry,
    SlotInfo,
    Snapshot,
)
from mlxcel.tui.app import MlxcelTop
from mlxcel.tui.state import Link

T0 = 1_700_000_000.0  # the fixed clock of the snapshot tests


def fixed_clock() -> float:
    return T0


# --- canned snapshots ---

CANNED_LOG = [
    (-60, "INFO", "mlxcel.daemon", "mlxcel-daemon 0.1.0 starting (pid 4242)"),
    (-58, "INFO", "mlxcel.daemon", "listening on http://127.0.0.1:8080 (loading smollm2)"),
    (-51, "INFO", "mlxcel.daemon", "ready: http://127.0.0.1:8080, socket /run/mlxcel.sock"),
    (-30, "INFO", "mlxcel.daemon", "config parallel: 4 -> 3"),
    (-20, "WARNING", "mlxcel.control", "refused a control connection from uid 1001"),
    (-9, "INFO", "mlxcel.daemon", "request cmpl-7f3a9c21e5 cancelled by mlxcel-top (pid 77)"),
    (-2, "ERROR", "mlxcel.engine", "step failed: the test says so"),
]
LEVELNO = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}


def canned_log_lines() -> list[dict[str, Any]]:
    return [
        {"ts": T0 + dt, "level": lv, "levelno": LEVELNO[lv], "logger": name, "message": msg}
        for dt, lv, name, msg in CANNED_LOG
    ]


def make_config(**overrides: Any) -> EffectiveConfig:
    values: dict[str, Any] = dict(
        parallel=4,
        parallel_requested=4,
        parallel_limit=256,
        parallel_clamp_reason=None,
        max_batch_prefill=4,
        max_batch_prefill_tokens=4096,
        prefill_chunk_size=512,
        prompt_cache=True,
        prompt_cache_bytes=512 << 20,
        kv_cache_budget=1536 << 20,
        max_queue_depth=64,
        ctx_per_slot=2048,
    )
    values.update(overrides)
    return EffectiveConfig(**values)


def make_snapshot(busy: bool, step: int = 0, config: EffectiveConfig | None = None) -> Snapshot:
    cfg = config or make_config()
    slots: list[SlotInfo] = []
    queue: tuple[QueueEntry, ...] = ()
    for i in range(cfg.parallel):
        slots.append(SlotInfo(id=i))
    if busy:
        slots[0] = SlotInfo(0, "decode", "chatcmpl-7f3a9c21e5", 262, 224, 262, 41, 64, 10,
                            0.184, 11.8, 4.2)  # fmt: skip
        slots[1] = SlotInfo(1, "prefill", "chatcmpl-b81d04aa90", 1480, 0, 512, 0, 64, 49,
                            None, None, 2.9)  # fmt: skip
        slots[2] = SlotInfo(2, "decode", "chatcmpl-0c55e2f713", 301, 0, 301, 12, 128, 14,
                            1.43, 9.6, 1.7, lane="high")  # fmt: skip
        queue = (
            QueueEntry("chatcmpl-91aa0e3b77", 2210, "prefill_cap", 1.2),
            QueueEntry("chatcmpl-c4e8d1f002", 180, "kv_budget", 0.4, lane="low"),
        )
    latency = LatencyInfo(
        ttft_p50_s=0.41 + 0.02 * (step % 5) if busy else None,
        ttft_p95_s=1.43 if busy else None,
        ttft_by_cache={"hit": (0.09, 0.18), "miss": (0.96, 1.43)} if busy else {},
        decode_tokens_per_s=20.0 + 3.0 * (step % 7) if busy else 0.0,
        prefill_tokens_per_s=180.0 + 10.0 * (step % 4) if busy else 0.0,
        itl_p50_s=0.081 if busy else None,
        itl_p95_s=0.142 if busy else None,
    )
    engine = EngineSnapshot(
        time=T0,
        config=cfg,
        slots=tuple(slots),
        queue=queue,
        kv=KVInfo(32, 1024, 124 if busy else 0, 310, 1536 << 20, 3 << 19),
        prompt_cache=PromptCacheInfo(
            cfg.prompt_cache, 17, 310 * (3 << 19), 512 << 20, 40, 29, 11, 6210, 9100, 3
        ),
        latency=latency,
        counters=Counters(
            {"stop": 31, "length": 6}, {"queue_full": 2}, preemptions=2 if busy else 0
        ),
    )
    daemon = DaemonInfo("0.1.0", 4242, 3723.0, "smollm2-135m-instruct", "cpu", "float32",
                        812 << 20, 143.0 if busy else 0.4)  # fmt: skip
    return Snapshot(daemon, engine)


# --- a test-only control server speaking the protocol with canned snapshots ---


class CannedDaemon:
    """Answers hello/status/subscribe/config.set/config.save from a thread of its own."""

    def __init__(self, snapshot: Snapshot, push: bool = False, protocol: int = PROTOCOL_VERSION):
        self.dir = tempfile.mkdtemp(prefix="mt-")
        self.path = os.path.join(self.dir, "c.sock")
        self.snapshot = snapshot
        self.push = push  # push a snapshot event every subscribe interval
        self.protocol = protocol
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.answers: dict[str, Any] = {}  # method -> canned result (tests add their own)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def __enter__(self) -> CannedDaemon:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path)

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pusher: asyncio.Task[None] | None = None
        try:
            while line := await reader.readline():
                req = decode_request(line)
                self.calls.append((req.method, req.params))
                result = self._answer(req.method, req.params)
                writer.write(encode(Reply(req.id, result)))
                await writer.drain()
                if req.method == "subscribe" and self.push:
                    pusher = asyncio.create_task(self._push(writer, req.params["interval_ms"]))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if pusher is not None:
                pusher.cancel()
            writer.close()

    async def _push(self, writer: asyncio.StreamWriter, interval_ms: int) -> None:
        while True:
            await asyncio.sleep(interval_ms / 1000)
            writer.write(encode(Event("snapshot", self.snapshot.to_dict())))
            await writer.drain()

    def _answer(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method in self.answers:
            return self.answers[method]
        if method == "hello":
            d = self.snapshot.daemon
            return {
                "protocol": self.protocol,
                "version": d.version,
                "model": d.model,
                "pid": d.pid,
                "methods": ["hello", "status", "subscribe", "logs.subscribe"],
            }
        if method == "logs.subscribe":
            return {"subscribed": True, "level": "debug", "lines": canned_log_lines()}
        if method == "status":
            return self.snapshot.to_dict()
        if method == "config.set":
            return self._set(params["values"])
        if method == "config.save":
            return {"path": os.path.join(self.dir, "config.toml")}
        return {}

    def _set(self, changes: dict[str, Any]) -> dict[str, Any]:
        cfg = self.snapshot.engine.config
        out = []
        for key, value in changes.items():
            previous = getattr(cfg, key)
            if key == "parallel" and value < 1:
                out.append(ConfigChange(key, value, False, previous, previous, "must be >= 1"))
                continue
            effective = min(value, 3) if key == "parallel" else value
            reason = "limited to 3 by the test" if effective != value else None
            cfg = cfg.__class__(**{**cfg.to_dict(), key: effective})
            out.append(ConfigChange(key, value, True, effective, previous, reason))
        self.snapshot = make_snapshot(False, config=cfg)
        return {"changes": [c.to_dict() for c in out], "effective": cfg.to_dict()}


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Log timestamps are local time: pin the zone so snapshots match anywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def connected_with_snapshot(app: MlxcelTop) -> bool:
    return app.link_state.link is Link.CONNECTED and app.snapshot is not None
