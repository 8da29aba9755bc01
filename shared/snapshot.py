"""The engine/daemon snapshot (docs/api.md, "Control API"): immutable values with to_dict/from_dict.

The engine builds one after every step; the daemon adds process figures; the console renders it.
"Not available" is None, never a fake 0.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


class Record:
    """Mixin: dict round-trip for frozen dataclasses of plain values and nested records."""

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        return _from_plain(cls, data)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    return value


def _from_plain(tp: Any, data: Any) -> Any:
    if data is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_plain(args[0], data) if len(args) == 1 else data
    if origin is tuple:
        (item,) = typing.get_args(tp)[:1]
        return tuple(_from_plain(item, v) for v in data)
    if origin is dict:
        _, vt = typing.get_args(tp)
        return {k: _from_plain(vt, v) for k, v in data.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp, vars(sys.modules[tp.__module__]))
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in data:
                kwargs[f.name] = _from_plain(hints[f.name], data[f.name])
        return tp(**kwargs)
    if tp is float and isinstance(data, int):
        return float(data)
    return data


@dataclass(frozen=True)
class SlotInfo(Record):
    id: int
    state: str = "idle"  # idle | prefill | decode
    request_id: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0  # of the prompt, computed or cached so far
    generated_tokens: int = 0
    max_tokens: int = 0
    kv_blocks: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    age_s: float = 0.0
    lane: str = "normal"  # high | normal | low (docs/tuning.md, "Priority lanes")


@dataclass(frozen=True)
class QueueEntry(Record):
    request_id: str
    prompt_tokens: int
    wait_reason: str  # slots_full | kv_budget | prefill_cap | disk_read
    age_s: float
    lane: str = "normal"


@dataclass(frozen=True)
class KVInfo(Record):
    block_size: int = 32
    blocks_total: int | None = None  # None: unbounded
    blocks_used: int = 0  # reserved by running requests
    blocks_cached: int = 0  # held by the prompt cache
    budget_bytes: int | None = None
    bytes_per_block: int = 0


@dataclass(frozen=True)
class DiskCacheInfo(Record):
    """The prompt cache's disk tier: chunks of `chunk_tokens` tokens' KV."""

    ready: bool = False  # its start scan is done (before it, nothing is found)
    dir: str = ""
    entries: int = 0
    bytes: int = 0
    other_bytes: int = 0  # files of other models (or older formats) in the same budget
    capacity_bytes: int = 0
    chunk_tokens: int = 0
    lookups: int = 0  # prompts looked up on disk
    hits: int = 0  # reads that served tokens
    misses: int = 0  # lookups that found nothing, and reads that served nothing
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    reads: int = 0
    writes: int = 0
    evictions: int = 0
    rejected: int = 0  # corrupt, truncated or foreign files: deleted, never served
    writes_dropped: int = 0
    write_errors: int = 0  # writes that failed (a full or read-only disk; logged once)
    pending_bytes: int = 0

    def summary(self) -> str:
        """One line (`mlxcel-daemon status`, the console's frame)."""
        from mlxcel.shared.config import format_size

        scanning = "" if self.ready else " (scanning)"
        return (
            f"{self.entries} chunks{scanning}, {format_size(self.bytes)} of "
            f"{format_size(self.capacity_bytes)}, {self.hits} hits ({self.hit_tokens} tokens), "
            f"{self.rejected} rejected, in {self.dir}"
        )


@dataclass(frozen=True)
class PromptCacheInfo(Record):
    enabled: bool = True
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    evictions: int = 0
    # the disk tier under this one (daemon/engine/disk_cache.py); None when it is off
    disk: DiskCacheInfo | None = None


CACHE_KINDS = ("hit", "partial", "miss")  # a request's prompt-cache outcome: its TTFT label


def cache_kind(prompt_tokens: int, cached_tokens: int, block_size: int) -> str:
    """hit: every reusable block (all but the last token's) was cached; partial: some; miss:
    none. The label of `LatencyInfo.ttft_by_cache` and of the TTFT histogram."""
    if cached_tokens <= 0:
        return "miss"
    reusable = (max(prompt_tokens - 1, 0) // block_size) * block_size
    return "hit" if cached_tokens >= reusable else "partial"


@dataclass(frozen=True)
class LatencyInfo(Record):
    """Over the last 60 s; None where there is no sample."""

    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_by_cache: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    decode_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None


@dataclass(frozen=True)
class Counters(Record):
    requests_by_finish_reason: dict[str, int] = field(default_factory=dict)
    rejections_by_reason: dict[str, int] = field(default_factory=dict)
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0  # real tokens through batched prefill
    prefill_padded_tokens: int = 0  # rows x longest, i.e. what the forward computed
    steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of rows over decode steps (occupancy = rows / steps)
    preemptions: int = 0  # running requests preempted for a higher lane
    engine_restarts: int = 0  # engines replaced after a step outran --step-timeout
    # speculative decoding (--speculative): verification steps, the rows they verified, the
    # drafted tokens verified and those accepted
    spec_steps: int = 0
    spec_rows: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    # the most rows at which verification pays, estimated from the measured step costs and
    # acceptance (None: not measured yet)
    spec_break_even_rows: int | None = None

    @property
    def spec_acceptance(self) -> float | None:
        """The share of drafted tokens accepted; None before any was verified."""
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else None

    @property
    def spec_tokens_per_step(self) -> float | None:
        """Tokens a row got per verification step (its own, plus the accepted drafts); None
        before any verification."""
        return (self.spec_rows + self.spec_accepted) / self.spec_rows if self.spec_rows else None


@dataclass(frozen=True)
class EffectiveConfig(Record):
    parallel: int
    parallel_requested: int
    parallel_limit: int
    parallel_clamp_reason: str | None
    max_batch_prefill: int
    max_batch_prefill_tokens: int
    prefill_chunk_size: int
    prompt_cache: bool
    prompt_cache_bytes: int
    kv_cache_budget: int | None
    max_queue_depth: int
    ctx_per_slot: int
    speculative: str = "off"  # off | ngram | draft: what the engine runs (off on a solo runner)
    # the draft model loaded for this model (`--draft-model`), None without one: `draft` runs
    # only with it
    draft_model: str | None = None


@dataclass(frozen=True)
class EngineSnapshot(Record):
    """What the engine knows after a step."""

    time: float
    config: EffectiveConfig
    slots: tuple[SlotInfo, ...]
    queue: tuple[QueueEntry, ...]
    kv: KVInfo
    prompt_cache: PromptCacheInfo
    latency: LatencyInfo
    counters: Counters


@dataclass(frozen=True)
class ModelState(Record):
    """One model the daemon holds (or is loading): docs/models.md."""

    name: str
    state: str = "loaded"  # loading | loaded | unloading
    path: str | None = None
    family: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    forward: str | None = None  # which path each step kind takes (docs/models.md)
    context_length: int | None = None
    weights_bytes: int | None = None
    kv_budget_bytes: int | None = None
    loaded_at: float | None = None  # wall clock
    load_s: float | None = None
    active_requests: int = 0
    idle_s: float = 0.0
    expires_in_s: float | None = None  # keep-alive: unloaded after this much more idle time
    pinned: bool = False  # never evicted for another model nor unloaded by keep-alive


@dataclass(frozen=True)
class ModelHostInfo(Record):
    """The resident models and the load/unload counters (`--keep-alive`, switching)."""

    models: tuple[ModelState, ...] = ()
    default: str | None = None  # the model requests without a name go to
    max_loaded_models: int = 1
    models_memory: int | None = None  # the resident weights' budget; None: free memory only
    resident_weights_bytes: int = 0  # the resident models' weights, counted against it
    keep_alive_s: float | None = None  # None: forever
    loads: int = 0
    unloads: int = 0
    load_failures: int = 0
    load_seconds_total: float = 0.0
    last_load_s: float | None = None


@dataclass(frozen=True)
class DaemonInfo(Record):
    version: str
    pid: int
    uptime_s: float
    model: str
    backend: str  # cpu | metal | cuda
    dtype: str
    rss_bytes: int | None = None
    cpu_percent: float | None = None
    http_url: str | None = None
    socket_path: str | None = None
    blas: str | None = None
    # Where the native kernels came from: "gemm package, ops cache" (docs/platforms.md)
    native: str | None = None
    service: str | None = None  # systemd | launchd | None
    # MLX's allocator: arrays alive, freed buffers kept for reuse, the high-water mark. On a
    # GPU this is where the weights and KV live; RSS alone does not show it.
    mlx_active_bytes: int | None = None
    mlx_cache_bytes: int | None = None
    mlx_peak_bytes: int | None = None
    host: ModelHostInfo | None = None  # the models held and their load/unload counters
    # The MLXCEL_* switches set in the daemon's environment, name -> value (shared/switches.py);
    # None from a daemon that does not report them.
    switches: dict[str, str] | None = None
    # The sampling defaults set (--temperature, --top-p, --top-k, --min-p), name -> value: what
    # a request that sends none gets; empty or None: the API's own.
    sampling: dict[str, float] | None = None


@dataclass(frozen=True)
class RankInfo(Record):
    """One rank of a distributed group (docs/distributed.md)."""

    rank: int
    host: str
    pid: int | None = None
    memory_bytes: int | None = None  # MLX active memory (weights, KV), else RSS
    step_ms: float | None = None  # its last engine step
    steps: int = 0


@dataclass(frozen=True)
class GroupInfo(Record):
    """The group serving one model across ranks; None in a snapshot: a single process."""

    size: int
    mode: str  # tensor | pipeline
    backend: str  # ring | mpi | jaccl
    status: str  # ok | degraded
    reason: str | None = None  # why degraded
    comm_ms: float | None = None  # rank 0's mean wait on the per-step exchange
    timeout_s: float = 0.0
    ranks: tuple[RankInfo, ...] = ()


@dataclass(frozen=True)
class Snapshot(Record):
    """One status snapshot of the daemon, as the control API sends it."""

    daemon: DaemonInfo
    engine: EngineSnapshot
    group: GroupInfo | None = None


@dataclass(frozen=True)
class ConfigChange(Record):
    """The answer to one runtime change: applied, clamped (with reason) or refused."""

    key: str
    requested: Any
    applied: bool
    effective: Any
    previous: Any = None
    reason: str | None = None
