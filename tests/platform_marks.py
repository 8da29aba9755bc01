"""Marks for tests whose claim only holds on one MLX backend (see docs/platforms.md).

`cpu_only`: exact float32 results (dequantized weights, the fused CPU forward, batched output
equal to each request alone bit for bit) are guarantees of the CPU path; Metal and CUDA keep
models quantized and their kernels reorder sums, so there such tests are skipped, not failed.
MLXCEL_TEST_BACKEND=metal (or cuda) makes a CPU run skip them too, to check the marks.
"""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

BACKEND_ENV = "MLXCEL_TEST_BACKEND"
ON_CPU = os.environ.get(BACKEND_ENV, "cpu") == "cpu" and mx.default_device().type == mx.cpu
cpu_only = pytest.mark.skipif(
    not ON_CPU, reason="a CPU-backend guarantee (docs/platforms.md); this run is on a GPU"
)
