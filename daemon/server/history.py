"""Fifteen minutes of coarse history for the console (`history` control method).

Every `STEP_S` seconds the loop thread reads the engine's snapshot and keeps one point: the
mean decode and prefill rates over that step (from the engine's generated / prefilled token
counters: `status`' counters, /metrics' generated tokens) and the TTFT p50/p95 the snapshot
reports (its 60 s window, as `status` shows it). 90 points = 15 minutes; the console's own 60 s
history stays one point per snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

STEP_S = 10.0
SPAN_S = 900.0


class CoarseHistory:
    def __init__(
        self,
        engine_snapshot: Callable[[], Any],
        step_s: float = STEP_S,
        span_s: float = SPAN_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine_snapshot = engine_snapshot
        self.step_s = step_s
        self.span_s = span_s
        self._clock = clock
        self._points: deque[dict[str, Any]] = deque(maxlen=max(1, int(span_s / step_s)))
        self._last: tuple[float, int, int] | None = None  # (time, generated, prefilled)
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        """Take one point now (the task calls this every step)."""
        snap = self._engine_snapshot()
        if snap is None:
            return
        now = self._clock()
        counters = snap.counters
        generated, prefilled = counters.generation_tokens, counters.prefill_tokens
        last, self._last = self._last, (now, generated, prefilled)
        if last is None or now <= last[0]:
            return  # the first reading only opens the first interval
        span = now - last[0]
        self._points.append(
            {
                "t": now,
                "decode_tokens_per_s": max(0, generated - last[1]) / span,
                "prefill_tokens_per_s": max(0, prefilled - last[2]) / span,
                "ttft_p50_s": snap.latency.ttft_p50_s,
                "ttft_p95_s": snap.latency.ttft_p95_s,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "span_s": self.span_s, "points": list(self._points)}

    def start(self) -> None:
        self.sample()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self.sample()
