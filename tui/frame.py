"""One frame as plain text, for `mlxcel-top --once`: same information, no full-screen app."""

from __future__ import annotations

from collections.abc import Sequence

from mlxcel.shared.snapshot import Snapshot

from .controls import cap_text, parallel_text
from .format import (
    QUEUE_COLUMNS,
    SLOT_COLUMNS,
    Column,
    cache_lines,
    engine_notes,
    fmt_bytes,
    fmt_percent,
    fmt_uptime,
    kv_lines,
    kv_subtitle,
    queue_cells,
    slot_cells,
)
from .latency import latency_figures


def render_frame(snapshot: Snapshot) -> str:
    d = snapshot.daemon
    eng = snapshot.engine
    cfg = eng.config
    counters = eng.counters
    lines = [
        f"mlxcel-top  {d.model} · {d.backend} {d.dtype} · v{d.version} pid {d.pid} · "
        f"up {fmt_uptime(d.uptime_s)}",
        "",
        "KV blocks     " + " · ".join([*kv_lines(eng.kv), kv_subtitle(eng.kv)]),
        "prompt cache  "
        + " · ".join([*cache_lines(eng.prompt_cache), f"{eng.prompt_cache.evictions} evicted"]),
        *(
            ["disk tier     " + eng.prompt_cache.disk.summary()]
            if eng.prompt_cache.disk is not None
            else []
        ),
        f"daemon        RSS {fmt_bytes(d.rss_bytes)} · CPU {fmt_percent(d.cpu_percent)} · "
        f"requests {sum(counters.requests_by_finish_reason.values())} done · "
        f"{sum(counters.rejections_by_reason.values())} rejected"
        + (f" · {engine_notes(counters)}" if engine_notes(counters) else ""),
        f"settings      parallel {parallel_text(cfg)} · prefill cap "
        f"{cap_text(cfg.max_batch_prefill_tokens)} · prompt cache "
        f"{'on' if cfg.prompt_cache else 'off'} · batch prefill {cfg.max_batch_prefill}",
        "",
    ]
    busy = sum(1 for s in eng.slots if s.state != "idle")
    lines.append(f"slots ({busy}/{len(eng.slots)} busy)")
    slot_rows = [slot_cells(s) for s in sorted(eng.slots, key=lambda s: s.id)]
    lines += text_table(SLOT_COLUMNS, slot_rows)
    lines.append("")
    lines.append(f"queue ({len(eng.queue)} waiting)")
    if eng.queue:
        queue_rows = [queue_cells(i, e) for i, e in enumerate(eng.queue, start=1)]
        lines += text_table(QUEUE_COLUMNS, queue_rows)
    lines.append("")
    figures = latency_figures(snapshot, ())
    lines += [
        "last 60 s",
        f"  TTFT          {figures['ttft']}  ({figures['split']})",
        f"  decode tok/s  {figures['decode']}",
        f"  prefill tok/s {figures['prefill']}",
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def text_table(columns: Sequence[Column], rows: Sequence[dict[str, str]]) -> list[str]:
    widths = {c.key: max([len(c.label)] + [len(r.get(c.key, "")) for r in rows]) for c in columns}

    def fmt(col: Column, value: str) -> str:
        return value.rjust(widths[col.key]) if col.right else value.ljust(widths[col.key])

    out = ["  " + "  ".join(fmt(c, c.label) for c in columns)]
    out += ["  " + "  ".join(fmt(c, r.get(c.key, "")) for c in columns) for r in rows]
    return out
