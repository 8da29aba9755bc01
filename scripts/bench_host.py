#!/usr/bin/env python
"""Where a step's host time goes: the daemon on a tiny random model, N streaming clients.

The daemon runs in a child process (`mlxcel-daemon start --foreground`, same flags as
bench_serving.py) with timers wrapped around the engine's phases and the HTTP side's work;
the clients (bench_lib.client, as bench_serving.py) run here. At the end it prints the
aggregate tok/s and, per engine step, the mean milliseconds of:

  schedule   Engine._admit (admission, prompt-cache lookups)
  forward    building and queuing the decode forward (model call, sampling graph, async_eval;
             with a packed step, the prefill chunk's inputs too)
  eval       waiting for the previous forward's tokens (mx.eval: the matmuls)
  prefill    BatchRunner.prefill_chunk: a prefill forward of its own (two-forward steps, or
             no decoding rows), or finishing the chunk that rode a packed decode forward
  delivery   turning tokens into outputs and handing them to the HTTP side (engine thread)
  publish    the snapshot(s) built each step
  detok      detokenising and stop-string matching (HTTP loop thread)
  sse        SSE chunk formatting and writes (HTTP loop thread)
the whole engine step and the wall time per step; and each thread's CPU time per step (the
engine thread, the loop thread `MainThread`, the daemon process as a whole: MLX's and BLAS's
own threads too; BENCH_OTHER_THREADS=1: those threads one by one), all counted from engine
step CPU_BASE_STEP on (after the warm-up request, so start-up and model loading are left
out), and the clients' process (this one) over the measured level.

  python scripts/bench_host.py [--clients 64] [--max-tokens 256] [--prompt-tokens 32]
  python scripts/bench_host.py --model DIR --clients 8 --requests-per-client 2 \
      --prompt-tokens 256 --max-tokens 64 --max-batch-prefill 4     # prompt-heavy SmolLM2

--profile FILE cProfiles the daemon's loop thread; BENCH_PROFILE_ENGINE=FILE its engine
thread; BENCH_SWITCH_INTERVAL=S sets the GIL switch interval before the daemon starts (the
bridge lowers it to 0.5 ms at most). The daemon's options come from the environment as usual
(e.g. MLXCEL_STREAM_INTERVAL=4). Before/after comparisons: run an older tree with
PYTHONPATH pointing at a directory whose `mlxcel` entry links to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("schedule", "forward", "eval", "prefill", "delivery", "publish", "detok", "sse")
CPU_BASE_STEP = 16  # the warm-up request takes ~9 steps; thread CPU is counted from here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="model directory (default: a tiny random llama)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch-prefill", type=int, help="default: the clients (at most 64)")
    p.add_argument("--prefill-chunk-size", type=int, help="the step's token budget (default 2048)")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--profile", type=Path, help="cProfile the daemon's loop thread into this file")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # child: write timings here
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- child: the timed daemon


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.thread_cpu: dict[str, float] = {}
        self.base_cpu: dict[str, float] = {}
        self.lock = threading.Lock()

    def wrap(self, owner: Any, name: str, phase: str, is_async: bool = False) -> None:
        inner = getattr(owner, name)
        seconds = self.seconds

        if is_async:

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await inner(*args, **kwargs)
                finally:
                    seconds[phase] += time.perf_counter() - t

            setattr(owner, name, timed_async)
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - t

        setattr(owner, name, timed)


def serve_timed(args: argparse.Namespace) -> int:
    """Install the timers, then run the daemon in this process until SIGTERM."""
    import atexit

    import mlx.core as mx
    from aiohttp import web
    from mlxcel.daemon import cli
    from mlxcel.daemon.engine import core as engine_mod
    from mlxcel.daemon.engine import runner as runner_mod
    from mlxcel.daemon.server import completions, textstream

    timers = Timers()
    engine_cls = engine_mod.Engine
    timers.wrap(engine_cls, "_admit", "schedule")
    timers.wrap(engine_cls, "_apply_decode", "delivery")
    timers.wrap(engine_cls, "_apply_prefill", "delivery")
    timers.wrap(engine_cls, "_publish", "publish")
    timers.wrap(runner_mod.BatchRunner, "prefill_chunk", "prefill")
    timers.wrap(textstream.TextAssembler, "add", "detok")
    if hasattr(completions.OpenAIAnswer, "sse_chunks"):  # formatting of the streamed chunks
        timers.wrap(completions.OpenAIAnswer, "sse_chunks", "sse")
    else:  # an older tree (before/after runs): one sse() per chunk
        timers.wrap(completions, "sse", "sse")
    timers.wrap(web.StreamResponse, "write", "sse", is_async=True)

    # eval: mx.eval called from the runner's decode step (the wait for the forward)
    real_eval = mx.eval

    def timed_eval(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_eval(*a, **k)
        finally:
            timers.seconds["eval"] += time.perf_counter() - t

    decode = runner_mod.BatchRunner.decode

    def timed_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        before = timers.seconds["eval"]
        mx.eval = timed_eval
        try:
            return decode(self, *args, **kwargs)
        finally:
            mx.eval = real_eval
            spent = time.perf_counter() - t
            timers.seconds["forward"] += spent - (timers.seconds["eval"] - before)

    runner_mod.BatchRunner.decode = timed_decode  # type: ignore[method-assign]
    step = engine_cls.step

    engine_profile = os.environ.get("BENCH_PROFILE_ENGINE")
    engine_profiler: Any = None

    def counted_step(self: Any) -> None:
        nonlocal engine_profiler
        if engine_profile and engine_profiler is None:
            import cProfile

            engine_profiler = cProfile.Profile()
            engine_profiler.enable()  # on the engine thread: profiles that thread only
            atexit.register(lambda: engine_profiler.dump_stats(engine_profile))
        timers.steps += 1
        if timers.steps == CPU_BASE_STEP:
            _record_thread_cpu(timers)
            timers.base_cpu = dict(timers.thread_cpu)
            timers.seconds.clear()  # the phases too: only the measured steps
        t = time.perf_counter()
        step(self)
        timers.seconds["step"] += time.perf_counter() - t
        if timers.steps % 16 == 0:  # the engine thread has ended when the daemon exits
            _record_thread_cpu(timers)

    engine_cls.step = counted_step  # type: ignore[method-assign]

    def dump() -> None:
        _record_thread_cpu(timers)
        base = timers.base_cpu
        steps = timers.steps - (CPU_BASE_STEP - 1 if base else 0)
        payload = {"steps": steps, "seconds": dict(timers.seconds)}
        payload["thread_cpu_s"] = {k: v - base.get(k, 0.0) for k, v in timers.thread_cpu.items()}
        args.serve.write_text(json.dumps(payload))

    atexit.register(dump)
    if os.environ.get("BENCH_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
    if args.profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        atexit.register(lambda: (profiler.disable(), profiler.dump_stats(str(args.profile))))
    argv = ["start", "--foreground", "--model", str(args.model), "--host", "127.0.0.1"]
    argv += ["--port", str(args.port), "--parallel", str(args.clients)]
    argv += ["--max-batch-prefill", str(args.max_batch_prefill or min(args.clients, 64))]
    if args.prefill_chunk_size:
        argv += ["--prefill-chunk-size", str(args.prefill_chunk_size)]
    return cli.main(argv)


def _record_thread_cpu(timers: Timers) -> None:
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    process = psutil.Process()
    others: dict[str, float] = defaultdict(float)
    for t in process.threads():
        name = names.get(t.id, "other")
        if name == "mlxcel-engine" or name == "MainThread":
            timers.thread_cpu[name] = t.user_time + t.system_time
        elif os.environ.get("BENCH_OTHER_THREADS"):  # native threads by their kernel name
            comm = Path(f"/proc/self/task/{t.id}/comm")
            label = comm.read_text().strip() if comm.exists() else name
            others[f"[{label} {t.id}]"] += t.user_time + t.system_time
    timers.thread_cpu.update(others)
    cpu = process.cpu_times()
    timers.thread_cpu["daemon"] = cpu.user + cpu.system


# ---------------------------------------------------------------- parent: clients + report


async def drive(args: argparse.Namespace, model_dir: Path, workdir: Path) -> dict[str, Any]:
    import subprocess

    from bench_lib.client import PromptFactory, ServerTarget, run_level
    from bench_lib.servers import (
        Server,
        blas_env,
        free_port,
        load_tokenizer,
        served_model,
        stop_server,
        wait_healthy,
    )

    port = free_port()
    timings = workdir / "timings.json"
    argv = [sys.executable, __file__, "--serve", str(timings), "--port", str(port)]
    argv += ["--model", str(model_dir), "--clients", str(args.clients)]
    if args.max_batch_prefill:
        argv += ["--max-batch-prefill", str(args.max_batch_prefill)]
    if args.prefill_chunk_size:
        argv += ["--prefill-chunk-size", str(args.prefill_chunk_size)]
    if args.profile is not None:
        argv += ["--profile", str(args.profile.resolve())]
    env = blas_env({"MLXCEL_HOME": str(workdir / "home")})
    log_path = workdir / "daemon.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server("mlxcel", argv, f"http://127.0.0.1:{port}", proc, log_path, "")
    try:
        await wait_healthy(server, 300)
        tokenizer = load_tokenizer(model_dir)
        bench_args = argparse.Namespace(
            prompt_tokens=args.prompt_tokens,
            shared_prefix_tokens=0,
            request_timeout=600.0,
            metrics=False,
            max_tokens=args.max_tokens,
        )
        model = await served_model(server.url, "mlxcel")
        target = ServerTarget("mlxcel", server.url, "ignore_eos", [], model)
        prompts = PromptFactory(tokenizer, bench_args)
        await run_level(target, prompts, 1, 1, 8, bench_args)  # warm-up
        clients_cpu = time.process_time()
        result = await run_level(
            target, prompts, args.clients, args.requests_per_client, args.max_tokens, bench_args
        )
        clients_cpu = time.process_time() - clients_cpu
    finally:
        stop_server(server)
    data = json.loads(timings.read_text()) if timings.exists() else {}
    data.setdefault("thread_cpu_s", {})["clients"] = clients_cpu
    return {"result": result, "timings": data}


def report(result: Any, timings: dict[str, Any]) -> dict[str, Any]:
    steps = max(timings.get("steps", 0), 1)
    per_step = {p: 1000 * timings["seconds"].get(p, 0.0) / steps for p in PHASES}
    cpu = {k: 1000 * v / steps for k, v in timings.get("thread_cpu_s", {}).items()}
    print(
        f"aggregate {result.output_tok_s:.1f} tok/s over {result.ok} requests "
        f"(ITL mean {result.itl_mean_ms or 0:.1f} ms, p95 {result.itl_p95_ms or 0:.1f} ms; "
        f"TTFT p95 {result.ttft_p95_s or 0:.2f} s), {steps} engine steps"
    )
    print("per step (ms): " + "  ".join(f"{p} {v:.2f}" for p, v in per_step.items()))
    step_ms = 1000 * timings["seconds"].get("step", 0.0) / steps
    wall_ms = 1000 * result.wall_s / steps
    print(
        f"engine step {step_ms:.2f} ms (of which outside the phases above "
        f"{step_ms - sum(per_step[p] for p in PHASES[:6]):.2f}); "
        f"level wall / steps {wall_ms:.2f} ms (arrivals, tokenizing and the last reads too)"
    )
    print("thread CPU per step (ms): " + "  ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    for error in result.errors:
        print(f"error: {error}")
    return {
        "tok_s": result.output_tok_s,
        "itl_mean_ms": result.itl_mean_ms,
        "steps": steps,
        "per_step_ms": per_step,
        "step_ms": step_ms,
        "wall_per_step_ms": wall_ms,
        "thread_cpu_per_step_ms": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve is not None:
        return serve_timed(args)
    with tempfile.TemporaryDirectory(prefix="mlxcel-host-") as tmp:
        workdir = Path(tmp)
        (workdir / "home").mkdir()
        model_dir = args.model
        if model_dir is None:
            from mlxcel.daemon.models.tiny import make_tiny_model

            model_dir = make_tiny_model(workdir / "tiny", "llama", seed=0)
        out = asyncio.run(drive(args, model_dir, workdir))
        figures = report(out["result"], out["timings"])
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if out["result"].fail == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
