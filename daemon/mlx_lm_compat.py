"""mlx-lm behind one seam: the only module that spells mlx-lm's private names.

mlx-lm has no stable API under its batch machinery, caches and loaders: the engine overrides
`GenerationBatch._step`, shifts `BatchKVCache._idx`, and the loader calls `_get_classes` and
`_download`. Each such name is spelled here and nowhere else, behind a small function (plain
attribute access: the decode step calls several per layer), and listed in `PRIVATE_NAMES`.
`tests/unit/test_mlx_lm_compat.py` checks that the installed mlx-lm still has every one
(by name when one is gone) and that no other product module uses a private mlx-lm name.

The mlx-lm versions the suite runs on are `MLX_LM_FLOOR` up to (not including)
`MLX_LM_CEILING`; pyproject.toml's requirement is that range (`MLX_LM_RANGE`, checked by the
test), and `untested_version_warning` is the line the daemon logs at start outside it.

Importing this module imports neither mlx nor mlx-lm (platform_check reads the range before
anything imports mlx; the engine's policy modules stay plain Python).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.models.base import BaseModelArgs

MLX_LM_FLOOR = (0, 32, 2)  # the oldest tested release (platform_check refuses older ones)
MLX_LM_CEILING = (0, 33)  # the next minor release: untested, its private names may differ
MLX_LM_RANGE = f">={'.'.join(map(str, MLX_LM_FLOOR))},<{'.'.join(map(str, MLX_LM_CEILING))}"

# Every private mlx-lm name the product uses, by owner (a module, or a class whose instances
# carry it). The owner's public API is not listed: mlx-lm keeps that across releases.
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "mlx_lm.utils": ("_get_classes", "_download"),
    # RowBatch (engine/runner.py) replaces the one-token step through `GenerationStep`
    "mlx_lm.generate.GenerationBatch": (
        "_step",
        "_current_tokens",
        "_current_logprobs",
        "_next_tokens",
        "_next_logprobs",
        "_token_context",
        "_num_tokens",
        "_matchers",
    ),
    "mlx_lm.models.cache.BatchKVCache": ("_idx", "_right_padding"),
    "mlx_lm.models.rope_utils.SuScaledRoPE": ("_scale", "_freqs"),
    "mlx_lm.models.rope_utils.YarnRoPE": ("_freqs",),
    "mlx_lm.tokenizer_utils.TokenizerWrapper": ("_tokenizer",),
}


# --- loading (mlx_lm.utils) ---


def get_model_classes(
    config: dict[str, Any],
) -> tuple[type[nn.Module], type[BaseModelArgs]]:
    """(model class, model-args class) of mlx-lm's module for `config`'s `model_type`
    (`mlx_lm.utils._get_classes`; raises as it does for an unknown family)."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def download(repo: str) -> Path:
    """The local snapshot of Hugging Face repo `repo`, fetched as `mlx_lm.load` fetches it
    (`mlx_lm.utils._download`; raises huggingface_hub's errors)."""
    from mlx_lm.utils import _download

    return _download(repo)


# --- BatchKVCache ---


def cache_index(cache: Any) -> int:
    """A `BatchKVCache`'s written columns (`_idx`): every row's keys end there."""
    return cache._idx


def shift_cache_index(cache: Any, by: int) -> None:
    """Move a `BatchKVCache`'s end of written columns by `by` (after dropping columns)."""
    cache._idx += by


def append_columns(cache: Any, keys: Any, values: Any) -> None:
    """`BatchKVCache.update_and_fetch(keys, values)` without its return value: where the
    buffers have room, the same two slice updates and offset, minus the two slices of every
    written column it builds to return (the native steps never read them: ~0.15 ms a decode
    step over SmolLM2's 30 layers); else the cache's own method (it grows the buffers)."""
    prev, new = cache._idx, keys.shape[2]
    if cache.keys is None or prev + new > cache.keys.shape[2]:
        cache.update_and_fetch(keys, values)
        return
    cache.offset = cache.offset + new
    cache._idx = prev + new
    cache.keys[..., prev : prev + new, :] = keys
    cache.values[..., prev : prev + new, :] = values


def right_padding(cache: Any) -> Any:
    """The right padding a `BatchKVCache.prepare(right_padding=)` left for `finalize()` to
    roll (an mx.array), or None when there is none."""
    return cache._right_padding


SMALL_GROWTH_STEP = 64  # columns a batch cache under mlx-lm's step (256) grows by


def growth_step(columns: int) -> int:
    """The columns a batch cache of `columns` grows by: 64 while it is under mlx-lm's step
    (256), that step from there on. A short request's rows then hold at most 63 unused
    columns, not 255 (8 rows of 111 tokens of a qwen3-1.7B shape: 234 MB of KV, not 469); the
    extra growths copy caches that are still small."""
    from mlx_lm.models.cache import BatchKVCache

    return SMALL_GROWTH_STEP if columns < BatchKVCache.step else BatchKVCache.step


def fit_growth_step(caches: Sequence[Any], new_columns: int = 1) -> None:
    """Set each batch cache's `step` (mlx-lm's growth in `update_and_fetch`) for the size it
    grows from, when writing `new_columns` more would grow it."""
    if not caches:
        return
    first = caches[0]
    keys = getattr(first, "keys", None)
    if keys is None or not hasattr(first, "_idx"):
        return
    size = keys.shape[2]
    if first._idx + new_columns <= size:
        return
    step = growth_step(size)
    if first.step != step:
        for c in caches:
            c.step = step


def row_fits(caches: Sequence[Any], others: Sequence[Any], other_row: int) -> bool:
    """Whether row `other_row` of `others` (a batch's `BatchKVCache`s, per layer) can take a row
    of `caches` in place (`place_row`): the same layout in every layer, no right padding left
    to roll, and no longer than `caches`' written columns."""
    if not caches or len(caches) != len(others):
        return False
    for c, o in zip(caches, others, strict=True):
        if c.keys is None or o.keys is None or c.keys.dtype != o.keys.dtype:
            return False
        if c.keys.shape[1] != o.keys.shape[1] or c.keys.shape[3] != o.keys.shape[3]:
            return False
        if o._right_padding is not None or o._idx != others[0]._idx or c._idx != caches[0]._idx:
            return False
    first = others[0]  # every layer's rows are padded alike
    length = first._idx - int(first.left_padding[other_row].item())
    return 0 < length <= caches[0]._idx


def place_row(caches: Sequence[Any], row: int, others: Sequence[Any], other_row: int) -> None:
    """Write row `other_row` of `others` into row `row` of `caches` (per layer; a row whose
    sequence left), ending at `caches`' written columns like every row: left-padded by the
    columns it does not fill, its offset its own. Each slice is updated in place when nothing
    else holds the arrays: one row's keys and values copied, not the whole batch's
    (`BatchKVCache.extend`). The caller checked `row_fits`."""
    import mlx.core as mx

    first = others[0]
    start = int(first.left_padding[other_row].item())
    end = caches[0]._idx
    begin = end - (first._idx - start)
    at = mx.arange(caches[0].left_padding.shape[0]) == row
    src = slice(other_row, other_row + 1)
    for c, o in zip(caches, others, strict=True):
        c.keys[row : row + 1, :, begin:end, :] = o.keys[src, :, start : o._idx]
        c.values[row : row + 1, :, begin:end, :] = o.values[src, :, start : o._idx]
        c.left_padding = mx.where(at, begin, c.left_padding)
        c.offset = mx.where(at, o.offset[other_row], c.offset)


def merge_with_room(caches: Sequence[Any], room: int) -> Any:
    """`BatchKVCache.merge(caches)` (one row per `KVCache`, left-padded to the longest) with
    room for `room` more columns, in whole `step`s: the rows' next `room` tokens are written
    in place instead of growing the cache, which copies all of it."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    lengths = [c.size() for c in caches]
    longest = max(lengths)
    if longest == 0:
        empty = BatchKVCache([0] * len(caches))
        empty.step = growth_step(room)  # its first write allocates
        return empty
    ref = next(c for c in caches if c.keys is not None)
    step = growth_step(longest + max(room, 0))
    columns = (longest + max(room, 0) + step - 1) // step * step
    shape = (len(caches), ref.keys.shape[1], columns)
    keys = mx.zeros((*shape, ref.keys.shape[3]), dtype=ref.keys.dtype)
    values = mx.zeros((*shape, ref.values.shape[3]), dtype=ref.values.dtype)
    padding = [longest - n for n in lengths]
    for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
        if c.keys is not None:
            keys[i : i + 1, :, p : p + c.offset] = c.keys[..., : c.offset, :]
            values[i : i + 1, :, p : p + c.offset] = c.values[..., : c.offset, :]
    cache = BatchKVCache(padding)
    cache.keys, cache.values = keys, values
    cache.offset += longest
    cache._idx = longest
    return cache


# --- RoPE modules (mlx_lm.models.rope_utils) ---


def rope_frequencies(rope: Any) -> Any:
    """The frequencies a YarnRoPE or SuScaledRoPE rotates with (`_freqs`)."""
    return rope._freqs


def longrope_scale(rope: Any) -> float:
    """The factor a SuScaledRoPE (longrope) multiplies its input by before rotating."""
    return float(rope._scale)


# --- tokenizer (mlx_lm.tokenizer_utils) ---


def wrapped_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper`, or `tokenizer` itself
    when it is not a wrapper."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


# --- GenerationBatch ---


class GenerationStep:
    """Mixin for a subclass of mlx-lm's `GenerationBatch` (first in its bases) that replaces
    the one-token step with `decode_step()`.

    `GenerationBatch.next()` (and `__init__`, for rows) calls the private `_step()`, which
    returns (each row's token, each row's logprobs) of the forward queued by the previous
    step and queues the next one. Its pipeline state is private: `_next_tokens` /
    `_next_logprobs` (sampled by the last forward: this step's inputs), `_current_tokens` /
    `_current_logprobs` (what this step returns) and `_token_context` (a `TokenBuffer` per
    row, the logits processors' context). `decode_step()` reaches them only through the
    methods below; `extend` and `filter` (mlx-lm's) keep them per row.
    """

    # GenerationBatch's, declared for the type checker (annotations only: nothing at run time)
    _next_tokens: Any
    _next_logprobs: list[Any]
    _token_context: list[Any]
    _num_tokens: list[int]
    _matchers: list[Any]

    def _step(self) -> tuple[list[int], list[Any]]:
        return self.decode_step()

    def decode_step(self) -> tuple[list[int], list[Any]]:
        """One step (mlx-lm's own unless a subclass overrides it)."""
        return super()._step()  # type: ignore[misc]

    def step_rows(self) -> tuple[list[int], list[Any]]:
        """One step as `next()` takes it (`_step`): each row's token and logprobs of the
        forward queued by the previous step; the next forward queued."""
        return self._step()

    def begin_step(self) -> tuple[Any, list[Any]]:
        """Start a step: the tokens (and their logprobs) the last forward sampled become the
        current ones, the step's inputs; returns (inputs, their logprobs)."""
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        return self._current_tokens, self._current_logprobs

    def queue_next(self, tokens: Any, logprobs: list[Any]) -> None:
        """The tokens (and logprobs) this step's forward samples: the next step's inputs."""
        self._next_tokens = tokens
        self._next_logprobs = logprobs

    def token_context(self, row: int) -> Any:
        """Row `row`'s `TokenBuffer`: `update_and_fetch(token)` gives its processors' context."""
        return self._token_context[row]

    def pending_inputs(self) -> tuple[Any, list[Any]]:
        """The tokens (and logprobs) the last forward sampled, not yet fed: the next step's
        inputs (`_next_tokens`)."""
        return self._next_tokens, self._next_logprobs

    def generated_counts(self) -> list[int]:
        """Tokens each row has returned so far (`_num_tokens`, which `next()` compares with
        its max_tokens); a step that returns several tokens of a row adds them here."""
        return self._num_tokens

    def stop_matcher(self, row: int) -> Any:
        """Row `row`'s stop-sequence matcher (`_matchers`; `advance(token)` is True on a stop)."""
        return self._matchers[row]

    def take_row(self, row: int, other: GenerationStep, other_row: int) -> None:
        """Row `row`'s state (GenerationBatch's per-row lists and pipeline state) replaced by
        `other`'s row `other_row`, whose pending input becomes row `row`'s. The caches are the
        caller's (`place_row`)."""
        import mlx.core as mx

        for name in _ROW_STATE:
            getattr(self, name)[row] = getattr(other, name)[other_row]
        at = mx.arange(self._next_tokens.shape[0]) == row
        self._next_tokens = mx.where(at, other._next_tokens[other_row], self._next_tokens)


# GenerationBatch's lists with an entry per row (public, then private)
_ROW_STATE = (
    "uids",
    "tokens",
    "samplers",
    "logits_processors",
    "max_tokens",
    "stop_sequences",
    "_next_logprobs",
    "_token_context",
    "_num_tokens",
    "_matchers",
)


# --- versions ---


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of `version` ("0.33.0rc1" -> (0, 33, 0))."""
    parts = []
    for piece in version.split(".")[:3]:
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def installed_mlx_lm() -> str | None:
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return None


def untested_version_warning(version: str | None = None) -> str | None:
    """One line when mlx-lm `version` (default: the installed one) is outside the tested
    range, else None (also when mlx-lm is not installed: platform_check says so)."""
    version = installed_mlx_lm() if version is None else version
    if version is None:
        return None
    release = _release(version)
    if MLX_LM_FLOOR <= release < MLX_LM_CEILING:
        return None
    return (
        f"mlx-lm {version} is outside the tested range {MLX_LM_RANGE}; serving may break: "
        f"pin mlx-lm to that range (pip install 'mlx-lm{MLX_LM_RANGE}')"
    )
