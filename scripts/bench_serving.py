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
  bench_serving.py --against-llama --llama-server PATH [--model DIR --gguf FILE]
                                                       # mlxcel and llama-server, same GGUF

--against-llama keeps both servers up and runs interleaved rounds in one run (round 1: mlxcel
then llama on each workload, round 2: llama then mlxcel, ...), best of --rounds per server per
workload; workloads CLIENTS:PROMPT:NEW (default: 1 client decode-heavy 32 -> 128 tokens, 8
clients decode-heavy, 8 clients prompt-heavy 1000 -> 32). The model defaults to the pulled
SmolLM2 (`mlxcel-daemon models pull`) and its source GGUF; llama-server gets -np = the most
clients, the same total context as mlxcel's --ctx-size, continuous batching, -t/-tb = the
cores, and no LD_PRELOAD (ggml uses its own kernels). Each server's RSS (VmHWM, VmRSS of its
process tree) is read from /proc after the rounds.

Servers run one at a time, with the same model directory, dtype and BLAS environment: the
daemon's own (`mlxcel.daemon.forward.blas.fast_blas_env`: the system OpenBLAS and the few-row
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
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
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
    best_round,
    format_gaps,
    format_markdown,
    format_ratios,
    format_rounds_table,
    format_table,
    format_versus,
    format_versus_markdown,
    print_metrics,
)
from bench_lib.servers import (
    Server,
    eos_token_ids,
    free_port,
    load_tokenizer,
    mlx_lm_model_dir,
    process_memory,
    served_model,
    shown_env,
    start_llama,
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
# --against-llama: 1 client decode-heavy, 8 clients decode-heavy, 8 clients prompt-heavy
LLAMA_WORKLOADS = "1:32:128,8:32:128,8:1000:32"
CTX_PER_SLOT = 2048  # --against-llama's default total context: this x the slots


@dataclass(frozen=True)
class Workload:
    label: str
    clients: int
    prompt_tokens: int
    max_tokens: int


def parse_workloads(text: str) -> list[Workload]:
    """ "CLIENTS:PROMPT:NEW,..." -> workloads labelled decode@N / prompt@N."""
    out: list[Workload] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            clients, prompt, new = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"workload {item!r}: want CLIENTS:PROMPT_TOKENS:NEW_TOKENS") from None
        if min(clients, prompt, new) < 1:
            raise ValueError(f"workload {item!r}: every figure must be >= 1")
        label = f"{'prompt' if prompt > new else 'decode'}@{clients}"
        while any(w.label == label for w in out):
            label += "'"
        out.append(Workload(label, clients, prompt, new))
    if not out:
        raise ValueError("no workloads given")
    return out


def default_smollm2() -> tuple[Path | None, Path | None]:
    """The pulled default model's directory and its source GGUF (None where absent)."""
    try:
        from mlxcel.daemon.models.registry import DEFAULT_MODEL, local_model_dir

        model = local_model_dir(DEFAULT_MODEL)
    except Exception:  # not pulled, or no mlxcel here: the caller says what to give
        return None, None
    if model is None or not Path(model).is_dir():
        return None, None
    ggufs = sorted((Path(model) / "source").glob("*.gguf"))
    return Path(model), ggufs[0] if len(ggufs) == 1 else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_argument_group("servers")
    mode.add_argument("--url", help="benchmark a running server at this base URL")
    mode.add_argument("--start-mlxcel", action="store_true", help="start mlxcel-daemon")
    mode.add_argument("--start-mlx-lm", action="store_true", help="start mlx_lm.server")
    mode.add_argument(
        "--against-mlx-lm", action="store_true", help="start both, one at a time; compare"
    )
    mode.add_argument(
        "--against-llama",
        action="store_true",
        help="start mlxcel and llama.cpp's llama-server on the same GGUF; interleaved rounds",
    )
    mode.add_argument("--llama-server", type=Path, help="llama-server binary (--against-llama)")
    mode.add_argument(
        "--gguf", type=Path, help="the GGUF llama-server serves (default: --model's source/)"
    )
    mode.add_argument("--llama-threads", type=int, help="llama-server -t/-tb (default: cores)")
    mode.add_argument(
        "--llama-arg", action="append", default=[], help="extra llama-server argument"
    )
    mode.add_argument(
        "--ctx-size",
        type=int,
        default=0,
        help=f"total context of the started servers, split across slots (--against-llama "
        f"default: {CTX_PER_SLOT} x --parallel, for both)",
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
    mode.add_argument(
        "--dtype",
        default="auto",
        help="weights dtype for both servers (--against-llama: mlxcel's; a comma list, e.g. "
        "auto,float32, runs one daemon per dtype in the same rounds)",
    )
    mode.add_argument(
        "--mlxcel-arg", action="append", default=[], help="extra mlxcel-daemon start argument"
    )
    mode.add_argument("--startup-timeout", type=float, default=300.0)
    load = p.add_argument_group("load")
    load.add_argument("--levels", default="1,4,8", help="concurrency levels (default 1,4,8)")
    load.add_argument("--requests-per-client", type=int, default=2)
    load.add_argument(
        "--workloads",
        default=LLAMA_WORKLOADS,
        help=f"--against-llama: CLIENTS:PROMPT:NEW,... (default {LLAMA_WORKLOADS})",
    )
    load.add_argument("--rounds", type=int, default=3, help="--against-llama: best of this many")
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
    if args.against_llama:
        check_llama_args(p, args)
        return args
    if "," in args.dtype:
        p.error("--dtype takes one value here (a list only with --against-llama)")
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


def check_llama_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--against-llama: the binary, the model directory and its GGUF, the workloads."""
    if args.url or args.start_mlx_lm or args.against_mlx_lm or args.tiny:
        p.error("--against-llama starts its own two servers: no --url / mlx-lm / --tiny")
    if args.llama_server is None or not os.access(args.llama_server, os.X_OK):
        p.error("--against-llama needs --llama-server PATH (an executable llama-server)")
    default_model, default_gguf = default_smollm2()
    if args.model is None:
        args.model = default_model
        if args.gguf is None:
            args.gguf = default_gguf
    elif args.gguf is None:
        ggufs = sorted((args.model / "source").glob("*.gguf"))
        args.gguf = ggufs[0] if len(ggufs) == 1 else None
    if args.model is None or not args.model.is_dir():
        p.error("--model DIR (default: the pulled SmolLM2; run `mlxcel-daemon models pull`)")
    if args.gguf is None or not args.gguf.is_file():
        p.error(f"--gguf FILE: the GGUF of {args.model} (none found in its source/ folder)")
    try:
        args.workloads = parse_workloads(args.workloads)
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 1 or args.requests_per_client < 1:
        p.error("--rounds and --requests-per-client must be >= 1")
    args.parallel = args.parallel or max(w.clients for w in args.workloads)
    args.ctx_size = args.ctx_size or CTX_PER_SLOT * args.parallel
    args.start_mlxcel = True


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
        if args.against_llama:
            return await run_against_llama(args, Path(tmp))
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


# ---------------------------------------------------------------- --against-llama


def mlxcel_names(args: argparse.Namespace) -> dict[str, str]:
    """--dtype auto,float32 -> {"mlxcel-auto": "auto", "mlxcel-float32": "float32"}: one daemon
    per dtype in the same interleaved rounds; a single dtype is just "mlxcel"."""
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()] or ["auto"]
    if len(dtypes) == 1:
        return {"mlxcel": dtypes[0]}
    return {f"mlxcel-{d}": d for d in dict.fromkeys(dtypes)}


async def start_healthy(
    kind: str, args: argparse.Namespace, workdir: Path, dtype: str | None = None
) -> tuple[Server, float]:
    """Start one server, print its command line and environment; (server, seconds to health).
    Each in its own folder (an mlxcel daemon's MLXCEL_HOME and log)."""
    port = free_port()
    started = time.perf_counter()
    workdir = workdir / kind
    workdir.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        server = start_mlxcel(argparse.Namespace(**{**vars(args), "dtype": dtype}), port, workdir)
    else:
        server = start_llama(args, port, workdir)
    print(f"# {kind} command: {' '.join(server.argv)}", flush=True)
    print(f"# {kind} environment: {shown_env(server)}", flush=True)
    try:
        await wait_healthy(server, args.startup_timeout)
    except BaseException:
        stop_server(server)
        raise
    return server, time.perf_counter() - started


def llama_version(binary: Path) -> str:
    """`llama-server --version`'s version line (it prints it on stderr)."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(no version: {exc})"
    lines = (done.stdout + done.stderr).splitlines()
    return next((ln for ln in lines if ln.startswith("version")), lines[-1] if lines else "?")


async def run_against_llama(args: argparse.Namespace, workdir: Path) -> int:
    """Both servers up at once (one loads, then the other), then --rounds interleaved rounds:
    each workload runs on one server then the other, the order swapped every round; the very
    same prompts for both within a round, new ones every round (no prompt-cache hits)."""
    tokenizer = load_tokenizer(args.model)
    dtypes = mlxcel_names(args)
    ours = list(dtypes)
    names = (*ours, "llama")
    print(
        f"# --against-llama: mlxcel --dtype {', '.join(dtypes.values())} on {args.model}, "
        f"llama-server on "
        f"{args.gguf}; {args.parallel} slots, total context {args.ctx_size}; "
        f"{args.rounds} rounds, {args.requests_per_client} request(s) per client; workloads "
        + ", ".join(
            f"{w.label} ({w.clients} x {w.prompt_tokens} -> {w.max_tokens})" for w in args.workloads
        ),
        flush=True,
    )
    print(f"# llama-server: {llama_version(args.llama_server)}", flush=True)
    servers: dict[str, Server] = {}
    load_s: dict[str, float] = {}
    memory: dict[str, dict[str, int]] = {}
    rounds: dict[str, dict[str, list[LevelResult]]] = {
        w.label: {n: [] for n in names} for w in args.workloads
    }
    try:
        targets: dict[str, ServerTarget] = {}
        for kind in names:
            dtype = dtypes.get(kind)
            servers[kind], load_s[kind] = await start_healthy(kind, args, workdir, dtype)
            model = args.served_model or await served_model(servers[kind].url, kind)
            mode = eos_mode(args, kind)
            targets[kind] = ServerTarget(kind, servers[kind].url, mode, [], model)
            print(f"# {kind}: healthy {load_s[kind]:.1f} s after start", flush=True)
            if not args.no_warmup:
                warm = await run_level(targets[kind], PromptFactory(tokenizer, args), 1, 1, 8, args)
                if warm.ok == 0:
                    raise RuntimeError(f"{kind}: warm-up request failed: {warm.errors[:1]}")
        header = True
        for rnd in range(1, args.rounds + 1):
            order = names if rnd % 2 else names[::-1]
            for index, work in enumerate(args.workloads):
                first_prompt = 1_000_000 * rnd + 10_000 * index
                for kind in order:
                    level_args = argparse.Namespace(
                        **{**vars(args), "prompt_tokens": work.prompt_tokens}
                    )
                    prompts = PromptFactory(tokenizer, level_args)
                    prompts.count = first_prompt  # the same texts for both servers
                    result = await run_level(
                        targets[kind],
                        prompts,
                        work.clients,
                        args.requests_per_client,
                        work.max_tokens,
                        args,
                    )
                    result.workload, result.round = work.label, rnd
                    rounds[work.label][kind].append(result)
                    print(format_rounds_table([result], header=header), flush=True)
                    header = False
        for kind, server in servers.items():
            memory[kind] = process_memory(server.proc.pid)
    finally:
        for server in servers.values():
            stop_server(server)
    best = {w: {k: best_round(rs) for k, rs in by.items() if rs} for w, by in rounds.items()}
    print(
        f"\nbest of {args.rounds} rounds per server per workload (the round with the most tok/s):"
    )
    print(format_versus(best, rounds, ours, "llama"))
    print("\nmemory after the rounds (process tree, /proc):")
    for kind, mem in memory.items():
        print(
            f"  {kind:>14}: VmHWM {mem['hwm_kb'] / 1024:.0f} MiB (peak), "
            f"VmRSS {mem['rss_kb'] / 1024:.0f} MiB (now), "
            f"{mem['processes']} process(es); healthy {load_s[kind]:.1f} s after start"
        )
    for kind in ours:
        if {kind, "llama"} <= memory.keys() and memory["llama"]["hwm_kb"]:
            ratio = memory[kind]["hwm_kb"] / memory["llama"]["hwm_kb"]
            print(f"  {kind} / llama VmHWM: {ratio:.2f}x")
    for kind, server in servers.items():
        print(f"# {kind}: {shown_env(server)} {' '.join(server.argv)}")
    if args.markdown:
        print("\n" + format_versus_markdown(best, ours, "llama"))
    if args.gaps:
        print("\ninter-token gaps (ms), best rounds:")
        print(format_gaps([r for by in best.values() for r in by.values()]))
    if args.json:
        payload = {
            "args": {
                k: str(v) if isinstance(v, Path) else v
                for k, v in vars(args).items()
                if k != "workloads"
            },
            "workloads": [asdict(w) for w in args.workloads],
            "commands": {k: s.argv for k, s in servers.items()},
            "environment": {k: shown_env(s) for k, s in servers.items()},
            "load_s": load_s,
            "memory_kb": memory,
            "rounds": {
                w: {k: [asdict(r) for r in rs] for k, rs in by.items()} for w, by in rounds.items()
            },
            "best": {w: {k: asdict(r) for k, r in by.items()} for w, by in best.items()},
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    failed = sum(r.fail for by in rounds.values() for rs in by.values() for r in rs)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            return asyncio.run(main_async(args))
        except RuntimeError as exc:  # a server that did not start or a failed warm-up
            print(f"bench_serving.py: error: {exc}", file=sys.stderr)
            return 1
    return 130


if __name__ == "__main__":
    sys.exit(main())
