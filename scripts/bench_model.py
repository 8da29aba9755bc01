#!/usr/bin/env python
"""Prefill and decode speed of one model, with and without the OpenBLAS fast path.

    python scripts/bench_model.py [--model smollm2-135m-instruct] [--prompt-tokens 256]
                                  [--decode-tokens 32] [--modes openblas,reference]

Each mode runs in its own child process (a BLAS preload only works from process start); the
parent prints one line per mode. Prefill is one forward pass over the whole prompt (batch 1),
decode is greedy single-token steps on that cache, both after a short warm-up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

MODES = ("openblas", "reference")


def _child(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlxcel.daemon.models import load_model

    start = time.perf_counter()
    loaded = load_model(args.model, args.dtype)
    load_s = time.perf_counter() - start
    model = loaded.model
    vocab = model.args.vocab_size
    prompt = mx.random.randint(100, vocab, (1, args.prompt_tokens), key=mx.random.key(0))

    warm = make_prompt_cache(model)  # warm-up: allocations, first-call overheads
    mx.eval(model(prompt[:, :16], cache=warm))

    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    prefill_s = time.perf_counter() - start

    token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
    start = time.perf_counter()
    for _ in range(args.decode_tokens):
        token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
        mx.eval(token)
    decode_s = time.perf_counter() - start
    result = {
        "blas": loaded.info.blas,
        "dtype": loaded.info.dtype,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_tok_s": args.prompt_tokens / prefill_s,
        "decode_tok_s": args.decode_tokens / decode_s,
        "decode_ms_per_token": 1000 * decode_s / args.decode_tokens,
    }
    print(json.dumps(result))


def _run_mode(mode: str, args: argparse.Namespace) -> dict[str, float | str] | None:
    from mlxcel.daemon.forward.blas import fast_blas_env, find_system_openblas, slow_blas_env

    if mode == "openblas" and find_system_openblas() is None:
        print("openblas : no system OpenBLAS found, skipped", file=sys.stderr)
        return None
    env = fast_blas_env() if mode == "openblas" else slow_blas_env()
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        print(f"{mode}: failed\n{proc.stderr}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--modes", default=",".join(MODES), help="comma list: openblas,reference")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return 0
    print(
        f"model {args.model}, prompt {args.prompt_tokens} tokens, "
        f"decode {args.decode_tokens} tokens (batch 1)"
    )
    failed = False
    for mode in args.modes.split(","):
        r = _run_mode(mode.strip(), args)
        if r is None:
            failed = True
            continue
        print(
            f"{mode:<9}: blas={r['blas']} dtype={r['dtype']} load {r['load_s']:.1f}s | "
            f"prefill {r['prefill_s']:.2f}s = {r['prefill_tok_s']:.0f} tok/s | "
            f"decode {r['decode_tok_s']:.1f} tok/s ({r['decode_ms_per_token']:.0f} ms/token)",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
