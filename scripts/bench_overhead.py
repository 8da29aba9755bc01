#!/usr/bin/env python
"""The daemon's own cost: HTTP + control socket vs driving the engine in-process.

Same model, same engine settings, same workload, same run, one after the other:
  1. in-process: an Engine + EngineBridge in this process, N concurrent clients submitting
     token-id prompts straight to the bridge;
  2. daemon: `mlxcel-daemon start --foreground` as a subprocess, N concurrent clients
     streaming /v1/completions over HTTP (same token ids, ignore_eos), while one control-socket
     subscriber takes snapshots every 100 ms, as mlxcel-top does.
Prints aggregate output tok/s for both and the overhead (target: < 10 %). --rounds R repeats
the pair R times (in-process, daemon, in-process, ...) to average out a busy machine.

  python scripts/bench_overhead.py [--model smollm2-135m-instruct] [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, directory or .gguf")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--subscribe-ms", type=int, default=100, help="0: no socket subscriber")
    return p.parse_args()


def make_prompts(args: argparse.Namespace, vocab: int, seed: int) -> list[list[list[int]]]:
    """Distinct token-id prompts: [client][request] -> ids (no prompt-cache hits)."""
    rng = random.Random(seed)
    return [
        [
            [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]
            for _ in range(args.requests_per_client)
        ]
        for _ in range(args.clients)
    ]


# --- in-process -------------------------------------------------------------------------


@dataclass
class Measure:
    tokens: int
    wall_s: float
    cpu_s: float  # serving process(es) and clients together

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s

    @property
    def per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s


async def run_in_process(loaded: Any, cfg: Any, prompts: list[list[list[int]]], n: int) -> Measure:
    from mlxcel.daemon.engine.bridge import EngineBridge
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.engine.types import GREEDY, GenerationRequest

    info = loaded.info
    engine = Engine(loaded.model, cfg, info.can_batch, info.batch_reason, info.context_length)
    bridge = EngineBridge(engine)
    bridge.start()
    counter = iter(range(1 << 30))

    async def one(ids: list[int]) -> int:
        req = GenerationRequest(f"b{next(counter)}", tuple(ids), n, GREEDY, frozenset())
        count = 0
        async for out in bridge.submit(req):
            count += out.token_id is not None
        return count

    async def client(mine: list[list[int]]) -> int:
        return sum([await one(ids) for ids in mine])

    try:
        await one(prompts[0][0][:16])  # warm-up
        start, cpu = time.perf_counter(), time.process_time()
        total = sum(await asyncio.gather(*(client(c) for c in prompts)))
        measure = Measure(total, time.perf_counter() - start, time.process_time() - cpu)
    finally:
        await bridge.shutdown(drain=False)
    return measure


# --- daemon -----------------------------------------------------------------------------


def start_daemon(args: argparse.Namespace, home: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "MLXCEL_HOME": str(home)}
    cmd = [sys.executable, "-m", "mlxcel.daemon.cli", "start", "--foreground"]
    cmd += ["--model", args.model, "--port", "0", "--parallel", str(args.clients)]
    log = open(home / "daemon.out", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
    state_file = home / "run" / "daemon.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon failed: {(home / 'daemon.out').read_text()[-2000:]}")
        if state_file.exists():
            url = json.loads(state_file.read_text())["http_url"]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return proc, url
            except OSError:
                pass
        time.sleep(0.2)
    raise SystemExit("the daemon did not become healthy")


async def subscriber(socket_path: Path, interval_ms: int, stop: asyncio.Event) -> int:
    from mlxcel.shared.control_client import ControlClient

    client = ControlClient(socket_path)
    await client.connect()
    await client.call("subscribe", {"interval_ms": interval_ms})
    seen = 0
    while not stop.is_set():
        try:
            event = await client.next_event(timeout=0.5)
        except asyncio.TimeoutError:
            continue
        seen += event is not None and event.event == "snapshot"
    await client.close()
    return seen


async def run_over_http(
    daemon: psutil.Process,
    url: str,
    socket_path: Path,
    prompts: list[list[list[int]]],
    args: argparse.Namespace,
) -> tuple[Measure, int]:
    import aiohttp

    async def one(session: aiohttp.ClientSession, ids: list[int]) -> int:
        body = {
            "prompt": ids,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        usage = 0
        async with session.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]["completion_tokens"]
        return usage

    async def client(session: aiohttp.ClientSession, mine: list[list[int]]) -> int:
        return sum([await one(session, ids) for ids in mine])

    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one(session, prompts[0][0][:16])  # warm-up
        watching = None
        if args.subscribe_ms:
            watching = asyncio.create_task(subscriber(socket_path, args.subscribe_ms, stop))
        start, cpu, server_cpu = time.perf_counter(), time.process_time(), _cpu(daemon)
        total = sum(await asyncio.gather(*(client(session, c) for c in prompts)))
        wall = time.perf_counter() - start
        cpu_s = time.process_time() - cpu + _cpu(daemon) - server_cpu
    stop.set()
    snapshots = await watching if watching else 0
    return Measure(total, wall, cpu_s), snapshots


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def run_daemon_round(args: argparse.Namespace, prompts: list[list[list[int]]]) -> Measure:
    with tempfile.TemporaryDirectory(prefix="mlxcel-bench-") as tmp:
        home = Path(tmp)
        proc, url = start_daemon(args, home)
        try:
            measure, snapshots = asyncio.run(
                run_over_http(
                    psutil.Process(proc.pid), url, home / "run" / "mlxcel.sock", prompts, args
                )
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(f"  daemon:     {_line(measure)} ({snapshots} snapshots to the subscriber)")
    return measure


def _line(m: Measure) -> str:
    return f"{m.rate:7.2f} tok/s, {m.per_cpu_s:6.2f} tok per CPU-second"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> int:
    from mlxcel.daemon.forward.blas import ensure_fast_blas

    ensure_fast_blas()  # same BLAS as the daemon (it preloads OpenBLAS itself)
    args = parse_args()
    from mlxcel.daemon.models import load_model
    from mlxcel.shared.config import build_config

    cfg = build_config({"model": args.model, "parallel": args.clients})
    loaded = load_model(args.model, "auto")
    info = loaded.info
    print(
        f"model {info.name} ({info.family}, {info.dtype}, {info.backend}, blas {info.blas}); "
        f"{args.clients} clients x {args.requests_per_client} requests, "
        f"{args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens"
    )
    direct: list[Measure] = []
    daemon: list[Measure] = []
    for r in range(args.rounds):
        prompts = make_prompts(args, len(loaded.tokenizer), seed=r)
        print(f"round {r + 1}/{args.rounds}")
        # Alternate which side goes first, so a drifting machine load evens out.
        for side in ("direct", "daemon") if r % 2 == 0 else ("daemon", "direct"):
            if side == "direct":
                direct.append(asyncio.run(run_in_process(loaded, cfg, prompts, args.max_tokens)))
                print(f"  in-process: {_line(direct[-1])}")
            else:
                daemon.append(run_daemon_round(args, prompts))
    a, b = _mean([m.rate for m in direct]), _mean([m.rate for m in daemon])
    ca, cb = _mean([m.per_cpu_s for m in direct]), _mean([m.per_cpu_s for m in daemon])
    overhead = 1 - b / a
    verdict = "OK" if overhead < 0.10 else "OVER TARGET"
    print(f"aggregate output tok/s: in-process {a:.2f}, daemon {b:.2f}")
    pct = overhead * 100
    print(f"daemon overhead: {pct:+.1f}% of in-process throughput (target < 10%): {verdict}")
    print(
        f"CPU cost (load-independent): {ca:.2f} vs {cb:.2f} tok per CPU-second, "
        f"the daemon side (server + HTTP clients) spends {(ca / cb - 1) * 100:+.1f}% more CPU "
        "per token"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
