"""Starting and stopping the servers under test, with the same model, dtype and BLAS."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
_DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass
class Server:
    name: str
    argv: list[str]
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    preload: str  # LD_PRELOAD it runs with ("" for none)
    coretype: str = ""  # OPENBLAS_CORETYPE it runs with ("" for OpenBLAS's own choice)

    @property
    def blas(self) -> str:
        """Its BLAS environment, as printed before each run."""
        coretype = self.coretype or "(OpenBLAS default)"
        return f"LD_PRELOAD={self.preload or '(none)'} OPENBLAS_CORETYPE={coretype}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blas_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ with the daemon's own BLAS environment (the same for every server): the
    system OpenBLAS and the few-row kernel preloaded, OPENBLAS_CORETYPE from the CPU flags."""
    try:
        from mlxcel.daemon.forward.blas import fast_blas_env

        env = fast_blas_env()
    except ImportError:
        env = dict(os.environ)
        if Path(OPENBLAS).is_file() and OPENBLAS not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = " ".join(filter(None, [OPENBLAS, env.get("LD_PRELOAD")]))
    env.update(extra or {})
    return env


def load_tokenizer(path: Path) -> Any:
    """The model's Hugging Face tokenizer, or None (then prompt lengths are approximate)."""
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # any failure just means approximate counts
        print(f"# no tokenizer from {path} ({type(exc).__name__}); approximating", flush=True)
        return None


def eos_token_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """Every id that ends generation: config.json, generation_config.json, the tokenizer."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((model_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        ids.update([value] if isinstance(value, int) else value or [])
    if tokenizer is not None and isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def daemon_command() -> list[str]:
    script = Path(sys.executable).parent / "mlxcel-daemon"
    if script.is_file():
        return [str(script)]
    found = shutil.which("mlxcel-daemon")
    return [found] if found else [sys.executable, "-m", "mlxcel.daemon.cli"]


def launch(name: str, argv: list[str], env: dict[str, str], port: int, workdir: Path) -> Server:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    preload, coretype = env.get("LD_PRELOAD", ""), env.get("OPENBLAS_CORETYPE", "")
    return Server(name, argv, url, proc, log_path, preload, coretype)


def start_mlxcel(args: argparse.Namespace, port: int, workdir: Path) -> Server:
    argv = [*daemon_command(), "start", "--foreground", "--model", str(args.model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--parallel", str(args.parallel)]
    argv += ["--max-batch-prefill", str(args.max_batch_prefill)]
    if getattr(args, "ctx_size", None):
        argv += ["--ctx-size", str(args.ctx_size)]
    if args.dtype != "auto":
        argv += ["--dtype", args.dtype]
    argv += args.mlxcel_arg
    home = workdir / "mlxcel-home"
    home.mkdir(exist_ok=True)
    return launch("mlxcel", argv, blas_env({"MLXCEL_HOME": str(home)}), port, workdir)


def start_mlx_lm(args: argparse.Namespace, model_dir: Path, port: int, workdir: Path) -> Server:
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    # Matched to mlxcel: decode slots and prompts per batched prefill.
    argv += ["--decode-concurrency", str(args.parallel)]
    argv += ["--prompt-concurrency", str(args.max_batch_prefill)]
    return launch("mlx_lm", argv, blas_env(), port, workdir)


async def wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"{server.name} exited ({server.proc.returncode}):\n{_tail(server)}"
                )
            try:
                async with session.get(f"{server.url}/health") as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{server.name} not healthy after {timeout_s:.0f} s:\n{_tail(server)}")


async def served_model(url: str, kind: str) -> str:
    """The model id to send: mlx_lm's alias for its --model, else the first /v1/models id."""
    if kind == "mlx_lm":
        return "default_model"  # any other name makes mlx_lm.server load that path
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(f"{url}/v1/models") as resp,
        ):
            models = (await resp.json()).get("data") or []
            return str(models[0]["id"]) if models else "default_model"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, AttributeError):
        return "default_model"


def _tail(server: Server, lines: int = 20) -> str:
    try:
        return "\n".join(server.log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_server(server: Server, timeout_s: float = 60.0) -> None:
    """SIGTERM (the daemon drains), then SIGKILL if it is still there."""
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


# ---------------------------------------------------------------- same dtype for mlx_lm


def _safetensors_dtypes(model_dir: Path) -> set[str]:
    dtypes: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        dtypes.update(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return dtypes


def target_dtype(dtype: str) -> str | None:
    """The dtype mlxcel serves with: `auto` is float32 on the CPU, the model's own elsewhere."""
    if dtype != "auto":
        return dtype
    import mlx.core as mx

    return "float32" if mx.default_device().type == mx.cpu else None


def mlx_lm_model_dir(model_dir: Path, dtype: str, workdir: Path) -> Path:
    """`model_dir`, or a copy in the dtype mlxcel serves, so mlx_lm.server runs the same."""
    want = target_dtype(dtype)
    if want is None:
        return model_dir
    config = json.loads((model_dir / "config.json").read_text())
    quantized = "quantization" in config or "quantization_config" in config
    floats = _safetensors_dtypes(model_dir) - {"U32", "I32", "U8", "I64"}
    if not quantized and floats <= {_DTYPE_NAMES[want]}:
        return model_dir
    out = workdir / f"mlx_lm-model-{want}"
    print(f"# mlx_lm: writing a {want} copy of {model_dir} (it is quantized or another dtype)")
    write_dtype_copy(model_dir, out, want, config)
    return out


def write_dtype_copy(src: Path, dst: Path, dtype: str, config: dict[str, Any]) -> None:
    """Dequantize/cast with mlxcel's own loader, so both servers get identical weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlxcel.daemon.forward.fast_forward import DISABLE_ENV
    from mlxcel.daemon.models.loader import load_model

    # mlx-lm's own module layout: our fused CPU forward would save fused q/k/v and gate/up.
    previous = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1"
    try:
        loaded = load_model(str(src), dtype=dtype)
    finally:
        if previous is None:
            os.environ.pop(DISABLE_ENV)
        else:
            os.environ[DISABLE_ENV] = previous
    dst.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(loaded.model.parameters()))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    for path in src.iterdir():
        skip = path.suffix == ".safetensors" or path.name.endswith(".index.json")
        if path.is_file() and not skip and path.name != "config.json":
            shutil.copy2(path, dst / path.name)
    drop = ("quantization", "quantization_config")
    config = {k: v for k, v in config.items() if k not in drop} | {"torch_dtype": dtype}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    del loaded, weights
    mx.clear_cache()


# ---------------------------------------------------------------- llama.cpp's server


def cpu_threads() -> int:
    """The cores this process may run on (llama.cpp's own default counts physical cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def llama_env() -> dict[str, str]:
    """os.environ without an LD_PRELOAD: ggml computes with its own kernels (no BLAS), so the
    daemon's preloaded OpenBLAS and few-row kernel would only add their threads and pages."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("OPENBLAS_CORETYPE", None)
    return env


def start_llama(args: argparse.Namespace, port: int, workdir: Path) -> Server:
    """llama-server on `args.gguf`: `-np` decode slots sharing `-c` (split per slot, as
    mlxcel's --ctx-size), continuous batching, `-t`/`-tb` threads for decode and prompts."""
    threads = str(args.llama_threads or cpu_threads())
    argv = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-c", str(args.ctx_size), "-np", str(args.parallel)]
    argv += ["--cont-batching", "-t", threads, "-tb", threads, "--no-webui"]
    argv += args.llama_arg
    return launch("llama", argv, llama_env(), port, workdir)


def process_memory(pid: int) -> dict[str, int]:
    """A process and its children's memory from /proc (kB summed over the tree): `hwm_kb`
    (VmHWM, each process's peak resident set), `rss_kb` (VmRSS now), `processes`."""
    import psutil

    try:
        tree = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        tree = [pid]
    out = {"hwm_kb": 0, "rss_kb": 0, "processes": 0}
    for p in tree:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out["hwm_kb"] += int(fields.get("VmHWM", "0 kB").split()[0])
        out["rss_kb"] += int(fields.get("VmRSS", "0 kB").split()[0])
        out["processes"] += 1
    return out


def shown_env(server: Server) -> str:
    """The environment a server runs with, as printed before a run."""
    return server.blas if server.preload else "LD_PRELOAD=(none)"


def launch_daemon(
    name: str, extra: list[str], args: argparse.Namespace, tmp: Path
) -> tuple[Server, Path]:
    """An mlxcel daemon named `name` on `args.model` with `--parallel args.parallel`, its own
    MLXCEL_HOME and control socket under `tmp`, on a free 127.0.0.1 port, with `extra` and
    `args.daemon_arg` on its command line; returns it and its socket path."""
    workdir = tmp / name
    home = workdir / "home"
    home.mkdir(parents=True)
    socket_path = tmp / f"{name}.sock"
    port = free_port()
    argv = [*daemon_command(), "start", "--foreground", "--model", str(args.model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--parallel", str(args.parallel)]
    argv += ["--socket", str(socket_path), *extra, *args.daemon_arg]
    env = blas_env({"MLXCEL_HOME": str(home), "MLXCEL_SOCKET": str(socket_path)})
    return launch(name, argv, env, port, workdir), socket_path
