"""The load generator: distinct prompts, closed-loop streaming clients, per-level figures."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench_lib.metrics import MetricsSampler

# Varied plain words, so prompts are not one token repeated (which tokenizers compress).
_WORD_TEXT = (
    "river mountain quiet engine harbor lantern orchard copper violet thunder meadow signal "
    "pencil window garden silver market winter candle forest bridge planet rhythm marble "
    "shadow captain ribbon velvet anchor desert island kitchen ladder mirror needle ocean "
    "pepper rocket saddle tunnel valley wagon yellow zephyr amber basket cactus dolphin "
    "falcon glacier hammer iceberg jungle kettle lemon magnet nectar opal parrot quartz "
    "raven salmon tiger umbrella vessel walnut anvil beacon cobalt drizzle ember fjord "
    "granite hollow ivory jasmine kernel lagoon mosaic nimbus oyster pillar quiver rustic "
    "summit timber urchin vortex willow yarrow zenith the of and to in is that it for on "
    "with as was at by from they we say her she or an will my one all would there their"
)
_WORDS = _WORD_TEXT.split()


class PromptFactory:
    """Distinct prompts of `prompt_tokens` tokens (counted with the tokenizer when given)."""

    def __init__(self, tokenizer: Any, args: argparse.Namespace) -> None:
        self.tokenizer = tokenizer
        self.prompt_tokens = args.prompt_tokens
        self.prefix = self._text(random.Random(-1), args.shared_prefix_tokens, "Shared notes.")
        self.count = 0

    def next(self) -> str:
        """The next distinct prompt: shared prefix, then text unique to this request."""
        self.count += 1
        head = f"Request {self.count}."
        return self.prefix + self._text(random.Random(self.count), self.prompt_tokens, head)

    def with_prefix(self, prefix_tokens: int, seed: int, tail_seed: int) -> str:
        """A prompt whose first `prefix_tokens` are shared by every call with this `seed`."""
        prefix = self._text(random.Random(10_000 + seed), prefix_tokens, f"Context {seed}.")
        tail = self._text(random.Random(20_000 + tail_seed), 32, f"Question {tail_seed}.")
        return prefix + tail

    def _text(self, rng: random.Random, num_tokens: int, head: str) -> str:
        if num_tokens <= 0:
            return ""
        words = [head]
        if self.tokenizer is None:  # about one token per common word
            words += [rng.choice(_WORDS) for _ in range(max(num_tokens - 3, 1))]
            return " ".join(words) + "\n"
        while True:
            words += [rng.choice(_WORDS) for _ in range(num_tokens)]
            ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False)
            if len(ids) >= num_tokens:
                return self.tokenizer.decode(ids[:num_tokens]) + "\n"


@dataclass(frozen=True)
class ServerTarget:
    name: str
    url: str
    eos_mode: str  # ignore_eos | logit_bias | none
    eos_ids: list[int]
    model: str = "default_model"


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class LevelResult:
    server: str
    clients: int
    ok: int
    fail: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    ttft_mean_s: float | None
    ttft_p95_s: float | None
    itl_mean_ms: float | None
    itl_p95_ms: float | None
    tokens_per_request: float | None
    prompt_tokens_mean: float | None
    cached_tokens_mean: float | None
    errors: list[str] = field(default_factory=list)
    metrics: dict[str, float] | None = None
    # every inter-token gap of every good request: percentiles and the tail, in ms
    itl_gaps: dict[str, float] = field(default_factory=dict)
    # --against-llama: the workload ("decode@1" ...) and round; "" / 0 in the other modes
    workload: str = ""
    round: int = 0
    # time per output token after the first, per request (first content chunk to last, over
    # the tokens after the first, from the usage the server reports), averaged: the ITL above
    # is per content chunk, and a chunk may carry several tokens (speculative decoding)
    tpot_mean_ms: float | None = None


GAP_PERCENTILES = (50, 90, 95, 97, 99)
GAP_OVER_MS = (100, 120, 200, 500)


def gap_distribution(gaps: list[float]) -> dict[str, float]:
    """Inter-token gaps (seconds) as {"n", "p50".."p99", "max", "over_100ms"..} in ms/counts."""
    if not gaps:
        return {}
    out: dict[str, float] = {"n": float(len(gaps))}
    for q in GAP_PERCENTILES:
        out[f"p{q}"] = 1000 * (percentile(gaps, q) or 0.0)
    out["max"] = 1000 * max(gaps)
    for ms in GAP_OVER_MS:
        out[f"over_{ms}ms"] = float(sum(g > ms / 1000 for g in gaps))
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def request_body(target: ServerTarget, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.eos_mode == "ignore_eos":
        body["ignore_eos"] = True
    elif target.eos_mode == "logit_bias" and target.eos_ids:
        body["logit_bias"] = {str(i): -100.0 for i in target.eos_ids}
    return body


async def sse_chunks(resp: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI-style event stream, up to `data: [DONE]`."""
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def stream_request(
    session: aiohttp.ClientSession, target: ServerTarget, prompt: str, max_tokens: int
) -> RequestResult:
    """One streamed chat completion; TTFT and the gaps between content chunks."""
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last: float | None = None
    chunks = 0
    try:
        url = f"{target.url}/v1/chat/completions"
        async with session.post(url, json=request_body(target, prompt, max_tokens)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for chunk in sse_chunks(resp):
                if chunk.get("error"):
                    result.error = str(chunk["error"])[:200]
                    return result
                _read_usage(chunk, result)
                if any(_delta_text(c) for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.gaps_s.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.output_tokens = result.output_tokens or chunks
    result.ok = result.ttft_s is not None
    if not result.ok:
        result.error = "no content streamed"
    return result


def _delta_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning") or "")


def _read_usage(chunk: dict[str, Any], result: RequestResult) -> None:
    usage = chunk.get("usage")
    if not usage:
        return
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    result.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


def _session(args: argparse.Namespace) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # A fresh connection per request, for every server alike: llama-server closes idle
    # keep-alive connections, and a request written into one fails ("Can not write request
    # body") before the server sees it; a new connection costs ~0.1 ms on loopback.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


async def run_level(
    target: ServerTarget,
    prompts: PromptFactory,
    clients: int,
    per_client: int,
    max_tokens: int,
    args: argparse.Namespace,
) -> LevelResult:
    """`clients` closed-loop clients, `per_client` requests each; the figures of the level."""
    work = [[prompts.next() for _ in range(per_client)] for _ in range(clients)]
    async with _session(args) as session:
        sampler = MetricsSampler(session, target.url) if args.metrics else None
        if sampler:
            await sampler.start()

        async def client(texts: list[str]) -> list[RequestResult]:
            return [await stream_request(session, target, t, max_tokens) for t in texts]

        start = time.perf_counter()
        per_client_results = await asyncio.gather(*(client(texts) for texts in work))
        wall = time.perf_counter() - start
        metrics = await sampler.stop() if sampler else None
    results = [r for rs in per_client_results for r in rs]
    return summarize(target.name, clients, results, wall, metrics)


def summarize(
    server: str,
    clients: int,
    results: list[RequestResult],
    wall_s: float,
    metrics: dict[str, float] | None,
) -> LevelResult:
    good = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    gaps = [g for r in good for g in r.gaps_s]
    out = sum(r.output_tokens for r in good)
    prompt = [float(r.prompt_tokens) for r in good if r.prompt_tokens is not None]
    cached = [float(r.cached_tokens) for r in good if r.cached_tokens is not None]
    itl_p95 = percentile(gaps, 95)
    tpots = [
        sum(r.gaps_s) / (r.output_tokens - 1) for r in good if r.output_tokens > 1 and r.gaps_s
    ]
    return LevelResult(
        server=server,
        clients=clients,
        ok=len(good),
        fail=len(results) - len(good),
        wall_s=wall_s,
        output_tokens=out,
        output_tok_s=out / wall_s if wall_s > 0 else 0.0,
        ttft_mean_s=_mean(ttfts),
        ttft_p95_s=percentile(ttfts, 95),
        itl_mean_ms=None if not gaps else 1000 * sum(gaps) / len(gaps),
        itl_p95_ms=None if itl_p95 is None else 1000 * itl_p95,
        tokens_per_request=out / len(good) if good else None,
        prompt_tokens_mean=_mean(prompt),
        cached_tokens_mean=_mean(cached),
        errors=[r.error for r in results if r.error][:5],
        metrics=metrics,
        itl_gaps=gap_distribution(gaps),
        tpot_mean_ms=None if not tpots else 1000 * sum(tpots) / len(tpots),
    )


async def run_cache_probe(
    target: ServerTarget, prompts: PromptFactory, pairs: int, args: argparse.Namespace
) -> dict[str, float]:
    """One client: a cold prompt, then one sharing its prefix; mean TTFT of each kind."""
    prefix_tokens = args.shared_prefix_tokens or 200
    cold: list[float] = []
    warm: list[float] = []
    async with _session(args) as session:
        for i in range(pairs):
            seed = 1_000_000 + i  # never used by the levels
            first = prompts.with_prefix(prefix_tokens, seed, 2 * i)
            second = prompts.with_prefix(prefix_tokens, seed, 2 * i + 1)
            a = await stream_request(session, target, first, 1)
            b = await stream_request(session, target, second, 1)
            if not (a.ok and b.ok) or a.ttft_s is None or b.ttft_s is None:
                raise RuntimeError(f"{target.name}: cache probe failed: {a.error or b.error}")
            cold.append(a.ttft_s)
            warm.append(b.ttft_s)
    cold_mean, warm_mean = sum(cold) / pairs, sum(warm) / pairs
    return {
        "prefix_tokens": prefix_tokens,
        "cold_ttft_mean_s": cold_mean,
        "warm_ttft_mean_s": warm_mean,
        "warm_over_cold": warm_mean / cold_mean,
    }
