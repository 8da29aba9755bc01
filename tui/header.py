"""The one-line header: who the daemon is, and whether what we show is live."""

from __future__ import annotations

import time
from collections.abc import Callable

from mlxcel.shared.snapshot import Snapshot
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from .format import fmt_bytes, fmt_uptime
from .state import Link, LinkState

STALE_FACTOR = 3.0  # a snapshot older than 3 intervals is flagged as stale


def group_extras(snap: Snapshot) -> list[tuple[str, int]]:
    """A distributed group (docs/distributed.md): ranks and split, then each rank's host,
    memory and last step time (dropped first when the line is short of room)."""
    group = snap.group
    if group is None:
        return []
    ranks = " ".join(
        f"r{r.rank}@{r.host} {fmt_bytes(r.memory_bytes)} "
        + ("-" if r.step_ms is None else f"{r.step_ms:.0f}ms")
        for r in group.ranks
    )
    return [(f" · {group.size} ranks {group.mode}", 4), (f" [{ranks}]", 1)]


class StatusHeader(Widget):
    """Model, backend, version/pid, uptime | connection state, snapshot age."""

    snapshot: reactive[Snapshot | None] = reactive(None)
    link_state: reactive[LinkState] = reactive(LinkState)
    received_at: reactive[float | None] = reactive(None)
    paused: reactive[bool] = reactive(False)

    def __init__(
        self, socket_path: str, interval_ms: int, clock: Callable[[], float] = time.time, **kw
    ) -> None:
        super().__init__(**kw)
        self.socket_path = socket_path
        self.interval_s = interval_ms / 1000.0
        self._clock = clock

    def on_mount(self) -> None:
        # The snapshot's age grows while nothing arrives: re-render on our own clock,
        # but only while it is stale (a fresh one repaints the header when it arrives).
        self.set_interval(1.0, self._tick)

    def _tick(self) -> None:
        if self.link_state.link is not Link.CONNECTED or self._is_stale():
            self.refresh()

    def _is_stale(self) -> bool:
        if self.received_at is None:
            return False
        limit = STALE_FACTOR * max(self.interval_s, 1.0)
        return self._clock() - self.received_at > limit

    def render(self) -> Content:
        right = self._liveness()
        room = self.size.width - right.cell_length - 1
        left = self._identity(room)
        gap = max(1, self.size.width - left.cell_length - right.cell_length)
        return Content.assemble(left, " " * gap, right)

    def _identity(self, room: int) -> Content:
        """Title and model first; backend, uptime, version and dtype go as room runs out."""
        title = ("mlxcel-top ", "bold")
        snap = self.snapshot
        if snap is None:
            hello = self.link_state.hello_dict
            if hello.get("model"):
                who = f"{hello['model']} · v{hello.get('version', '?')} pid {hello.get('pid', '?')}"
                content = Content.assemble(title, (who, "bold $accent"))
            else:
                content = Content.assemble(title, (self.socket_path, "dim"))
            return content.truncate(max(room, 0), ellipsis=True)
        d = snap.daemon
        # (text, drop order): the lowest number is dropped first.
        extras = [
            (f" · {d.backend}", 4),
            (f" {d.dtype}", 1.5),  # after the BLAS line: "4/8-bit + float32" says more
            (f" · {d.blas}" if d.blas else "", 1),
            (f" · v{d.version} pid {d.pid}", 2),
            (f" · up {fmt_uptime(d.uptime_s)}", 3),
            *group_extras(snap),
        ]
        head = Content.assemble(title, (d.model, "bold $accent"))
        for drop in (0, *sorted({order for _, order in extras})):
            kept = "".join(text for text, order in extras if order > drop)
            content = Content.assemble(head, kept)
            if content.cell_length <= room:
                return content
        return head.truncate(max(room, 0), ellipsis=True)

    def _liveness(self) -> Content:
        link = self.link_state.link
        if link is Link.CONNECTED and self.link_state.detail:
            text = Content.styled(f"◐ {self.link_state.detail}", "bold $warning")
        elif link is Link.CONNECTED:
            access = self.link_state.hello_dict.get("access")
            read_only = (" · read-only", "bold $warning") if access == "read-only" else ""
            text = Content.assemble(("● connected", "bold $success"), read_only, self._age_text())
        elif link is Link.CONNECTING:
            text = Content.styled("○ connecting…", "$warning")
        elif link is Link.MISMATCH:
            text = Content.styled("✖ protocol mismatch", "bold $error")
        else:
            text = Content.styled("✖ disconnected — retrying", "bold $error")
            if self.received_at is not None:
                text = Content.assemble(text, self._age_text())
        group = self.snapshot.group if self.snapshot is not None else None
        if group is not None and group.status != "ok":
            text = Content.assemble((f"⚠ group {group.status}", "bold reverse $error"), " ", text)
        if self.paused:
            text = Content.assemble(("⏸ PAUSED", "bold reverse $warning"), " ", text)
        return text

    def _age_text(self) -> Content:
        """`live` while snapshots arrive on time, else how old the one shown is."""
        if self.received_at is None:
            return Content.styled(" · no snapshot yet", "dim")
        if self.link_state.link is Link.CONNECTED and not self._is_stale():
            return Content.styled(f" · live ({self.interval_s:g}s)", "dim")
        age = max(0.0, self._clock() - self.received_at)
        return Content.styled(f" · last data {age:.0f}s ago", "bold $error")
