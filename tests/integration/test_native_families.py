"""More families on the fused forward and the native steps (fast_forward.py, native_decode.py,
native/fused_ops.c): llama with rope scaling (linear, llama3, yarn), mistral, qwen3 (q/k norms),
phi3 (fused projections, longrope), gemma2 (post norms, GELU, soft-capped scores) give mlx-lm's
own forward on tiny random-weight models, batched and left-padded, with the native decode step
installed and running every step; a family they do not cover keeps mlx-lm's forward and the log
names it and why. The models are tests/family_models.py's; their prefill chunks through the
native chunk step (a process with the daemon's BLAS preload) are
tests/e2e/test_native_families_chunk.py's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from family_models import ATOL, FAMILIES, GEMMA, make_family_dirs
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlxcel.daemon.forward import forward_plan, native_decode, native_ops
from mlxcel.daemon.forward.fast_forward import FusedAttention, is_fast
from mlxcel.daemon.forward.packed_forward import PackedForward
from mlxcel.daemon.models import load_model
from mlxcel.daemon.models.tiny import make_tiny_model
from native_quant_checks import counted_calls
from platform_marks import cpu_only

pytestmark = [
    cpu_only,
    pytest.mark.skipif(native_ops.path() is None, reason="native ops library not built"),
]
STEPS = 32


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_family_dirs(tmp_path_factory.mktemp("families"))


def _pair(path: Path, native: bool = True) -> tuple[Any, Any]:
    """(mlx-lm's own model, ours through load_model: the fused forward, and the native steps
    when `native`)."""
    stock, _ = mlx_lm.load(str(path))
    ours = load_model(str(path)).model
    assert is_fast(ours) and not is_fast(stock)
    assert native_decode.is_installed(ours) == native, "native decode step installed or not"
    return stock, ours


def _close(a: mx.array, b: mx.array) -> None:
    diff = mx.abs(a - b).max().item()
    assert diff <= ATOL, f"max |diff| {diff}"


ROWS = [list(range(3, 40)), [40, 41, 42, 43, 44], [7, 9] * 9]


@pytest.mark.parametrize("prefill", ["mlx", "native-ops"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_decode_matches_mlx_lm_batched_and_left_padded(
    name: str, prefill: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rows of different lengths, left-padded: the prefill (fused MLX ops, or with the
    native RMSNorm / RoPE kernels at these sizes) and 32 greedy decode steps through the C step
    give mlx-lm's logits and tokens."""
    if prefill == "native-ops":
        monkeypatch.setattr(native_ops, "NATIVE_ELEMENTWISE_MIN", 256)
    pair = _pair(model_dirs[name])
    calls = counted_calls(pair[1].model._mlxcel_native, "_step")
    longest = max(len(r) for r in ROWS)
    padding = [longest - len(r) for r in ROWS]
    inputs = mx.array([[0] * p + r for p, r in zip(padding, ROWS, strict=True)])
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
    logits = [m(inputs, cache=c) for m, c in zip(pair, caches, strict=True)]
    keep = (mx.arange(longest)[None] >= mx.array(padding)[:, None])[..., None]
    _close(logits[0] * keep, logits[1] * keep)  # the padding positions hold nothing read
    last = [out[:, -1, :] for out in logits]
    tokens = [[], []]
    for _ in range(STEPS):
        _close(*last)
        step = [mx.argmax(x, axis=-1)[:, None] for x in last]
        for seen, token in zip(tokens, step, strict=True):
            seen.append(token)
        assert mx.array_equal(*step).item()
        last = [m(step[0], cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    _close(*last)
    assert calls[0] == STEPS  # every decode step ran in C
    generated = mx.concatenate(tokens[0], axis=1)
    assert len({tuple(r) for r in generated.tolist()}) == len(ROWS)  # distinct text per row


@pytest.mark.parametrize("name", list(GEMMA))
def test_gemma_matches_mlx_lm(name: str, model_dirs: dict[str, Path], caplog: Any) -> None:
    """gemma2 on the C decode step (its post-attention and post-MLP norms, GELU MLP, soft-capped
    scores and scaled embedding in C: every decode step runs there), gemma3 through the fused
    MLX modules (its sliding-window layers: the log says why not the C steps): a prefill past
    the sliding window and 32 greedy steps give mlx-lm's logits and tokens, on mlx-lm's own
    caches (gemma3: rotating ones for its local layers) and batched on BatchKVCaches
    (left-padded rows; the windows from the mask)."""
    caplog.set_level(logging.INFO, logger="mlxcel.daemon.forward.native_decode")
    on_c = name.startswith("gemma2")
    pair = _pair(model_dirs[name], native=on_c)
    if not on_c:
        family = GEMMA[name]["model_type"]
        assert f"native decode step: not in use ({family}: the C steps" in caplog.text
    attn = pair[1].layers[0].self_attn
    assert (attn.softcap is not None) == name.startswith("gemma2")
    tables = [layer.self_attn._rope_table for layer in pair[1].layers]
    assert None not in tables  # gemma3: one table for its local layers, one for its global
    assert len({id(t) for t in tables}) == (2 if name == "gemma3" else 1)
    for batched in (False, True) if name != "gemma2" else (False,):
        calls = counted_calls(pair[1].model._mlxcel_native, "_step") if on_c else [0]
        rows = ROWS if batched else ROWS[:1]
        longest = max(len(r) for r in rows)
        padding = [longest - len(r) for r in rows]
        inputs = mx.array([[0] * p + r for p, r in zip(padding, rows, strict=True)])
        if batched or on_c:  # the C step takes BatchKVCaches
            caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
        else:
            caches = [make_prompt_cache(m) for m in pair]
        last = [m(inputs, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
        for _ in range(STEPS):
            _close(*last)
            step = [mx.argmax(x, axis=-1)[:, None] for x in last]
            assert mx.array_equal(*step).item()
            last = [m(step[0], cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
        _close(*last)
        assert calls[0] == (STEPS if on_c else 0)  # gemma2: every decode step ran in C


@pytest.mark.parametrize("name", ["qwen3", "phi3-longrope", "llama-yarn"])
def test_packed_step_matches_mlx_lm(name: str, model_dirs: dict[str, Path]) -> None:
    """The engine's packed step (decode rows and a prefill chunk in one forward), on the fused
    MLX path (native steps set aside) and with them, gives each group's mlx-lm results."""
    stock, ours = _pair(model_dirs[name])
    packed = PackedForward.for_model(ours)
    assert packed is not None
    native = ours.model._mlxcel_native
    for use_native in (False, True):
        ours.model._mlxcel_native = native if use_native else None
        dec_rows, pre_rows = (
            [[5, 6, 7, 8], [9] * 11],
            [[1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15]],
        )
        results = []
        for model in (stock, ours):
            dec_cache = [BatchKVCache([7, 0]) for _ in model.layers]
            dec_in = mx.array([[0] * 7 + dec_rows[0], dec_rows[1]])
            first = mx.argmax(model(dec_in, cache=dec_cache)[:, -1, :], axis=-1)
            pre_cache = [BatchKVCache([0, 0]) for _ in model.layers]
            pre_in = mx.array(pre_rows)
            if model is stock:
                dec = model(first[:, None], cache=dec_cache)
                pre = model(pre_in, cache=pre_cache)
            else:
                dec_h, pre_h = packed(first, dec_cache, pre_in, pre_cache)
                assert packed.ran_native == use_native
                dec, pre = model.lm_head(dec_h), model.lm_head(pre_h)
            results.append((dec, pre))
        _close(results[0][0], results[1][0])
        _close(results[0][1], results[1][1])
    ours.model._mlxcel_native = native


def test_attention_modules_are_the_fused_ones(model_dirs: dict[str, Path]) -> None:
    """qwen3 keeps its q/k norms on the fused attention, phi3 its own fused projections."""
    qwen3 = load_model(str(model_dirs["qwen3"])).model
    attn = qwen3.layers[0].self_attn
    assert isinstance(attn, FusedAttention) and attn.q_norm is not None
    assert native_decode.is_installed(qwen3)
    phi3 = load_model(str(model_dirs["phi3-longrope"])).model
    attn = phi3.layers[0].self_attn
    assert isinstance(attn, FusedAttention) and attn.q_norm is None
    assert attn._rope_table is not None and attn._rope_table.input_scale > 1.0


@pytest.mark.parametrize(
    ("family", "overrides", "reason"),
    [
        ("lfm2", {}, "lfm2: attention none is not one it fuses"),
        (
            "llama",
            {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "head_dim": 16},
            "gemma: attention mlx_lm.models.gemma.Attention is not one it fuses",
        ),
    ],
    ids=["lfm2", "gemma"],
)
def test_a_family_not_covered_keeps_mlx_lm_and_the_log_says_why(
    family: str, overrides: dict[str, Any], reason: str, tmp_path: Path, caplog: Any
) -> None:
    caplog.set_level(logging.INFO, logger="mlxcel.daemon.forward.fast_forward")
    model = load_model(str(make_tiny_model(tmp_path / family, family, **overrides))).model
    assert not is_fast(model) and not native_decode.is_installed(model)
    assert f"fast forward: not applied ({reason}" in caplog.text
    plan = forward_plan.describe(model, "cpu", set())  # status shows the same reason
    assert plan.decode.path == forward_plan.STOCK and plan.decode.why.startswith(
        f"fast forward: {reason}"
    )


def test_a_rope_no_table_gives_keeps_the_fused_forward_without_the_c_steps(
    tmp_path: Path, caplog: Any
) -> None:
    """Dynamic NTK RoPE (its frequencies depend on the sequence length) has no table: the fused
    layers use the RoPE module, the C steps step aside and say so, results stay mlx-lm's."""
    caplog.set_level(logging.INFO, logger="mlxcel.daemon.forward.native_decode")
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    path = make_tiny_model(tmp_path / "ntk", "llama", rope_scaling=scaling)
    stock, ours = _pair(path, native=False)
    assert "native decode step: not in use (RoPE without a table)" in caplog.text
    assert all(layer.self_attn._rope_table is None for layer in ours.layers)
    inputs = mx.array([ROWS[0]])
    caches = [make_prompt_cache(m) for m in (stock, ours)]
    _close(*[m(inputs, cache=c) for m, c in zip((stock, ours), caches, strict=True)])


def _quantized_pair(path: Path, native: bool) -> tuple[Any, Any]:
    """(mlx-lm's model quantized 4-bit, group 32, scales and biases float32; the same weights
    with the fused forward and, when `native`, the native steps on the quantized kernels)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlxcel.daemon.forward.fast_forward import apply_fast_forward

    pair = []
    for _ in range(2):
        model, _ = mlx_lm.load(str(path))
        nn.quantize(model, group_size=32, bits=4)
        cast = [
            (k, v.astype(mx.float32))
            for k, v in tree_flatten(model.parameters())
            if k.endswith(("scales", "biases"))
        ]
        model.update(tree_unflatten(cast))
        mx.eval(model.parameters())
        pair.append(model)
    assert apply_fast_forward(pair[1], "cpu")
    assert native_decode.is_installed(pair[1]) == native
    return pair[0], pair[1]


@pytest.mark.skipif(native_ops.quant_path() is None, reason="native quantized kernels absent")
@pytest.mark.parametrize("name", ["qwen3", "phi3-longrope", "gemma3", "gemma2-mha"])
def test_quantized_families_match_mlx_lm_quantized(name: str, model_dirs: dict[str, Path]) -> None:
    """Quantized weights (helper Q's kernels) on the same families: the native decode step with
    the q/k norms (qwen3), phi3's own fused quantized projections, gemma2 (its tied quantized
    embedding as the head, then its final soft cap), gemma3 on the fused path, against mlx-lm's
    own quantized forward, batched and left-padded."""
    pair = _quantized_pair(model_dirs[name], native=name != "gemma3")
    longest = max(len(r) for r in ROWS)
    padding = [longest - len(r) for r in ROWS]
    inputs = mx.array([[0] * p + r for p, r in zip(padding, ROWS, strict=True)])
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
    last = [m(inputs, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    for _ in range(12):
        _close(*last)
        step = [mx.argmax(x, axis=-1)[:, None] for x in last]
        assert mx.array_equal(*step).item()
        last = [m(step[0], cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    _close(*last)


@pytest.mark.parametrize("name", ["qwen3", "phi3-longrope", "gemma3", "gemma2-mha"])
def test_the_engine_serves_them_as_mlx_lm_generates(name: str, model_dirs: dict[str, Path]) -> None:
    """The engine (batched decode, chunked prefill, packed steps where the family has them)
    on each family gives mlx-lm's own greedy tokens for every request."""
    from engine_checks import greedy, make_prompts, staggered
    from engine_driver import Driver
    from mlx_lm.generate import generate_step

    model = load_model(str(model_dirs[name]))
    stock, _ = mlx_lm.load(str(model_dirs[name]))
    prompts = make_prompts(4, seed=9, hi=60)
    requests = [greedy(f"r{i}", p, 12) for i, p in enumerate(prompts)]
    d = staggered(Driver(model, parallel=4, prefill_chunk_size=32, prompt_cache=False), requests)
    for r, prompt in zip(requests, prompts, strict=True):
        steps = generate_step(mx.array(prompt), stock, max_tokens=12)
        want = [int(tok) for (tok, _), _ in zip(steps, range(12), strict=False)]
        assert d.tokens[r.request_id] == want, r.request_id
    packed = getattr(d.engine.runner, "num_packed_steps", 0)  # gemma3: one row at a time
    assert (packed > 0) == (name in ("qwen3", "phi3-longrope"))
