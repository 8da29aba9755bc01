"""A real object of each owner in daemon/mlx_lm_compat.py's `PRIVATE_NAMES` (instance
attributes exist only on one): `SAMPLES` maps each owner to a builder taking the test's
`request` (the GenerationBatch and the TokenizerWrapper need the tiny model's fixtures);
`resolve` imports the module or class an owner names. Used by the tests of the seam,
tests/unit/test_mlx_lm_compat.py and tests/integration/test_mlx_lm_compat.py."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

import pytest


def resolve(owner: str) -> Any:
    """The module or class `owner` ("mlx_lm.models.cache.BatchKVCache") names."""
    parts = owner.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(owner)


def generation_batch(request: pytest.FixtureRequest) -> Any:
    """A one-row GenerationBatch on the tiny llama, one `next()` in (its steps ran)."""
    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch, StopSequences
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.sample_utils import greedy_sampler

    model = request.getfixturevalue("tiny").model
    caches = [BatchKVCache([0]) for _ in model.layers]
    batch = GenerationBatch(
        model, [0], mx.array([3]), caches, [[1, 2]], [None], greedy_sampler, [[]],
        [StopSequences([])], [4],
    )  # fmt: skip
    batch.next()
    return batch


def batch_kv_cache(request: pytest.FixtureRequest) -> Any:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = BatchKVCache([1, 0])
    cache.update_and_fetch(mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)))
    return cache


def rope(kind: str) -> Callable[[pytest.FixtureRequest], Any]:
    scaling = {
        "longrope": {
            "rope_type": "longrope",
            "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
        },
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    }[kind]

    def build(request: pytest.FixtureRequest) -> Any:
        from mlx_lm.models.rope_utils import initialize_rope

        return initialize_rope(8, 10000.0, False, scaling, max_position_embeddings=64)

    return build


def tokenizer_wrapper(request: pytest.FixtureRequest) -> Any:
    from mlx_lm.tokenizer_utils import load

    return load(request.getfixturevalue("tiny_model_dir"))


# A real object of each owner in PRIVATE_NAMES: instance attributes exist only on one.
SAMPLES: dict[str, Callable[[pytest.FixtureRequest], Any]] = {
    "mlx_lm.utils": lambda request: resolve("mlx_lm.utils"),
    "mlx_lm.generate.GenerationBatch": generation_batch,
    "mlx_lm.models.cache.BatchKVCache": batch_kv_cache,
    "mlx_lm.models.rope_utils.SuScaledRoPE": rope("longrope"),
    "mlx_lm.models.rope_utils.YarnRoPE": rope("yarn"),
    "mlx_lm.tokenizer_utils.TokenizerWrapper": tokenizer_wrapper,
}
