"""Memory budgets per MLX backend, and MLX's own limits while the engine runs.

What the KV budget (`kv_cache_budget = "auto"`) and the prompt-cache default are shares of:

- CPU: the host's available RAM (psutil); the KV cache lives there.
- Metal (unified memory): the GPU's recommended working set minus what MLX already holds (the
  weights), and never more than the host has available.
- CUDA: the device's free memory (`mx.device_info()["free_memory"]`, from NVML; the weights
  are already counted as used), else its total memory minus MLX's active memory. Host RAM says
  nothing about where the KV cache lives there.

mlx-lm grows each KV cache in steps of 256 tokens (`KVCache.step`), so every running sequence
may hold up to 255 tokens more than it uses: that headroom is taken off the memory first.

On a GPU the engine also bounds MLX's buffer cache (`mx.set_cache_limit`, else freed buffers
pile up to the memory limit) and, on Metal, wires the recommended working set while it runs
(what mlx-lm's own generator does; the previous limits are restored at shutdown). On the CPU
it leaves MLX's limits alone; the loader has glibc's malloc serve buffers up to 32 MiB from its
heap while a model serves (`models/loader.py: serve_from_heap`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlxcel.daemon.models.loader import malloc_trim, serve_from_heap

log = logging.getLogger(__name__)

KV_ALLOC_STEP = 256  # tokens: mlx_lm.models.cache.KVCache.step
MIN_BUFFER_CACHE_BYTES = 256 << 20

DeviceInfo = Mapping[str, Any]


def current_backend() -> str:
    if mx.default_device().type == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def host_available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class DeviceMemory:
    backend: str  # cpu | metal | cuda
    available_bytes: int  # what the KV cache and the prompt cache may use now
    source: str  # where the figure comes from, for the log


def device_memory(
    backend: str | None = None,
    info: DeviceInfo | None = None,
    active_bytes: int | None = None,
    host_bytes: int | None = None,
) -> DeviceMemory:
    """The memory available on the backend's device; the arguments default to this machine."""
    backend = backend or current_backend()
    host = host_available_bytes() if host_bytes is None else host_bytes
    if backend == "cpu":
        return DeviceMemory("cpu", host, "host RAM available")
    info = mx.device_info() if info is None else info
    active = mx.get_active_memory() if active_bytes is None else active_bytes
    if backend == "metal":
        working_set = int(info.get("max_recommended_working_set_size", 0) or 0)
        if working_set:
            free = max(working_set - active, 0)
            return DeviceMemory("metal", min(free, host), "Metal working set minus active")
        return DeviceMemory("metal", host, "host RAM available (no working-set size)")
    cuda_free = info.get("free_memory")
    if cuda_free is not None:
        return DeviceMemory(backend, int(cuda_free), "CUDA free memory")
    total = int(info.get("total_memory", 0) or info.get("memory_size", 0) or 0)
    if total:
        return DeviceMemory(backend, max(total - active, 0), "CUDA total memory minus active")
    return DeviceMemory(backend, host, "host RAM available (device reports no memory)")


def mlx_memory() -> tuple[int, int, int]:
    """MLX's (active, cache, peak) bytes, as `status`, /metrics and the console show them."""
    return mx.get_active_memory(), mx.get_cache_memory(), mx.get_peak_memory()


def kv_growth_headroom(parallel: int, kv_bytes_per_token: int) -> int:
    """Bytes mlx-lm may allocate beyond the tokens in use: a step per running sequence."""
    return max(parallel, 1) * KV_ALLOC_STEP * max(kv_bytes_per_token, 0)


def available_for_caches(
    parallel: int = 1, kv_bytes_per_token: int = 0, memory: DeviceMemory | None = None
) -> int:
    """The memory the KV budget and the prompt cache are shares of (after the growth step)."""
    memory = device_memory() if memory is None else memory
    return max(memory.available_bytes - kv_growth_headroom(parallel, kv_bytes_per_token), 0)


def buffer_cache_limit(available_bytes: int, kv_budget: int | None, prompt_cache: int) -> int:
    """MLX's free-buffer cache: what the KV budget and the prompt cache leave, >= 256 MiB."""
    left = available_bytes - (kv_budget or available_bytes // 2) - prompt_cache
    return max(left, MIN_BUFFER_CACHE_BYTES)


class MlxLimits:
    """MLX's buffer-cache limit and (Metal) wired limit while the engine runs on a GPU; on the
    CPU, malloc's serving setting (`serve_from_heap`). `restore()` puts back MLX's previous
    values."""

    def __init__(self) -> None:
        self.backend = "cpu"
        self.cache_limit: int | None = None
        self.wired_limit: int | None = None
        self.malloc_from_heap = False  # glibc serves buffers up to 32 MiB from its heap (CPU)
        self._old_cache: int | None = None
        self._old_wired: int | None = None

    @classmethod
    def engage(
        cls,
        kv_budget: int | None,
        prompt_cache: int,
        backend: str | None = None,
        memory: DeviceMemory | None = None,
        info: DeviceInfo | None = None,
    ) -> MlxLimits:
        limits = cls()
        limits.backend = backend or current_backend()
        if limits.backend == "cpu":
            limits.malloc_from_heap = serve_from_heap()  # as the loader left it; idempotent
            heap = ", malloc serves buffers up to 32 MiB from its heap"
            log.info(
                "memory: MLX's buffer cache left at its default%s",
                heap if limits.malloc_from_heap else "",
            )
            return limits
        memory = device_memory(limits.backend, info) if memory is None else memory
        limits.cache_limit = buffer_cache_limit(memory.available_bytes, kv_budget, prompt_cache)
        limits._old_cache = mx.set_cache_limit(limits.cache_limit)
        if limits.backend == "metal":
            info = mx.device_info() if info is None else info
            wired = int(info.get("max_recommended_working_set_size", 0) or 0)
            if wired:
                limits.wired_limit = wired
                limits._old_wired = mx.set_wired_limit(wired)
        log.info(
            "memory: %s, buffer cache limit %d MiB, wired limit %s",
            memory.source,
            limits.cache_limit >> 20,
            "unchanged" if limits.wired_limit is None else f"{limits.wired_limit >> 20} MiB",
        )
        return limits

    def restore(self) -> None:
        if self._old_wired is not None:
            mx.synchronize()  # as mlx-lm does: no kernel may still use wired buffers
            mx.set_wired_limit(self._old_wired)
            self._old_wired = None
        if self._old_cache is not None:
            mx.set_cache_limit(self._old_cache)
            self._old_cache = None


def release_idle_memory() -> tuple[int, int]:
    """What an engine idle for a while gives back (the bridge calls it once per idle
    period; docs/platforms.md "Memory budgets"): MLX's buffer cache, and glibc's freed heap
    pages (a burst's KV copies leave hundreds of MB of them resident: `serve_from_heap`
    serves buffers up to 32 MiB from the heap, where free() keeps them). No collection of
    Python's objects (that holds the GIL for a while). Returns the process's resident bytes
    (before, after)."""
    import psutil

    process = psutil.Process()
    before = int(process.memory_info().rss)
    mx.clear_cache()
    malloc_trim()
    return before, int(process.memory_info().rss)
