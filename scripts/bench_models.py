#!/usr/bin/env python
"""Two resident models served at once (issue #28 item 4): one engine thread per model (the
daemon's design, `EngineBridge` per model) vs one thread stepping both engines in turn, measured
on the real engine in this process (no HTTP).

Two engines (default: the pulled SmolLM2 loaded twice, separate weights; `--second tiny`: a
random-weight float32 llama of SmolLM2's shape written to a temp dir), one greedy stream per model
(a distinct ~--prompt-tokens chat prompt, --new-tokens tokens, EOS ignored). Three modes,
interleaved in rounds (their order reversed every other round):

  alone    each model's stream on its own, one after the other (the reference)
  threads  both streams at once, each engine stepped by its own thread (today's design)
  rr       both streams at once, one thread stepping the two engines round-robin

Per stream: inter-token latency median / p95 (the gaps between the engine's token outputs),
TTFT, decode tok/s; per mode: total tok/s (all tokens / the mode's wall time) and the CPU the
process used (psutil cpu_times: cores = CPU seconds / wall), split into the stepping threads
and the others (the native kernels' pool workers, OpenBLAS's). The GIL switch interval is the
engine's (bridge.ENGINE_SWITCH_INTERVAL_S) in every mode. Ends with a one-line conclusion.

MLXCEL_NO_FAST_FORWARD=1 runs the stock MLX forward instead of the native kernels (the
forward plan is printed per model).

  python scripts/bench_models.py [--rounds 4] [--new-tokens 128] [--prompt-tokens 256]
                                 [--second same|tiny|SPEC]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import make_prompt  # distinct chat prompts of a given size

MODES = ("alone", "threads", "rr")


def percentile(values: list[float], q: float) -> float:
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass
class Model:
    name: str
    engine: Any
    tokenizer: Any


@dataclass
class Stream:
    """One request's token output times (perf_counter), recorded on the stepping thread."""

    model: str
    submitted: float = 0.0
    times: list[float] = field(default_factory=list)
    finish: str | None = None

    @property
    def gaps_ms(self) -> list[float]:
        return [1000 * (b - a) for a, b in zip(self.times, self.times[1:], strict=False)]

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.submitted

    @property
    def decode_tok_s(self) -> float:
        span = self.times[-1] - self.times[0]
        return (len(self.times) - 1) / span if span > 0 else 0.0


@dataclass
class Run:
    mode: str
    round: int
    streams: list[Stream]
    wall_s: float
    cpu_s: float  # the process's CPU seconds (all threads)
    stepper_cpu_s: float  # the stepping threads' (the Python engine loop and what it calls)

    @property
    def tokens(self) -> int:
        return sum(len(s.times) for s in self.streams)


def load(spec: str, name: str, args: argparse.Namespace) -> Model:
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.models import load_model
    from mlxcel.shared.config import ServingConfig

    loaded = load_model(spec)
    info = loaded.info
    cfg = ServingConfig(parallel=args.parallel)
    engine = Engine(
        loaded.model,
        cfg,
        info.can_batch,
        info.batch_reason,
        info.context_length,
        tokenizer=loaded.tokenizer,
    )
    print(
        f"# {name}: {info.name} ({info.family}, {info.dtype}, {info.backend}, blas {info.blas}, "
        f"forward {info.forward}) from {info.path}",
        flush=True,
    )
    return Model(name, engine, loaded.tokenizer)


def submit(model: Model, stream: Stream, prompt: tuple[int, ...], new_tokens: int, rid: str):
    """Queue the request on `model`'s engine; its outputs land in `stream`."""
    from mlxcel.daemon.engine.types import GREEDY, GenerationRequest

    def on_output(request_id: str, out: Any) -> None:
        if out.token_id is not None:
            stream.times.append(time.perf_counter())
        if out.finished:
            stream.finish = out.finish_reason

    model.engine.on_output = on_output
    stream.submitted = time.perf_counter()
    model.engine.add_request(GenerationRequest(rid, prompt, new_tokens, GREEDY))


def step_until_done(engines: list[Any]) -> None:
    """Step every engine that has work, in turn, until none has."""
    while True:
        busy = [e for e in engines if e.has_work]
        if not busy:
            return
        for e in busy:
            e.step()


def run_mode(
    mode: str,
    models: list[Model],
    prompts: dict[str, tuple[int, ...]],
    args: argparse.Namespace,
    rnd: int,
) -> list[Run]:
    """One mode's run(s): `alone` gives one Run per model, the others one Run for both."""
    groups = [[m] for m in models] if mode == "alone" else [models]
    return [run_group(mode, group, prompts, args, rnd) for group in groups]


def run_group(
    mode: str,
    group: list[Model],
    prompts: dict[str, tuple[int, ...]],
    args: argparse.Namespace,
    rnd: int,
) -> Run:
    """`group`'s streams at once: `threads` steps each engine on its own thread, the other
    modes step the group on one thread in turn."""
    import psutil

    proc = psutil.Process()
    streams = {m.name: Stream(m.name) for m in group}
    work = [[m] for m in group] if mode == "threads" else [group]
    go = threading.Barrier(len(work) + 1)  # the steppers and this thread: one start
    stepper_cpu: list[float] = []

    def stepper(mine: list[Model]) -> None:
        go.wait()
        cpu0 = time.thread_time()
        for m in mine:
            rid = f"{mode}-{rnd}-{m.name}"
            submit(m, streams[m.name], prompts[m.name], args.new_tokens, rid)
        step_until_done([m.engine for m in mine])
        stepper_cpu.append(time.thread_time() - cpu0)

    threads = [
        threading.Thread(target=stepper, args=(mine,), name=f"bench-{mode}-{i}")
        for i, mine in enumerate(work)
    ]
    for t in threads:
        t.start()
    before = proc.cpu_times()
    start = time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = proc.cpu_times()
    for st in streams.values():
        if st.finish != "length" or len(st.times) != args.new_tokens:
            raise RuntimeError(f"{mode}: {st.model} ended {st.finish} after {len(st.times)}")
    cpu = (after.user + after.system) - (before.user + before.system)
    return Run(mode, rnd, list(streams.values()), wall, cpu, sum(stepper_cpu))


# ---------------------------------------------------------------- printing


def run_line(r: Run) -> str:
    parts = [f"r{r.round} {r.mode:>7}"]
    for s in r.streams:
        g = s.gaps_ms
        parts.append(
            f"{s.model}: ITL median {statistics.median(g):5.1f} ms p95 {percentile(g, 95):5.1f} ms"
            f" TTFT {s.ttft_s:.3f} s {s.decode_tok_s:5.1f} tok/s"
        )
    parts.append(
        f"total {r.tokens / r.wall_s:6.1f} tok/s over {r.wall_s:.2f} s, CPU "
        f"{r.cpu_s / r.wall_s:.2f} cores"
    )
    return "  ".join(parts)


def summary(runs: list[Run], args: argparse.Namespace, names: list[str]) -> None:
    print(f"\nsummary over {args.rounds} rounds (gaps of all rounds pooled per model and mode):")
    itl: dict[str, float] = {}
    itl95: dict[str, float] = {}
    stepping: dict[str, float] = {}  # cores used by the stepping threads
    for mode in MODES:
        rs = [r for r in runs if r.mode == mode]
        cells = []
        medians, p95s = [], []
        for name in names:
            gaps = [g for r in rs for s in r.streams if s.model == name for g in s.gaps_ms]
            medians.append(statistics.median(gaps))
            p95s.append(percentile(gaps, 95))
            cells.append(f"{name} ITL median {medians[-1]:5.1f} ms p95 {p95s[-1]:5.1f} ms")
        itl[mode], itl95[mode] = statistics.mean(medians), statistics.mean(p95s)
        wall = sum(r.wall_s for r in rs)
        tokens = sum(r.tokens for r in rs)
        cores = sum(r.cpu_s for r in rs) / wall
        stepper = stepping[mode] = sum(r.stepper_cpu_s for r in rs) / wall
        total = (
            f"{tokens / wall:6.1f} tok/s (one stream at a time)"
            if mode == "alone"
            else f"{tokens / wall:6.1f} tok/s (both streams)"
        )
        print(
            f"  {mode:>7}: {'  '.join(cells)}  total {total}, CPU {cores:.2f} cores "
            f"(stepping threads {stepper:.2f}, others {cores - stepper:.2f})"
        )

    def cores(mode: str) -> float:
        rs = [r for r in runs if r.mode == mode]
        return sum(r.cpu_s for r in rs) / sum(r.wall_s for r in rs)

    t, rr, a = itl["threads"], itl["rr"], itl["alone"]
    agg = {
        mode: sum(r.tokens for r in runs if r.mode == mode)
        / sum(r.wall_s for r in runs if r.mode == mode)
        for mode in MODES
    }
    print(
        f"  mean of the models' ITL medians: alone {a:.1f} ms, threads {t:.1f} ms "
        f"({t / a:.2f}x alone), rr {rr:.1f} ms ({rr / a:.2f}x alone); threads / rr "
        f"{t / rr:.2f}x; total tok/s threads / rr {agg['threads'] / agg['rr']:.2f}x, "
        f"threads / alone {agg['threads'] / agg['alone']:.2f}x"
    )
    cpus = _cpus()
    used = ", ".join(
        f"{m} {cores(m):.2f} (stepping threads {stepping[m]:.2f})" for m in ("alone", "threads")
    )
    used += f", rr {cores('rr'):.2f}"
    if t < rr:
        why = (
            f"one stream alone keeps only {cores('alone'):.2f} of {cpus} cores busy (the Python "
            "part of each step and the kernels' serial parts run on one core), and the decode "
            "kernels are ctypes calls that release the GIL, so a second engine thread fills the "
            "idle core time (while one engine holds the native kernels' pool, the other's "
            "kernels run single-threaded on its own thread: the stepping threads' share of the "
            "CPU rises), whereas round-robin runs one step at a time and each stream waits out "
            "the other's whole step"
        )
    else:
        why = (
            f"one stream alone already keeps {cores('alone'):.2f} of {cpus} cores busy, so two "
            "engine threads only contend for the same cores (the native kernels' pool serves one "
            "caller at a time: the other runs single-threaded) and for the GIL, while "
            "round-robin gives each step the whole machine in turn"
        )
    tail = (
        "; the tail is not better"
        if (itl95["threads"] >= itl95["rr"]) == (t < rr)
        else "; the tail agrees"
    )
    print(
        f"conclusion: {'threads' if t < rr else 'rr'} keeps inter-token latency lower on this "
        f"machine (mean of the models' ITL medians {min(t, rr):.1f} vs {max(t, rr):.1f} ms; "
        f"p95 threads {itl95['threads']:.1f} vs rr {itl95['rr']:.1f} ms{tail}; alone {a:.1f} / "
        f"{itl95['alone']:.1f} ms; CPU cores: {used}): {why}."
    )


def _cpus() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- the run


def second_spec(args: argparse.Namespace, first: str, tmp: Path) -> str:
    if args.second == "same":
        return first
    if args.second == "tiny":
        from mlxcel.daemon.models.tiny import make_tiny_model

        # SmolLM2-135M's shape (config.json): the same cost per token, random weights
        shape = {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "max_position_embeddings": 8192,
            "rope_theta": 100000.0,
            "tie_word_embeddings": True,
        }
        return str(make_tiny_model(tmp / "llama-135m-random", "llama", seed=1, **shape))
    return args.second


def main_run(args: argparse.Namespace) -> int:
    from mlxcel.daemon.engine.bridge import ENGINE_SWITCH_INTERVAL_S

    sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
    with tempfile.TemporaryDirectory(prefix="mlxcel-models-") as tmp:
        models = [load(args.model, "m1", args)]
        models.append(load(second_spec(args, args.model, Path(tmp)), "m2", args))
        return run_all(args, models)


def run_all(args: argparse.Namespace, models: list[Model]) -> int:
    names = [m.name for m in models]
    rng = random.Random(0)
    print(
        f"# one greedy stream per model: ~{args.prompt_tokens}-token prompt -> "
        f"{args.new_tokens} tokens; --parallel {args.parallel}; {args.rounds} rounds; "
        f"switch interval {sys.getswitchinterval() * 1000:.1f} ms; {_cpus()} CPUs",
        flush=True,
    )
    for m in models:  # warm-up: first-forward costs (allocation, kernel pools)
        prompt = make_prompt(m.tokenizer, rng, 64)
        s = Stream(m.name)
        submit(m, s, prompt, 8, f"warm-{m.name}")
        step_until_done([m.engine])
    runs: list[Run] = []
    for rnd in range(1, args.rounds + 1):
        order = MODES if rnd % 2 else MODES[::-1]
        for mode in order:
            # distinct prompts every round and mode: no prompt-cache hits
            prompts = {m.name: make_prompt(m.tokenizer, rng, args.prompt_tokens) for m in models}
            for r in run_mode(mode, models, prompts, args, rnd):
                runs.append(r)
                print(run_line(r), flush=True)
    summary(runs, args, names)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="the first model")
    p.add_argument(
        "--second",
        default="same",
        help="same (the first model loaded again), tiny (a random float32 llama of SmolLM2's "
        "shape: the float path, not the 4-bit one, so not the same cost) or a model spec",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--parallel", type=int, default=4, help="each engine's slots")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 3:
        p.error("--rounds >= 1 and --new-tokens >= 3")
    from mlxcel.daemon.forward.blas import ensure_fast_blas

    ensure_fast_blas()  # re-executes with the daemon's BLAS environment (as the daemon does)
    try:
        return main_run(args)
    except RuntimeError as exc:
        print(f"bench_models.py: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
