"""Event-log lines for daemon events (rejections, cache resets, shutdown, finishes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxcel.shared.protocol import (
    EV_CACHE_RESET,
    EV_CANCELLED,
    EV_FINISHED,
    EV_REJECTED,
    EV_SHUTDOWN,
)
from rich.text import Text

from .format import fmt_bytes, short_id

if TYPE_CHECKING:
    from textual.notifications import SeverityLevel

# describe_change severity -> log style / notification severity
STYLE = {"information": "", "warning": "yellow", "error": "red"}
SEVERITY: dict[str, SeverityLevel] = {
    "information": "information",
    "warning": "warning",
    "error": "error",
}

# Finishes worth a line; stop/length (and aborts: client gone or stop string) would flood it.
NOTABLE_FINISHES = frozenset({"error"})


def log_line(stamp: str, text: str, style: str = "") -> Text:
    return Text.assemble((stamp, "dim"), " ", (text, style))


def describe_event(name: str, data: dict[str, Any]) -> tuple[str, str] | None:
    """(text, style) for one daemon event, or None when it is not worth a line."""
    rid = short_id(_str(data.get("request_id")))
    if name == EV_REJECTED:
        reason = _str(data.get("reason")) or "unknown reason"
        detail = _str(data.get("message"))
        return f"rejected {rid}: {reason}" + (f" — {detail}" if detail else ""), "red"
    if name == EV_FINISHED:
        finish = _str(data.get("finish_reason"))
        if finish in NOTABLE_FINISHES:
            error = _str(data.get("error"))
            return f"request {rid} failed: {error or finish}", "red"
        return None
    if name == EV_CANCELLED:
        by = _str(data.get("by")) or "someone"
        return f"request {rid} cancelled by {by}", "yellow"
    if name == EV_CACHE_RESET:
        entries = data.get("entries_freed")
        freed = data.get("bytes_freed")
        noun = "entry" if entries == 1 else "entries"
        suffix = f" ({entries} {noun}, {fmt_bytes(freed)} freed)" if entries is not None else ""
        return f"prompt cache reset{suffix}", "yellow"
    if name == EV_SHUTDOWN:
        return "daemon is shutting down", "yellow"
    if name == "bad_snapshot":
        return f"unreadable snapshot from the daemon: {_str(data.get('message'))}", "red"
    return None


def _str(value: Any) -> str:
    return "" if value is None else str(value)
