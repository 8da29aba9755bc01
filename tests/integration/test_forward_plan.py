"""The forward plan (forward/forward_plan.py): one decision at load, recorded and shown.

Each test loads a tiny random-weight model the way the daemon does (`load_model`) and checks
what the plan says against what is installed on the model's modules, and that the weights the
footprint predicted are the weights that were kept.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.utils import quantize_model, save
from mlxcel.daemon.cli import control_commands as cli_control
from mlxcel.daemon.forward import forward_plan, native_decode, native_ops
from mlxcel.daemon.forward.fast_forward import is_fast
from mlxcel.daemon.models import load_model
from mlxcel.daemon.models.footprint import resident_weight_bytes
from mlxcel.daemon.models.tiny import make_tiny_model
from mlxcel.shared import snapshot as sn
from platform_marks import cpu_only

pytestmark = [pytest.mark.integration, cpu_only]  # the plan's choices are the CPU's


def _quantized_copy(src: Path, dst: Path, bits: int = 4, group: int = 32) -> Path:
    model, tokenizer, config = mlx_lm.load(str(src), return_config=True)
    model, config = quantize_model(model, config, group_size=group, bits=bits)
    save(dst, src, model, tokenizer, config)
    return dst


def _quantized_layers(model: nn.Module) -> int:
    return sum(
        isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in model.named_modules()
    )


def _weights_bytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def test_a_float_model_takes_the_native_steps_when_the_library_is_built(
    tiny_model_dir: Path,
) -> None:
    loaded = load_model(str(tiny_model_dir))
    plan = forward_plan.describe(loaded.model, "cpu", set())
    assert loaded.info.forward == plan.summary()
    assert plan.weights.path == "float32" and plan.weights.why == ""
    if native_decode.is_installed(loaded.model):
        assert plan.decode.path == forward_plan.NATIVE_FLOAT
    else:  # no library in this process: the fused MLX forward, and the plan says why
        assert plan.decode.path == forward_plan.FUSED_MLX and plan.decode.why
    assert is_fast(loaded.model.model)


def test_a_quantized_model_stays_quantized_exactly_when_the_kernels_take_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    qdir = _quantized_copy(tiny_model_dir, tmp_path / "q4")
    formats = {(4, 32, "affine")}
    refused = forward_plan.kernels_refuse(formats)
    predicted = resident_weight_bytes(qdir, "cpu")
    loaded = load_model(str(qdir))
    plan = forward_plan.describe(loaded.model, "cpu", forward_plan.quantized_formats(loaded.model))
    if refused is None:
        assert _quantized_layers(loaded.model) > 0
        assert loaded.info.forward.startswith("weights 4-bit g32")
        assert plan.decode.path == forward_plan.NATIVE_QUANTIZED, plan
        assert plan.head.path == forward_plan.NATIVE_QUANTIZED, plan  # the untied lm_head
        scales = [m.scales.dtype for _, m in loaded.model.named_modules() if hasattr(m, "scales")]
        assert set(scales) == {mx.float32}  # the native kernels read float32 scales
    else:
        assert _quantized_layers(loaded.model) == 0
        assert f"dequantized: {refused}" in forward_plan.ForwardPlan.reasons(
            _plan_of(loaded.model, refused)
        )
    # The footprint the model host checks before a load is what the load kept (within the
    # fused copies' and the float32 head's rounding): 8x apart between the two outcomes.
    actual = _weights_bytes(loaded.model)
    assert 0.5 * actual <= predicted <= 1.5 * actual, (predicted, actual)


def _plan_of(model: nn.Module, refused: str) -> forward_plan.ForwardPlan:
    return forward_plan.describe(model, "cpu", set(), f"dequantized: {refused}")


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen3", {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 16}),
        ("phi3", {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}),
        ("gemma2", {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                    "head_dim": 16, "query_pre_attn_scalar": 16}),
        ("gemma3", {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                    "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                    "sliding_window_pattern": 2}),
    ],
)  # fmt: skip
def test_each_family_is_kept_quantized_only_where_the_native_steps_run_it(
    family: str, overrides: dict, tmp_path: Path
) -> None:
    """The families of forward_plan.NATIVE_FAMILIES load quantized onto the native steps (what
    footprint.py predicted); any other (gemma3: the fused MLX path only) is dequantized with
    the reason in the plan."""
    src = make_tiny_model(tmp_path / family, "llama", seed=5, **overrides)
    qdir = _quantized_copy(src, tmp_path / f"{family}-q4")
    if forward_plan.kernels_refuse({(4, 32, "affine")}) is not None:
        pytest.skip("native quantized kernels absent")
    predicted = resident_weight_bytes(qdir, "cpu")
    loaded = load_model(str(qdir))
    actual = _weights_bytes(loaded.model)
    assert 0.5 * actual <= predicted <= 1.5 * actual, (predicted, actual)
    if family != "gemma3":  # qwen3, phi3 and gemma2 run on the native steps
        assert _quantized_layers(loaded.model) > 0
        assert "decode native quantized" in loaded.info.forward, loaded.info.forward
    else:
        assert _quantized_layers(loaded.model) == 0
        assert loaded.info.forward.startswith("weights float32"), loaded.info.forward
        why = forward_plan.stays_quantized_why_not("gemma3_text", {(4, 32, "affine")})
        assert why == "the native steps do not run the gemma3_text family", why


def test_dtype_float32_dequantizes_and_says_so(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    qdir = _quantized_copy(tiny_model_dir, tmp_path / "q8", bits=8, group=64)
    with caplog.at_level("INFO", logger="mlxcel.daemon.forward.forward_plan"):
        loaded = load_model(str(qdir), dtype="float32")
    assert _quantized_layers(loaded.model) == 0
    assert loaded.info.forward.startswith("weights float32")
    assert "weights: dequantized: --dtype float32" in caplog.text


def test_a_family_the_steps_do_not_run_is_named_with_the_reason(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "lfm2", "lfm2")
    loaded = load_model(str(path))
    plan = forward_plan.describe(loaded.model, "cpu", set())
    assert plan.decode.path == forward_plan.STOCK and plan.decode.why
    assert loaded.info.forward == plan.summary()
    assert not native_decode.is_installed(loaded.model)


def test_unsupported_quantized_formats_are_refused_by_name() -> None:
    if native_ops.quant_path() is None:  # no library: every format is refused, saying so
        assert "not available" in (forward_plan.kernels_refuse({(4, 32, "affine")}) or "")
        return
    assert forward_plan.kernels_refuse({(3, 32, "affine")}) is not None
    assert forward_plan.kernels_refuse({(4, 16, "affine")}) is not None
    assert "mxfp4" in (forward_plan.kernels_refuse({(4, 32, "mxfp4")}) or "")


@pytest.mark.usefixtures("mlxcel_home")
def test_status_shows_each_models_plan() -> None:
    cfg = sn.EffectiveConfig(2, 4, 256, None, 4, 0, 512, True, 1 << 30, None, 64, 2048)
    engine = sn.EngineSnapshot(
        0.0, cfg, (sn.SlotInfo(0),), (), sn.KVInfo(), sn.PromptCacheInfo(), sn.LatencyInfo(),
        sn.Counters(),
    )  # fmt: skip
    model = sn.ModelState("tiny", forward="weights 4-bit g32 · decode native quantized")
    host = sn.ModelHostInfo(models=(model,))
    daemon = sn.DaemonInfo("0.1.0", 42, 5.0, "tiny", "cpu", "float32", host=host)
    wire = sn.Snapshot(daemon, engine).to_dict()  # what the socket carries
    text = cli_control.format_status(sn.Snapshot.from_dict(wire), {})
    assert "  forward: weights 4-bit g32 · decode native quantized" in text
