"""Packed steps on the native decode and chunk steps, in a process with the daemon's BLAS
preload (tests/blas_process.py: run_with_fast_blas). Prints one JSON object: per step budget
the packed steps, the native calls (decode, chunk, right-padded chunks) and every request's
greedy tokens; and each request's tokens alone (tests/engine_checks.py: check_native_packed_run).

Usage: engine_packed_native.py MODEL_DIR BUDGETS (comma-separated step budgets)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the engine helpers

from engine_checks import alone, greedy, make_prompts
from engine_driver import Driver
from mlxcel.daemon.forward import native_decode
from mlxcel.daemon.models import load_model


def main(model_dir: str, budgets: str) -> None:
    model = load_model(model_dir)
    native = model.model.model._mlxcel_native
    if native._chunk is None:
        print(json.dumps({"available": False}))
        return
    calls = {"decode": 0, "chunk": 0, "right_padded": 0}
    step, chunk = native._step, native._chunk

    def counted_step(*args):
        calls["decode"] += 1
        return step(*args)

    def counted_chunk(*args):
        calls["chunk"] += 1
        return chunk(*args)

    native._step, native._chunk = counted_step, counted_chunk
    real = native_decode.NativeDecode.chunk

    def chunk_method(self, backbone, inputs, caches):
        padded = getattr(caches[0], "_right_padding", None) is not None
        out = real(self, backbone, inputs, caches)
        calls["right_padded"] += int(padded and out is not None)
        return out

    native_decode.NativeDecode.chunk = chunk_method
    prompts = make_prompts(8, seed=31, lo=24, hi=90)
    requests = [greedy(f"n{i}", p, 16) for i, p in enumerate(prompts)]
    result = {"available": True, "budgets": {}}
    for budget in map(int, budgets.split(",")):
        d = Driver(
            model, parallel=8, max_batch_prefill=4, prefill_chunk_size=budget, prompt_cache=False
        )
        before = dict(calls)
        # one request, then cohorts of 3 and 4 prompts of different lengths (right-padded
        # chunks) that prefill while the earlier ones decode
        for group in (requests[:1], requests[1:4], requests[4:]):
            d.add(*group)
            for _ in range(3):
                d.step()
        d.run()
        result["budgets"][budget] = {
            "packed_steps": d.engine.runner.num_packed_steps,
            "calls": {k: calls[k] - before[k] for k in calls},
            "tokens": d.tokens,
        }
    result["alone"] = alone(model, requests)
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
