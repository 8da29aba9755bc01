"""The daemon's own log, followed over the control socket (`logs.subscribe`), filterable by
level. The console asks for every line the daemon keeps (debug and up) and filters here, so a
change of level redraws from what it already holds, at once."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from rich.text import Text
from textual.events import Resize
from textual.widgets import RichLog

KEPT_LINES = 2000
LEVELS = ("debug", "info", "warning", "error")
LEVEL_NO = {"debug": 10, "info": 20, "warning": 30, "error": 40}
STYLES = {"DEBUG": "dim", "WARNING": "yellow", "ERROR": "bold red", "CRITICAL": "bold red"}


def log_line_text(line: dict[str, Any]) -> Text:
    """`12:31:48 INFO    mlxcel.daemon: request … cancelled by …` (local time)."""
    ts = line.get("ts")
    stamp = time.strftime("%H:%M:%S", time.localtime(ts)) if isinstance(ts, (int, float)) else "?"
    level = str(line.get("level", "?"))
    style = STYLES.get(level, "")
    return Text.assemble(
        (stamp, "dim"),
        " ",
        (f"{level:<7}", style or "bold"),
        " ",
        (f"{line.get('logger', '?')}: ", "dim"),
        (str(line.get("message", "")), style),
    )


def next_level(level: str) -> str:
    return LEVELS[(LEVELS.index(level) + 1) % len(LEVELS)]


class DaemonLogPane(RichLog):
    """The lines the daemon sent (newest `KEPT_LINES`), shown from `level` up."""

    def __init__(self, level: str = "info", **kwargs: Any) -> None:
        super().__init__(max_lines=KEPT_LINES, wrap=True, markup=False, **kwargs)
        self.level = level
        self.kept: deque[dict[str, Any]] = deque(maxlen=KEPT_LINES)
        self.shown = 0  # log lines written since the last redraw (a long one wraps to several)
        self._wrapped_at = 0

    def on_mount(self) -> None:
        self._retitle()

    def on_resize(self, event: Resize) -> None:
        # Rewrap at the new width and keep the newest lines in view (RichLog keeps lines as
        # they were wrapped when written).
        if event.size.width and event.size.width != self._wrapped_at and self.kept:
            self._wrapped_at = event.size.width
            self.call_after_refresh(self.set_level, self.level)

    def add_lines(self, lines: Iterable[dict[str, Any]], replace: bool = False) -> None:
        """New lines from the daemon; `replace`: a (re)subscription's recent lines, which
        supersede what is held (the daemon's ring holds them all)."""
        if replace:
            self.kept.clear()
            self.clear()
            self.shown = 0
        floor = LEVEL_NO[self.level]
        for line in lines:
            if not isinstance(line, dict):
                continue
            self.kept.append(line)
            if _levelno(line) >= floor:
                self._write(line)

    def set_level(self, level: str) -> None:
        self.level = level
        floor = LEVEL_NO[level]
        self.clear()
        self.shown = 0
        for line in self.kept:
            if _levelno(line) >= floor:
                self._write(line)
        self._retitle()
        self.call_after_refresh(self.scroll_end, animate=False)

    def _write(self, line: dict[str, Any]) -> None:
        # Wrap at the pane's own width (Textual's console may be narrower than the screen).
        width = self.scrollable_content_region.width
        self.write(log_line_text(line), width=width if width > 0 else None)
        self.shown += 1

    def _retitle(self) -> None:
        self.border_title = f"daemon log · {self.level} and up"
        self.border_subtitle = "f level · l events"

    def text(self) -> str:
        """What the pane shows, as plain text (tests)."""
        return "\n".join(line.text for line in self.lines)


def _levelno(line: dict[str, Any]) -> int:
    value = line.get("levelno")
    return value if isinstance(value, int) else LEVEL_NO.get(str(line.get("level")).lower(), 0)
