"""Console state the App owns: link status, the 60 s history, change de-duplication.

Plain Python (no widgets) so the rules are testable on their own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

from mlxcel.shared.snapshot import ConfigChange, Snapshot

HISTORY_S = 60.0


class Link(Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    MISMATCH = "protocol mismatch"


@dataclass(frozen=True)
class LinkState:
    """What the header says about the connection."""

    link: Link = Link.CONNECTING
    detail: str = ""
    hello: tuple[tuple[str, Any], ...] = ()

    @property
    def hello_dict(self) -> dict[str, Any]:
        return dict(self.hello)


@dataclass(frozen=True)
class Sample:
    """One point of the latency/throughput history."""

    time: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    decode_tps: float
    prefill_tps: float


def long_samples(points: list[dict[str, Any]]) -> tuple[Sample, ...]:
    """The daemon's `history` points as Samples (unreadable points are skipped)."""
    out = []
    for p in points:
        try:
            out.append(
                Sample(
                    float(p["t"]),
                    p.get("ttft_p50_s"),
                    p.get("ttft_p95_s"),
                    float(p["decode_tokens_per_s"]),
                    float(p["prefill_tokens_per_s"]),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(out)


class History:
    """Samples of the last `window_s` seconds, one per received snapshot."""

    def __init__(self, window_s: float = HISTORY_S) -> None:
        self.window_s = window_s
        self._samples: deque[Sample] = deque()

    def add(self, snapshot: Snapshot, now: float) -> None:
        lat = snapshot.engine.latency
        self._samples.append(
            Sample(
                now,
                lat.ttft_p50_s,
                lat.ttft_p95_s,
                lat.decode_tokens_per_s,
                lat.prefill_tokens_per_s,
            )
        )
        while self._samples and self._samples[0].time < now - self.window_s:
            self._samples.popleft()

    def clear(self) -> None:
        self._samples.clear()

    def samples(self) -> tuple[Sample, ...]:
        return tuple(self._samples)


def series(samples: tuple[Sample, ...], name: str) -> list[float]:
    """One field of the samples as sparkline data; missing values are skipped, not zeroed."""
    values = (getattr(s, name) for s in samples)
    return [float(v) for v in values if v is not None]


_CHANGE_FIELDS = frozenset({"key", "requested", "applied", "effective"})  # the required ones


def parse_changes(data: dict[str, Any]) -> list[ConfigChange]:
    """ConfigChange records from a `config.set` reply or a `config_changed` event."""
    raw = data.get("changes", data if "key" in data else [])
    if isinstance(raw, dict):
        raw = [raw]
    return [
        ConfigChange.from_dict(item)
        for item in (raw if isinstance(raw, list) else [])
        if isinstance(item, dict) and item.keys() >= _CHANGE_FIELDS
    ]


def describe_change(change: ConfigChange) -> tuple[str, str]:
    """(severity, text) for the log and the notification: applied, clamped or refused."""
    key = change.key
    if not change.applied:
        why = change.reason or "no reason given"
        stays = _show(change.effective)
        return "error", f"{key}={_show(change.requested)} refused: {why} (stays {stays})"
    if change.requested != change.effective:
        why = f": {change.reason}" if change.reason else ", clamped"
        moved = (
            f"stays {_show(change.effective)}"
            if change.previous == change.effective
            else f"{_show(change.previous)} → {_show(change.effective)}"
        )
        return "warning", f"{key} {moved} (asked {_show(change.requested)}{why})"
    if change.previous == change.effective:
        return "information", f"{key} unchanged at {_show(change.effective)}"
    return "information", f"{key} {_show(change.previous)} → {_show(change.effective)}"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "n/a" if value is None else str(value)


class ChangeDedupe:
    """Drops a change already logged in the last few seconds.

    The console's own `config.set` is answered twice: by the reply and by the
    `config_changed` event every subscriber gets; whichever comes first is logged.
    """

    def __init__(self, window_s: float = 3.0) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, tuple[Any, ...]]] = deque()

    def is_new(self, change: ConfigChange, now: float) -> bool:
        while self._seen and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()
        ident = (change.key, repr(change.requested), change.applied, repr(change.effective))
        if any(seen == ident for _, seen in self._seen):
            return False
        self._seen.append((now, ident))
        return True


TIMELINE_KEEP_S = 120.0  # a request gone this long is forgotten
TIMELINE_MAX = 1000


class Timelines:
    """What each request was doing, snapshot after snapshot, as this console saw it: the
    phases of its life (waiting for a reason, prefill, decode) with how long each lasted."""

    def __init__(self) -> None:
        self._phases: dict[str, list[list[Any]]] = {}  # id -> [[label, first, last], ...]
        self._seen: dict[str, float] = {}

    def add(self, snapshot: Snapshot, now: float) -> None:
        from .format import WAIT_REASONS

        for entry in snapshot.engine.queue:
            reason = WAIT_REASONS.get(entry.wait_reason, entry.wait_reason)
            self._note(entry.request_id, f"waiting for {reason}", now)
        for slot in snapshot.engine.slots:
            if slot.request_id and slot.state != "idle":
                self._note(slot.request_id, slot.state, now)
        oldest_first = sorted(self._seen, key=self._seen.__getitem__)
        excess = len(oldest_first) - TIMELINE_MAX
        for i, rid in enumerate(oldest_first):
            if i >= excess and now - self._seen[rid] <= TIMELINE_KEEP_S:
                break
            del self._phases[rid], self._seen[rid]

    def _note(self, request_id: str, label: str, now: float) -> None:
        phases = self._phases.setdefault(request_id, [])
        if phases and phases[-1][0] == label:
            phases[-1][2] = now
        else:
            if phases:
                phases[-1][2] = now  # the previous phase lasted until this snapshot
            phases.append([label, now, now])
        self._seen[request_id] = now

    def describe(self, request_id: str) -> list[str]:
        """`waiting for a free slot 1.2s`, `prefill 0.3s`, `decode 4.1s`: oldest first."""
        return [
            f"{label} {_span(last - first)}"
            for label, first, last in self._phases.get(request_id, [])
        ]

    def clear(self) -> None:
        self._phases.clear()
        self._seen.clear()


def _span(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 100 else f"{seconds:.0f}s"
