"""In-process engine benchmark on the default model (SmolLM2) through the real EngineBridge.

Prints aggregate output tok/s and TTFT mean/p95 with 1, 4, 8 and 16 concurrent requests
(distinct ~256-token chat prompts, 64 new tokens, EOS ignored), then the TTFT of a request
whose 200-token prefix is cached against a cold one. Targets (docs/benchmarks.md): aggregate at 8
>= 4x the single-request figure; shared-prefix TTFT <= 1/4 of cold.

    python scripts/bench_engine.py [--model NAME] [--levels 1,4,8,16] [--parallel 16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

_TEXT = """river mountain quiet engine garden silver morning paper window orange market winter
signal letter music forest bridge castle planet ocean yellow simple travel doctor kitchen
mirror summer pocket island shadow number animal circle battery"""
WORDS = _TEXT.split()


def make_prompt(tokenizer: Any, rnd: random.Random, target: int) -> tuple[int, ...]:
    """A distinct chat prompt of about `target` tokens."""
    words: list[str] = []
    while True:
        words += rnd.choices(WORDS, k=8)
        text = "Summarize these notes: " + " ".join(words)
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        if len(ids) >= target:
            return tuple(ids)


async def one(bridge: Any, request: Any) -> tuple[float, int, float]:
    """(ttft_s, tokens, duration_s) of one request."""
    from mlxcel.daemon.engine.types import TokenOutput

    start = time.perf_counter()
    ttft = None
    final: TokenOutput | None = None
    async for out in bridge.submit(request):
        if ttft is None:
            ttft = time.perf_counter() - start
        final = out
    assert final is not None and final.finish_reason == "length", final
    return ttft or 0.0, final.completion_tokens, time.perf_counter() - start


async def level(bridge: Any, prompts: list[tuple[int, ...]], new_tokens: int, tag: str) -> dict:
    from mlxcel.daemon.engine.types import GREEDY, GenerationRequest

    requests = [
        GenerationRequest(f"{tag}-{i}", p, new_tokens, GREEDY) for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*(one(bridge, r) for r in requests))
    wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    return {
        "n": len(prompts),
        "tok_s": sum(r[1] for r in results) / wall,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "wall": wall,
    }


async def shared_prefix(bridge: Any, tokenizer: Any, rnd: random.Random, reps: int) -> dict:
    """Median TTFT, alone, of cold prompts vs prompts whose first 200 tokens are cached."""
    from mlxcel.daemon.engine.types import GREEDY, GenerationRequest

    base = make_prompt(tokenizer, rnd, 256)
    prefix = base[:200]
    await one(bridge, GenerationRequest("warm", base, 4, GREEDY))
    cold, hit = [], []
    for i in range(reps):
        cold_prompt = make_prompt(tokenizer, rnd, 256)
        ttft, _, _ = await one(bridge, GenerationRequest(f"cold-{i}", cold_prompt, 4, GREEDY))
        cold.append(ttft)
        suffix = make_prompt(tokenizer, rnd, 60)[-56:]
        ttft, _, _ = await one(bridge, GenerationRequest(f"hit-{i}", prefix + suffix, 4, GREEDY))
        hit.append(ttft)
    return {"cold": statistics.median(cold), "hit": statistics.median(hit)}


async def main_async(args: argparse.Namespace) -> None:
    from mlxcel.daemon.engine.bridge import EngineBridge
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.models import load_model
    from mlxcel.shared.config import ServingConfig

    loaded = load_model(args.model)
    info = loaded.info
    print(f"model {info.name} ({info.dtype}, {info.backend}, blas {info.blas})", flush=True)
    cfg = ServingConfig(parallel=args.parallel, prefill_chunk_size=args.chunk)
    engine = Engine(loaded.model, cfg, info.can_batch, info.batch_reason, info.context_length)
    bridge = EngineBridge(engine)
    bridge.start()
    rnd = random.Random(0)
    tokenizer = loaded.tokenizer
    try:
        warm = [make_prompt(tokenizer, rnd, 64)]
        await level(bridge, warm, 4, "warmup")
        rows = []
        for n in args.levels:
            prompts = [make_prompt(tokenizer, rnd, args.prompt_tokens) for _ in range(n)]
            row = await level(bridge, prompts, args.new_tokens, f"c{n}")
            rows.append(row)
            print(
                f"concurrency {n:>2}: {row['tok_s']:6.1f} tok/s aggregate, TTFT mean "
                f"{row['ttft_mean']:5.2f} s, p95 {row['ttft_p95']:5.2f} s "
                f"(wall {row['wall']:5.1f} s)",
                flush=True,
            )
        by_n = {r["n"]: r for r in rows}
        if 1 in by_n and 8 in by_n:
            ratio = by_n[8]["tok_s"] / by_n[1]["tok_s"]
            print(f"aggregate at 8 / at 1: {ratio:.2f}x (target >= 4x)", flush=True)
        sp = await shared_prefix(bridge, tokenizer, rnd, args.reps)
        print(
            f"shared 200-token prefix: TTFT {sp['hit']:.3f} s vs cold {sp['cold']:.3f} s "
            f"= {sp['hit'] / sp['cold']:.2f} of cold (target <= 0.25)",
            flush=True,
        )
        snap = bridge.snapshot()
        c = snap.counters
        occupancy = c.decode_rows / max(c.decode_steps, 1)
        padding = c.prefill_padded_tokens / max(c.prefill_tokens, 1)
        print(
            f"engine: {c.steps} steps, decode occupancy {occupancy:.1f} rows/step, prefill "
            f"padding {padding:.2f}x, prompt cache hits {snap.prompt_cache.hits}"
            f"/{snap.prompt_cache.lookups}"
        )
    finally:
        await bridge.shutdown(drain=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    from mlxcel.daemon.forward.blas import ensure_fast_blas

    ensure_fast_blas()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
