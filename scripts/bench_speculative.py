#!/usr/bin/env python
"""Speculative decoding by prompt lookup (issue #29): tok/s with speculation on and off, on
three workloads at 1, 4 and 8 clients, interleaved in one run.

Two daemons on the same model (default: the pulled SmolLM2, `--parallel 8`), both up for the
whole run, each with its own MLXCEL_HOME and MLXCEL_SOCKET in a temp dir, on 127.0.0.1:

  on   the default daemon (--speculative ngram)
  off  the same with --speculative off

Workloads (greedy chat completions, temperature 0, streamed; every client sends its requests
one after the other; the same prompts, in the same order, on both daemons):

  rewrite    a ~430-token Python file (embedded below) with "rename X to Y, reply with the full
             code only" after it: the answer copies the prompt, the case prompt lookup is for
             (--max-tokens, 400)
  summarise  a ~380-token pasted passage with "Summarise the passage above ..." (--max-tokens)
  chat       short open questions (--chat-max-tokens, 200): little to look up

Phases:

  0  the check by hand: one rewrite request on each daemon; the `on` answer's first lines are
     printed, with how many of the source's lines it copies and whether on and off agree.
  1  rounds: for each round, each workload, each level (--levels, clients at once; --requests,
     requests per level), `on` and `off` back to back, their order swapped every round so
     drift on this shared machine falls on both alike. Each level prints a line per daemon
     (tok/s = completion tokens / the level's wall, the client's mean inter-token latency =
     a request's (last token - first token) / (tokens - 1), TTFT) and a profile line from the
     daemon's own figures over the level (/metrics and snapshot deltas: engine steps and ms
     per step, decode steps x rows, engine ITL, daemon CPU; for `on` the verification steps
     and their share of the decode steps, drafted / accepted tokens, acceptance ratio, tokens
     per row in a verification step and per decode row-step overall).
  2  summary per (workload, level): best round (each daemon's best tok/s) and the median of the
     rounds (each daemon's median tok/s; the ratio: the median of the rounds' paired on/off
     ratios). The targets use the median when --rounds >= 3, else the best round.

Targets (this machine, SmolLM2-135M, CPU): rewrite at 1 client on/off >= 2.0x; chat at 8
clients on/off >= 0.95x (the policy must switch itself off where speculation does not pay).
Also printed: the break-even point per workload (the most clients at which on/off >= 1.0, and
where the ratio crosses 1.0 by linear interpolation), the engine's own estimate where its
snapshot has one, and the equality check: greedy speculation is exact, so the rewrite answers
at 1 client must be identical on and off ("identical: yes/no"; the other levels' counts are
informational: a batch's float sums may differ with its composition). Errors in either
daemon's log are counted at the end. Timing targets live here, never in pass/fail tests.

  python scripts/bench_speculative.py [--rounds 3] [--levels 1,4,8] [--requests 1:2,4:4,8:8]
                                      [--workloads rewrite,summarise,chat] [--model DIR]
  python scripts/bench_speculative.py --quick    # ~3 minutes: 1 round, levels 1 and 8,
                                                 # rewrite and chat
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.client import sse_chunks
from bench_lib.metrics import parse_metrics
from bench_lib.servers import (
    Server,
    launch_daemon,
    served_model,
    shown_env,
    stop_server,
    wait_healthy,
)

REWRITE_TARGET = 2.0  # rewrite at 1 client: on/off tok/s at least
CHAT_TARGET = 0.95  # chat at 8 clients: on/off tok/s at least
DAEMONS = {"on": ["--speculative", "ngram"], "off": ["--speculative", "off"]}
WORKLOAD_NAMES = ("rewrite", "summarise", "chat")

# ---------------------------------------------------------------- the workloads

CODE = '''import time
from collections import OrderedDict


class TTLCache:
    """A least-recently-used cache whose entries expire after `ttl` seconds."""

    def __init__(self, capacity, ttl):
        self.capacity = capacity
        self.ttl = ttl
        self.items = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        entry = self.items.get(key)
        if entry is None:
            self.misses += 1
            return default
        value, stamp = entry
        if time.monotonic() - stamp > self.ttl:
            del self.items[key]
            self.misses += 1
            return default
        self.items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key, value):
        if key in self.items:
            self.items.move_to_end(key)
        self.items[key] = (value, time.monotonic())
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def remove_expired(self):
        now = time.monotonic()
        stale = [k for k, (_, stamp) in self.items.items() if now - stamp > self.ttl]
        for key in stale:
            del self.items[key]
        return len(stale)

    def hit_rate(self):
        total = self.hits + self.misses
        if total == 0:
            return 0.0
        return self.hits / total

    def __len__(self):
        return len(self.items)

    def __contains__(self, key):
        entry = self.items.get(key)
        return entry is not None and time.monotonic() - entry[1] <= self.ttl
'''

# SmolLM2-135M copies the file (48 of its 54 lines, the rename done) with this system prompt and
# the instruction after the code; before the code, or without the system prompt, it explains
# the code instead or drops methods.
EDITOR_SYSTEM = (
    "You are a careful code editor. You output the complete edited file, copying every "
    "unchanged line exactly, and nothing else."
)
RENAMES = (  # (kind, old, new): one per request, distinct over a level
    ("method", "hit_rate", "hit_ratio"),
    ("method", "remove_expired", "purge_expired"),
    ("method", "put", "store"),
    ("method", "get", "lookup"),
    ("class", "TTLCache", "ExpiringCache"),
    ("method", "hit_rate", "success_rate"),
    ("method", "remove_expired", "drop_stale"),
    ("method", "put", "insert"),
    ("method", "get", "fetch"),
    ("class", "TTLCache", "TimedCache"),
)

PASSAGE = """For most of the nineteenth century the lighthouse keeper's job changed less than the \
lamps he tended. A keeper and usually one or two assistants lived at the station, often with \
their families, and divided the night into watches. Every evening before sunset they trimmed \
the wicks, polished the brass and the great glass lens, and wound the clockwork that turned \
it; through the night they climbed the tower every few hours to wind it again and to check \
that the flame burned clean and steady. A smoking lamp blackened the lens within an hour, and \
a stopped clockwork turned a flashing light into a fixed one, which a passing captain could \
mistake for another station altogether.

The work was lonely and exact. Keepers kept a log of the weather, the ships that passed and \
the oil they burned, and inspectors arrived without warning to check the log against the \
stores. A station on a rock far from the coast might see a supply boat once a fortnight in \
summer and not at all for weeks in a winter storm, so keepers learned to ration food, fresh \
water and lamp oil, and to mend whatever broke with whatever they had.

Three changes ended the old routine. Kerosene replaced whale and colza oil, and later \
pressurised vapour burners gave a brighter flame that needed less trimming. Electric lamps \
and motors, arriving first at stations near towns, removed the clockwork and most of the \
nightly climbing. Finally, in the second half of the twentieth century, automatic lamp \
changers, remote monitoring by radio and solar panels made the resident keeper unnecessary. \
By the end of the century almost every lighthouse in Europe and North America had been \
automated. Many of the keepers' cottages became museums or holiday lets, and the logs they \
kept are now read by historians of climate and of shipping, who find in them a daily record \
of weather and traffic that no other source preserves.
"""
SUMMARY_ASKS = (
    "Summarise the passage above in a few paragraphs.",
    "Summarise the passage above for a school newsletter.",
    "Summarise the passage above in plain words.",
    "Summarise the passage above, keeping the main changes in order.",
    "Summarise the passage above for someone who has never seen a lighthouse.",
    "Summarise the passage above in one paragraph.",
    "Summarise the passage above and say what the keepers' logs are used for today.",
    "Summarise the passage above in the words of a keeper's child.",
)

CHAT_QUESTIONS = (
    "What makes a good city park?",
    "How do bees find their way back to the hive?",
    "Why is the sky blue?",
    "What should I pack for a week of hiking?",
    "Can you explain how a bicycle stays upright?",
    "What are some good habits for learning a new language?",
    "Why do cats purr?",
    "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?",
    "Give me three ideas for a rainy Sunday afternoon.",
    "How do volcanoes form?",
    "What makes bread rise?",
    "Why do leaves change colour in autumn?",
    "How can I sleep better?",
    "What is a black hole?",
    "Tell me about the history of the printing press.",
)

Messages = list[dict[str, str]]


def rewrite_messages(i: int) -> Messages:
    kind, old, new = RENAMES[i % len(RENAMES)]
    ask = f"Rename the {kind} `{old}` to `{new}`. Reply with the full code only."
    return [
        {"role": "system", "content": EDITOR_SYSTEM},
        {"role": "user", "content": f"```python\n{CODE}```\n\n{ask}"},
    ]


def summarise_messages(i: int) -> Messages:
    return [{"role": "user", "content": f"{PASSAGE}\n{SUMMARY_ASKS[i % len(SUMMARY_ASKS)]}"}]


def chat_messages(i: int) -> Messages:
    return [{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}]


@dataclass(frozen=True)
class Workload:
    name: str
    messages: Callable[[int], Messages]
    max_tokens: int


def workloads(args: argparse.Namespace) -> list[Workload]:
    table = {
        "rewrite": Workload("rewrite", rewrite_messages, args.max_tokens),
        "summarise": Workload("summarise", summarise_messages, args.max_tokens),
        "chat": Workload("chat", chat_messages, args.chat_max_tokens),
    }
    return [table[name] for name in args.workloads]


# ---------------------------------------------------------------- the client


@dataclass
class Answer:
    """One streamed chat completion: its text and timing."""

    ok: bool = False
    error: str | None = None
    text: str = ""
    ttft_s: float | None = None
    first: float | None = None  # perf_counter of the first content chunk
    last: float | None = None
    tokens: int = 0  # completion tokens (usage; the content chunks where it is missing)
    finish: str | None = None

    @property
    def itl_s(self) -> float | None:
        """The mean spacing of this answer's tokens (a verification step streams several)."""
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


async def stream_chat(
    session: aiohttp.ClientSession, url: str, model: str, messages: Messages, max_tokens: int
) -> Answer:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer, chunks, parts = Answer(), 0, []
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                answer.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return answer
            async for chunk in sse_chunks(resp):
                if chunk.get("error"):
                    answer.error = str(chunk["error"])[:200]
                    return answer
                usage = chunk.get("usage")
                if usage:
                    answer.tokens = int(usage.get("completion_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    answer.finish = choice.get("finish_reason") or answer.finish
                    text = (choice.get("delta") or {}).get("content") or ""
                    if not text:
                        continue
                    now = time.perf_counter()
                    if answer.first is None:
                        answer.first, answer.ttft_s = now, now - start
                    answer.last = now
                    parts.append(text)
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:200]
        return answer
    answer.text = "".join(parts)
    answer.tokens = answer.tokens or chunks
    answer.ok = answer.first is not None
    if not answer.ok:
        answer.error = "no content streamed"
    return answer


def session_for(args: argparse.Namespace) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a fresh connection each
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


# ---------------------------------------------------------------- the daemons' figures


def _total(samples: dict, name: str) -> float | None:
    """The sum of a sample over its label sets; None when /metrics has no such sample."""
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


METRICS = {  # Sample field -> /metrics sample name
    "generation": "mlxcel_generation_tokens_total",
    "cpu_s": "mlxcel_process_cpu_seconds_total",
    "itl_sum": "mlxcel_inter_token_latency_seconds_sum",
    "itl_count": "mlxcel_inter_token_latency_seconds_count",
    "spec_steps": "mlxcel_speculative_steps_total",
    "spec_drafted": "mlxcel_speculative_draft_tokens_total",
    "spec_accepted": "mlxcel_speculative_accepted_tokens_total",
    "spec_acceptance_gauge": "mlxcel_speculative_acceptance_ratio",
    "spec_tokens_per_step_gauge": "mlxcel_speculative_tokens_per_step",
}
SNAPSHOT = ("steps", "decode_steps", "decode_rows", "spec_rows")  # engine snapshot counters


@dataclass
class Sample:
    """One read of a daemon's /metrics and engine snapshot counters (None: not exposed)."""

    t: float
    values: dict[str, float | None] = field(default_factory=dict)

    def delta(self, other: Sample, key: str) -> float | None:
        a, b = self.values.get(key), other.values.get(key)
        return None if a is None or b is None else b - a


class Daemon:
    """One started daemon: its HTTP server, /metrics and control-socket reads."""

    def __init__(self, name: str, server: Server, socket_path: Path) -> None:
        self.name = name
        self.server = server
        self.socket_path = socket_path
        self.model = "default_model"

    async def snapshot(self) -> dict[str, Any]:
        """The engine snapshot over the control socket ({} when it does not answer)."""
        from mlxcel.shared.control_client import ControlClient

        try:
            async with ControlClient(self.socket_path) as client:
                return dict(await client.call("status", timeout=10) or {})
        except Exception as exc:  # a figure missing from the profile, not a failed run
            print(f"# {self.name}: no snapshot ({type(exc).__name__}: {exc})", flush=True)
            return {}

    async def sample(self, session: aiohttp.ClientSession) -> Sample:
        async with session.get(f"{self.server.url}/metrics") as resp:
            m = parse_metrics(await resp.text())
        s = Sample(time.perf_counter(), {k: _total(m, name) for k, name in METRICS.items()})
        counters = ((await self.snapshot()).get("engine") or {}).get("counters") or {}
        for key in SNAPSHOT:
            value = counters.get(key)
            s.values[key] = float(value) if isinstance(value, (int, float)) else None
        return s


def start_daemon(name: str, extra: list[str], args: argparse.Namespace, tmp: Path) -> Daemon:
    server, socket_path = launch_daemon(name, extra, args, tmp)
    return Daemon(name, server, socket_path)


# ---------------------------------------------------------------- one level


@dataclass
class Level:
    daemon: str
    workload: str
    clients: int
    round: int
    answers: dict[int, Answer] = field(default_factory=dict)  # request index -> answer
    wall_s: float = 0.0
    start: Sample | None = None
    end: Sample | None = None

    @property
    def good(self) -> list[Answer]:
        return [a for a in self.answers.values() if a.ok]

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.good)

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s > 0 and self.good else None

    @property
    def itl_ms(self) -> float | None:
        itls = [a.itl_s for a in self.good if a.itl_s is not None]
        return 1000 * statistics.mean(itls) if itls else None

    @property
    def ttft_s(self) -> float | None:
        ttfts = [a.ttft_s for a in self.good if a.ttft_s is not None]
        return statistics.mean(ttfts) if ttfts else None

    @property
    def errors(self) -> list[str]:
        return [a.error or "?" for a in self.answers.values() if not a.ok]

    def d(self, key: str) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.start.delta(self.end, key)


async def run_level(
    daemon: Daemon, wl: Workload, clients: int, total: int, rnd: int, args: argparse.Namespace
) -> Level:
    """`clients` clients at once, `total` requests among them (each client's one after the
    other); request i gets the workload's prompt i, so both daemons get the same work."""
    level = Level(daemon.name, wl.name, clients, rnd)
    per_client = [list(range(c, total, clients)) for c in range(clients)]
    async with session_for(args) as session:
        level.start = await daemon.sample(session)

        async def client(indices: list[int]) -> None:
            for i in indices:
                level.answers[i] = await stream_chat(
                    session, daemon.server.url, daemon.model, wl.messages(i), wl.max_tokens
                )

        start = time.perf_counter()
        await asyncio.gather(*(client(ix) for ix in per_client if ix))
        level.wall_s = time.perf_counter() - start
        level.end = await daemon.sample(session)
    return level


# ---------------------------------------------------------------- printing


def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def level_line(lv: Level) -> str:
    line = (
        f"r{lv.round} {lv.workload:<9} @{lv.clients:<2} {lv.daemon:>3}: "
        f"{_f(lv.tok_s, '{:6.1f}')} tok/s ({lv.tokens} tok in {lv.wall_s:.1f} s, "
        f"{len(lv.good)} req), ITL mean {_f(lv.itl_ms, '{:.1f}')} ms, TTFT mean "
        f"{_f(lv.ttft_s, '{:.2f}')} s"
    )
    if lv.errors:
        line += f"  {len(lv.errors)} errors, e.g. {lv.errors[0]!r}"
    return line


def spec_figures(lv: Level) -> dict[str, float | None]:
    steps, dsteps = lv.d("spec_steps"), lv.d("decode_steps")
    drafted, accepted, rows = lv.d("spec_drafted"), lv.d("spec_accepted"), lv.d("spec_rows")
    return {
        "steps": steps,
        "share": _div(steps, dsteps),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": _div(accepted, drafted),
        "per_row_step": _div(None if rows is None or accepted is None else rows + accepted, rows),
        "overall": _div(lv.d("generation"), lv.d("decode_rows")),
    }


def profile_line(lv: Level) -> str:
    if lv.start is None or lv.end is None:
        return f"profile {lv.daemon}: n/a"
    wall = lv.end.t - lv.start.t
    steps, dsteps, drows = lv.d("steps"), lv.d("decode_steps"), lv.d("decode_rows")
    gen, cpu = lv.d("generation"), lv.d("cpu_s")
    itl = _div(lv.d("itl_sum"), lv.d("itl_count"))
    s = spec_figures(lv)
    spec = (
        f"; speculation: {_f(s['steps'], '{:.0f}')} verification steps "
        f"({_pct(s['share'])} of decode steps), "
        f"{_f(s['drafted'], '{:.0f}')} drafted / {_f(s['accepted'], '{:.0f}')} accepted "
        f"({_pct(s['acceptance'])}), "
        f"{_f(s['per_row_step'], '{:.2f}')} tok per row in a verification step"
        if lv.daemon == "on"
        else ""
    )
    return (
        f"  profile {lv.daemon}: {wall:.1f} s, {_f(steps, '{:.0f}')} engine steps "
        f"({_f(None if not steps else 1000 * wall / steps, '{:.1f}')} ms/step), "
        f"{_f(dsteps, '{:.0f}')} decode steps x {_f(_div(drows, dsteps), '{:.2f}')} rows, "
        f"generated {_f(gen, '{:.0f}')} tok ({_f(s['overall'], '{:.2f}')} per decode row-step), "
        f"engine ITL mean {_f(None if itl is None else 1000 * itl, '{:.1f}')} ms, daemon CPU "
        f"{_f(_div(cpu, wall), '{:.2f}')} cores{spec}"
    )


def _clients(n: int) -> str:
    return f"{n} client{'s' if n != 1 else ''}"


def verdict(value: float | None, target: float) -> str:
    return "n/a" if value is None else ("met" if value >= target else "missed")


@dataclass
class Cell:
    """One (workload, level) over the rounds."""

    workload: str
    clients: int
    on: list[Level]
    off: list[Level]

    def tok_s(self, name: str) -> list[float]:
        return [x for lv in getattr(self, name) if (x := lv.tok_s) is not None]

    def ratios(self) -> list[float]:
        offs = {lv.round: lv.tok_s for lv in self.off}
        return [
            lv.tok_s / offs[lv.round]
            for lv in self.on
            if lv.tok_s is not None and offs.get(lv.round)
        ]

    def best(self) -> float | None:
        on, off = self.tok_s("on"), self.tok_s("off")
        return max(on) / max(off) if on and off else None

    def median(self) -> float | None:
        r = self.ratios()
        return statistics.median(r) if r else None

    def chosen(self, rounds: int) -> float | None:
        return self.median() if rounds >= 3 else self.best()


def cells(levels: list[Level]) -> list[Cell]:
    out: dict[tuple[str, int], Cell] = {}
    for lv in levels:
        cell = out.setdefault((lv.workload, lv.clients), Cell(lv.workload, lv.clients, [], []))
        getattr(cell, lv.daemon).append(lv)
    return list(out.values())


def _sum(levels: list[Level], key: str) -> float | None:
    values = [v for lv in levels if (v := lv.d(key)) is not None]
    return sum(values) if values else None


def find_break_even(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """Any snapshot field whose name says break-even (the engine's own estimate)."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            if "break_even" in str(k).lower() or "breakeven" in str(k).lower():
                found.append((p, v))
            found += find_break_even(v, p)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += find_break_even(v, f"{path}[{i}]")
    return found


def first_difference(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at char {n}: on {a[n : n + 40]!r} vs off {b[n : n + 40]!r}"


def equality(levels: list[Level], args: argparse.Namespace) -> None:
    print("\noutput equality (greedy speculation is exact: on and off must answer alike):")
    for cell in cells(levels):
        offs = {lv.round: lv for lv in cell.off}
        same = total = 0
        diffs: list[str] = []
        for on in cell.on:
            off = offs.get(on.round)
            if off is None:
                continue
            for i, a in sorted(on.answers.items()):
                b = off.answers.get(i)
                if not (a.ok and b is not None and b.ok):
                    continue
                total += 1
                if a.text == b.text:
                    same += 1
                elif len(diffs) < 2:
                    diffs.append(
                        f"r{on.round} request {i} ({a.tokens} vs {b.tokens} tok): "
                        f"{first_difference(a.text, b.text)}"
                    )
        head = f"  {cell.workload:<9} @{cell.clients:<2} {same}/{total} answers identical"
        if cell.workload == "rewrite" and cell.clients == 1:
            head += f"  -> identical: {'yes' if total and same == total else 'no'}"
        elif cell.clients > 1:
            head += " (informational: batched rows)"
        print(head)
        for d in diffs:
            print(f"      {d}")
    if not any(c.workload == "rewrite" and c.clients == 1 for c in cells(levels)):
        print("  (no rewrite level at 1 client in this run: identical: n/a)")


def summary(levels: list[Level], args: argparse.Namespace, snapshot: dict[str, Any]) -> None:
    use = "median of the rounds" if args.rounds >= 3 else "best round"
    print(
        f"\nsummary over {args.rounds} round(s): tok/s best / median per daemon; on/off best "
        f"(best on / best off) and median (of the rounds' paired ratios); the targets and the "
        f"break-even use the {use}"
    )
    print(
        "  workload  clients   on tok/s best/med   off tok/s best/med  on/off best   med   "
        "ITL on/off ms  verif. steps  accepted  tok/row-step"
    )
    all_cells = cells(levels)
    for c in all_cells:
        on, off = c.tok_s("on"), c.tok_s("off")
        itl_on = [x for lv in c.on if (x := lv.itl_ms) is not None]
        itl_off = [x for lv in c.off if (x := lv.itl_ms) is not None]
        drafted, accepted = _sum(c.on, "spec_drafted"), _sum(c.on, "spec_accepted")
        rows = _sum(c.on, "spec_rows")
        steps = _sum(c.on, "spec_steps")
        per_row = _div(None if rows is None or accepted is None else rows + accepted, rows)
        acc = _div(accepted, drafted)

        def bm(xs: list[float]) -> str:
            return f"{max(xs):6.1f} /{statistics.median(xs):6.1f}" if xs else "   n/a /   n/a"

        print(
            f"  {c.workload:<9} {c.clients:>4}   {bm(on):>18}   {bm(off):>18}  "
            f"{_f(c.best(), '{:6.2f}x'):>7} {_f(c.median(), '{:6.2f}x'):>7}  "
            f"{_f(statistics.median(itl_on) if itl_on else None, '{:5.1f}')} / "
            f"{_f(statistics.median(itl_off) if itl_off else None, '{:5.1f}')}   "
            f"{_f(steps, '{:10.0f}'):>10}  {_pct(acc):>8}  {_f(per_row, '{:8.2f}'):>8}"
        )

    def pick(workload: str, clients: int) -> Cell | None:
        return next((c for c in all_cells if c.workload == workload and c.clients == clients), None)

    print(f"\ntargets ({use}):")
    for workload, clients, target in (("rewrite", 1, REWRITE_TARGET), ("chat", 8, CHAT_TARGET)):
        cell = pick(workload, clients)
        ratio = cell.chosen(args.rounds) if cell else None
        extra = "" if cell else " (not measured in this run)"
        print(
            f"  {workload} at {_clients(clients)}: on/off "
            f"{_f(ratio, '{:.3f}x')}, target >= {target}x: {verdict(ratio, target)}{extra}"
        )

    print(f"\nbreak-even (the most clients at which on/off >= 1.0, {use}):")
    for workload in args.workloads:
        row = sorted((c for c in all_cells if c.workload == workload), key=lambda c: c.clients)
        pairs = [(c.clients, c.chosen(args.rounds)) for c in row]
        shown = ", ".join(f"{n}: {_f(r, '{:.3f}x')}" for n, r in pairs)
        paying = [n for n, r in pairs if r is not None and r >= 1.0]
        if not paying:
            text = f"none (below 1.0 from {_clients(pairs[0][0])} on)" if pairs else "n/a"
        elif paying[-1] == pairs[-1][0]:
            text = f">= {_clients(paying[-1])} (the most measured)"
        else:
            text = _clients(paying[-1])
        notes = []
        for (n1, r1), (n2, r2) in itertools.pairwise(pairs):
            if r1 is not None and r2 is not None and r1 >= 1.0 > r2:
                at = n1 + (n2 - n1) * (r1 - 1.0) / (r1 - r2)
                notes.append(f"first falls below 1.0 at ~{at:.1f} clients (linear)")
                break
        idle = [c.clients for c in row if not _sum(c.on, "spec_steps")]
        if idle:
            notes.append(
                f"no verification step at {', '.join(map(str, idle))} client(s): both daemons "
                "decoded alike there, the ratio is noise"
            )
        print(f"  {workload:<9} {text}  ({shown}){''.join(f'; {n}' for n in notes)}")
    estimates = find_break_even(snapshot)
    if estimates:
        print("  engine's own estimate: " + ", ".join(f"{p} = {v}" for p, v in estimates))
    else:
        print("  engine's own estimate: not exposed (no break-even field in the `on` snapshot)")

    equality(levels, args)

    steps = _sum([lv for lv in levels if lv.daemon == "on"], "spec_steps")
    if steps is None:
        print("\n! the `on` daemon's /metrics has no mlxcel_speculative_steps_total")
    elif steps == 0:
        print("\n! speculation never engaged: 0 verification steps on the `on` daemon")
    off_steps = _sum([lv for lv in levels if lv.daemon == "off"], "spec_steps")
    if off_steps:
        print(f"\n! the `off` daemon ran {off_steps:.0f} verification steps")


# ---------------------------------------------------------------- the run


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def copied_lines(text: str) -> str:
    want = [line for line in CODE.splitlines() if line.strip()]
    got = set(text.splitlines())
    return f"{sum(line in got for line in want)} of the source's {len(want)} non-blank lines"


async def check_by_hand(daemons: dict[str, Daemon], args: argparse.Namespace) -> None:
    """Phase 0: one rewrite request on each daemon; the `on` answer's first lines."""
    messages = rewrite_messages(0)
    answers = {}
    async with session_for(args) as session:
        for name, d in daemons.items():
            answers[name] = a = await stream_chat(
                session, d.server.url, d.model, messages, args.max_tokens
            )
            if not a.ok:
                raise RuntimeError(f"{name}: the first rewrite request failed: {a.error}")
    on, off = answers["on"], answers["off"]
    _, old, new = RENAMES[0]
    agree = "identical" if on.text == off.text else "DIFFER: " + first_difference(on.text, off.text)
    print(
        f"# rewrite check ({RENAMES[0][0]} {old} -> {new}): on {on.tokens} tok "
        f"(finish {on.finish}), {copied_lines(on.text)}, `{new}` "
        f"{'present' if new in on.text else 'missing'}, `def {old}` "
        f"{'still there' if f'def {old}(' in on.text else 'gone'}; on and off "
        f"{agree}"
    )
    lines = on.text.splitlines()
    for line in lines[: args.show_lines]:
        print(f"#   | {line}")
    if len(lines) > args.show_lines:
        print(f"#   | ... ({len(lines) - args.show_lines} more lines)")
    if on.text != off.text:
        diff = difflib.unified_diff(
            on.text.splitlines(), off.text.splitlines(), "on", "off", lineterm="", n=0
        )
        for line in list(diff)[:12]:
            print(f"#   diff {line}")


def log_problems(daemons: dict[str, Daemon]) -> None:
    """Each daemon's error and warning count, and its first error with its traceback."""
    for d in daemons.values():
        try:
            lines = d.server.log_path.read_text(errors="replace").splitlines()
        except OSError:
            print(f"# {d.name} log: unreadable")
            continue
        bad = [i for i, line in enumerate(lines) if " ERROR " in line or " CRITICAL " in line]
        warn = [i for i, line in enumerate(lines) if " WARNING " in line]
        print(f"# {d.name} log: {len(bad)} errors, {len(warn)} warnings ({len(lines)} lines)")
        if bad:  # the first error and what follows it up to the next log record
            first = bad[0]
            block = [lines[first]]
            for line in lines[first + 1 : first + 60]:
                if line[:4].isdigit() and line[4:5] == "-":  # "2026-..." starts a new record
                    break
                block.append(line)
            for line in block:
                print(f"#   {line[:300]}")
            for i in bad[1:4]:
                print(f"#   (later) {lines[i][:300]}")
        elif warn:
            for i in warn[:3]:
                print(f"#   {lines[i][:300]}")


def keep_logs(daemons: dict[str, Daemon], folder: Path | None) -> None:
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for d in daemons.values():
        with contextlib.suppress(OSError):
            shutil.copy2(d.server.log_path, folder / f"{d.name}.log")
    print(f"# daemon logs kept in {folder}")


async def run(args: argparse.Namespace, tmp: Path, started: list[Daemon]) -> int:
    daemons: dict[str, Daemon] = {}
    for name, extra in DAEMONS.items():
        daemons[name] = d = start_daemon(name, extra, args, tmp)
        started.append(d)
    try:
        await asyncio.gather(
            *(wait_healthy(d.server, args.startup_timeout) for d in daemons.values())
        )
        for d in daemons.values():
            d.model = await served_model(d.server.url, "mlxcel")
            mode = ((await d.snapshot()).get("engine") or {}).get("config", {}).get("speculative")
            print(
                f"# {d.name}: pid {d.server.proc.pid}, engine speculative={mode}; "
                f"{shown_env(d.server)} {' '.join(d.server.argv)}",
                flush=True,
            )
        await check_by_hand(daemons, args)
        wls = workloads(args)
        print(
            f"# workloads {', '.join(f'{w.name} ({w.max_tokens} max tokens)' for w in wls)}; "
            f"levels {', '.join(f'{n} clients x {args.requests[n]} req' for n in args.levels)}; "
            f"--parallel {args.parallel}; {args.rounds} round(s); load average {_loadavg()}",
            flush=True,
        )
        levels: list[Level] = []
        t0 = time.perf_counter()
        for rnd in range(1, args.rounds + 1):
            order = list(daemons) if rnd % 2 else list(daemons)[::-1]
            for wl in wls:
                for clients in args.levels:
                    for name in order:
                        lv = await run_level(
                            daemons[name], wl, clients, args.requests[clients], rnd, args
                        )
                        levels.append(lv)
                        print(level_line(lv), flush=True)
                        print(profile_line(lv), flush=True)
                        await asyncio.sleep(0.5)
        print(
            f"# rounds took {time.perf_counter() - t0:.0f} s; load average now {_loadavg()} "
            f"(other work shares these CPUs)",
            flush=True,
        )
        snapshot = await daemons["on"].snapshot()
        counters = (snapshot.get("engine") or {}).get("counters") or {}
        spec = {k: v for k, v in counters.items() if str(k).startswith("spec_")}
        print(f"# `on` snapshot counters at the end: {spec}", flush=True)
        summary(levels, args, snapshot)
        print()
        log_problems(daemons)
    finally:
        for d in daemons.values():
            stop_server(d.server)
        keep_logs(daemons, args.keep_logs)
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="model directory (default: the pulled SmolLM2)")
    p.add_argument("--parallel", type=int, default=8, help="decode slots (default 8)")
    p.add_argument("--rounds", type=int, help="rounds (default 3; --quick: 1)")
    p.add_argument("--levels", help="clients at once, comma-separated (default 1,4,8)")
    p.add_argument(
        "--requests",
        default="1:2,4:4,8:8",
        help="requests per level, CLIENTS:N,... (default 1:2,4:4,8:8; a level not named: one "
        "request per client)",
    )
    p.add_argument(
        "--workloads",
        help=f"comma-separated, of {','.join(WORKLOAD_NAMES)} (default all; --quick: rewrite,chat)",
    )
    p.add_argument("--max-tokens", type=int, default=400, help="rewrite, summarise (400)")
    p.add_argument("--chat-max-tokens", type=int, default=200, help="chat (200)")
    p.add_argument("--quick", action="store_true", help="1 round, levels 1 and 8, rewrite, chat")
    p.add_argument("--show-lines", type=int, default=12, help="lines of the check answer shown")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--keep-logs", type=Path, help="copy the daemons' logs to this folder")
    p.add_argument(
        "--daemon-arg", action="append", default=[], help="extra mlxcel-daemon start argument"
    )
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.levels = _ints(args.levels) if args.levels else ([1, 8] if args.quick else [1, 4, 8])
    names = args.workloads or ("rewrite,chat" if args.quick else ",".join(WORKLOAD_NAMES))
    args.workloads = [w.strip() for w in names.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOAD_NAMES]
    if bad or not args.workloads:
        p.error(f"--workloads: unknown {bad}; use {','.join(WORKLOAD_NAMES)}")
    try:
        given = dict(tuple(int(x) for x in item.split(":")) for item in args.requests.split(","))
    except ValueError:
        p.error("--requests CLIENTS:N,... (e.g. 1:2,4:4,8:8)")
    args.requests = {n: given.get(n, n) for n in args.levels}
    if min([args.rounds, *args.levels, *args.requests.values()]) < 1:
        p.error("--rounds, --levels and --requests must be >= 1")
    if max(args.levels) > args.parallel:
        print(f"# note: {max(args.levels)} clients > --parallel {args.parallel}: some queue")
    if args.model is None:
        from bench_serving import default_smollm2

        args.model = default_smollm2()[0]
    if args.model is None or not Path(args.model).is_dir():
        p.error("--model DIR (default: the pulled SmolLM2; run `mlxcel-daemon models pull`)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started: list[Daemon] = []
    with contextlib.suppress(KeyboardInterrupt):
        with tempfile.TemporaryDirectory(prefix="mlxcel-spec-") as tmp:
            try:
                return asyncio.run(run(args, Path(tmp), started))
            except RuntimeError as exc:
                print(f"bench_speculative.py: error: {exc}", file=sys.stderr)
                return 1
            finally:  # whatever ended the run (Ctrl-C too): stop the daemons by pid
                for d in started:
                    with contextlib.suppress(Exception):
                        stop_server(d.server)
    return 130


if __name__ == "__main__":
    sys.exit(main())
