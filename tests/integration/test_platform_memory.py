"""Issue 17 item 6: memory budgets per backend from `mx.device_info()` (fake device info for
Metal and CUDA: no GPU here), mlx-lm's 256-token KV growth step, MLX's buffer-cache and wired
limits engaged and restored (docs/platforms.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlxcel.daemon.engine import memory
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.kv_budget import AUTO_BUDGET_FRACTION
from mlxcel.daemon.engine.mlx_support import probe_model
from mlxcel.daemon.models import load_model
from mlxcel.shared.config import KV_BLOCK_SIZE, ServingConfig

GiB = 1 << 30
# What mx.device_info() returns on each backend (keys from mlx 0.32's Metal and CUDA code).
METAL_INFO = {
    "architecture": "applegpu_g15s",
    "device_name": "Apple M3 Max",
    "memory_size": 64 * GiB,
    "max_recommended_working_set_size": 48 * GiB,
    "max_buffer_size": 32 * GiB,
}
CUDA_INFO = {
    "architecture": "sm_90",
    "device_name": "NVIDIA H100 80GB HBM3",
    "total_memory": 80 * GiB,
    "free_memory": 70 * GiB,
}


def test_cpu_budget_is_host_ram() -> None:
    got = memory.device_memory("cpu", info=CUDA_INFO, active_bytes=5 * GiB, host_bytes=12 * GiB)
    assert got.available_bytes == 12 * GiB and got.backend == "cpu"


def test_metal_budget_is_the_working_set_minus_active_memory() -> None:
    got = memory.device_memory("metal", METAL_INFO, active_bytes=6 * GiB, host_bytes=60 * GiB)
    assert got.available_bytes == 42 * GiB
    tight = memory.device_memory("metal", METAL_INFO, active_bytes=6 * GiB, host_bytes=9 * GiB)
    assert tight.available_bytes == 9 * GiB  # unified memory: other apps use it too
    full = memory.device_memory("metal", METAL_INFO, active_bytes=50 * GiB, host_bytes=60 * GiB)
    assert full.available_bytes == 0


def test_cuda_budget_is_device_memory_not_host_ram() -> None:
    host = 500 * GiB  # a big host: the old psutil-based budget would have used this
    got = memory.device_memory("cuda", CUDA_INFO, active_bytes=1 * GiB, host_bytes=host)
    assert got.available_bytes == 70 * GiB and "CUDA free" in got.source
    no_free = {k: v for k, v in CUDA_INFO.items() if k != "free_memory"}
    got = memory.device_memory("cuda", no_free, active_bytes=10 * GiB, host_bytes=host)
    assert got.available_bytes == 70 * GiB and "total" in got.source


def test_kv_growth_step_is_taken_off_the_memory() -> None:
    mem = memory.DeviceMemory("cpu", 4 * GiB, "test")
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M in float32: 46 KiB a token
    headroom = 8 * memory.KV_ALLOC_STEP * per_token
    assert memory.kv_growth_headroom(8, per_token) == headroom
    assert memory.available_for_caches(8, per_token, mem) == 4 * GiB - headroom
    assert memory.available_for_caches(8, per_token, memory.DeviceMemory("cpu", 1, "")) == 0


def test_engine_auto_budget_uses_the_device_memory_less_the_growth_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2 * GiB)
    loaded = load_model(str(tiny_model_dir))
    per_token = probe_model(loaded.model).kv_bytes_per_token
    engine = Engine(loaded.model, ServingConfig(parallel=6, kv_cache_budget="auto"))
    usable = 2 * GiB - 6 * memory.KV_ALLOC_STEP * per_token
    block = per_token * KV_BLOCK_SIZE
    assert engine.kv.budget_bytes == int(usable * AUTO_BUDGET_FRACTION) // block * block


class _Recorder:
    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, []

    def __call__(self, value: int) -> int:
        self.calls.append(value)
        return self.real(value)


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_gpu_limits_are_engaged_and_restored(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated: the backend and its device info are fakes; MLX's setters are the real ones
    (on the CPU build set_wired_limit is a no-op, so its calls are recorded)."""
    wired = _Recorder(mx.set_wired_limit)
    monkeypatch.setattr(memory.mx, "set_wired_limit", wired)
    before = mx.set_cache_limit(123 << 20)
    try:
        info = METAL_INFO if backend == "metal" else CUDA_INFO
        mem = memory.device_memory(backend, info, active_bytes=6 * GiB, host_bytes=60 * GiB)
        limits = memory.MlxLimits.engage(8 * GiB, 2 * GiB, backend, mem, info)
        assert limits.cache_limit == mem.available_bytes - 8 * GiB - 2 * GiB
        assert mx.set_cache_limit(limits.cache_limit) == limits.cache_limit  # in force
        if backend == "metal":
            assert limits.wired_limit == 48 * GiB and wired.calls == [48 * GiB]
        else:
            assert limits.wired_limit is None and wired.calls == []
        limits.restore()
        assert mx.set_cache_limit(123 << 20) == 123 << 20  # the previous cache limit is back
        assert wired.calls[1:] == ([0] if backend == "metal" else [])  # and the wired one
    finally:
        mx.set_cache_limit(before)


def test_cpu_leaves_mlx_limits_alone_and_malloc_serves_from_its_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU: MLX's buffer cache and wired limit untouched; on Linux with glibc, malloc
    serves buffers up to 32 MiB from its heap (`mallopt` accepted it), elsewhere nothing is
    done."""
    import platform

    wired = _Recorder(mx.set_wired_limit)
    monkeypatch.setattr(memory.mx, "set_wired_limit", wired)
    before = mx.set_cache_limit(77 << 20)
    try:
        limits = memory.MlxLimits.engage(GiB, GiB, "cpu")
        assert limits.cache_limit is None and wired.calls == []
        assert mx.set_cache_limit(77 << 20) == 77 << 20
        glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
        assert limits.malloc_from_heap == glibc
        limits.restore()
    finally:
        mx.set_cache_limit(before)


def test_buffer_cache_has_a_floor() -> None:
    assert memory.buffer_cache_limit(GiB, GiB, GiB) == memory.MIN_BUFFER_CACHE_BYTES
