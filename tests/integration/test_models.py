"""load_model on tiny random-weight models: ModelInfo, dtype handling, can_batch, errors. The
`run` command's subprocess runs are tests/e2e/test_models_cli.py's."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model, save
from mlxcel.daemon.models import LoadedModel, ModelInfo, ModelLoadError, load_model
from mlxcel.daemon.models.loader import backend_name
from mlxcel.daemon.models.tiny import make_tiny_model

ON_CPU = backend_name() == "cpu"


def _float_dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {
        v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)
    }


def _logits(loaded: LoadedModel, text: str = "What is the capital of France?") -> np.ndarray:
    ids = loaded.tokenizer.encode(text)
    return np.array(loaded.model(mx.array([ids]))[0].astype(mx.float32))


def test_tiny_dir_info(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    info = loaded.info
    assert isinstance(info, ModelInfo)
    assert (info.name, info.path, info.source) == (
        str(tiny_model_dir),
        str(tiny_model_dir),
        "dir",
    )
    assert info.family == "llama" and info.can_batch and info.batch_reason is None
    assert info.context_length == 2048
    assert info.backend in ("cpu", "metal", "cuda")
    assert info.num_params > 0 and info.weights_bytes > 0
    assert info.eos_token_ids == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert json.loads(json.dumps(info.to_dict()))["family"] == "llama"
    if ON_CPU:
        assert info.dtype == "float32"
        assert info.weights_bytes == 4 * info.num_params
        assert info.blas in ("openblas", "reference", "mkl", "blis", "unknown")
    with pytest.raises(AttributeError):
        info.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize("family", ["lfm2", "mamba"])
def test_families_that_cannot_batch(tmp_path: Path, family: str) -> None:
    info = load_model(str(make_tiny_model(tmp_path / family, family))).info
    assert info.family == family and not info.can_batch
    assert info.batch_reason == (
        f"model family '{family}' uses ArraysCache caches which mlx-lm cannot batch"
    )


def test_rotating_cache_family_cannot_batch(tmp_path: Path) -> None:
    path = make_tiny_model(
        tmp_path / "swa",
        "llama",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
    )
    info = load_model(str(path)).info
    assert not info.can_batch and "RotatingKVCache" in (info.batch_reason or "")


def test_load_leaves_no_replaced_weights_in_mlx_cache(tiny_model_dir: Path) -> None:
    """The fast forward's fused q/k/v and gate/up replace weights that MLX keeps in its buffer
    cache; load_model gives them back, so each load's RSS is the model, not the model plus a
    varying cache (issue #13)."""
    from mlxcel.daemon.forward.fast_forward import is_fast

    if backend_name() != "cpu" or os.environ.get("MLXCEL_NO_FAST_FORWARD"):
        pytest.skip("the fast forward runs on the CPU backend only")
    mx.clear_cache()
    loaded = load_model(str(tiny_model_dir))
    assert is_fast(loaded.model)
    assert mx.get_cache_memory() == 0


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap, /proc")
def test_load_gives_its_transient_heap_back(tmp_path: Path) -> None:
    """The fast forward's setup (fused copies, the RoPE table and its probes) frees heap that
    glibc keeps resident until a trim: load_model trims, so a load in a worker thread (as the
    model host runs it) leaves nothing for a later trim to give back (issue #13)."""
    from mlxcel.daemon.models.loader import malloc_trim

    if backend_name() != "cpu" or os.environ.get("MLXCEL_NO_FAST_FORWARD"):
        pytest.skip("the fast forward runs on the CPU backend only")
    # Wide layers and a long context (a RoPE table of 8 MB): a transient of several MB.
    model_dir = make_tiny_model(
        tmp_path / "wide",
        "llama",
        hidden_size=768,
        intermediate_size=2048,
        num_attention_heads=12,
        num_key_value_heads=4,
        num_hidden_layers=6,
        max_position_embeddings=32768,
    )
    freed = []
    for _ in range(3):
        box: list[LoadedModel] = []
        worker = threading.Thread(target=lambda out=box: out.append(load_model(str(model_dir))))
        worker.start()
        worker.join()
        before = _rss_mb()
        malloc_trim()
        freed.append(before - _rss_mb())
        box.clear()
    assert max(freed) < 2.0, freed


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_explicit_dtype_is_honoured(tiny_model_dir: Path, dtype: str) -> None:
    loaded = load_model(str(tiny_model_dir), dtype=dtype)
    assert loaded.info.dtype == dtype
    assert _float_dtypes(loaded.model) == {getattr(mx, dtype)}
    reference = _logits(load_model(str(tiny_model_dir), dtype="float32"))
    np.testing.assert_allclose(_logits(loaded), reference, atol=0.1 if dtype != "float32" else 0)


def _quantized_copy(src: Path, dst: Path) -> Path:
    model, tokenizer, config = mlx_lm.load(str(src), return_config=True)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save(dst, src, model, tokenizer, config)
    return dst


@pytest.mark.skipif(not ON_CPU, reason="auto keeps quantized weights off the CPU backend")
def test_float32_dequantizes_on_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`--dtype float32` (and `auto` where the native quantized steps do not run the model:
    tests/integration/test_forward_plan.py) dequantizes exactly: the logits are the quantized
    model's."""
    qdir = _quantized_copy(tiny_model_dir, tmp_path / "q4")
    loaded = load_model(str(qdir), dtype="float32")
    assert loaded.info.dtype == "float32" and loaded.info.quantization is None
    assert not any(
        isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
        for _, m in loaded.model.named_modules()
    )
    quantized, _ = mlx_lm.load(str(qdir))
    ids = loaded.tokenizer.encode("What is the capital of France?")
    expected = np.array(quantized(mx.array([ids]))[0].astype(mx.float32))
    np.testing.assert_allclose(_logits(loaded), expected, atol=2e-2)


def test_bad_specs_fail_with_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    cases = {
        "no-such-alias": "unknown model 'no-such-alias'",
        str(tmp_path / "missing"): "no such model file or directory",
        str(tmp_path / "empty"): "has no config.json",
        str(broken): "cannot load model",
        "missing.gguf": "no such model file or directory",
    }
    for spec, message in cases.items():
        with pytest.raises(ModelLoadError, match=message) as info:
            load_model(spec)
        assert "\n" not in str(info.value)
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'"):
        load_model(str(tiny_model_dir), dtype="int8")
