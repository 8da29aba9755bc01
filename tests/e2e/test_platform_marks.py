"""Issue 17 item 3: the tests whose claim is a CPU-backend guarantee are marked `cpu_only`, so a
Metal or CUDA run skips them instead of failing (simulated with MLXCEL_TEST_BACKEND, in a
pytest subprocess). What holds everywhere, batched close to alone, is checked with a tolerance
in tests/integration/test_engine.py."""

from __future__ import annotations

import os
import subprocess
import sys

from platform_marks import BACKEND_ENV
from repo_paths import ROOT

CPU_ONLY = [
    "tests/integration/test_gguf.py::test_quantized_gguf_dequantizes_exactly",
    "tests/integration/test_fast_forward.py",
    "tests/e2e/test_fast_forward_smollm2.py",
    "tests/integration/test_engine.py::test_batched_chunked_greedy_equals_each_alone",
    "tests/integration/test_engine_host.py::test_batched_delivery_equals_each_request_alone",
    "tests/e2e/test_engine_e2e.py::test_batched_equals_alone_and_cache_hit_equals_cold",
    "tests/e2e/test_models_exact.py",
]


def test_cpu_guarantees_are_skipped_on_a_gpu_run() -> None:
    env = {**os.environ, BACKEND_ENV: "metal"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CPU_ONLY],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail
    summary = tail.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, tail
    assert "a CPU-backend guarantee" in proc.stdout or "not pulled" in proc.stdout
