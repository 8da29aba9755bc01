"""`load_model(spec, dtype)`: an alias, a local MLX/HF dir, a .gguf file or a Hugging Face id.

Every failure becomes a one-line `ModelLoadError` (the CLI prints it without a traceback).
On the CPU backend `dtype="auto"` keeps 4/8-bit affine layers quantized when the native
quantized steps run the model, and dequantizes to float32 otherwise (scales and biases in
float32, so the weights are the GGUF's exact values; MLX's own CPU quantized matmul is ~20x
slower than float32 on OpenBLAS): forward_plan.py decides and records which. On Metal/CUDA
quantized layers stay quantized (see `apply_dtype`).
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlxcel.daemon.forward.blas import blas_name
from mlxcel.daemon.models.info import ModelInfo, ModelLoadError
from mlxcel.daemon.models.registry import (
    ALIASES,
    check_model_files,
    context_length,
    hf_cached_snapshot,
    is_hf_repo_id,
    is_store_name,
    local_model_dir,
    model_dir,
    resolve_alias,
)
from mlxcel.shared.switches import switch_flag

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
Progress = Callable[[str], None]


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    info: ModelInfo


@dataclass(frozen=True)
class _Resolved:
    source: str  # "alias", "store", "dir", "gguf" or "hf"
    path: Path | None  # None for a hub id not yet downloaded


def backend_name() -> str:
    if mx.default_device().type == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def resolve_spec(spec: str, progress: Progress | None = None) -> _Resolved:
    """Which kind of model `spec` names, through the alias tables (shipped and config.toml):
    a built-in model (pulled when not local yet), a store entry, a path or a repo id."""
    target = resolve_alias(spec)
    if target in ALIASES:
        path = local_model_dir(target)
        if path is None:
            from mlxcel.daemon.models.pull import pull_model, stderr_progress

            path = pull_model(target, progress=progress or stderr_progress)
        return _Resolved("alias", path)
    stored = local_model_dir(target)
    if stored is not None:
        return _Resolved("gguf" if stored.suffix == ".gguf" else "store", stored)
    if is_store_name(target) and model_dir(target).is_dir():
        raise ModelLoadError(
            f"model {target!r} in the store is incomplete (a pull that did not finish, or an "
            "older conversion): pull it again or remove it with `mlxcel-daemon models rm`"
        )
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _Resolved("gguf", path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not an MLX/Hugging Face model dir")
        return _Resolved("dir", path)
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    if target.startswith(("/", ".", "~")) or target.endswith(".gguf"):
        raise ModelLoadError(f"no such model file or directory: {target}")
    if is_hf_repo_id(target):
        return _Resolved("hf", hf_cached_snapshot(target))
    raise ModelLoadError(
        f"unknown model {spec!r}: not an alias ({', '.join(sorted(ALIASES))}), "
        "a pulled model, a local directory, a .gguf file or a Hugging Face repo id (owner/name)"
    )


def release_memory() -> None:
    """After a model's last reference went: collect it and give MLX's buffer cache back. The
    objects `freeze_long_lived` froze are let go first (the unloaded model's among them), and
    what is still alive afterwards is frozen again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    mx.clear_cache()
    malloc_trim()


def freeze_long_lived() -> None:
    """After a load: collect, then move every object alive now (the model, its tokenizer, the
    imported libraries: ~110k objects) out of the garbage collector's sight. A full collection
    of them holds the GIL, so the event loop, for 0.3-0.5 s on 2 cores, and one request's
    objects (a 190 KB JSON body) are enough to trigger one (docs/reliability.md, "The event loop
    never waits on a request's content"). They are still freed by reference counting; an
    unload lets them go to the collector again (`release_memory`)."""
    gc.collect()
    gc.freeze()


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20  # while a model loads
SERVE_MMAP_THRESHOLD_BYTES = 32 << 20  # while it serves (glibc's maximum)
NO_MALLOPT_ENV = "MLXCEL_NO_MALLOPT"


def _libc() -> Any:
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def map_large_buffers() -> None:
    """Serve buffers of 1 MiB and more from their own mappings (glibc): freeing a model's
    weights then returns their memory to the OS at once, instead of leaving it in the heap
    (glibc raises its mmap threshold after large frees). Called before a model loads."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def serve_from_heap() -> bool:
    """Serve buffers up to 32 MiB from glibc's heap again once a model is loaded; True when
    set. `map_large_buffers` maps every 1 MiB+ buffer on its own for the load; left so, each
    KV copy of the engine (tens to hundreds of MB, as rows join and leave the decode batch)
    would be mapped, unmapped and faulted in again every time, ~2.5-11 us a page on a 2-core VM
    and most of the copy's time. Freed heap pages stay mapped until glibc trims its heap top
    or `release_memory` trims it all (an unload). `MLXCEL_NO_MALLOPT=1` leaves malloc alone."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt") or switch_flag(NO_MALLOPT_ENV):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD_BYTES))


def malloc_trim() -> None:
    """glibc keeps freed heap pages (its mmap threshold rises after large frees): give them
    back, so an unloaded model's RSS goes too. Elsewhere free() already returns them."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # musl has none
        libc.malloc_trim(0)


def download_hf(repo: str) -> Path:
    """The local snapshot of a Hugging Face repo (through mlx-lm); one-line errors."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from mlxcel.daemon.mlx_lm_compat import download

    try:
        return download(repo)
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ModelLoadError(f"Hugging Face repo {repo!r} not found or not accessible") from exc
    except Exception as exc:
        raise ModelLoadError(
            f"cannot reach the Hugging Face hub to fetch {repo!r} ({type(exc).__name__}); "
            "download the model elsewhere and pass its local directory or .gguf file as --model"
        ) from exc


def _dequantize(model: nn.Module, dtype: mx.Dtype) -> None:
    """Replace quantized layers by float ones; scales in float32 so nothing is rounded twice."""
    replacements = []
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            weight = mx.dequantize(
                module.weight,
                module.scales.astype(mx.float32),
                None if module.get("biases") is None else module.biases.astype(mx.float32),
                module.group_size,
                module.bits,
                module.mode,
            ).astype(dtype)
            out_dims, in_dims = weight.shape
            if isinstance(module, nn.QuantizedLinear):
                layer: nn.Module = nn.Linear(in_dims, out_dims, bias="bias" in module)
                if "bias" in module:
                    layer.bias = module.bias
            else:
                layer = nn.Embedding(out_dims, in_dims)
            layer.weight = weight
            replacements.append((name, layer))
    if replacements:
        model.update_modules(tree_unflatten(replacements))


def _quantized_paths(model: nn.Module) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
    ]


def _cast_plain(model: nn.Module, target: mx.Dtype) -> None:
    """Cast the float parameters except quantized layers' scales and biases to `target`."""
    keep = {f"{p}.{k}" if p else k for p in _quantized_paths(model) for k in ("scales", "biases")}
    update = [
        (name, value.astype(target))
        for name, value in tree_flatten(model.parameters())
        if name not in keep and mx.issubdtype(value.dtype, mx.floating) and value.dtype != target
    ]
    if update:
        model.update(tree_unflatten(update))


def _cast_quantization(model: nn.Module, target: mx.Dtype) -> None:
    """Cast quantized layers' scales and biases to `target` (float16/bfloat16 -> float32 is
    exact: the native kernels read float32)."""
    update = []
    modules = dict(model.named_modules())
    for path in _quantized_paths(model):
        module = modules[path]
        for key in ("scales", "biases"):
            value = module.get(key)
            if value is not None and value.dtype != target:
                update.append((f"{path}.{key}" if path else key, value.astype(target)))
    if update:
        model.update(tree_unflatten(update))


def apply_dtype(model: nn.Module, dtype: str, backend: str, keep_quantized: bool = False) -> None:
    """Dequantize and cast for `dtype` on the CPU; off it, quantized layers stay quantized.

    CPU: "auto" means float32; every quantized layer is dequantized (in float32, then cast),
    unless `keep_quantized` (forward_plan.py: the native quantized steps run it): then the
    quantized layers stay packed, their scales and biases in float32.
    GPU: "auto" casts the plain float parameters (norms, biases) to the quantized layers'
    scale dtype, so no float32 norm promotes activations and the KV cache; an explicit dtype
    casts only the parameters that are not quantized.
    """
    if dtype != "auto" and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use auto, float32, float16 or bfloat16")
    if backend != "cpu":
        paths = _quantized_paths(model)
        if dtype == "auto" and paths:
            modules = dict(model.named_modules())
            scale_dtypes = Counter(modules[p].scales.dtype for p in paths)
            _cast_plain(model, scale_dtypes.most_common(1)[0][0])
        elif dtype != "auto":
            _cast_plain(model, DTYPES[dtype])
        mx.eval(model.parameters())
        return
    target = DTYPES["float32" if dtype == "auto" else dtype]
    if keep_quantized and dtype == "auto":
        _cast_quantization(model, mx.float32)
        _cast_plain(model, mx.float32)
        mx.eval(model.parameters())
        return
    _dequantize(model, target)
    _cast_plain(model, target)
    mx.eval(model.parameters())


def batch_support(model: nn.Module, family: str) -> tuple[bool, str | None]:
    """mlx-lm batches only plain KVCache lists (merge into BatchKVCache)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    odd = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if not odd:
        return True, None
    return False, f"model family '{family}' uses {'/'.join(odd)} caches which mlx-lm cannot batch"


def _weights_summary(model: nn.Module) -> tuple[str, str | None, int]:
    """(float dtype, quantization description or None, bytes) of the parameters."""
    params = tree_flatten(model.parameters())
    bytes_by_dtype: Counter[str] = Counter()
    for name, value in params:
        # a quantized layer's scales and biases are not the compute type (the native kernels
        # may hold them as float16: forward/native_ops.py narrow_scales)
        if mx.issubdtype(value.dtype, mx.floating) and not name.endswith((".scales", ".biases")):
            bytes_by_dtype[str(value.dtype).removeprefix("mlx.core.")] += value.nbytes
    bits = sorted(
        {m.bits for _, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "scales")}
    )
    quant = None
    if bits:
        quant = "/".join(str(b) for b in bits) + "-bit quantized"
    dtype = bytes_by_dtype.most_common(1)[0][0] if bytes_by_dtype else "unknown"
    return dtype, quant, sum(value.nbytes for _, value in params)


def _describe(
    spec: str, resolved: _Resolved, model: nn.Module, tokenizer: Any, config: dict[str, Any]
) -> ModelInfo:
    from mlx_lm.utils import get_total_parameters

    family = str(config.get("model_type", "unknown"))
    can_batch, reason = batch_support(model, family)
    dtype, quant, nbytes = _weights_summary(model)
    return ModelInfo(
        name=spec,
        path=str(resolved.path),
        source=resolved.source,
        family=family,
        can_batch=can_batch,
        batch_reason=reason,
        context_length=context_length(config),
        dtype=dtype,
        quantization=quant,
        backend=backend_name(),
        blas=blas_name(),
        weights_bytes=nbytes,
        num_params=int(get_total_parameters(model)),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
    )


def load_model(spec: str, dtype: str = "auto", progress: Progress | None = None) -> LoadedModel:
    """Load `spec` (alias, directory, .gguf, HF repo id) for serving; see the module doc.

    An alias that is not local yet is pulled first, reporting to `progress` (default: stderr).
    """
    if dtype != "auto" and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use auto, float32, float16 or bfloat16")
    map_large_buffers()
    resolved = resolve_spec(spec, progress)
    if resolved.source == "hf" and resolved.path is None:
        resolved = _Resolved("hf", download_hf(resolve_alias(spec)))
    if resolved.source != "gguf" and resolved.path is not None and _is_encoder_dir(resolved.path):
        return _load_encoder(spec, resolved, dtype)
    if resolved.source != "gguf" and resolved.path is not None:
        try:
            check_model_files(resolved.path)
        except ModelLoadError as exc:
            raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from None
    try:
        if resolved.source == "gguf":
            from mlxcel.daemon.models.gguf import load_gguf

            assert resolved.path is not None  # a GGUF source is a file

            model, tokenizer, config = load_gguf(resolved.path)
        else:
            import mlx_lm

            model, tokenizer, config = mlx_lm.load(str(resolved.path), return_config=True)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {_first_line(exc)}") from exc
    from mlxcel.daemon.forward.forward_plan import prepare

    family = str(config.get("model_type", "unknown"))
    plan = prepare(model, dtype, backend_name(), family)
    # The weights the fast forward replaced (q/k/v, gate/up: ~30 MB on a 42M model) sit in
    # MLX's buffer cache, and its setup's transient heap (~10 MB) stays resident in glibc until
    # a trim: left there, each load's RSS swings by tens of MB (issue #13).
    mx.clear_cache()
    malloc_trim()
    serve_from_heap()
    info = _describe(spec, resolved, model, tokenizer, config)
    loaded = LoadedModel(model, tokenizer, replace(info, forward=plan.summary()))
    freeze_long_lived()
    return loaded


def _is_encoder_dir(path: Path) -> bool:
    """An embedding-only model (a BERT-family encoder: models/encoder/)."""
    from mlxcel.daemon.models.encoder import is_encoder_config
    from mlxcel.daemon.models.registry import read_config

    if not path.is_dir() or not (path / "config.json").is_file():
        return False
    try:
        return is_encoder_config(read_config(path))
    except ModelLoadError:
        return False  # check_model_files says what is wrong with it


def _load_encoder(spec: str, resolved: _Resolved, dtype: str) -> LoadedModel:
    from mlxcel.daemon.models.encoder.load import load_encoder, weight_files

    assert resolved.path is not None
    try:
        weight_files(resolved.path)  # a pytorch_model.bin-only directory: its own message
        check_model_files(resolved.path)
        loaded = load_encoder(spec, resolved.path, resolved.source, dtype)
    except ModelLoadError as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from None
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {_first_line(exc)}") from exc
    serve_from_heap()
    freeze_long_lived()
    return loaded
