#!/usr/bin/env python
"""Serving benchmark: closed-loop streaming chat clients against OpenAI-compatible servers.

Each level runs N clients at once; each client sends --requests-per-client requests one after
the other (no think time), every prompt distinct (optionally after a shared prefix), with a
fixed number of new tokens. Per level it prints ok/fail, aggregate output tok/s, TTFT and
inter-token latency (mean/p95), with --gaps the whole inter-token gap distribution (p50-p99,
max, how many gaps exceed 100/120/200/500 ms) and, with --metrics, the daemon's slot
occupancy and padded prefill efficiency from /metrics.

  bench_serving.py --url http://127.0.0.1:8080 [--tokenizer DIR]
  bench_serving.py --start-mlxcel --model DIR          # starts mlxcel-daemon, MLXCEL_HOME in tmp
  bench_serving.py --against-mlx-lm --model DIR        # mlxcel, then mlx_lm.server, side by side
  bench_serving.py --start-mlx-lm --model DIR          # mlx_lm.server alone
  bench_serving.py --against-mlx-lm --tiny             # a tiny random llama, 64 streams x 256

Servers run one at a time, with the same model directory, dtype and BLAS environment: the
daemon's own (`mlxcel.daemon.models.blas.fast_blas_env`: the system OpenBLAS and the few-row
kernel preloaded, OPENBLAS_CORETYPE from the CPU flags), printed for each server. --tiny runs
a random-weight llama whose forward costs almost nothing: what is left is host time (Python
scheduling, delivery, detokenising, SSE), the ceiling a fast accelerator would hit. Timing
targets live here, never in pass/fail tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.client import (
    LevelResult,
    PromptFactory,
    ServerTarget,
    run_cache_probe,
    run_level,
)
from bench_lib.report import (
    format_gaps,
    format_markdown,
    format_ratios,
    format_table,
    print_metrics,
)
from bench_lib.servers import (
    eos_token_ids,
    free_port,
    load_tokenizer,
    mlx_lm_model_dir,
    served_model,
    start_mlx_lm,
    start_mlxcel,
    stop_server,
    wait_healthy,
)

# --tiny: the host-overhead ceiling (flags given explicitly still win)
TINY_DEFAULTS: dict[str, object] = {
    "--levels": "64",
    "--requests-per-client": 1,
    "--prompt-tokens": 32,
    "--max-tokens": 256,
    "--max-batch-prefill": 64,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_argument_group("servers")
    mode.add_argument("--url", help="benchmark a running server at this base URL")
    mode.add_argument("--start-mlxcel", action="store_true", help="start mlxcel-daemon")
    mode.add_argument("--start-mlx-lm", action="store_true", help="start mlx_lm.server")
    mode.add_argument(
        "--against-mlx-lm", action="store_true", help="start both, one at a time; compare"
    )
    mode.add_argument("--model", type=Path, help="model directory for the servers started here")
    mode.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random llama (written to a temp dir) instead of --model; defaults to "
        "64 clients x 1 request x 256 new tokens, 32-token prompts, all prompts per prefill",
    )
    mode.add_argument("--tokenizer", type=Path, help="tokenizer dir for --url (default: approx)")
    mode.add_argument("--served-model", help="model name to send (default: ask /v1/models)")
    mode.add_argument("--parallel", type=int, help="decode slots (default: the top level)")
    mode.add_argument("--max-batch-prefill", type=int, default=4, help="prompts per prefill")
    mode.add_argument("--dtype", default="auto", help="weights dtype for both servers")
    mode.add_argument(
        "--mlxcel-arg", action="append", default=[], help="extra mlxcel-daemon start argument"
    )
    mode.add_argument("--startup-timeout", type=float, default=300.0)
    load = p.add_argument_group("load")
    load.add_argument("--levels", default="1,4,8", help="concurrency levels (default 1,4,8)")
    load.add_argument("--requests-per-client", type=int, default=2)
    load.add_argument("--prompt-tokens", type=int, default=256)
    load.add_argument("--shared-prefix-tokens", type=int, default=0)
    load.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    load.add_argument(
        "--eos-mode",
        choices=("auto", "ignore_eos", "logit_bias", "none"),
        default="auto",
        help="how to get exactly --max-tokens (auto: ignore_eos; logit_bias for mlx_lm)",
    )
    load.add_argument("--request-timeout", type=float, default=900.0)
    load.add_argument("--no-warmup", action="store_true")
    load.add_argument(
        "--cache-probe",
        type=int,
        default=0,
        metavar="PAIRS",
        help="also time cold vs prefix-cached TTFT over PAIRS request pairs",
    )
    out = p.add_argument_group("output")
    out.add_argument("--metrics", action="store_true", help="read mlxcel /metrics per level")
    out.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    out.add_argument(
        "--gaps",
        action="store_true",
        help="also print the inter-token gap distribution (percentiles, tail counts)",
    )
    out.add_argument("--json", type=Path, help="write all results as JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        given = argv if argv is not None else sys.argv[1:]
        for flag, value in TINY_DEFAULTS.items():
            if not any(a == flag or a.startswith(flag + "=") for a in given):
                setattr(args, flag.lstrip("-").replace("-", "_"), value)
    args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if args.against_mlx_lm:
        args.start_mlxcel = args.start_mlx_lm = True
    if args.tiny and (args.url or args.model):
        p.error("--tiny makes its own model: give neither --url nor --model")
    if args.tiny and not (args.start_mlxcel or args.start_mlx_lm):
        args.start_mlxcel = args.start_mlx_lm = True  # --tiny alone: side by side
    if not (args.url or args.start_mlxcel or args.start_mlx_lm):
        p.error("give --url, or --start-mlxcel / --start-mlx-lm / --against-mlx-lm with --model")
    starting = args.start_mlxcel or args.start_mlx_lm
    if starting and not args.tiny and (args.model is None or not args.model.is_dir()):
        p.error("--model must be a model directory when this script starts the servers")
    if min(args.levels, default=0) < 1 or args.requests_per_client < 1:
        p.error("levels and --requests-per-client must be >= 1")
    args.parallel = args.parallel or max(args.levels)
    return args


async def bench_target(
    target: ServerTarget, prompts: PromptFactory, args: argparse.Namespace
) -> tuple[list[LevelResult], dict | None]:
    """All levels (and the cache probe) against one server that is already healthy."""
    results = []
    if not args.no_warmup:
        warm = await run_level(target, prompts, 1, 1, min(args.max_tokens, 8), args)
        if warm.ok == 0:
            raise RuntimeError(f"{target.name}: warm-up request failed: {warm.errors[:1]}")
    for clients in args.levels:
        result = await run_level(
            target, prompts, clients, args.requests_per_client, args.max_tokens, args
        )
        results.append(result)
        print(format_table([result], header=not results[:-1]), flush=True)
        if result.metrics:
            print_metrics(result)
    probe = None
    if args.cache_probe:
        probe = await run_cache_probe(target, prompts, args.cache_probe, args)
        print(
            f"cache probe {target.name}: cold TTFT {probe['cold_ttft_mean_s']:.3f} s, "
            f"cached-prefix TTFT {probe['warm_ttft_mean_s']:.3f} s "
            f"(x{probe['warm_over_cold']:.2f})",
            flush=True,
        )
    return results, probe


async def run_started(
    kind: str, args: argparse.Namespace, workdir: Path, tokenizer: object
) -> tuple[list[LevelResult], dict | None]:
    port = free_port()
    if kind == "mlxcel":
        server = start_mlxcel(args, port, workdir)
    else:
        server = start_mlx_lm(
            args, mlx_lm_model_dir(args.model, args.dtype, workdir), port, workdir
        )
    print(f"# {kind}: {server.blas} {' '.join(server.argv)}", flush=True)
    try:
        await wait_healthy(server, args.startup_timeout)
        eos = eos_token_ids(args.model, tokenizer) if kind == "mlx_lm" else []
        model = args.served_model or await served_model(server.url, kind)
        target = ServerTarget(kind, server.url, eos_mode(args, kind), eos, model)
        # Fresh prompt numbering per server: both see the very same request texts.
        return await bench_target(target, PromptFactory(tokenizer, args), args)
    finally:
        stop_server(server)


def eos_mode(args: argparse.Namespace, kind: str) -> str:
    if args.eos_mode != "auto":
        return args.eos_mode
    return "logit_bias" if kind == "mlx_lm" else "ignore_eos"


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="mlxcel-bench-") as tmp:
        if args.tiny:
            from mlxcel.daemon.models.tiny import make_tiny_model

            args.model = make_tiny_model(Path(tmp) / "tiny-llama", "llama", seed=0)
            print(f"# --tiny: random llama at {args.model}", flush=True)
        return await run_all(args, Path(tmp))


async def run_all(args: argparse.Namespace, workdir: Path) -> int:
    tok_dir = args.tokenizer or args.model
    tokenizer = load_tokenizer(tok_dir) if tok_dir else None
    print(
        f"# prompts: {args.prompt_tokens} tokens ({'counted' if tokenizer else 'approx'}) + "
        f"{args.shared_prefix_tokens} shared, {args.max_tokens} new, "
        f"{args.requests_per_client} per client, levels {args.levels}",
        flush=True,
    )
    by_server: dict[str, list[LevelResult]] = {}
    probes: dict[str, dict | None] = {}
    if args.url:
        url = args.url.rstrip("/")
        model = args.served_model or await served_model(url, "server")
        target = ServerTarget("server", url, eos_mode(args, "server"), [], model)
        by_server["server"], probes["server"] = await bench_target(
            target, PromptFactory(tokenizer, args), args
        )
    for kind, wanted in (("mlxcel", args.start_mlxcel), ("mlx_lm", args.start_mlx_lm)):
        if wanted:
            by_server[kind], probes[kind] = await run_started(kind, args, workdir, tokenizer)
    if len(by_server) > 1:
        print("\n" + format_table([r for rs in by_server.values() for r in rs]))
        print(format_ratios(by_server))
    if args.gaps:
        print("\ninter-token gaps (ms): every gap between streamed chunks of every request")
        print(format_gaps([r for rs in by_server.values() for r in rs]))
    if args.markdown:
        print("\n" + format_markdown(by_server))
    if args.json:
        payload = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": {k: [asdict(r) for r in v] for k, v in by_server.items()},
            "cache_probe": probes,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    failed = sum(r.fail for rs in by_server.values() for r in rs)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(main_async(args))
    return 130


if __name__ == "__main__":
    sys.exit(main())
