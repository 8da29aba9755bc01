"""The daemon's log over the control socket (`logs.subscribe`).

`LogHub` is a logging handler on the root logger. Every record (from any thread: the engine,
the loader, the event loop) becomes a small dict kept in a bounded ring of recent lines and,
when someone follows the log, is handed to the event loop with one `call_soon_threadsafe`.
Nothing here waits: a subscriber's lines go into its connection's bounded backlog (the oldest
are dropped for a reader that falls behind), so a slow subscriber never blocks the daemon nor
the thread that logged.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

RING_LINES = 500  # recent lines a new subscriber receives first (at most)
MAX_MESSAGE_CHARS = 4000
MAX_BACKLOG_CHARS = 256 * 1024  # the recent lines sent in one reply, newest kept
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
LEVELS["error"] = logging.ERROR

LogSink = Callable[[dict[str, Any]], None]


def parse_level(value: Any) -> int:
    """`"debug"`, `"info"`, `"warning"` or `"error"` (any case) → a logging level."""
    if isinstance(value, str) and value.lower() in LEVELS:
        return LEVELS[value.lower()]
    raise ValueError(f"level must be one of {', '.join(LEVELS)}")


def record_dict(record: logging.LogRecord) -> dict[str, Any]:
    """One log line as the protocol sends it."""
    try:
        message = record.getMessage()
    except Exception as exc:  # a bad %-format in someone's log call
        message = f"{record.msg!r} (unformattable: {exc})"
    if record.exc_info and record.exc_info[0] is not None:
        message += "\n" + logging.Formatter().formatException(record.exc_info)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + " …"
    return {
        "ts": record.created,
        "level": record.levelname,
        "levelno": record.levelno,
        "logger": record.name,
        "message": message,
    }


class LogHub(logging.Handler):
    """Ring of recent lines plus fan-out to the loop thread's subscribers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ring_lines: int = RING_LINES) -> None:
        super().__init__(logging.DEBUG)
        self._loop = loop
        self._ring: deque[dict[str, Any]] = deque(maxlen=ring_lines)
        self._ring_lock = threading.Lock()
        self._sinks: dict[int, tuple[int, LogSink]] = {}  # id -> (level, sink); loop thread

    # --- any thread ---

    def emit(self, record: logging.LogRecord) -> None:
        item = record_dict(record)
        with self._ring_lock:
            self._ring.append(item)
        if self._sinks:  # a racy read is fine: a subscriber gets the ring when it joins
            try:
                self._loop.call_soon_threadsafe(self._deliver, item)
            except RuntimeError:  # the loop is closed: the daemon is gone
                pass

    def handle(self, record: logging.LogRecord) -> bool:
        # logging.Handler.handle takes the handler's lock around emit; the ring has its own
        # lock, so a record from the engine thread never waits on a record being delivered.
        if self.filter(record):
            self.emit(record)
        return True

    def recent(self, level: int = logging.DEBUG, limit: int = RING_LINES) -> list[dict[str, Any]]:
        with self._ring_lock:
            lines = [item for item in self._ring if item["levelno"] >= level]
        kept: list[dict[str, Any]] = []
        chars = 0
        for item in reversed(lines[-limit:] if limit > 0 else []):
            chars += len(item["message"]) + 64
            if chars > MAX_BACKLOG_CHARS:
                break
            kept.append(item)
        return kept[::-1]

    # --- loop thread ---

    def subscribe(self, key: int, level: int, sink: LogSink) -> None:
        self._sinks[key] = (level, sink)

    def unsubscribe(self, key: int) -> None:
        self._sinks.pop(key, None)

    @property
    def num_subscribers(self) -> int:
        return len(self._sinks)

    def _deliver(self, item: dict[str, Any]) -> None:
        for level, sink in list(self._sinks.values()):
            if item["levelno"] >= level:
                sink(item)

    # --- lifetime ---

    def install(self) -> LogHub:
        logging.getLogger().addHandler(self)
        return self

    def uninstall(self) -> None:
        logging.getLogger().removeHandler(self)
        self._sinks.clear()
