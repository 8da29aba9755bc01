#!/usr/bin/env python
"""Distributed benchmark: tok/s at N concurrent clients, one process vs a group of ranks on
this machine (ring backend over 127.0.0.1), and the per-step communication time.

  bench_distributed.py                      # a tiny random llama, 8 clients, 2 ranks
  bench_distributed.py --tiny-size 512,8    # a wider random llama (forward costs something)
  bench_distributed.py --model DIR --ranks 3 --max-tokens 64

On ONE machine a group cannot be faster: the ranks share the same cores and memory bandwidth
and add a broadcast per step plus two all_sums per layer. The figures show the overhead of the
group, not the speed-up two machines give a model that does not fit in one. Both runs use the
same forward (the fused CPU forward is off in a group, so it is off for the single process
too). Per step it prints rank 0's wait on the step exchange (the broadcast of the step's
commands; it includes waiting for the slowest rank to finish its previous step), each rank's
last step time, and a measured all_sum of one decode step's activations times the all_sums a
tensor-parallel step makes (2 per layer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "mlxcel.daemon.cli"]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    return {**env, "MLXCEL_HOME": str(home), "MLXCEL_NO_FAST_FORWARD": "1"}


def start(home: Path, model: str, parallel: int, extra: list[str]) -> dict[str, Any]:
    home.mkdir(parents=True, exist_ok=True)
    argv = [*CLI, "start", "--model", model, "--port", "0", "--parallel", str(parallel), *extra]
    done = subprocess.run(argv, env=env_for(home), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"start failed: {done.stderr.strip()}")
    return json.loads((home / "run" / "daemon.json").read_text())


def status(home: Path) -> dict[str, Any]:
    argv = [*CLI, "status", "--json"]
    done = subprocess.run(argv, env=env_for(home), capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout)


def stop(home: Path, pids: list[int]) -> None:
    subprocess.run([*CLI, "stop"], env=env_for(home), capture_output=True, timeout=120)
    for pid in pids:  # whatever did not exit: by pid, never by name
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_clients(url: str, clients: int, max_tokens: int) -> tuple[int, float]:
    """`clients` concurrent greedy completions of exactly `max_tokens`; (tokens, seconds)."""
    counts = [0] * clients

    def one(i: int) -> None:
        body = {
            "prompt": f"client {i} tells a story about the number {i * 13}",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as resp:
            counts[i] = json.loads(resp.read())["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - began


def measure(
    name: str, home: Path, model: str, args: argparse.Namespace, extra: list[str]
) -> dict[str, Any]:
    state = start(home, model, args.clients, extra)
    pids = [int(state["pid"])]
    try:
        snap = status(home)
        group = snap.get("group")
        if group:
            pids += [r["pid"] for r in group["ranks"][1:]]
        run_clients(state["http_url"], args.clients, 8)  # warm-up
        tokens, seconds = run_clients(state["http_url"], args.clients, args.max_tokens)
        snap = status(home)
    finally:
        stop(home, pids)
    return {"name": name, "tok_s": tokens / seconds, "tokens": tokens, "group": snap.get("group")}


ALLSUM_CODE = """
import sys, time, mlx.core as mx
g = mx.distributed.init(backend="ring", strict=True)
x = mx.ones((int(sys.argv[1]), int(sys.argv[2])), dtype=mx.float32)
for _ in range(20): mx.eval(mx.distributed.all_sum(x))
n = 300
t = time.perf_counter()
for _ in range(n): mx.eval(mx.distributed.all_sum(x))
if g.rank() == 0: print((time.perf_counter() - t) / n * 1e3)
"""


def allsum_ms(ranks: int, rows: int, hidden: int, workdir: Path) -> float:
    """One all_sum of (rows, hidden) float32 across `ranks` local processes, in ms."""
    hostfile = workdir / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        cmd = [sys.executable, "-c", ALLSUM_CODE, str(rows), str(hidden)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    try:
        out = procs[0].communicate(timeout=120)[0]
        for p in procs[1:]:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return float(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random llama)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--tiny-size",
        default="",
        metavar="HIDDEN,LAYERS",
        help="the random llama's width and depth (e.g. 512,8; default 64,2)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxcel-bench-dist-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from mlxcel.daemon.models.tiny import make_tiny_model

            size: dict[str, int] = {}
            if args.tiny_size:
                hidden, layers = (int(v) for v in args.tiny_size.split(","))
                heads = max(hidden // 64, 2)
                size = {
                    "hidden_size": hidden,
                    "num_hidden_layers": layers,
                    "intermediate_size": 3 * hidden,
                    "num_attention_heads": heads,
                    "num_key_value_heads": max(heads // 2, 1),
                }
            model = str(make_tiny_model(work / "tiny", "llama", seed=0, **size))
        config = json.loads((Path(model) / "config.json").read_text())
        hosts = work / "hosts.json"
        hosts.write_text(
            json.dumps(
                [{"ssh": "localhost", "ips": [f"127.0.0.1:{p}"]} for p in free_ports(args.ranks)]
            )
        )
        single = measure("1 process", work / "single", model, args, [])
        group = measure(f"{args.ranks} ranks", work / "group", model, args, ["--hosts", str(hosts)])
        one = allsum_ms(args.ranks, args.clients, config["hidden_size"], work)
    layers = config["num_hidden_layers"]
    g = group["group"] or {}
    print(f"model {Path(model).name}: {layers} layers, hidden {config['hidden_size']}")
    print(
        f"{args.clients} clients x {args.max_tokens} tokens, greedy; "
        "one machine, ring over 127.0.0.1"
    )
    for r in (single, group):
        print(f"  {r['name']:>9}: {r['tok_s']:8.1f} tok/s ({r['tokens']} tokens)")
    print(
        f"  group/single: {group['tok_s'] / single['tok_s']:.2f}x "
        "(the group's overhead on one machine, not its speed)"
    )
    print(f"  step exchange (rank 0's wait per step, incl. sync): {g.get('comm_ms') or 0:.2f} ms")
    for rank in g.get("ranks", []):
        print(f"  rank {rank['rank']} last step: {rank.get('step_ms') or 0:.2f} ms")
    per_step = 2 * layers * one
    print(
        f"  all_sum ({args.clients}x{config['hidden_size']} float32): {one:.3f} ms; "
        f"x {2 * layers} per tensor-parallel step = {per_step:.2f} ms per decode step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
