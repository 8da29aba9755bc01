"""The lanes load of issue #28, one definition for the benchmarks that run it
(`bench_priority.py` against daemons, `bench_lanes_engine.py` on the engine alone)."""

from __future__ import annotations

import argparse


def add_lanes_load_args(p: argparse.ArgumentParser) -> None:
    """Low-lane clients that fill the slots, and high-lane requests arriving one by one."""
    p.add_argument("--low-clients", type=int, default=8)
    p.add_argument(
        "--max-tokens", type=int, default=320, help="low requests: 3/4 of this .. this (320)"
    )
    p.add_argument("--high-max-tokens", type=int, default=16)
    p.add_argument("--low-prompt-tokens", type=int, default=128)
    p.add_argument("--high-prompt-tokens", type=int, default=32)
    p.add_argument("--spacing", type=float, default=1.5, help="seconds between high requests")
