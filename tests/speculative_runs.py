"""Engine runs with speculative decoding verifying every draft, for the speculation tests
(tests/integration/test_speculative.py, test_speculative_draft.py): `looping_prompt` (a prompt
with repeated stretches, where prompt lookup finds drafts), `engine_run` (requests through one
engine stepped here, speculation on or off, with a KV check after every step)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from engine_driver import Driver
from mlxcel.daemon.engine.speculative import SpecPolicy
from mlxcel.daemon.engine.types import GenerationRequest
from mlxcel.daemon.mlx_lm_compat import cache_index


def looping_prompt(seed: int, n: int = 40) -> tuple[int, ...]:
    """A prompt with repeated stretches: prompt lookup finds drafts in it."""
    rnd = random.Random(seed)
    motif = [rnd.randrange(1, 300) for _ in range(8)]
    tail = [rnd.randrange(1, 300) for _ in range(n - 24)]
    return tuple(motif + tail[:8] + motif + tail[8:] + motif)


def engine_run(
    model: Any,
    requests: list[GenerationRequest],
    spec: bool,
    late: list[GenerationRequest] = (),  # type: ignore[assignment]
    check_kv: bool = False,
    setup: Callable[[Driver], None] | None = None,
    check: Callable[[Any], None] | None = None,
    **config: Any,
) -> Driver:
    """Every request through one engine stepped here, speculation verifying every draft (or
    off); `late` requests join after a few steps. With `check_kv`, after every step each
    decoding row's cache holds exactly the tokens the row has fed. `setup` replaces the
    prompt-lookup policy with its own (a draft model's), `check` runs on the runner after
    every step."""
    cfg = {"parallel": 4, "max_batch_prefill": 4, "prompt_cache": False, **config}
    driver = Driver(model, **cfg)
    runner = driver.engine.runner
    runner.speculation = SpecPolicy("ngram", always=True) if spec else None
    if spec and setup is not None:
        setup(driver)
    driver.add(*requests)
    for _ in range(3):
        driver.step()
    driver.add(*late)
    for _ in range(5000):
        if not driver.engine.has_work:
            return driver
        driver.step()
        if check_kv:
            assert_kv_matches_tokens(runner)
        if check is not None:
            check(runner)
    raise AssertionError("the engine did not finish")


def assert_kv_matches_tokens(runner: Any) -> None:
    batch = runner._decode
    if not len(batch) or not batch.prompt_cache:
        return
    for cache in batch.prompt_cache:
        offsets = cache.offset.tolist()
        padding = cache.left_padding.tolist()
        for i, tokens in enumerate(batch.tokens):
            assert offsets[i] == len(tokens), "a row's cache holds other tokens than it fed"
            assert padding[i] + offsets[i] == cache_index(cache)
