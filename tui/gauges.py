"""Gauges: KV blocks, prompt cache, daemon process. Each renders the snapshot it is given."""

from __future__ import annotations

from mlxcel.shared.snapshot import KVInfo, Snapshot
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from .format import (
    NA,
    cache_lines,
    disk_subtitle,
    engine_notes,
    fmt_bytes,
    fmt_percent,
    kv_lines,
    kv_subtitle,
)


def kv_bar(kv: KVInfo, width: int) -> Content:
    """used █ / cached ▓ / free ░, scaled to the budget (or to used+cached when unbounded)."""
    width = max(width, 4)
    total = kv.blocks_total
    scale = total if total else max(kv.blocks_used + kv.blocks_cached, 1)
    used = _cells(width, kv.blocks_used, scale)
    cached = min(width - used, _cells(width, kv.blocks_cached, scale))
    free = width - used - cached
    return Content.assemble(
        ("█" * used, "$warning"),
        ("▓" * cached, "$accent"),
        ("░" * free, "$success 50%" if total else "dim"),
    )


def _cells(width: int, count: int, scale: int) -> int:
    """Bar cells for count/scale; anything above zero gets at least one cell."""
    return max(1, round(width * count / scale)) if count > 0 else 0


class Gauge(Widget):
    """A panel whose content is a function of the latest snapshot."""

    snapshot: reactive[Snapshot | None] = reactive(None)

    def render(self) -> Content:
        if self.snapshot is None:
            return Content.styled(NA, "dim")
        return self.render_snapshot(self.snapshot)

    def render_snapshot(self, snapshot: Snapshot) -> Content:
        raise NotImplementedError


class KVGauge(Gauge):
    BORDER_TITLE = "KV blocks"

    def watch_snapshot(self, snapshot: Snapshot | None) -> None:
        self.border_subtitle = kv_subtitle(snapshot.engine.kv) if snapshot else ""

    def render_snapshot(self, snapshot: Snapshot) -> Content:
        kv = snapshot.engine.kv
        lines = kv_lines(kv)
        bar = kv_bar(kv, self.content_size.width)
        return Content("\n").join([bar, Content(lines[0]), Content(lines[1])])


class CacheGauge(Gauge):
    BORDER_TITLE = "prompt cache"

    def watch_snapshot(self, snapshot: Snapshot | None) -> None:
        if snapshot is None:
            self.border_subtitle = ""
            return
        pc = snapshot.engine.prompt_cache
        self.border_subtitle = (
            disk_subtitle(pc.disk) if pc.disk is not None else f"{pc.evictions} evicted"
        )

    def render_snapshot(self, snapshot: Snapshot) -> Content:
        pc = snapshot.engine.prompt_cache
        head, hits, size = cache_lines(pc)
        first = Content.styled(head, "bold $success" if pc.enabled else "bold $error")
        return Content("\n").join([first, Content(hits), Content.styled(size, "dim")])


class ProcessGauge(Gauge):
    BORDER_TITLE = "daemon"

    def watch_snapshot(self, snapshot: Snapshot | None) -> None:
        # preemptions, engine restarts, speculative decoding's figures: below the frame,
        # where the lines never clip them
        self.border_subtitle = engine_notes(snapshot.engine.counters) if snapshot else ""

    def render_snapshot(self, snapshot: Snapshot) -> Content:
        d = snapshot.daemon
        counters = snapshot.engine.counters
        done = sum(counters.requests_by_finish_reason.values())
        rejected = sum(counters.rejections_by_reason.values())
        lines = [
            Content(f"RSS {fmt_bytes(d.rss_bytes)}"),
            Content(f"CPU {fmt_percent(d.cpu_percent)}"),
            Content(f"{done} done · {rejected} rejected"),
        ]
        if d.mlx_active_bytes is not None:  # MLX's allocator (a daemon that reports it)
            lines.insert(
                1,
                Content(
                    f"MLX {fmt_bytes(d.mlx_active_bytes)} · cache {fmt_bytes(d.mlx_cache_bytes)}"
                    f" · peak {fmt_bytes(d.mlx_peak_bytes)}"
                ),
            )
        return Content("\n").join(lines)
