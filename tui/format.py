"""Plain formatting of snapshot values, shared by the widgets and `--once`.

Pure functions, no Textual: "not available" (None) always prints as "n/a", never as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.shared.config import format_duration, format_size
from mlxcel.shared.snapshot import (
    CACHE_KINDS,
    Counters,
    DiskCacheInfo,
    KVInfo,
    LatencyInfo,
    PromptCacheInfo,
    QueueEntry,
    SlotInfo,
    Snapshot,
    cache_kind,
)

NA = "n/a"
_ID_PREFIXES = ("chatcmpl-", "cmpl-", "req-", "request-")


def fmt_bytes(num_bytes: int | None) -> str:
    return format_size(num_bytes, none=NA)


def fmt_uptime(seconds: float | None) -> str:
    return NA if seconds is None else format_duration(seconds)


def fmt_secs(seconds: float | None) -> str:
    """A latency: milliseconds below one second, seconds above."""
    if seconds is None:
        return NA
    if seconds < 1.0:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 100:
        return f"{seconds:.2f}s"
    return f"{seconds:.0f}s"


def fmt_count(n: int) -> str:
    """Block counts stay readable in a narrow gauge: 845104 -> 845k."""
    if n < 100_000:
        return str(n)
    if n < 10_000_000:
        return f"{n / 1000:.0f}k"
    return f"{n / 1_000_000:.1f}M"


def fmt_pair(p50: float | None, p95: float | None) -> str:
    """`p50/p95` latencies; a single n/a when neither is known."""
    if p50 is None and p95 is None:
        return NA
    return f"{fmt_secs(p50)}/{fmt_secs(p95)}"


def engine_notes(counters: Counters) -> str:
    """`3 preempted · 1 engine restart · spec 78% · 2.9 tok/step`: what only happens now and
    then, and speculative decoding once it has verified drafts ("" while none of them has)."""
    notes = []
    if counters.preemptions:
        notes.append(f"{counters.preemptions} preempted")
    if counters.engine_restarts:
        plural = "s" if counters.engine_restarts > 1 else ""
        notes.append(f"{counters.engine_restarts} engine restart{plural}")
    spec = spec_note(counters)
    if spec:
        notes.append(spec)
    return " · ".join(notes)


def spec_note(counters: Counters) -> str:
    """`spec 78% · 2.9 tok/step`: the share of drafted tokens accepted and the tokens a row got
    per verification step, since the start ("" before the first verification)."""
    if not counters.spec_steps:
        return ""
    acceptance = counters.spec_acceptance
    per_step = counters.spec_tokens_per_step or 0.0
    accepted = NA if acceptance is None else f"{100 * acceptance:.0f}%"
    return f"spec {accepted} · {per_step:.1f} tok/step"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return NA
    if seconds < 60:
        return f"{seconds:.1f}s"
    return fmt_uptime(seconds)


def fmt_rate(value: float | None) -> str:
    if value is None:
        return NA
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def fmt_pct(part: int | float, whole: int | float) -> str:
    """part/whole as a percentage; n/a when there is nothing to divide."""
    if not whole:
        return NA
    return f"{100.0 * part / whole:.0f}%"


def fmt_percent(value: float | None) -> str:
    return NA if value is None else f"{value:.0f}%"


def short_id(request_id: str | None, width: int = 8) -> str:
    if not request_id:
        return "-"
    for prefix in _ID_PREFIXES:
        if request_id.startswith(prefix) and len(request_id) > len(prefix):
            request_id = request_id[len(prefix) :]
            break
    return request_id[:width]


def slot_state(slot: SlotInfo) -> str:
    if slot.state == "prefill":
        return f"prefill {slot.prefilled_tokens}/{slot.prompt_tokens}"
    return slot.state


# --- the slots table and the queue: column definitions shared by widget and text ---


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    width: int
    compact: bool  # kept in the compact (narrow) layout
    right: bool = True


SLOT_COLUMNS = (
    Column("slot", "slot", 4, True),
    Column("state", "state", 17, True, right=False),
    Column("request", "request", 8, False, right=False),
    Column("lane", "lane", 6, False, right=False),
    Column("prompt", "prompt", 6, True),
    Column("cached", "cached", 6, True),
    Column("generated", "gen", 6, True),
    Column("kv", "KV blk", 6, False),
    Column("ttft", "TTFT", 7, True),
    Column("tps", "tok/s", 6, True),
    Column("age", "age", 7, True),
)

QUEUE_COLUMNS = (
    Column("pos", "#", 3, True),
    Column("request", "request", 8, True, right=False),
    Column("lane", "lane", 6, False, right=False),
    Column("prompt", "prompt", 6, True),
    Column("reason", "waiting for", 22, True, right=False),
    Column("age", "age", 7, True),
)

WAIT_REASONS = {
    "slots_full": "a free slot",
    "kv_budget": "KV blocks (budget)",
    "prefill_cap": "prefill token cap",
    "disk_read": "its prefix from disk",
}


def slot_cells(slot: SlotInfo) -> dict[str, str]:
    busy = slot.state != "idle"
    return {
        "slot": str(slot.id),
        "state": slot_state(slot),
        "request": short_id(slot.request_id) if busy else "-",
        "lane": slot.lane if busy else "-",
        "prompt": str(slot.prompt_tokens) if busy else "-",
        "cached": str(slot.cached_tokens) if busy else "-",
        "generated": str(slot.generated_tokens) if busy else "-",
        "kv": str(slot.kv_blocks) if busy else "-",
        "ttft": fmt_secs(slot.ttft_s) if busy else "-",
        "tps": fmt_rate(slot.tokens_per_s) if busy else "-",
        "age": fmt_age(slot.age_s) if busy else "-",
    }


def queue_cells(position: int, entry: QueueEntry) -> dict[str, str]:
    return {
        "pos": str(position),
        "request": short_id(entry.request_id),
        "lane": entry.lane,
        "prompt": str(entry.prompt_tokens),
        "reason": WAIT_REASONS.get(entry.wait_reason, entry.wait_reason),
        "age": fmt_age(entry.age_s),
    }


# --- one request's detail (enter on a slot or queue row) ---


def request_detail(snapshot: Snapshot, request_id: str) -> list[tuple[str, str]] | None:
    """(label, value) rows for one running or waiting request; None once it has left.
    Only what the snapshot carries: counts and timings, never the prompt text."""
    engine = snapshot.engine
    slot = next((s for s in engine.slots if s.request_id == request_id), None)
    if slot is not None and slot.state != "idle":
        block = engine.kv.block_size
        max_tokens = str(slot.max_tokens) if slot.max_tokens else NA
        return [
            ("request", request_id),
            ("state", f"{slot_state(slot)} in slot {slot.id}"),
            ("lane", slot.lane),
            ("prompt tokens", str(slot.prompt_tokens)),
            ("cached tokens", str(slot.cached_tokens)),
            ("prompt cache", cache_kind(slot.prompt_tokens, slot.cached_tokens, block)),
            ("generated", f"{slot.generated_tokens} of max {max_tokens}"),
            ("TTFT", fmt_secs(slot.ttft_s)),
            ("tok/s", fmt_rate(slot.tokens_per_s)),
            ("KV blocks", f"{slot.kv_blocks} ({slot.kv_blocks * block} token slots)"),
            ("age", fmt_age(slot.age_s)),
        ]
    for pos, entry in enumerate(engine.queue, start=1):
        if entry.request_id == request_id:
            return [
                ("request", request_id),
                ("state", f"waiting, #{pos} of {len(engine.queue)} in the queue"),
                ("waiting for", WAIT_REASONS.get(entry.wait_reason, entry.wait_reason)),
                ("lane", entry.lane),
                ("prompt tokens", str(entry.prompt_tokens)),
                ("age", fmt_age(entry.age_s)),
            ]
    return None


# --- gauges ---


def kv_free(kv: KVInfo) -> int | None:
    if kv.blocks_total is None:
        return None
    return max(0, kv.blocks_total - kv.blocks_used - kv.blocks_cached)


def kv_budget_bytes(kv: KVInfo) -> int | None:
    if kv.budget_bytes is not None:
        return kv.budget_bytes
    if kv.blocks_total is not None and kv.bytes_per_block:
        return kv.blocks_total * kv.bytes_per_block
    return None


def kv_lines(kv: KVInfo) -> list[str]:
    """Two short lines (they fit a 22-column gauge)."""
    free = kv_free(kv)
    if free is None or kv.blocks_total is None:
        second = "free: unbounded"
    else:
        second = f"free {fmt_count(free)} / {fmt_count(kv.blocks_total)} blk"
    return [f"used {fmt_count(kv.blocks_used)} · cached {fmt_count(kv.blocks_cached)}", second]


def kv_subtitle(kv: KVInfo) -> str:
    """In use as a share of the budget, and the budget itself."""
    free = kv_free(kv)
    if free is None:
        return "unbounded"
    if not kv.blocks_total:  # an embedding model's engine: no KV pool at all
        return "no KV cache"
    share = 100 * (kv.blocks_total - free) / kv.blocks_total
    budget = kv_budget_bytes(kv)
    return f"{share:.0f}% of {fmt_bytes(budget)}" if budget else f"{share:.0f}%"


def cache_hit_rates(pc: PromptCacheInfo) -> tuple[str, str]:
    """Hit rate by requests and by tokens."""
    return fmt_pct(pc.hits, pc.lookups), fmt_pct(pc.hit_tokens, pc.lookup_tokens)


def cache_lines(pc: PromptCacheInfo) -> list[str]:
    """Three short lines (they fit a 22-column gauge)."""
    by_req, by_tok = cache_hit_rates(pc)
    return [
        f"ON · {pc.entries} entries" if pc.enabled else "OFF",
        f"hit {by_req} req · {by_tok} tok",
        f"{fmt_bytes(pc.bytes)} / {fmt_bytes(pc.capacity_bytes)}",
    ]


def disk_subtitle(disk: DiskCacheInfo) -> str:
    """The cache gauge's subtitle when the disk tier is on (22 columns)."""
    return f"disk {fmt_bytes(disk.bytes)} · {disk.hits} hit"


def ttft_split(latency: LatencyInfo) -> str:
    """TTFT p50/p95 by cache outcome: `hit 40ms/90ms · partial n/a · miss 1.20s/2.31s`."""
    parts = []
    for outcome in CACHE_KINDS:
        p50, p95 = latency.ttft_by_cache.get(outcome) or (None, None)
        parts.append(f"{outcome} {fmt_pair(p50, p95)}")
    return " · ".join(parts)
