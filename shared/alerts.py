"""Alert thresholds (config.toml `[alerts]`, docs/configuration.md) and their evaluation over
the snapshots a console receives. Plain Python: the daemon validates the section at start,
mlxcel-top evaluates it on every snapshot and colours the panel an alert concerns.

| alert | panel | active while |
|---|---|---|
| `queue` | queue | `queue_min` waiting for `queue_window` s, `queue_growth` more than then |
| `kv` | KV blocks | blocks reserved by running requests are above `kv_percent` % of the budget |
| `ttft` | last 60 s | TTFT p95 over the last minute is above `ttft_p95` seconds |
| `rejections` | daemon | `rejections` requests or more refused in the last `rejections_window` s |
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mlxcel.shared.config import ConfigError
from mlxcel.shared.snapshot import Snapshot

ALERTS_TABLE = "alerts"
ALERT_PANELS = {"queue": "queue", "kv": "kv", "ttft": "latency", "rejections": "process"}


@dataclass(frozen=True)
class AlertRules:
    queue_min: int = 2  # requests waiting
    queue_window: float = 10.0  # seconds
    queue_growth: int = 2  # more waiting than a window ago, at least
    kv_percent: float = 90.0
    ttft_p95: float = 10.0  # seconds
    rejections: int = 1
    rejections_window: float = 60.0  # seconds
    enabled: bool = True


_LIMITS: dict[str, tuple[float, float]] = {
    "queue_min": (1, 1 << 20),
    "queue_window": (1, 3600),
    "queue_growth": (1, 1 << 20),
    "kv_percent": (1, 100),
    "ttft_p95": (0.001, 86400),
    "rejections": (1, 1 << 30),
    "rejections_window": (1, 3600),
}


def parse_alerts(table: Any) -> AlertRules:
    """`[alerts]` of config.toml → AlertRules; raises ConfigError naming the bad key."""
    if table is None:
        return AlertRules()
    if not isinstance(table, dict):
        raise ConfigError("[alerts] must be a table")
    known = {f.name: f for f in fields(AlertRules)}
    values: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = str(raw_key).replace("-", "_")
        if key not in known:
            raise ConfigError(f"alerts.{raw_key}: unknown (known: {', '.join(known)})")
        if key == "enabled":
            if not isinstance(value, bool):
                raise ConfigError("alerts.enabled must be true or false")
            values[key] = value
            continue
        low, high = _LIMITS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"alerts.{raw_key} must be a number, got {value!r}")
        if not low <= value <= high:
            raise ConfigError(f"alerts.{raw_key} must be between {low:g} and {high:g}")
        integer = key in ("queue_min", "queue_growth", "rejections")
        values[key] = int(value) if integer else float(value)
    return AlertRules(**values)


def read_alert_rules(config_file: Path) -> AlertRules:
    """The `[alerts]` table of a config.toml (defaults when the file or table is absent).

    Read with tomlkit, as the daemon reads the file (daemon/process/option_sources.py; the standard
    library's tomllib is 3.11+), a BOM included: the console takes what the daemon takes."""
    import tomlkit
    import tomlkit.exceptions

    try:
        text = config_file.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        return AlertRules()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_file}: {exc}") from None
    try:
        doc = tomlkit.parse(text).unwrap()
    except tomlkit.exceptions.ParseError as exc:
        raise ConfigError(f"{config_file}: {exc}") from None
    try:
        return parse_alerts(doc.get(ALERTS_TABLE))
    except ConfigError as exc:
        raise ConfigError(f"{config_file}: {exc}") from None


@dataclass(frozen=True)
class AlertChange:
    name: str  # queue | kv | ttft | rejections
    active: bool
    message: str

    @property
    def panel(self) -> str:
        return ALERT_PANELS[self.name]


class AlertTracker:
    """Feed it every snapshot; it answers which alerts started or ended."""

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self.active: dict[str, str] = {}  # name -> message
        self._queue: deque[tuple[float, int]] = deque()
        self._rejected: deque[tuple[float, int]] = deque()

    def clear(self) -> None:
        """A new daemon: its history starts over (active alerts end without an event)."""
        self.active.clear()
        self._queue.clear()
        self._rejected.clear()

    def update(self, snapshot: Snapshot, now: float) -> list[AlertChange]:
        if not self.rules.enabled:
            return []
        found = self._evaluate(snapshot, now)
        changes = [AlertChange(n, True, m) for n, m in found.items() if n not in self.active]
        changes += [AlertChange(n, False, m) for n, m in self.active.items() if n not in found]
        self.active = found
        return changes

    def _evaluate(self, snapshot: Snapshot, now: float) -> dict[str, str]:
        rules = self.rules
        engine = snapshot.engine
        found: dict[str, str] = {}
        waiting = len(engine.queue)
        then = _value_at(self._queue, now - rules.queue_window)
        _record(self._queue, now, waiting, rules.queue_window)
        # To start, the queue held at least queue_min through the whole window and is longer
        # than at its start (a queue that merely flickers past queue_min is no alert); once on,
        # it holds until the queue is shorter than it was a window ago.
        held = min(v for t, v in self._queue if t >= now - rules.queue_window)
        was_on = "queue" in self.active
        if (
            waiting >= rules.queue_min
            and then is not None
            and (
                (held >= rules.queue_min and waiting - then >= rules.queue_growth)
                or (was_on and waiting >= then)
            )
        ):
            found["queue"] = (
                f"queue growing: {waiting} waiting, {then} {rules.queue_window:g} s ago"
            )
        kv = engine.kv
        if kv.blocks_total:
            share = 100.0 * kv.blocks_used / kv.blocks_total
            if share > rules.kv_percent:
                found["kv"] = f"KV blocks {share:.0f}% in use (above {rules.kv_percent:g}%)"
        p95 = engine.latency.ttft_p95_s
        if p95 is not None and p95 > rules.ttft_p95:
            found["ttft"] = f"TTFT p95 {p95:.2f}s (above the {rules.ttft_p95:g}s target)"
        rejected = sum(engine.counters.rejections_by_reason.values())
        before = _value_at(self._rejected, now - rules.rejections_window)
        _record(self._rejected, now, rejected, rules.rejections_window)
        if before is None and self._rejected:
            before = self._rejected[0][1]  # the console's first look: count from there
        if before is not None and rejected - before >= rules.rejections:
            found["rejections"] = (
                f"rejections rising: {rejected - before} in the last {rules.rejections_window:g} s"
            )
        return found


def _record(samples: deque[tuple[float, int]], now: float, value: int, window: float) -> None:
    samples.append((now, value))
    # Keep one sample at or before the window's start: it is the "then".
    while len(samples) > 1 and samples[1][0] <= now - window:
        samples.popleft()


def _value_at(samples: deque[tuple[float, int]], at: float) -> int | None:
    """The newest value recorded at or before `at` (None when the history is younger)."""
    value = None
    for t, v in samples:
        if t > at:
            break
        value = v
    return value
