"""Constrained decoding benchmark: tok/s at 8 rows with and without a JSON schema, same run.

In process, on the default model (SmolLM2), through the real EngineBridge. Each phase sends 8
concurrent greedy requests (distinct chat prompts, `--new-tokens` new tokens, EOS ignored by
the free rows): free rows, rows under a JSON schema, and rows that ask for logprobs (the
log-softmax free rows skip). The constrained rows' schema asks for an array of at least 64
strings, so they also run to `--new-tokens`: every phase computes the same number of tokens.
It also prints the grammar's own cost: the time spent computing the llguidance masks per decode
step for 8 rows.

    python scripts/bench_constrained.py [--model NAME] [--rows 8] [--new-tokens 64] [--reps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 64},
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}
TOPICS = [
    "rivers",
    "mountains",
    "gardens",
    "planets",
    "oceans",
    "castles",
    "bridges",
    "forests",
    "islands",
    "markets",
]


def prompts(tokenizer: Any, n: int, rnd: random.Random) -> list[tuple[int, ...]]:
    out = []
    for i in range(n):
        topic = rnd.choice(TOPICS)
        text = f"Request {i}. List many {topic} as JSON with a title and items."
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        out.append(tuple(ids))
    return out


async def phase(
    bridge: Any, batch: list[tuple[int, ...]], new: int, schema: str | None, logprobs: bool = False
) -> float:
    """Aggregate tok/s of one batch of concurrent requests."""
    from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, json_schema=schema, logprobs=logprobs)
    tag = "json" if schema else "logp" if logprobs else "free"

    async def one(i: int, p: tuple[int, ...]) -> int:
        final = None
        request = GenerationRequest(f"{tag}-{i}-{time.monotonic_ns()}", p, new, sampling)
        async for out in bridge.submit(request):
            final = out
        assert final is not None and final.finish_reason == "length", final
        return final.completion_tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    return sum(counts) / (time.perf_counter() - start)


async def main_async(args: argparse.Namespace) -> None:
    from mlxcel.daemon.engine import constraints
    from mlxcel.daemon.process.daemon import load_engine
    from mlxcel.shared.config import ServingConfig

    mask_times: list[float] = []
    allowed = constraints.RowConstraint.allowed

    def timed(self: Any) -> Any:
        start = time.perf_counter()
        try:
            return allowed(self)
        finally:
            mask_times.append(time.perf_counter() - start)

    constraints.RowConstraint.allowed = timed  # type: ignore[method-assign]

    cfg = ServingConfig(parallel=args.rows, max_batch_prefill=args.rows)
    loaded, engine, bridge = load_engine(cfg, args.model)
    info = loaded.info
    print(f"model {info.name} ({info.dtype}, {info.backend}, blas {info.blas})", flush=True)
    bridge.start()
    rnd = random.Random(0)
    schema = json.dumps(SCHEMA)
    try:
        t0 = time.perf_counter()
        engine.grammars.compile(schema)  # the tokenizer and the schema, once, off the clock
        print(f"llguidance tokenizer + schema compile: {time.perf_counter() - t0:.2f} s")
        await phase(bridge, prompts(loaded.tokenizer, args.rows, rnd), 4, schema)  # warm-up
        free, constrained, with_logprobs = [], [], []
        for _ in range(args.reps):
            batch = prompts(loaded.tokenizer, args.rows, rnd)
            with_logprobs.append(await phase(bridge, batch, args.new_tokens, None, True))
            free.append(
                await phase(
                    bridge, prompts(loaded.tokenizer, args.rows, rnd), args.new_tokens, None
                )
            )
            mask_times.clear()
            batch = prompts(loaded.tokenizer, args.rows, rnd)
            constrained.append(await phase(bridge, batch, args.new_tokens, schema))
        steps = len(mask_times) / args.rows
        per_step = sum(mask_times) / max(steps, 1) * 1e3
        free_s, json_s = statistics.median(free), statistics.median(constrained)
        logp_s = statistics.median(with_logprobs)
        print(
            f"{args.rows} rows x {args.new_tokens} tokens: free {free_s:.1f} tok/s, "
            f"json_schema {json_s:.1f} tok/s ({json_s / free_s:.2f}x of free; "
            f"median of {args.reps})",
            flush=True,
        )
        print(
            f"{args.rows} greedy rows with logprobs: {logp_s:.1f} tok/s ({logp_s / free_s:.2f}x of "
            "free rows, which compute no log-softmax)",
            flush=True,
        )
        print(
            f"grammar masks: {per_step:.3f} ms per decode step for {args.rows} rows "
            f"(mean over {int(steps)} steps, vocabulary {engine.vocab_size})",
            flush=True,
        )
    finally:
        await bridge.shutdown(drain=False)


def main() -> None:
    from mlxcel.daemon.models.registry import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    from mlxcel.daemon.forward.blas import ensure_fast_blas

    ensure_fast_blas()  # as the daemon does: OpenBLAS for MLX's CPU matmuls when present
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
