#!/usr/bin/env python
"""A random-weight model of a real size on the daemon: load time, RSS, decode tok/s.

Makes (or reuses) a model of a real model's shape with the test tools
(`mlxcel.daemon.models.tiny.make_sized_model`: qwen3-1.7B, 4-bit MLX affine by default),
then for each --dtypes value starts `mlxcel-daemon --dtype D` on it, one at a time, and
prints: seconds from start to healthy, the daemon's RSS (VmHWM peak and VmRSS now, its
process tree, from /proc, read after the levels), and decode tok/s / inter-token latency at
each level (closed-loop streaming clients, short prompts, --max-tokens new tokens each).
A dtype the daemon refuses (its memory check) or that fails to load prints the daemon's own
error line instead of figures.

  bench_sized.py                                  # qwen3 1.7b 4-bit in a temp dir; auto, float32
  bench_sized.py --model DIR                      # an existing model directory
  bench_sized.py --keep DIR --size 4b --bits 8    # make it into DIR (reused next time)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.client import LevelResult, PromptFactory, ServerTarget, run_level
from bench_lib.report import format_table
from bench_lib.servers import (
    free_port,
    load_tokenizer,
    process_memory,
    served_model,
    shown_env,
    start_mlxcel,
    stop_server,
    wait_healthy,
)

CTX_PER_SLOT = 2048


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="an existing model directory (else one is made)")
    p.add_argument("--keep", type=Path, help="make the model here and keep it (reused if there)")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--size", default="1.7b")
    p.add_argument("--bits", default="4", help="4, 8, ... or none (float32 weights)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--dtypes", default="auto,float32", help="daemon --dtype values, in order")
    p.add_argument("--levels", default="1,8", help="client counts (default 1,8)")
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--max-batch-prefill", type=int, default=4)
    p.add_argument("--mlxcel-arg", action="append", default=[], help="extra daemon argument")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
    args.dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    if not args.levels or min(args.levels) < 1 or args.requests_per_client < 1:
        p.error("levels and --requests-per-client must be >= 1")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    args.bits = None if args.bits.lower() in ("none", "float32", "0") else int(args.bits)
    # what bench_lib's start_mlxcel and run_level read
    args.parallel = max(args.levels)
    args.ctx_size = CTX_PER_SLOT * args.parallel
    args.shared_prefix_tokens = 0
    args.metrics = False
    return args


def make_model(args: argparse.Namespace, tmp: Path) -> Path:
    from mlxcel.daemon.models.tiny import make_sized_model

    target = args.keep or tmp / f"{args.family}-{args.size}"
    if (target / "config.json").is_file():
        print(f"# reusing {target}", flush=True)
        return target
    made = make_sized_model(
        target, args.family, args.size, bits=args.bits, group_size=args.group_size
    )
    kind = "float32" if args.bits is None else f"{args.bits}-bit group {args.group_size}"
    print(
        f"# made {made.path}: {args.family} {args.size}, {made.parameters / 1e9:.2f} B "
        f"parameters, {kind}, {len(made.shards)} shard(s), {made.size_bytes / 2**30:.2f} GiB "
        f"on disk, in {made.seconds:.1f} s (peak MLX memory {made.peak_memory_bytes / 2**20:.0f}"
        " MiB)",
        flush=True,
    )
    return target


def daemon_error(log: Path) -> str:
    """The daemon's own error line(s) from its log (its memory refusal, a load failure)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    picked = [ln for ln in lines if "error" in ln.lower() or "refus" in ln.lower()]
    return "\n".join((picked or lines)[-3:])


def forward_lines(log: Path) -> list[str]:
    """What the daemon logged about its forward path (native steps, quantized, fallbacks)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keys = ("native", "forward", "quantiz", "dequantiz", "plan")
    return [ln.strip() for ln in lines if any(k in ln.lower() for k in keys)][:8]


async def run_dtype(
    args: argparse.Namespace, dtype: str, model: Path, tokenizer: object, workdir: Path
) -> dict:
    """One daemon with --dtype `dtype`: its figures, or its error."""
    run_args = argparse.Namespace(**{**vars(args), "dtype": dtype, "model": model})
    started = time.perf_counter()
    server = start_mlxcel(run_args, free_port(), workdir / dtype)
    print(f"\n# mlxcel --dtype {dtype}: {shown_env(server)} {' '.join(server.argv)}", flush=True)
    out: dict = {"dtype": dtype, "command": server.argv, "environment": shown_env(server)}
    try:
        try:
            await wait_healthy(server, args.startup_timeout)
        except RuntimeError:
            out["error"] = daemon_error(server.log_path)
            print(f"  --dtype {dtype} did not load:\n  {out['error']}", flush=True)
            return out
        out["load_s"] = time.perf_counter() - started
        print(f"  healthy {out['load_s']:.1f} s after start", flush=True)
        for line in forward_lines(server.log_path):
            print(f"  log: {line}", flush=True)
        name = await served_model(server.url, "mlxcel")
        target = ServerTarget(f"mlxcel:{dtype}", server.url, "ignore_eos", [], name)
        prompts = PromptFactory(tokenizer, run_args)
        warm = await run_level(target, prompts, 1, 1, 4, run_args)
        if warm.ok == 0:
            out["error"] = f"warm-up failed: {warm.errors[:1]}"
            print(f"  {out['error']}", flush=True)
            return out
        results: list[LevelResult] = []
        for clients in args.levels:
            r = await run_level(
                target, prompts, clients, args.requests_per_client, args.max_tokens, run_args
            )
            results.append(r)
            print(format_table([r], header=len(results) == 1), flush=True)
        out["levels"] = {r.clients: _figures(r) for r in results}
        out["memory_kb"] = process_memory(server.proc.pid)
        mem = out["memory_kb"]
        print(
            f"  RSS: VmHWM {mem['hwm_kb'] / 1024:.0f} MiB (peak), VmRSS "
            f"{mem['rss_kb'] / 1024:.0f} MiB (now), {mem['processes']} process(es)",
            flush=True,
        )
        return out
    finally:
        stop_server(server)


def _figures(r: LevelResult) -> dict:
    return {
        "ok": r.ok,
        "fail": r.fail,
        "output_tok_s": r.output_tok_s,
        "ttft_mean_s": r.ttft_mean_s,
        "itl_mean_ms": r.itl_mean_ms,
        "itl_p95_ms": r.itl_p95_ms,
        "errors": r.errors,
    }


def summary(rows: list[dict], levels: list[int]) -> str:
    head = ["dtype", "healthy s", "VmHWM MiB", "VmRSS MiB"]
    for n in levels:
        head += [f"tok/s @{n}", f"ITL ms @{n}"]
    table = [head]
    for row in rows:
        if "error" in row:
            table.append([row["dtype"], "did not load: " + row["error"].splitlines()[-1][:120]])
            continue
        mem = row["memory_kb"]
        cells = [row["dtype"], f"{row['load_s']:.1f}", f"{mem['hwm_kb'] / 1024:.0f}"]
        cells.append(f"{mem['rss_kb'] / 1024:.0f}")
        for n in levels:
            fig = row["levels"][n]
            cells.append(f"{fig['output_tok_s']:.2f}")
            cells.append("n/a" if fig["itl_mean_ms"] is None else f"{fig['itl_mean_ms']:.0f}")
        table.append(cells)
    return "\n".join("  ".join(f"{c:>10}" for c in row) for row in table)


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="mlxcel-bench-sized-") as tmp:
        workdir = Path(tmp)
        model = args.model or make_model(args, workdir)
        tokenizer = load_tokenizer(model)
        print(
            f"# {model}: levels {args.levels} x {args.requests_per_client} request(s), "
            f"{args.prompt_tokens} prompt tokens, {args.max_tokens} new; --parallel "
            f"{args.parallel}, --ctx-size {args.ctx_size}",
            flush=True,
        )
        rows = []
        for dtype in args.dtypes:
            (workdir / dtype).mkdir(exist_ok=True)
            rows.append(await run_dtype(args, dtype, model, tokenizer, workdir))
        print("\n" + summary(rows, args.levels))
        if args.json:
            args.json.write_text(json.dumps({"model": str(model), "runs": rows}, indent=2) + "\n")
    # a dtype that does not load is a figure of the run (printed); a failed request is not
    failed = any(v["fail"] for r in rows for v in r.get("levels", {}).values())
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(main_async(args))
    return 130


if __name__ == "__main__":
    sys.exit(main())
