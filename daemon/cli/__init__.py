"""`mlxcel-daemon`: start, stop, restart, status, logs, set, models, install-service.

Light on imports (no mlx) so that `status`, `stop` and `set` answer fast and the serving
process can preload OpenBLAS before anything imports mlx. Failures print one line
(`mlxcel-daemon: error: ...`) and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxcel.daemon.cli import control_commands as cli_control
from mlxcel.daemon.process.lifecycle import (
    LifecycleError,
    check_socket_path,
    clean_stale,
    log_offset,
    read_state,
    running_pid,
    spawn_detached,
    wait_until_healthy,
)
from mlxcel.daemon.process.option_sources import resolve_config
from mlxcel.shared import __version__
from mlxcel.shared.config import ConfigError, ServingConfig
from mlxcel.shared.paths import Paths, get_paths

DEFAULT_START_WAIT_S = 600.0
DEFAULT_STOP_TIMEOUT_S = 30.0
MAX_WAIT_S = 86400.0  # --wait and --timeout: a day at most

# (flag, dest, help); every value is parsed by mlxcel.shared.config, not by argparse.
SERVING_OPTIONS = (
    ("--model", "model", "alias, Hugging Face repo id, MLX/HF directory or .gguf file"),
    ("--host", "host", "HTTP host (default 127.0.0.1; non-loopback needs --api-key)"),
    ("--port", "port", "HTTP port (default 8080; 0 picks a free one)"),
    ("--api-key", "api_key", "Bearer key for the HTTP API (not for /health)"),
    ("--socket", "socket", "control socket path (default: runtime dir mlxcel.sock)"),
    ("--parallel", "parallel", "decode slots (default 4)"),
    ("--max-batch-prefill", "max_batch_prefill", "max prompts per batched prefill (default 4)"),
    ("--prefill-chunk-size", "prefill_chunk_size", "tokens per engine step (default 2048)"),
    (
        "--max-batch-prefill-tokens",
        "max_batch_prefill_tokens",
        "cap on padded tokens per batched prefill (default 2 x max-batch-prefill x "
        "min(chunk, 512) = 4096; 0 = off)",
    ),
    ("--prompt-cache-bytes", "prompt_cache_bytes", "prompt-cache budget, e.g. 2GiB"),
    (
        "--prompt-cache-dir",
        "prompt_cache_dir",
        "folder of the prompt cache's disk tier (default: the user cache dir)",
    ),
    (
        "--prompt-cache-disk-bytes",
        "prompt_cache_disk_bytes",
        "disk tier budget, e.g. 20GiB (default 1/4 of free disk, at most 32GiB; 0 = off)",
    ),
    ("--warm-prompts", "warm_prompts", "JSON file of prompts (chat bodies or strings) to prefill"),
    ("--kv-cache-budget", "kv_cache_budget", "auto, a size (8GiB) or none"),
    ("--ctx-size", "ctx_size", "total context split across slots (0 = model window per slot)"),
    ("--max-queue-depth", "max_queue_depth", "waiting requests beyond this get 503 (default 64)"),
    ("--dtype", "dtype", "auto, float32, float16 or bfloat16"),
    ("--allowed-origins", "allowed_origins", "CORS origins, comma-separated (default none)"),
    (
        "--allowed-hosts",
        "allowed_hosts",
        "Host header names answered besides loopback and --host, comma-separated (* = any)",
    ),
    ("--api-key-file", "api_key_file", "read the API key from this file's first line"),
    (
        "--api-keys-file",
        "api_keys_file",
        "API keys, one per line with a default priority lane: KEY [high|normal|low]",
    ),
    ("--stream-timeout", "stream_timeout", "seconds a stream may go unread (default 60)"),
    ("--header-timeout", "header_timeout", "seconds to send a request's headers (default 30)"),
    ("--max-connections", "max_connections", "open HTTP connections at most (default 512)"),
    (
        "--reasoning-budget",
        "reasoning_budget",
        "reasoning tokens a thinking model may spend per answer (default: unbounded)",
    ),
    ("--hosts", "hosts", "hosts file: one model across several ranks (docs/distributed.md)"),
    ("--distributed-mode", "distributed_mode", "auto, tensor or pipeline (with --hosts)"),
    ("--distributed-timeout", "distributed_timeout", "seconds a step waits on a rank (default 60)"),
    ("--keep-alive", "keep_alive", "unload a model idle this long (30s, 5m; default forever)"),
    ("--max-loaded-models", "max_loaded_models", "models resident at once (default 1)"),
    (
        "--models-memory",
        "models_memory",
        "bytes the resident models' weights may take together, e.g. 24GiB (default: free memory)",
    ),
    (
        "--request-timeout",
        "request_timeout",
        "seconds a request may take unless it asks otherwise (default: no limit)",
    ),
    (
        "--priority-aging",
        "priority_aging",
        "seconds a waiting request takes to rise one priority lane (default 10; 0 = never)",
    ),
    (
        "--step-timeout",
        "step_timeout",
        "seconds an engine step may take before the watchdog restarts it (default 600; 0 = off)",
    ),
    (
        "--speculative",
        "speculative",
        "speculative decoding: ngram (the default) drafts tokens by prompt lookup, draft "
        "drafts with --draft-model, and the policy turns itself off while that does not pay; "
        "off: one token per row and step",
    ),
    (
        "--draft-model",
        "draft_model",
        "a smaller model of the same tokenizer that drafts for --speculative draft",
    ),
    (
        "--temperature",
        "temperature",
        "sampling temperature (0..2) of a request that sends none (default: the API's, 1)",
    ),
    ("--top-p", "top_p", "top_p (0..1) of a request that sends none (default: the API's, 1)"),
    ("--top-k", "top_k", "top_k of a request that sends none (default: off)"),
    ("--min-p", "min_p", "min_p (0..1) of a request that sends none (default: off)"),
)
SERVING_DESTS = (
    *(dest for _, dest, _ in SERVING_OPTIONS),
    "prompt_cache",
    "strict_api",
    "preemption",
)


class CLIError(Exception):
    """One line for the operator; exit status 1."""


def add_serving_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "serving options", "flag > env MLXCEL_<NAME> > config.toml > default"
    )
    for flag, dest, text in SERVING_OPTIONS:
        group.add_argument(flag, dest=dest, default=None, metavar="VALUE", help=text)
    cache = group.add_mutually_exclusive_group()
    cache.add_argument(
        "--no-prompt-cache",
        dest="prompt_cache",
        action="store_const",
        const=False,
        help="disable the prompt-prefix cache",
    )
    cache.add_argument(
        "--prompt-cache",
        dest="prompt_cache",
        action="store_const",
        const=True,
        help="enable the prompt-prefix cache (the default)",
    )
    group.add_argument(
        "--strict-api",
        dest="strict_api",
        action="store_const",
        const=True,
        help="refuse unknown request fields (400) instead of ignoring them",
    )
    group.add_argument(
        "--no-preemption",
        dest="preemption",
        action="store_const",
        const=False,
        help="a waiting high-lane request never preempts a running lower-lane one",
    )


def serving_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {d: getattr(args, d) for d in SERVING_DESTS if getattr(args, d, None) is not None}


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """Serving flags as command-line words. The API key itself travels in the environment,
    never on the command line; `--api-key-file PATH` does (the child reads the file), unless
    `--api-key` is given too and wins."""
    argv: list[str] = []
    for dest, value in flags.items():
        if dest == "api_key" or (dest == "api_key_file" and flags.get("api_key")):
            continue
        if dest == "prompt_cache":
            argv.append("--prompt-cache" if value else "--no-prompt-cache")
        elif dest == "strict_api":
            argv += ["--strict-api"] if value else []
        elif dest == "preemption":
            argv += [] if value else ["--no-preemption"]
        else:
            argv += [f"--{dest.replace('_', '-')}", str(value)]
    return argv


def argv_to_flags(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(add_help=False)
    add_serving_options(parser)
    return serving_flags(parser.parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxcel-daemon", description="Local LLM serving daemon on MLX."
    )
    parser.add_argument("--version", action="version", version=f"mlxcel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    start = sub.add_parser("start", help="start the daemon (in the background by default)")
    start.add_argument("--foreground", action="store_true", help="serve in this process")
    start.add_argument(
        "--wait",
        type=float,
        default=DEFAULT_START_WAIT_S,
        metavar="S",
        help="seconds to wait for the daemon to become healthy",
    )
    add_serving_options(start)
    stop = sub.add_parser("stop", help="drain in-flight requests, then stop the daemon")
    stop.add_argument("--timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S, metavar="S")
    restart = sub.add_parser("restart", help="stop, then start (reusing the previous options)")
    restart.add_argument("--timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S, metavar="S")
    restart.add_argument("--wait", type=float, default=DEFAULT_START_WAIT_S, metavar="S")
    add_serving_options(restart)
    status = sub.add_parser("status", help="is it running, and how is it doing")
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    status.add_argument("--socket", default=None, help="control socket path")
    logs = sub.add_parser("logs", help="print the daemon's log")
    logs.add_argument("-n", type=int, default=50, metavar="N", help="last N lines (default 50)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    set_ = sub.add_parser(
        "set", help="change runtime settings (parallel, prefill cap, cache, speculative)"
    )
    set_.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    set_.add_argument("--save", action="store_true", help="also write them to config.toml")
    set_.add_argument("--socket", default=None, help="control socket path")
    _add_plugins(sub)
    return parser


def _add_plugins(sub: argparse._SubParsersAction) -> None:
    from mlxcel.daemon.cli.model_commands import add_host_parsers, add_models_parser

    add_models_parser(sub)
    add_host_parsers(sub)
    try:
        from mlxcel.daemon.process.service_units import add_service_parser
    except ImportError:
        return
    add_service_parser(sub)


def resolve(flags: dict[str, Any], paths: Paths) -> tuple[ServingConfig, Path]:
    cfg, _sources = resolve_config(flags, paths.config_file)
    socket_path = Path(cfg.socket).expanduser() if cfg.socket else paths.socket_path
    check_socket_path(socket_path, f"--socket {socket_path}" if cfg.socket else None)
    return cfg, socket_path


def check_seconds(flag: str, value: float) -> float:
    """--wait and --timeout: a finite number of seconds, 0 to a day (nan and 1e999 refused)."""
    if not math.isfinite(value) or not 0.0 <= value <= MAX_WAIT_S:
        raise CLIError(f"{flag} must be between 0 and {MAX_WAIT_S:.0f} seconds, got {value!r}")
    return value


# --- start / stop / restart ---------------------------------------------------------------


def cmd_start(args: argparse.Namespace) -> int:
    check_seconds("--wait", args.wait)
    if args.foreground:
        return start_foreground(serving_flags(args))
    return start_detached(serving_flags(args), args.wait)


def start_foreground(flags: dict[str, Any]) -> int:
    from mlxcel.daemon.forward.blas import ensure_fast_blas

    ensure_fast_blas()  # may re-exec this process with OpenBLAS preloaded; before mlx loads
    paths = get_paths()
    cfg, socket_path = resolve(flags, paths)
    clean_stale(paths, socket_path)
    from mlxcel.daemon.process.daemon import serve

    return serve(cfg, paths, socket_path, flags_to_argv(flags))


def _pull_if_needed(model: str) -> None:
    """First start: fetch the default model here, where the operator sees the progress."""
    from mlxcel.daemon.models.registry import ALIASES, local_model_dir

    if model not in ALIASES or local_model_dir(model) is not None:
        return
    from mlxcel.daemon.models import ModelLoadError
    from mlxcel.daemon.models.pull import pull_model, stderr_progress

    print(f"first start: fetching {model} (once)", file=sys.stderr)
    try:
        pull_model(model, progress=stderr_progress)
    except ModelLoadError as exc:
        raise CLIError(str(exc)) from None


def start_detached(flags: dict[str, Any], wait_s: float) -> int:
    paths = get_paths()
    cfg, socket_path = resolve(flags, paths)
    pid = running_pid(paths)
    if pid is not None:
        raise CLIError(f"mlxcel-daemon is already running (pid {pid}); see `mlxcel-daemon status`")
    removed = clean_stale(paths, socket_path)
    if removed:
        names = ", ".join(p.name for p in removed)
        print(f"removed stale files of a daemon that is gone: {names}", file=sys.stderr)
    _pull_if_needed(cfg.model)
    if flags.get("api_key"):
        os.environ["MLXCEL_API_KEY"] = str(flags["api_key"])  # not on the command line
    offset = log_offset(paths.log_file)
    proc = spawn_detached(flags_to_argv(flags), paths.log_file)
    try:
        state = wait_until_healthy(proc, paths, paths.log_file, offset, wait_s)
    except LifecycleError as exc:
        raise CLIError(str(exc)) from None
    except KeyboardInterrupt:
        raise CLIError(f"interrupted; the daemon (pid {proc.pid}) may still be starting") from None
    print(f"mlxcel-daemon started (pid {state['pid']})")
    print(f"  http:   {state['http_url']}")
    print(f"  socket: {state['socket']}")
    print(f"  log:    {state['log_file']}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    check_seconds("--timeout", args.timeout)
    paths = get_paths()
    pid = running_pid(paths)
    if pid is None:
        clean_stale(paths)
        print("mlxcel-daemon is not running")
        return 0
    message = cli_control.stop_daemon(paths, pid, args.timeout)
    print(message)
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    check_seconds("--timeout", args.timeout)
    check_seconds("--wait", args.wait)
    paths = get_paths()
    flags = serving_flags(args)
    state = read_state(paths) or {}
    pid = running_pid(paths)
    if not flags and isinstance(state.get("argv"), list):
        flags = argv_to_flags([str(a) for a in state["argv"]])
    cfg, _ = resolve(flags, paths)
    if pid is not None and state.get("auth") and not cfg.api_key:
        raise CLIError(
            "the running daemon uses an API key: pass --api-key (or --api-key-file) again "
            "to restart"
        )
    if pid is not None:
        print(cli_control.stop_daemon(paths, pid, args.timeout))
    return start_detached(flags, args.wait)


# --- dispatch -----------------------------------------------------------------------------


def _dispatch(args: argparse.Namespace) -> int:
    command = args.command
    if command == "start":
        return cmd_start(args)
    if command == "stop":
        return cmd_stop(args)
    if command == "restart":
        return cmd_restart(args)
    if command == "status":
        return cli_control.cmd_status(args)
    if command == "logs":
        return cli_control.cmd_logs(args)
    if command == "set":
        return cli_control.cmd_set(args)
    if command in ("models", "load", "unload", "pin", "unpin", "ps"):
        return int(args.func(args) or 0)
    if command in ("install-service", "uninstall-service"):
        from mlxcel.daemon.process.service_units import run_service

        return run_service(args)
    raise CLIError(f"unknown command {command!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _dispatch(args)
    except (CLIError, ConfigError, LifecycleError, cli_control.ControlCommandError) as exc:
        print(f"mlxcel-daemon: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `mlxcel-daemon status | head -1`: the reader left; say nothing more (and keep Python
        # from complaining about the closed stdout at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
