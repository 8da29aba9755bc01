#!/usr/bin/env python
"""Priority lanes and preemption under load (issue #28): TTFT of high-lane requests arriving
while low-lane clients saturate every slot, and what the lanes cost the low lane.

Two daemons on the same model (default: the pulled SmolLM2, `--parallel 4`), both up for the
whole run, MLXCEL_HOME and MLXCEL_SOCKET in a temp dir, on 127.0.0.1:

  preempt    the default daemon (preemption on)
  nopreempt  the same with --no-preemption

Phases (each daemon's in every round; the daemons' order is swapped every round, and so is the
order of the phases on the preempt daemon, so drift on this machine falls on both alike):

  A  idle TTFT: --idle-reps short high-lane requests one after the other on an idle daemon
     (median); the reference of B and D, taken on the same daemon.
  B  (preempt) --low-clients low-lane streaming clients with long generations (each draws its
     max_tokens from [3/4 x --max-tokens, --max-tokens], EOS ignored, and starts a new request
     when one ends) fill the slots; then --high-requests short high-lane requests arrive one by
     one, --spacing seconds apart. Their TTFT median / p95 vs A: target <= 1.5x.
  C  the low lane's throughput (the daemon's generation-token counter, read at each high
     request's start and end) over the windows with no high request in flight, vs a baseline
     phase on the same daemon with the same clients in the normal lane and no high arrivals:
     target within 5 %.
  D  (nopreempt) B again: the high requests' TTFT waits for a low request to finish; D - B is
     the wait preemption removes.

Each phase prints a profile line from the daemon's own figures over that phase (snapshot
counters, /metrics histograms and process CPU): engine steps and ms per step, decode rows per
step, the engine-side TTFT and inter-token latency of all requests, daemon CPU in cores,
preemptions, and the high requests' TTFT split into the engine's part (arrival in the engine
to first token, from the TTFT histogram read around each request, in steps) and the part
before the engine (HTTP, chat template, tokenizing). Timing targets live here, never in
pass/fail tests; the machine is shared, so compare the figures of one run.

  python scripts/bench_priority.py [--rounds 2] [--low-clients 8] [--high-requests 6]
                                   [--max-tokens 320] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.client import PromptFactory, RequestResult, ServerTarget, percentile, stream_request
from bench_lib.lanes import add_lanes_load_args
from bench_lib.metrics import parse_metrics
from bench_lib.servers import (
    Server,
    launch_daemon,
    load_tokenizer,
    served_model,
    shown_env,
    stop_server,
    wait_healthy,
)

TTFT_TARGET = 1.5  # B's high-lane TTFT / A's, at most
THROUGHPUT_TARGET = 0.95  # C: the low lane's tok/s between high requests / the baseline's
DAEMONS = {"preempt": [], "nopreempt": ["--no-preemption"]}


@dataclass
class Sample:
    """One read of the daemon's /metrics: the counters and histogram sums this script uses."""

    t: float
    generation: float = 0.0
    preemptions: float = 0.0
    cpu_s: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    prefill_tokens: int = 0


@dataclass
class Phase:
    daemon: str
    kind: str  # idle | lanes | baseline
    round: int
    ttfts: list[float] = field(default_factory=list)  # the high (or idle) requests'
    # the same requests' engine-side TTFT (arrival in the engine to first token, from the
    # /metrics histogram around each; only where it saw that one first token alone)
    engine_ttfts: list[tuple[float, float]] = field(default_factory=list)  # (client, engine)
    window_tokens: float = 0.0  # low-lane tokens in the windows with no high request
    window_s: float = 0.0
    low_results: list[RequestResult] = field(default_factory=list)
    start: Sample | None = None
    end: Sample | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def low_tok_s(self) -> float | None:
        return self.window_tokens / self.window_s if self.window_s > 0 else None


def _total(samples: dict, name: str) -> float:
    """The sum of a sample over all its label sets (0 when absent)."""
    return sum(v for (n, _), v in samples.items() if n == name)


class Daemon:
    """One started daemon: its HTTP target, /metrics and control-socket reads."""

    def __init__(self, name: str, server: Server, socket_path: Path) -> None:
        self.name = name
        self.server = server
        self.socket_path = socket_path
        self.target: ServerTarget | None = None

    async def sample(self, session: aiohttp.ClientSession, snapshot: bool = False) -> Sample:
        async with session.get(f"{self.server.url}/metrics") as resp:
            m = parse_metrics(await resp.text())
        s = Sample(
            t=time.perf_counter(),
            generation=_total(m, "mlxcel_generation_tokens_total"),
            preemptions=_total(m, "mlxcel_preemptions_total"),
            cpu_s=_total(m, "mlxcel_process_cpu_seconds_total"),
            ttft_sum=_total(m, "mlxcel_time_to_first_token_seconds_sum"),
            ttft_count=_total(m, "mlxcel_time_to_first_token_seconds_count"),
            itl_sum=_total(m, "mlxcel_inter_token_latency_seconds_sum"),
            itl_count=_total(m, "mlxcel_inter_token_latency_seconds_count"),
        )
        if snapshot:
            c = await self._counters()
            s.steps = c.get("steps", 0)
            s.decode_steps = c.get("decode_steps", 0)
            s.decode_rows = c.get("decode_rows", 0)
            s.prefill_tokens = c.get("prefill_tokens", 0)
        return s

    async def _counters(self) -> dict[str, Any]:
        """The engine snapshot's counters over the control socket ({} when it does not answer)."""
        from mlxcel.shared.control_client import ControlClient

        try:
            async with ControlClient(self.socket_path) as client:
                snap = await client.call("status", timeout=10)
        except Exception as exc:  # a figure missing from the profile, not a failed run
            print(f"# {self.name}: no snapshot ({type(exc).__name__}: {exc})", flush=True)
            return {}
        return dict((snap.get("engine") or {}).get("counters") or {})


def start_daemon(name: str, extra: list[str], args: argparse.Namespace, tmp: Path) -> Daemon:
    server, socket_path = launch_daemon(name, extra, args, tmp)
    return Daemon(name, server, socket_path)


def session_for(lane: str, args: argparse.Namespace) -> aiohttp.ClientSession:
    """A session whose every request carries `X-Priority: lane` (a fresh connection each)."""
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, headers={"X-Priority": lane})


class Prompts:
    """Distinct prompts (no prompt-cache hits past the chat template): long for the low lane,
    short for the high one; a fresh numbering per phase and round."""

    def __init__(self, tokenizer: Any, args: argparse.Namespace) -> None:
        ns = argparse.Namespace(prompt_tokens=args.low_prompt_tokens, shared_prefix_tokens=0)
        self.low = PromptFactory(tokenizer, ns)
        ns = argparse.Namespace(prompt_tokens=args.high_prompt_tokens, shared_prefix_tokens=0)
        self.high = PromptFactory(tokenizer, ns)

    def renumber(self, base: int) -> None:
        self.low.count = base
        self.high.count = base + 500_000


class LowClients:
    """--low-clients closed-loop streaming clients (each starts a new request when one ends),
    started 0.2 s apart, until `stop()`."""

    def __init__(
        self,
        daemon: Daemon,
        lane: str,
        prompts: Prompts,
        args: argparse.Namespace,
        results: list[RequestResult],
        seed: int,
    ) -> None:
        assert daemon.target is not None
        self.target = daemon.target
        self.prompts = prompts
        self.results = results
        self.seed = seed
        self.range = (max(1, (3 * args.max_tokens) // 4), args.max_tokens)
        self.session = session_for(lane, args)
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(args.low_clients)]

    async def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        await asyncio.sleep(0.2 * i)
        while True:
            prompt, max_tokens = self.prompts.low.next(), rng.randint(*self.range)
            r = await stream_request(self.session, self.target, prompt, max_tokens)
            self.results.append(r)
            if not r.ok:
                await asyncio.sleep(0.5)

    async def stop(self) -> None:
        """Cancel the clients (their connections close: the daemon aborts the requests)."""
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()


async def high_request(
    session: aiohttp.ClientSession, daemon: Daemon, prompts: Prompts, args: argparse.Namespace
) -> RequestResult:
    assert daemon.target is not None
    return await stream_request(session, daemon.target, prompts.high.next(), args.high_max_tokens)


def record_high(phase: Phase, r: RequestResult, before: Sample, after: Sample) -> None:
    """A high request's client TTFT, and its engine-side one when the histogram saw only it."""
    if not (r.ok and r.ttft_s is not None):
        phase.errors.append(r.error or "?")
        return
    phase.ttfts.append(r.ttft_s)
    if after.ttft_count - before.ttft_count == 1:
        phase.engine_ttfts.append((r.ttft_s, after.ttft_sum - before.ttft_sum))


async def phase_idle(daemon: Daemon, rnd: int, prompts: Prompts, args: argparse.Namespace) -> Phase:
    """A: short high-lane requests one at a time on the idle daemon."""
    phase = Phase(daemon.name, "idle", rnd)
    async with session_for("high", args) as session:
        phase.start = await daemon.sample(session, snapshot=True)
        for _ in range(args.idle_reps):
            before = await daemon.sample(session)
            r = await high_request(session, daemon, prompts, args)
            record_high(phase, r, before, await daemon.sample(session))
            await asyncio.sleep(0.2)
        phase.end = await daemon.sample(session, snapshot=True)
    return phase


async def phase_loaded(
    daemon: Daemon, rnd: int, prompts: Prompts, args: argparse.Namespace, with_high: bool
) -> Phase:
    """B / D (with_high: low-lane clients, high requests one by one) or the baseline (normal-
    lane clients, no high requests, the same number of windows of the same length)."""
    phase = Phase(daemon.name, "lanes" if with_high else "baseline", rnd)
    lane = "low" if with_high else "normal"
    clients = LowClients(daemon, lane, prompts, args, phase.low_results, seed=rnd)
    try:
        async with session_for("high", args) as session:
            await asyncio.sleep(args.warmup)
            phase.start = await daemon.sample(session, snapshot=True)
            last = phase.start
            for _ in range(args.high_requests):
                await asyncio.sleep(args.spacing)
                before = await daemon.sample(session)
                phase.window_tokens += before.generation - last.generation
                phase.window_s += before.t - last.t
                if with_high:
                    r = await high_request(session, daemon, prompts, args)
                    last = await daemon.sample(session)
                    record_high(phase, r, before, last)
                else:  # no high request: the whole phase is one window
                    await asyncio.sleep(args.spacing)
                    last = before
            await asyncio.sleep(args.spacing)
            phase.end = await daemon.sample(session, snapshot=True)
            phase.window_tokens += phase.end.generation - last.generation
            phase.window_s += phase.end.t - last.t
    finally:
        await clients.stop()
    phase.errors += [r.error or "?" for r in phase.low_results if not r.ok]
    return phase


# ---------------------------------------------------------------- printing


def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def profile_line(p: Phase) -> str:
    a, b = p.start, p.end
    if a is None or b is None:
        return f"profile {p.daemon}/{p.kind} r{p.round}: n/a"
    wall = b.t - a.t
    steps = b.steps - a.steps
    dsteps = b.decode_steps - a.decode_steps
    ttft_n, itl_n = b.ttft_count - a.ttft_count, b.itl_count - a.itl_count
    # wall / steps: the step time only while the engine never idles (not in the idle phase)
    ms_step = 1000 * wall / steps if steps > 0 and p.kind != "idle" else None
    rows = (b.decode_rows - a.decode_rows) / dsteps if dsteps > 0 else None
    ttft = (b.ttft_sum - a.ttft_sum) / ttft_n if ttft_n > 0 else None
    itl = 1000 * (b.itl_sum - a.itl_sum) / itl_n if itl_n > 0 else None
    high = ""
    if p.engine_ttfts:  # medians over the same requests
        client = statistics.median(c for c, _ in p.engine_ttfts)
        engine = statistics.median(e for _, e in p.engine_ttfts)
        before_engine = statistics.median(c - e for c, e in p.engine_ttfts)
        high = (
            f"; high requests ({len(p.engine_ttfts)} of {len(p.ttfts)}, those the histogram saw "
            f"alone): TTFT median {client:.3f} s = engine {engine:.3f} s (arrival in the engine "
            f"-> first token{f', {1000 * engine / ms_step:.1f} steps' if ms_step else ''}) + "
            f"before the engine (HTTP, chat template, tokenizing) {before_engine:.3f} s"
        )
    return (
        f"profile {p.daemon}/{p.kind} r{p.round}: {wall:.1f} s, {steps} engine steps "
        f"({_f(ms_step, '{:.1f}')} ms/step, {dsteps} decode steps x {_f(rows, '{:.2f}')} rows), "
        f"prefill {b.prefill_tokens - a.prefill_tokens} tok, generated "
        f"{b.generation - a.generation:.0f} tok ({(b.generation - a.generation) / wall:.1f} "
        f"tok/s), engine TTFT mean (all lanes) {_f(ttft, '{:.3f}')} s over {ttft_n:.0f} req, "
        f"engine ITL mean {_f(itl, '{:.1f}')} ms, daemon CPU "
        f"{(b.cpu_s - a.cpu_s) / wall:.2f} cores, preemptions "
        f"{b.preemptions - a.preemptions:.0f}{high}"
    )


def phase_line(p: Phase) -> str:
    label = {"idle": "A idle", "lanes": "B lanes" if p.daemon == "preempt" else "D lanes"}
    head = f"{p.daemon:>9} r{p.round} {label.get(p.kind, 'C baseline'):<10}"
    parts = [head]
    if p.ttfts:
        parts.append(
            f"TTFT median {statistics.median(p.ttfts):.3f} s p95 "
            f"{percentile(p.ttfts, 95):.3f} s ({' '.join(f'{t:.2f}' for t in p.ttfts)})"
        )
    if p.kind != "idle":
        low = [r for r in p.low_results if r.ok]
        gaps = [1000 * g for r in low for g in r.gaps_s]
        spread = (
            f"; their gaps p50 {percentile(gaps, 50):.0f} / p99 {percentile(gaps, 99):.0f} / "
            f"max {max(gaps):.0f} ms"
            if gaps
            else ""
        )
        parts.append(
            f"{'low' if p.kind == 'lanes' else 'normal'} lane {_f(p.low_tok_s, '{:.1f}')} tok/s "
            f"over {p.window_s:.1f} s of windows ({len(low)} requests done{spread})"
        )
    if p.errors:
        parts.append(f"{len(p.errors)} errors, e.g. {p.errors[0]!r}")
    return "  ".join(parts)


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def verdict(value: float | None, target: float, at_most: bool) -> str:
    if value is None:
        return "n/a"
    return "met" if (value <= target if at_most else value >= target) else "missed"


def summary(phases: list[Phase], args: argparse.Namespace) -> None:
    def pick(daemon: str, kind: str) -> list[Phase]:
        return [p for p in phases if p.daemon == daemon and p.kind == kind]

    def ttfts(daemon: str, kind: str) -> list[float]:
        return [t for p in pick(daemon, kind) for t in p.ttfts]

    def tok_s(daemon: str, kind: str) -> float | None:
        ps = pick(daemon, kind)
        secs = sum(p.window_s for p in ps)
        return sum(p.window_tokens for p in ps) / secs if secs else None

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    a_pre, a_no = ttfts("preempt", "idle"), ttfts("nopreempt", "idle")
    b, d = ttfts("preempt", "lanes"), ttfts("nopreempt", "lanes")
    ref_pre, ref_no = med(a_pre), med(a_no)
    print(f"\nsummary over {args.rounds} rounds (all rounds' requests pooled):")
    print(
        f"  A idle high-lane TTFT median: preempt {_f(ref_pre, '{:.3f}')} s "
        f"({len(a_pre)} req), nopreempt {_f(ref_no, '{:.3f}')} s ({len(a_no)} req)"
    )
    for name, xs, ref in (("B preempt  ", b, ref_pre), ("D nopreempt", d, ref_no)):
        m, p95 = med(xs), percentile(xs, 95)
        rm = m / ref if m is not None and ref else None
        rp = p95 / ref if p95 is not None and ref else None
        print(
            f"  {name} high-lane TTFT under load: median {_f(m, '{:.3f}')} s = "
            f"{_f(rm, '{:.2f}')}x A ({verdict(rm, TTFT_TARGET, True)}), p95 {_f(p95, '{:.3f}')} s "
            f"= {_f(rp, '{:.2f}')}x A ({verdict(rp, TTFT_TARGET, True)}); target <= "
            f"{TTFT_TARGET}x ({len(xs)} req)"
        )
    mb, md = med(b), med(d)
    if mb is not None and md is not None:
        print(
            f"  wait preemption removes (D - B, median TTFT): {md - mb:.3f} s "
            f"(D is {md / mb:.2f}x B)"
        )
    lanes, base = tok_s("preempt", "lanes"), tok_s("preempt", "baseline")
    ratio = lanes / base if lanes and base else None
    print(
        f"  C low-lane tok/s between high requests {_f(lanes, '{:.1f}')} vs baseline (normal "
        f"lane, no high) {_f(base, '{:.1f}')} = {_f(ratio, '{:.3f}')}x "
        f"({verdict(ratio, THROUGHPUT_TARGET, False)}; target within 5 %, >= "
        f"{THROUGHPUT_TARGET}x)"
    )
    per_round = [
        f"r{r}: {_f(lanes_r, '{:.1f}')}/{_f(base_r, '{:.1f}')}"
        for r in range(1, args.rounds + 1)
        for lanes_r, base_r in [
            (
                next((p.low_tok_s for p in pick("preempt", "lanes") if p.round == r), None),
                next((p.low_tok_s for p in pick("preempt", "baseline") if p.round == r), None),
            )
        ]
    ]
    ratios = [
        lanes_p.low_tok_s / base_p.low_tok_s
        for lanes_p in pick("preempt", "lanes")
        for base_p in pick("preempt", "baseline")
        if lanes_p.round == base_p.round and lanes_p.low_tok_s and base_p.low_tok_s
    ]
    med_ratio = med(ratios)
    print(
        f"    per round (lanes/baseline tok/s): {', '.join(per_round)}; median of the rounds' "
        f"ratios {_f(med_ratio, '{:.3f}')}x ({verdict(med_ratio, THROUGHPUT_TARGET, False)})"
    )
    d_low = tok_s("nopreempt", "lanes")
    print(f"  (D's low lane between high requests: {_f(d_low, '{:.1f}')} tok/s)")
    for name in DAEMONS:
        pre = sum(
            (p.end.preemptions - p.start.preemptions)
            for p in phases
            if p.daemon == name and p.start and p.end
        )
        total = max((p.end.preemptions for p in phases if p.daemon == name and p.end), default=0)
        print(
            f"  /metrics mlxcel_preemptions_total {name}: {total:.0f} "
            f"({pre:.0f} within the measured phases)"
        )


# ---------------------------------------------------------------- the run


async def run(args: argparse.Namespace, tmp: Path) -> int:
    tokenizer = load_tokenizer(args.model)
    prompts = Prompts(tokenizer, args)
    daemons = {name: start_daemon(name, extra, args, tmp) for name, extra in DAEMONS.items()}
    try:
        await asyncio.gather(
            *(wait_healthy(d.server, args.startup_timeout) for d in daemons.values())
        )
        for d in daemons.values():
            model = await served_model(d.server.url, "mlxcel")
            d.target = ServerTarget(d.name, d.server.url, "ignore_eos", [], model)
            print(f"# {d.name}: {shown_env(d.server)} {' '.join(d.server.argv)}", flush=True)
            async with session_for("high", args) as session:  # warm-up: first-request costs
                for _ in range(2):
                    r = await stream_request(session, d.target, prompts.low.next(), 16)
                    if not r.ok:
                        raise RuntimeError(f"{d.name}: warm-up request failed: {r.error}")
        print(
            f"# {args.low_clients} low clients x {args.low_prompt_tokens}-token prompts -> "
            f"{(3 * args.max_tokens) // 4}..{args.max_tokens} tokens; {args.high_requests} high "
            f"requests x {args.high_prompt_tokens} -> {args.high_max_tokens} tokens, "
            f"{args.spacing} s apart after {args.warmup} s warm-up; {args.idle_reps} idle reps; "
            f"--parallel {args.parallel}; {args.rounds} rounds",
            flush=True,
        )
        phases: list[Phase] = []
        started, load_at_start = time.perf_counter(), _loadavg()
        for rnd in range(1, args.rounds + 1):
            order = list(daemons) if rnd % 2 else list(daemons)[::-1]
            for name in order:
                d = daemons[name]
                prompts.renumber(1_000_000 * rnd + (0 if name == "preempt" else 100_000))
                kinds = ["idle", "lanes"] + (["baseline"] if name == "preempt" else [])
                if rnd % 2 == 0:
                    kinds = kinds[::-1]
                for kind in kinds:
                    if kind == "idle":
                        p = await phase_idle(d, rnd, prompts, args)
                    else:
                        p = await phase_loaded(d, rnd, prompts, args, kind == "lanes")
                    phases.append(p)
                    print(phase_line(p), flush=True)
                    print("  " + profile_line(p), flush=True)
                    await asyncio.sleep(1.0)  # the aborted streams' slots free up
        print(
            f"# rounds took {time.perf_counter() - started:.0f} s; load average "
            f"{load_at_start} at the start, {_loadavg()} now (other work shares these CPUs)",
            flush=True,
        )
        summary(phases, args)
    finally:
        for d in daemons.values():
            stop_server(d.server)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="model directory (default: the pulled SmolLM2)")
    p.add_argument("--parallel", type=int, default=4, help="decode slots (default 4)")
    p.add_argument("--rounds", type=int, default=3)
    add_lanes_load_args(p)
    p.add_argument("--high-requests", type=int, default=6, help="per loaded phase")
    p.add_argument("--warmup", type=float, default=6.0, help="seconds of load before measuring")
    p.add_argument("--idle-reps", type=int, default=5)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--daemon-arg", action="append", default=[], help="extra mlxcel-daemon start argument"
    )
    args = p.parse_args(argv)
    if args.model is None:
        from bench_serving import default_smollm2

        args.model = default_smollm2()[0]
    if args.model is None or not Path(args.model).is_dir():
        p.error("--model DIR (default: the pulled SmolLM2; run `mlxcel-daemon models pull`)")
    if min(args.rounds, args.low_clients, args.high_requests, args.idle_reps) < 1:
        p.error("--rounds, --low-clients, --high-requests and --idle-reps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        with tempfile.TemporaryDirectory(prefix="mlxcel-prio-") as tmp:
            try:
                return asyncio.run(run(args, Path(tmp)))
            except RuntimeError as exc:
                print(f"bench_priority.py: error: {exc}", file=sys.stderr)
                return 1
    return 130


if __name__ == "__main__":
    sys.exit(main())
