#!/usr/bin/env python
"""Where the forward's time goes: stock mlx-lm, then each stage of mlxcel's CPU path switched on.

    python scripts/bench_forward.py [--model smollm2-135m-instruct] [--batches 1,8,16]
                                    [--context 300] [--reps 5] [--steps 3]

Stages (each one process, since the BLAS is chosen at process start):
  1. stock mlx-lm on OpenBLAS with OpenBLAS's own core type (what a plain preload gets)
  2. + the core type from the CPU flags (`OPENBLAS_CORETYPE`, daemon/forward/blas.py)
  3. + the few-row sgemm kernel preloaded in front of OpenBLAS (daemon/forward/native/)
  4. + mlxcel's fused forward (fused q/k/v and gate/up, vectorised exp, RoPE table)
  5. + the native fused ops (attention and SwiGLU in C) for prefill-sized inputs
  6. + the native decode and prefill chunk steps (every layer of a decode step or a prefill
     chunk in one C call, native_decode.py)

Then the quantized stage (`--quant-only` runs it alone, `--no-quant` skips it), in stage 6's
environment: the model as it comes (4-bit group 32 for SmolLM2's GGUF, its embedding 8-bit),
the same weights requantized to 8 bits (group 64), and its float32 copy, each on the native
steps with samples interleaved: decode steps at each batch size, a 256x1 prefill through the
chunk step, and one quantized matmul of each of SmolLM2's layer shapes at 64-512 rows through
dequantized tiles into cblas_sgemm against the few-row kernel in 16-row blocks ("direct").

Then a profile of stage 5: each op of a decode step at B=8 and of a 256x1 prefill evaluated
on its own (so the total exceeds a real step by one sync per op, ~30 us each), in ms per step,
biggest first; and, in stage 6's process, the native decode step (and the chunk step for a
256x1 prefill) on and off with samples interleaved.

Decode: ms per step (one token per row through the whole model, logits and argmax) on
`BatchKVCache`s holding `--context` tokens per row (left-padded by different amounts, as in
the engine; trimmed back after each step). Prefill: tokens/s for 256 tokens of one row and
64 tokens of each of 4 rows into fresh caches (backbone on every position, head on the last).
Times are medians. An operator's own OPENBLAS_CORETYPE is kept in every stage (the header
says so). Run it alone (`flock -x /tmp/mlxcel-cpu.lock ...`): the stages run one after another,
so a busy machine skews their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from mlxcel.daemon.forward.blas import (
    CORETYPE_ENV,
    CORETYPE_SOURCE_ENV,
    NO_GEMM_ENV,
    cpu_flags,
    fast_blas_env,
    find_system_openblas,
)

STAGES = (
    ("stock mlx-lm, OpenBLAS own core type", "own-core", False),
    ("+ core type from CPU flags", "cpu-core", False),
    ("+ few-row sgemm kernel", "kernel", False),
    ("+ fused forward (mlxcel)", "kernel", True),
    ("+ native attention/SwiGLU (mlxcel)", "native", True),
    ("+ native decode/chunk steps (mlxcel)", "native-decode", True),
)
PROFILED = "native"  # the stage whose MLX ops are profiled
PREFILLS = ((256, 1), (64, 4))


NO_NATIVE_OPS_ENV = "MLXCEL_NO_NATIVE_OPS"  # as daemon/forward/native_ops.py (imports mlx)
NO_NATIVE_DECODE_ENV = "MLXCEL_NO_NATIVE_DECODE"  # as daemon/forward/native_decode.py


def _stage_env(blas: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", CORETYPE_SOURCE_ENV)}
    base = {k: v for k, v in base.items() if k not in (NO_NATIVE_OPS_ENV, NO_NATIVE_DECODE_ENV)}
    if blas not in ("native", "native-decode"):
        base[NO_NATIVE_OPS_ENV] = "1"
    if blas != "native-decode":
        base[NO_NATIVE_DECODE_ENV] = "1"
    if blas == "own-core":
        env = fast_blas_env({**base, NO_GEMM_ENV: "1"})
        if env.get(CORETYPE_SOURCE_ENV) == "cpu flags":
            env.pop(CORETYPE_ENV)
        return env
    if blas == "cpu-core":
        return fast_blas_env({**base, NO_GEMM_ENV: "1"})
    return fast_blas_env({k: v for k, v in base.items() if k != NO_GEMM_ENV})


# ---- the child: one stage ------------------------------------------------------------------


def _load(model: str, fast: bool) -> Any:
    from mlxcel.daemon.forward.fast_forward import DISABLE_ENV
    from mlxcel.daemon.models import load_model

    if fast:
        os.environ.pop(DISABLE_ENV, None)
    else:
        os.environ[DISABLE_ENV] = "1"
    return load_model(model).model


def _filled_caches(model: Any, batch: int, context: int) -> list[Any]:
    """BatchKVCaches holding `context` positions per row (random keys/values)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    padding = [(3 * i) % 17 for i in range(batch)]
    caches = []
    margs = model.args
    head_dim = getattr(margs, "head_dim", None) or margs.hidden_size // margs.num_attention_heads
    for layer in model.layers:
        heads = layer.self_attn.n_kv_heads
        size = (context // BatchKVCache.step + 1) * BatchKVCache.step
        keys = mx.random.normal((batch, heads, size, head_dim), key=mx.random.key(len(caches)))
        values = mx.random.normal((batch, heads, size, head_dim), key=mx.random.key(99))
        cache = BatchKVCache([0] * batch)
        offset = mx.array([context - p for p in padding])
        cache.state = (keys, values, offset, mx.array(padding), context)
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def _decode_step(model: Any, caches: list[Any], tokens: Any) -> None:
    import mlx.core as mx

    mx.eval(mx.argmax(model(tokens, cache=caches)[:, -1, :], axis=-1))
    for c in caches:
        c.trim(1)


def _prefill(model: Any, tokens: Any) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    caches = [BatchKVCache([0] * tokens.shape[0]) for _ in model.layers]
    hidden = model.model(tokens, cache=caches)
    if model.args.tie_word_embeddings:
        logits = model.model.embed_tokens.as_linear(hidden[:, -1:, :])
    else:
        logits = model.lm_head(hidden[:, -1:, :])
    mx.eval(logits, [c.state for c in caches])


def _median_s(fn: Callable[[], Any], reps: int, per_sample: int) -> float:
    fn()  # warm-up: allocations, compiled traces
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(per_sample):
            fn()
        samples.append((time.perf_counter() - start) / per_sample)
    return statistics.median(samples)


class _Profile:
    """Per-op times of the fused forward: each wrapped op evaluates its inputs, then itself."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import mlx.core as mx

        def timed(*args: Any, **kwargs: Any) -> Any:
            mx.eval([a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)])
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(out)
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start
            return out

        return timed

    def install(self, model: Any) -> None:
        from mlxcel.daemon.forward import fast_forward, native_ops

        fast_forward.attention = self.wrap("attention (MLX ops)", fast_forward.attention)
        fast_forward.swiglu = self.wrap("swiglu (MLX ops)", fast_forward.swiglu)
        native_ops.attention = self.wrap("attention (native)", native_ops.attention)
        native_ops.swiglu = self.wrap("swiglu (native)", native_ops.swiglu)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn._qkv = self.wrap("q/k/v matmul", attn._qkv)
            attn._out = self.wrap("o matmul", attn._out)
            attn._rope = self.wrap("rope", attn._rope)
            mlp._gate_up = self.wrap("gate/up matmul", mlp._gate_up)
            mlp._down = self.wrap("down matmul", mlp._down)
            object.__setattr__(
                layer, "input_layernorm", self.wrap("rms norm", layer.input_layernorm)
            )
            object.__setattr__(
                layer,
                "post_attention_layernorm",
                self.wrap("rms norm", layer.post_attention_layernorm),
            )

    def report(self, title: str, step: Callable[[], Any], steps: int) -> dict[str, float]:
        step()
        self.totals = {}
        start = time.perf_counter()
        for _ in range(steps):
            step()
        total = (time.perf_counter() - start) / steps
        ops = {k: v / steps * 1000 for k, v in self.totals.items()}
        ops["everything else (residuals, head, cache, syncs)"] = total * 1000 - sum(ops.values())
        return {"title": title, "total": total * 1000, "ops": ops}


def _bandwidth_gbs() -> dict[str, float]:
    """Memory read rates now: a one-row product over 256 MB of float32 weights (the decode
    case; the few-row kernel's threads when loaded) and numpy's one-thread sum of it."""
    import mlx.core as mx
    import numpy as np

    weight = mx.random.normal((16384, 4096), key=mx.random.key(5))
    row = mx.random.normal((1, 4096), key=mx.random.key(6))
    mx.eval(weight, row)
    product = _median_s(lambda: mx.eval(row @ weight.T), 5, 1)
    host = np.asarray(weight)
    summed = _median_s(lambda: host.sum(), 3, 1)
    return {"matvec": weight.nbytes / product / 1e9, "numpy 1 thread": weight.nbytes / summed / 1e9}


def _native_ab(model: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """The native ops on and off in this one process, samples interleaved, so both sides see
    the same machine (a busy one skews stages run one after the other): [on, off] medians,
    decode in ms, prefill in tok/s."""
    import mlx.core as mx
    from mlxcel.daemon.forward import native_ops

    on = native_ops.NATIVE_MIN_ROWS
    caches = _filled_caches(model, 8, args.context)
    tokens = mx.random.randint(100, model.args.vocab_size, (8, 1), key=mx.random.key(8))
    prompt = mx.random.randint(100, model.args.vocab_size, (1, 256), key=mx.random.key(256))
    cases = {
        "decode B=8": (lambda: _decode_step(model, caches, tokens), args.steps),
        "prefill 256x1": (lambda: _prefill(model, prompt), 1),
    }
    out: dict[str, list[float]] = {}
    for name, (fn, per_sample) in cases.items():
        samples: dict[int, list[float]] = {on: [], 1 << 30: []}
        for _ in range(max(3, args.reps)):
            for threshold in samples:
                native_ops.NATIVE_MIN_ROWS = threshold
                samples[threshold].append(_median_s(fn, 1, per_sample))
        native_ops.NATIVE_MIN_ROWS = on
        medians = [statistics.median(v) for v in samples.values()]
        out[name] = (
            [m * 1000 for m in medians] if name.startswith("decode") else [256 / m for m in medians]
        )
    return out


def _decode_ab(model: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """The native decode step on and off in this one process, samples interleaved:
    [on, off] median ms per decode step at each batch size."""
    import mlx.core as mx

    backbone = model.model
    native = backbone.__dict__.get("_mlxcel_native")
    if native is None:
        return {}
    out: dict[str, list[float]] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        caches = _filled_caches(model, batch, args.context)
        tokens = mx.random.randint(100, model.args.vocab_size, (batch, 1), key=mx.random.key(9))
        samples: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(max(3, args.reps)):
            for on in samples:
                backbone._mlxcel_native = native if on else None
                run = lambda c=caches, t=tokens: _decode_step(model, c, t)  # noqa: E731
                samples[on].append(_median_s(run, 1, args.steps))
        backbone._mlxcel_native = native
        out[f"decode B={batch}"] = [statistics.median(samples[k]) * 1000 for k in (True, False)]
    chunk = native._chunk
    if chunk is not None:
        prompt = mx.random.randint(100, model.args.vocab_size, (1, 256), key=mx.random.key(256))
        prefill: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(max(3, args.reps)):
            for on in prefill:
                native._chunk = chunk if on else None
                prefill[on].append(_median_s(lambda: _prefill(model, prompt), 1, 1))
        native._chunk = chunk
        out["prefill 256x1"] = [256 / statistics.median(prefill[k]) for k in (True, False)]
    return out


def _profile(model: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    import mlx.core as mx

    profile = _Profile()
    profile.install(model)
    vocab = model.args.vocab_size
    caches = _filled_caches(model, 8, args.context)
    tokens = mx.random.randint(100, vocab, (8, 1), key=mx.random.key(8))
    prompt = mx.random.randint(100, vocab, (1, 256), key=mx.random.key(256))
    return [
        profile.report("decode B=8", lambda: _decode_step(model, caches, tokens), args.steps),
        profile.report("prefill 256x1", lambda: _prefill(model, prompt), 2),
    ]


def child(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlxcel.daemon.forward.blas import blas_label, openblas_coretype

    model = _load(args.model, args.fast)
    vocab = model.args.vocab_size
    out: dict[str, Any] = {"blas": blas_label(), "coretype": openblas_coretype()}
    for batch in [int(b) for b in args.batches.split(",")]:
        caches = _filled_caches(model, batch, args.context)
        tokens = mx.random.randint(100, vocab, (batch, 1), key=mx.random.key(batch))
        run = lambda c=caches, t=tokens: _decode_step(model, c, t)  # noqa: E731
        step = _median_s(run, args.reps, args.steps)
        out[f"decode B={batch}"] = step * 1000
    for length, rows in PREFILLS:
        prompt = mx.random.randint(100, vocab, (rows, length), key=mx.random.key(length))
        took = _median_s(lambda p=prompt: _prefill(model, p), max(3, args.reps // 2), 1)
        out[f"prefill {length}x{rows}"] = length * rows / took
    if args.decode_ab:
        out["decode on/off"] = _decode_ab(model, args)
    if args.profile:
        out["native on/off"] = _native_ab(model, args)
        out["profile"] = _profile(model, args)
        out["bandwidth"] = _bandwidth_gbs()
    print(json.dumps(out))


# ---- the parent: every stage, one table ----------------------------------------------------


def _cast_float32(model: Any) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    cast = [
        (k, v.astype(mx.float32))
        for k, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32
    ]
    model.update(tree_unflatten(cast))
    mx.eval(model.parameters())


def _quant_models(spec: str) -> dict[str, Any]:
    """name -> model on the native steps: as it comes quantized, requantized to 8 bits, float32."""
    import mlx.nn as nn
    import mlx_lm
    from mlxcel.daemon.forward.fast_forward import apply_fast_forward
    from mlxcel.daemon.models.loader import apply_dtype, resolve_spec

    path = str(resolve_spec(spec).path)
    models: dict[str, Any] = {}
    quant, _ = mlx_lm.load(path)
    layer = quant.layers[0].mlp.down_proj
    if isinstance(layer, nn.QuantizedLinear):
        _cast_float32(quant)
        models[f"{layer.bits}-bit g{layer.group_size}"] = quant
    eight, _ = mlx_lm.load(path)
    apply_dtype(eight, "float32", "cpu")
    nn.quantize(eight, group_size=64, bits=8)
    models["8-bit g64"] = eight
    plain, _ = mlx_lm.load(path)
    apply_dtype(plain, "float32", "cpu")
    models["float32"] = plain
    for model in models.values():
        if not apply_fast_forward(model, "cpu"):
            raise SystemExit("bench_forward: the fast forward does not take this model")
    return models


def _qmatmul_tiles(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """ms per product, SmolLM2's layer shapes, 4-bit group 32: dequantized tiles into
    cblas_sgemm, the few-row kernel in 16-row blocks, and float32 cblas_sgemm (MLX matmul)."""
    import mlx.core as mx
    import numpy as np
    from mlxcel.daemon.forward import native_ops

    out: dict[str, dict[str, float]] = {}
    for in_dims, out_dims in ((576, 960), (576, 576), (576, 3072), (1536, 576)):
        w = mx.random.normal((out_dims, in_dims), key=mx.random.key(in_dims + out_dims))
        q, scales, biases = mx.quantize(w, group_size=32, bits=4)
        arrays = [np.ascontiguousarray(np.asarray(a)) for a in (q, scales, biases)]
        wt = w.T
        mx.eval(wt)
        for rows in (64, 128, 256, 512):
            x = mx.random.normal((rows, in_dims), key=mx.random.key(rows))
            mx.eval(x)

            def product(x: Any = x, arrays: list[Any] = arrays) -> Any:
                return native_ops.qmatmul(x, *arrays, 4, 32)

            cases = {
                "tiles": ("tiles", product),
                "direct": ("direct", product),
                "float32": ("", lambda x=x, wt=wt: mx.eval(x @ wt)),
            }
            samples: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(max(3, args.reps)):
                for name, (mode, fn) in cases.items():
                    os.environ["MLXCEL_QUANT_BIG"] = mode
                    samples[name].append(_median_s(fn, 1, 3))
            os.environ.pop("MLXCEL_QUANT_BIG", None)
            out[f"{rows}x{in_dims}->{out_dims}"] = {
                k: statistics.median(v) * 1000 for k, v in samples.items()
            }
    return out


def quant_child(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlxcel.daemon.forward import native_decode, native_ops

    models = _quant_models(args.model)
    first = next(iter(models.values()))
    vocab = first.args.vocab_size
    out: dict[str, Any] = {"path": native_ops.quant_path(), "models": list(models)}
    for name, model in models.items():
        if not native_decode.is_installed(model):
            raise SystemExit(f"bench_forward: the native steps do not take the {name} model")
    cases: dict[str, dict[str, Callable[[], Any]]] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        tokens = mx.random.randint(100, vocab, (batch, 1), key=mx.random.key(batch))
        fns: dict[str, Callable[[], Any]] = {}
        for name, m in models.items():
            caches = _filled_caches(m, batch, args.context)
            fns[name] = lambda m=m, c=caches, t=tokens: _decode_step(m, c, t)
        cases[f"decode B={batch}"] = fns
    prompt = mx.random.randint(100, vocab, (1, 256), key=mx.random.key(256))
    cases["prefill 256x1"] = {n: (lambda m=m: _prefill(m, prompt)) for n, m in models.items()}
    for case, fns in cases.items():
        per_sample = args.steps if case.startswith("decode") else 1
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(max(3, args.reps)):
            for name, fn in fns.items():
                samples[name].append(_median_s(fn, 1, per_sample))
        medians = {k: statistics.median(v) for k, v in samples.items()}
        if case.startswith("decode"):
            out[case] = {k: v * 1000 for k, v in medians.items()}
        else:
            out[case] = {k: 256 / v for k, v in medians.items()}
    out["bytes"] = {
        name: sum(v.nbytes for _, v in tree_leaves(m.parameters())) for name, m in models.items()
    }
    out["qmatmul"] = _qmatmul_tiles(args)
    print(json.dumps(out))


def tree_leaves(params: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def _print_quant(result: dict[str, Any]) -> None:
    names = result["models"]
    print(f"\nquantized stage (native steps; quantized kernels on the {result['path']} path):")
    print(f"| {'case':<16} | " + " | ".join(f"{n:>15}" for n in names) + " |")
    print("|" + "-" * 18 + "|" + "|".join("-" * 17 for _ in names) + "|")
    for case, values in result.items():
        if not case.startswith(("decode", "prefill")):
            continue
        unit = "ms" if case.startswith("decode") else "tok/s"
        cells = [f"{values[n]:>9.1f} {unit:<5}" for n in names]
        print(f"| {case:<16} | " + " | ".join(cells) + " |")
    sizes = ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in result["bytes"].items())
    print(f"parameters: {sizes}")
    print("\nquantized matmul, 4-bit g32, ms (tiles into cblas_sgemm / direct / float32 sgemm):")
    for shape, t in result["qmatmul"].items():
        print(f"  {shape:<18} {t['tiles']:7.2f} / {t['direct']:7.2f} / {t['float32']:7.2f}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="decode steps per timed sample")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fast", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode-ab", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-profile", action="store_true", help="skip the per-op profile")
    parser.add_argument("--quant-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-quant", action="store_true", help="skip the quantized stage")
    parser.add_argument("--quant-only", action="store_true", help="only the quantized stage")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quant_child:
        quant_child(args)
        return
    if find_system_openblas() is None:
        sys.exit("bench_forward: no system OpenBLAS (scripts/setup.sh installs it)")
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "avx2", "fma")))
    operator = os.environ.get(CORETYPE_ENV)
    print(f"model {args.model}, context {args.context}/row, {os.cpu_count()} CPUs: {_cpu_name()}")
    print(f"CPU flags: {' '.join(flags) or '(none of avx2/avx512/fma)'}")
    if operator:
        print(f"OPENBLAS_CORETYPE={operator} set by the operator: kept in every stage")
    cols = [f"decode B={b}" for b in args.batches.split(",")]
    cols += [f"prefill {n}x{r}" for n, r in PREFILLS]
    rows = []
    for name, blas, fast in () if args.quant_only else STAGES:
        argv = [sys.executable, __file__, "--child", "--model", args.model]
        argv += ["--batches", args.batches, "--context", str(args.context)]
        argv += ["--reps", str(args.reps), "--steps", str(args.steps)]
        argv += ["--fast"] if fast else []
        argv += ["--profile"] if blas == PROFILED and not args.no_profile else []
        argv += ["--decode-ab"] if blas == "native-decode" else []
        proc = subprocess.run(argv, env=_stage_env(blas), capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"stage {name!r} failed:\n{proc.stderr}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append((name, result))
        print(f"  stage {len(rows)}: {name}: blas {result['blas']}", flush=True)
    if not args.no_quant:
        argv = [sys.executable, __file__, "--quant-child", "--model", args.model]
        argv += ["--batches", args.batches, "--context", str(args.context)]
        argv += ["--reps", str(args.reps), "--steps", str(args.steps)]
        proc = subprocess.run(argv, env=_stage_env("native-decode"), capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"quantized stage failed:\n{proc.stderr}")
        _print_quant(json.loads(proc.stdout.strip().splitlines()[-1]))
    if not rows:
        return
    print()
    head = f"| {'stage':<38} | " + " | ".join(f"{c:>15}" for c in cols) + " |"
    print(head)
    print("|" + "-" * 40 + "|" + "|".join("-" * 17 for _ in cols) + "|")
    for name, result in rows:
        cells = []
        for c in cols:
            unit = "ms" if c.startswith("decode") else "tok/s"
            cells.append(f"{result[c]:>9.1f} {unit:<5}")
        print(f"| {name:<38} | " + " | ".join(cells) + " |")
    profiled = next((r for (n, r), s in zip(rows, STAGES, strict=True) if s[1] == PROFILED), {})
    profiled_name = next(s[0] for s in STAGES if s[1] == PROFILED)
    if "bandwidth" in profiled:
        rates = ", ".join(f"{k} {v:.1f} GB/s" for k, v in profiled["bandwidth"].items())
        print(f"\nmemory read rate in this run (256 MB of float32): {rates}")
    for case, (on, off) in rows[-1][1].get("decode on/off", {}).items():
        step, unit = ("decode", "ms") if case.startswith("decode") else ("chunk", "tok/s")
        print(
            f"native {step} step on / off in one process, interleaved: {case} "
            f"{on:.1f} / {off:.1f} {unit}"
        )
    for case, (on, off) in profiled.get("native on/off", {}).items():
        unit = "ms" if case.startswith("decode") else "tok/s"
        print(
            f"native ops on / off in one process, interleaved: {case} {on:.1f} / {off:.1f} {unit}"
        )
    for prof in profiled.get("profile", []):
        print(f"\nprofile, {prof['title']} ({profiled_name.lstrip('+ ')}): {prof['total']:.1f} ms")
        print("each op evaluated on its own: one sync (~30 us) per op more than a real step")
        for op, ms in sorted(prof["ops"].items(), key=lambda kv: -kv[1]):
            print(f"  {op:<50} {ms:8.2f} ms  {100 * ms / prof['total']:5.1f} %")


if __name__ == "__main__":
    main()
