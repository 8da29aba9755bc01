"""The scripted-runner scenario (tests/scripted_engine.py: run_scenario) in a fresh
interpreter: engine, scheduler, KV, prefix cache, stats, snapshots and a runner through the
protocol. Prints the sorted list of mlx / mlx_lm top-level modules imported meanwhile (`[]`).

Usage: engine_scripted_no_mlx.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the scripted engine

from scripted_engine import run_scenario


def main() -> None:
    r = run_scenario()
    assert r["kv_used"] == 0 and r["cancelled_at"] is not None
    print(sorted({m.split(".")[0] for m in sys.modules} & {"mlx", "mlx_lm"}))


if __name__ == "__main__":
    main()
