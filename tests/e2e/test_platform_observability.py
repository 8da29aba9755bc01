"""Issue 17 item 11: MLX's active, cache and peak memory in `status`, /metrics and the console,
from a real daemon on the tiny model (on a GPU these hold the weights and KV; RSS does not)."""

from __future__ import annotations

import urllib.request
from dataclasses import replace
from pathlib import Path

from daemon_helpers import chat_body, cli, http_json, running_daemon
from mlxcel.shared.snapshot import Snapshot
from mlxcel.tui.gauges import ProcessGauge


def _metric(text: str, name: str) -> float:
    [line] = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


def test_status_metrics_and_console_show_mlx_memory(tmp_path: Path, tiny_model_dir: Path) -> None:
    home = tmp_path / "home"
    with running_daemon(home, tiny_model_dir) as daemon:
        code, _, _ = http_json(
            f"{daemon.http_url}/v1/chat/completions", chat_body("hi", 4, stream=False)
        )
        assert code == 200
        snap = daemon.status()
        d = snap["daemon"]
        assert d["mlx_active_bytes"] > 0  # the weights, at least
        assert d["mlx_peak_bytes"] >= d["mlx_active_bytes"] and d["mlx_cache_bytes"] >= 0

        with urllib.request.urlopen(f"{daemon.http_url}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        assert _metric(text, "mlxcel_mlx_active_memory_bytes") > 0
        assert _metric(text, "mlxcel_mlx_peak_memory_bytes") >= _metric(
            text, "mlxcel_mlx_active_memory_bytes"
        )
        assert _metric(text, "mlxcel_mlx_cache_memory_bytes") >= 0

        out = cli(home, "status")
        assert out.returncode == 0, out.stderr
        [line] = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("mlx:")]
        assert "active" in line and "cache" in line and "peak" in line and "n/a" not in line

        gauge = ProcessGauge()
        rendered = gauge.render_snapshot(Snapshot.from_dict(snap)).plain
        assert "MLX " in rendered and " · peak " in rendered
        older = Snapshot.from_dict(snap)  # a daemon without the figures: no MLX line
        older = replace(older, daemon=replace(older.daemon, mlx_active_bytes=None))
        assert "MLX" not in gauge.render_snapshot(older).plain
