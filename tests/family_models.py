"""Tiny random-weight models of more families for the fused forward and the native steps
(tests/integration/test_native_families.py, tests/e2e/test_native_families_chunk.py): `FAMILIES`
(llama with rope scaling, mistral, qwen3, phi3, on the C steps) and `GEMMA` (gemma2 on the C
steps too, gemma3 on the fused MLX path), each a config over the tiny llama's;
`make_family_dirs` writes them (qwen3's and gemma's norm weights random too); `ATOL`, the logit
tolerance against mlx-lm's own forward."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlxcel.daemon.models.tiny import make_tiny_model

# Logits of these models are O(1); float32 sums in another order (the fused matmuls, the C
# kernels' dot products and exp) differ by ~1e-6 per layer; 1e-4 is far below any logit gap
# that changes a greedy token, and far above what a wrong norm or RoPE scale gives (>1e-2).
ATOL = 1e-4

# Tiny configs over the tiny llama's (tiny.py: hidden 64, 4 heads, 2 kv heads, head_dim 16).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama-linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,  # some frequencies scaled, some smoothed
        }
    },
    "llama-yarn": {  # mscale 1 + 0.1 ln 4: the input scale before the rotation
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
        }
    },
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 16},
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]},
    "phi3-longrope": {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "original_max_position_embeddings": 256,  # factor 8: scale sqrt(1 + ln 8 / ln 256)
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
            "short_factor": [1.0] * 8,
        },
    },
}


# Gemma: gemma2 on the C steps too (its norms folded, GELU MLP, soft-capping), gemma3 on the
# fused MLX path only (its sliding windows). gemma2 with as many kv heads as heads runs batched:
# mlx-lm's own gemma2 broadcasts a batch's mask against its kv-head axis when heads are grouped.
GEMMA = {
    "gemma2": {
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 2.0,  # low enough that capping changes the scores
        "final_logit_softcapping": 5.0,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,  # the rows outgrow it: the local layers' masks and caches slide
        "sliding_window_pattern": 2,  # layer 0 local (RoPE base 10000), layer 1 global
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    },
}
GEMMA["gemma2-mha"] = {**GEMMA["gemma2"], "num_key_value_heads": 4}
# head_dim 64: the chunk step's attention takes its tiled path (head dims 64 and 128)
GEMMA["gemma2-hd64"] = {**GEMMA["gemma2-mha"], "head_dim": 64, "query_pre_attn_scalar": 64}


def _weights_random(model: Any, gemma: bool) -> None:
    """The norm weights random too (tiny.py leaves 1-D weights at ones; gemma's norms scale by
    1 + w): a norm skipped, or gemma's 1 + w not folded, then changes the results."""
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(7)
    params = dict(tree_flatten(model.parameters()))
    for name, value in params.items():
        if name.endswith("norm.weight"):
            params[name] = 0.5 * mx.random.normal(value.shape) + (0.0 if gemma else 1.0)
    model.update(tree_unflatten(list(params.items())))


def make_family_dirs(root: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """The model directory of each family in `names` (all of FAMILIES and GEMMA by default)
    under `root`, by name."""
    configs = {**FAMILIES, **GEMMA}
    dirs = {}
    for name in configs if names is None else names:
        path = make_tiny_model(root / name, "llama", seed=5, **configs[name])
        if name == "qwen3" or name in GEMMA:  # rewrite its weights with random norms
            model, _ = mlx_lm.load(str(path))
            _weights_random(model, gemma=name in GEMMA)
            from mlx.utils import tree_flatten

            weights = dict(tree_flatten(model.parameters()))
            mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
        dirs[name] = path
    return dirs
