#!/usr/bin/env python
"""What lanes and preemption cost the low lane, and what the load costs a high request's first
token, measured on the real engine in this process (no HTTP, no client on the same cores):
issue #28's C and B figures without `bench_priority.py`'s daemons.

One engine (default: the pulled SmolLM2, `--parallel 4`, the daemon's defaults otherwise) runs
two phases, interleaved in rounds (their order swapped every other round):

  lanes     --low-clients low-lane requests (random --low-prompt-tokens prompts, max_tokens
            drawn from [3/4 x --max-tokens, --max-tokens], EOS ignored, temperature 0.8
            seeded), each replaced as it ends, fill the slots; every --spacing seconds one
            high-lane request (--high-prompt-tokens, --high-max-tokens, greedy) arrives and
            preempts a low row. The low lane's tok/s counts only the windows with no high
            request in flight (its arrival to its last token), as bench_priority.py does.
  baseline  the same clients in the normal lane, no high requests: the whole phase is one
            window.
  idle      (each round, first) six high requests one at a time on the idle engine: their
            median TTFT is the reference of the lanes phase's high requests' TTFT (B).

Each phase prints the low lane's tok/s, the preemptions, and where the engine's time went that
differs between the two: the rows joining the decode batch (`BatchRunner._join_decode`, which
copies every running row's KV into the merged cache: a preempted row's resumption joins once
more) and the prefill chunks, from cProfile's cumulative times with `--profile`.

  python scripts/bench_lanes_engine.py [--rounds 3] [--seconds 12] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench_lib.lanes import add_lanes_load_args

PROFILED = ("_join_decode", "prefill_chunk", "_preempt", "decode_step")


@dataclass
class Result:
    kind: str
    tok_s: float
    preemptions: int
    high_s: list[float] = field(default_factory=list)  # high requests: arrival to last token
    high_ttft: list[float] = field(default_factory=list)  # arrival to first token
    profile: dict[str, tuple[int, float]] = field(default_factory=dict)


class Load:
    """The engine, its outputs and the low clients that keep it full."""

    def __init__(self, engine: Any, args: argparse.Namespace, vocab: int) -> None:
        self.engine, self.args, self.vocab = engine, args, vocab
        self.rng = random.Random(0)
        self.low_tokens = 0
        self.done: set[str] = set()
        self.live: set[str] = set()
        self.count = 0
        self.first_at: dict[str, float] = {}  # high requests: when their first token came out
        engine.on_output = self._on_output

    def _on_output(self, rid: str, out: Any) -> None:
        if out.token_id is not None and rid.startswith("low"):
            self.low_tokens += 1
        if out.token_id is not None and rid.startswith("high"):
            self.first_at.setdefault(rid, time.perf_counter())
        if out.finish_reason is not None:
            self.done.add(rid)

    def prompt(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(1000, self.vocab) for _ in range(n))

    def top_up(self, lane: str) -> None:
        from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams

        self.live -= self.done
        while len(self.live) < self.args.low_clients:
            self.count += 1
            top = self.args.max_tokens
            request = GenerationRequest(
                f"low{self.count}",
                self.prompt(self.args.low_prompt_tokens),
                self.rng.randint(top * 3 // 4, top),
                SamplingParams(temperature=0.8, seed=self.count),
                lane=lane,
            )
            self.live.add(request.request_id)
            self.engine.add_request(request)

    def step(self, lane: str) -> None:
        self.engine.step()
        self.top_up(lane)

    def drain(self) -> None:
        for rid in list(self.live):
            self.engine.abort(rid, "abort")
        while self.engine.has_work:
            self.engine.step()
        self.live.clear()


def phase(load: Load, with_high: bool, args: argparse.Namespace) -> Result:
    from mlxcel.daemon.engine.types import GREEDY, GenerationRequest

    lane = "low" if with_high else "normal"
    load.top_up(lane)
    warm_until = time.perf_counter() + args.warmup
    while time.perf_counter() < warm_until:
        load.step(lane)
    preempted = load.engine.stats.preemptions
    tokens, seconds, highs, ttfts = 0, 0.0, [], []
    start = last = time.perf_counter()
    last_tokens, next_high, high, high_at = load.low_tokens, start + args.spacing, None, 0.0
    while time.perf_counter() < start + args.seconds:
        now = time.perf_counter()
        if with_high and high is None and now >= next_high:
            tokens, seconds = tokens + load.low_tokens - last_tokens, seconds + now - last
            high, high_at = f"high{load.count}-{len(highs)}", now
            prompt = load.prompt(args.high_prompt_tokens)
            load.engine.add_request(
                GenerationRequest(high, prompt, args.high_max_tokens, GREEDY, lane="high")
            )
        load.step(lane)
        if high is not None and high in load.done:
            last = time.perf_counter()
            highs.append(last - high_at)
            ttfts.append(load.first_at[high] - high_at)
            high, last_tokens, next_high = None, load.low_tokens, last + args.spacing
    if high is None:
        tokens += load.low_tokens - last_tokens
        seconds += time.perf_counter() - last
    else:
        load.engine.abort(high, "abort")
    load.drain()
    kind = "lanes" if with_high else "baseline"
    preemptions = load.engine.stats.preemptions - preempted
    return Result(kind, tokens / seconds, preemptions, highs, ttfts)


def idle_ttft(load: Load, args: argparse.Namespace, reps: int = 6) -> list[float]:
    """TTFT of high requests one at a time on the idle engine: the reference of the loaded
    figure (issue #28's A)."""
    from mlxcel.daemon.engine.types import GREEDY, GenerationRequest

    out = []
    for i in range(reps):
        rid = f"high-idle{load.count}-{i}"
        start = time.perf_counter()
        load.engine.add_request(
            GenerationRequest(rid, load.prompt(args.high_prompt_tokens), 2, GREEDY, lane="high")
        )
        while load.engine.has_work:
            load.engine.step()
        out.append(load.first_at[rid] - start)
    return out


def profiled(load: Load, with_high: bool, args: argparse.Namespace) -> Result:
    prof = cProfile.Profile()
    prof.enable()
    result = phase(load, with_high, args)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    for (_, _, name), (_, calls, _, cumtime, _) in stats.items():
        if name in PROFILED:
            n, t = result.profile.get(name, (0, 0.0))
            result.profile[name] = (n + calls, t + cumtime)
    return result


def show(rnd: int, r: Result) -> None:
    high = ""
    if r.high_s:
        high = (
            f", {len(r.high_s)} high requests (TTFT median {statistics.median(r.high_ttft):.3f}"
            f" s, each {' '.join(f'{t:.2f}' for t in r.high_ttft)}; done median"
            f" {statistics.median(r.high_s):.3f} s)"
        )
    prof = "; ".join(
        f"{name} {n} x {1000 * t / n:.1f} ms = {t:.2f} s" for name, (n, t) in r.profile.items() if n
    )
    print(
        f"r{rnd} {r.kind:<8} low lane {r.tok_s:6.1f} tok/s, preemptions {r.preemptions}{high}"
        + (f"\n   profile: {prof}" if prof else ""),
        flush=True,
    )


def main_run(args: argparse.Namespace) -> int:
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.models import load_model
    from mlxcel.shared.config import ServingConfig

    loaded = load_model(args.model)
    info = loaded.info
    engine = Engine(
        loaded.model,
        ServingConfig(parallel=args.parallel),
        info.can_batch,
        info.batch_reason,
        info.context_length,
        available_bytes=4 << 30,
    )
    vocab = min(len(loaded.tokenizer.vocab), 40_000)
    load = Load(engine, args, vocab)
    run = profiled if args.profile else phase
    phase(load, True, argparse.Namespace(**{**vars(args), "seconds": 4.0}))  # warm-up, unshown
    ratios, ttft_ratios = [], []
    for rnd in range(args.rounds):
        order = (True, False) if rnd % 2 == 0 else (False, True)
        idle = statistics.median(idle_ttft(load, args))
        results = {with_high: run(load, with_high, args) for with_high in order}
        print(f"r{rnd} idle     high TTFT median {idle:.3f} s")
        for with_high in order:
            show(rnd, results[with_high])
        ratios.append(results[True].tok_s / results[False].tok_s)
        ttft_ratios.append(statistics.median(results[True].high_ttft) / idle)
    print(
        f"high TTFT under load / idle (engine only), by round: "
        f"{', '.join(f'{r:.2f}' for r in ttft_ratios)}; "
        f"median {statistics.median(ttft_ratios):.2f}x (issue #28's B, without HTTP: <= 1.5x)"
    )
    print(
        f"low lane between high requests / baseline, by round: "
        f"{', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}x "
        "(issue #28: within 5 %, >= 0.95x)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=12.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring")
    add_lanes_load_args(p)  # bench_priority.py's load, its flags and defaults
    p.add_argument("--profile", action="store_true", help="cProfile each phase (slower)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.seconds <= args.spacing:
        p.error("--rounds >= 1 and --seconds > --spacing")
    from mlxcel.daemon.forward.blas import ensure_fast_blas

    ensure_fast_blas()  # re-executes with the daemon's BLAS environment (as the daemon does)
    return main_run(args)


if __name__ == "__main__":
    sys.exit(main())
