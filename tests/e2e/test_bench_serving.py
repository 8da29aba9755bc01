"""The serving benchmark, run for real (a few tokens) against servers on the tiny model.

Only that the figures come out and make sense is checked here; speed targets belong to the
benchmark itself (scripts/bench_serving.py), never to a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_lib.client import PromptFactory, gap_distribution, percentile
from bench_lib.metrics import parse_metrics, sample_value
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from repo_paths import SCRIPTS

BENCH = SCRIPTS / "bench_serving.py"

COLUMNS = 12  # server clients ok fail out_tok/s ttft_mean ttft_p95 itl_mean itl_p95 tok/req ...


def run_bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(BENCH), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def table_rows(stdout: str, server: str) -> list[list[str]]:
    """The benchmark's per-level rows for `server` (fixed-width: split on blanks)."""
    rows = [line.split() for line in stdout.splitlines()]
    return [r for r in rows if len(r) == COLUMNS and r[0] == server]


def check_rows(rows: list[list[str]], clients: int, per_client: int, max_tokens: int) -> None:
    assert rows, "no result rows printed"
    for row in rows:
        assert int(row[1]) == clients
        assert (int(row[2]), int(row[3])) == (clients * per_client, 0)
        out_tok_s, ttft_mean, ttft_p95, itl_mean, itl_p95, tok_req = map(float, row[4:10])
        assert min(out_tok_s, ttft_mean, ttft_p95, itl_mean, itl_p95) > 0
        assert ttft_p95 >= ttft_mean * 0.999 or clients * per_client == 1
        assert tok_req == max_tokens  # EOS suppressed: exactly max_tokens each
        assert float(row[10]) > 0  # prompt tokens the server reported


def test_bench_against_mlx_lm_server_on_the_tiny_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out_json = tmp_path / "bench.json"
    result = run_bench(
        "--start-mlx-lm", "--model", str(tiny_model_dir), "--levels", "2",
        "--requests-per-client", "2", "--prompt-tokens", "48", "--max-tokens", "6",
        "--shared-prefix-tokens", "40", "--cache-probe", "1", "--json", str(out_json),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    check_rows(table_rows(result.stdout, "mlx_lm"), clients=2, per_client=2, max_tokens=6)
    assert "--decode-concurrency 2" in result.stdout  # matched to --parallel (top level)
    data = json.loads(out_json.read_text())
    (level,) = data["results"]["mlx_lm"]
    assert level["output_tokens"] == 2 * 2 * 6
    assert level["prompt_tokens_mean"] >= 48 + 40  # content tokens plus the chat template
    probe = data["cache_probe"]["mlx_lm"]
    assert probe["cold_ttft_mean_s"] > 0 and probe["warm_ttft_mean_s"] > 0


def test_bench_mlxcel_side_by_side_with_mlx_lm(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = run_bench(
        "--against-mlx-lm", "--model", str(tiny_model_dir), "--levels", "2",
        "--requests-per-client", "2", "--prompt-tokens", "40", "--max-tokens", "6",
        "--metrics", "--markdown", "--gaps",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    for server in ("mlxcel", "mlx_lm"):
        check_rows(table_rows(result.stdout, server)[:1], clients=2, per_client=2, max_tokens=6)
    ratio = [
        line.split() for line in result.stdout.splitlines() if line.strip().startswith("ratio")
    ]
    assert ratio and ratio[0][1] == "2" and float(ratio[0][2].rstrip("x")) > 0
    metrics = [line for line in result.stdout.splitlines() if "metrics mlxcel @2" in line]
    assert metrics and "prefill padding efficiency n/a" not in metrics[0]
    assert "| mlxcel | 2 | 4 / 0 |" in result.stdout and "| mlx_lm | 2 | 4 / 0 |" in result.stdout
    gaps = result.stdout.split("inter-token gaps (ms)")[1].splitlines()
    for server in ("mlxcel", "mlx_lm"):
        (row,) = [line.split() for line in gaps if line.split()[:2] == [server, "2"]]
        n, p50, p99, top = int(row[2]), float(row[3]), float(row[7]), float(row[8])
        assert 0 < n <= 4 * 5 and 0 < p50 <= p99 <= top  # 4 requests x 6 tokens: <= 5 gaps each


def test_prompts_are_distinct_and_exactly_the_asked_length(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    args = argparse.Namespace(prompt_tokens=50, shared_prefix_tokens=30)
    factory = PromptFactory(tok, args)
    prompts = [factory.next() for _ in range(5)]
    assert len(set(prompts)) == 5
    assert all(p.startswith(factory.prefix) for p in prompts)
    lengths = [len(tok.encode(p, add_special_tokens=False)) for p in prompts]
    # cut at exactly 30 + 50 tokens; re-encoding the joined text may merge at the seams
    assert all(abs(n - 80) <= 4 for n in lengths), lengths
    again = PromptFactory(tok, args)
    assert [again.next() for _ in range(5)] == prompts  # every server sees the same texts


def test_percentile_interpolates() -> None:
    assert percentile([], 95) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_gap_distribution_counts_the_tail() -> None:
    gaps = [0.01] * 95 + [0.11, 0.15, 0.25, 0.6, 1.2]
    d = gap_distribution(gaps)
    assert d["n"] == 100 and d["p50"] == pytest.approx(10) and d["max"] == pytest.approx(1200)
    assert (d["over_100ms"], d["over_120ms"], d["over_200ms"], d["over_500ms"]) == (5, 4, 3, 2)
    assert d["p95"] == pytest.approx(10 + (110 - 10) * 0.05)  # interpolated, as the table's p95
    assert gap_distribution([]) == {}


def test_metrics_parsing_reads_labelled_counters() -> None:
    registry = CollectorRegistry()
    prompt = Counter("mlxcel_prompt_tokens", "p", ["source"], registry=registry)
    prompt.labels("computed").inc(120)
    prompt.labels("cached").inc(64)
    Gauge("mlxcel_slots_busy", "b", registry=registry).set(3)
    samples = parse_metrics(generate_latest(registry).decode())
    assert sample_value(samples, "mlxcel_prompt_tokens_total", {"source": "computed"}) == 120
    assert sample_value(samples, "mlxcel_prompt_tokens_total", {"source": "cached"}) == 64
    assert sample_value(samples, "mlxcel_slots_busy", {}) == 3
    assert sample_value(samples, "mlxcel_missing", {}) is None


def test_tiny_mode_defaults_and_both_servers_get_the_daemons_blas_environment() -> None:
    import bench_serving
    from bench_lib.servers import blas_env
    from mlxcel.daemon.forward.blas import fast_blas_env

    args = bench_serving.parse_args(["--tiny"])
    assert (args.start_mlxcel, args.start_mlx_lm, args.model) == (True, True, None)
    assert (args.levels, args.max_tokens, args.prompt_tokens, args.parallel) == ([64], 256, 32, 64)
    args = bench_serving.parse_args(["--tiny", "--levels=8", "--max-tokens", "16"])
    assert (args.levels, args.max_tokens, args.parallel) == ([8], 16, 8)  # given flags win
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--tiny", "--model", "somewhere"])
    env, daemon = blas_env(), fast_blas_env()
    for key in ("LD_PRELOAD", "OPENBLAS_CORETYPE"):
        assert env.get(key) == daemon.get(key)  # the core type the daemon picks, for both
