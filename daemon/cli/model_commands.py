"""`mlxcel-daemon models pull|list|rm|show|run|pin|unpin` and `load` / `unload` / `pin` /
`unpin` / `ps` (docs/models.md).

`add_models_parser(subparsers)` and `add_host_parsers(subparsers)` plug these into the
daemon's argparse tree; `run_models(args)` executes them.
`python -m mlxcel.daemon.cli.model_commands ...` works on its own too. `load`, `unload`, `pin`,
`unpin`, `ps` and the `loaded` column talk to a running daemon over its control socket; the rest
works on the files alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.daemon.models.registry import (
    DEFAULT_MODEL,
    list_models,
    resolve_alias,
)
from mlxcel.shared.config import format_size as _format_size

DEFAULT_PROMPT = "What is the capital of France?"
EXIT_NOT_RUNNING = 3
QUERY_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 600.0


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `models` command (pull / list / rm / show / run / pin / unpin) to a subparsers
    object."""
    parser = subparsers.add_parser("models", help="fetch, list, remove and inspect local models")
    sub = parser.add_subparsers(
        dest="models_command", metavar="{pull,list,rm,show,run,pin,unpin}", required=True
    )
    pull = sub.add_parser(
        "pull", help="fetch an alias or repo id, or import a local directory / .gguf"
    )
    pull.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL,
        help="alias, Hugging Face repo id (owner/name), MLX/HF directory or .gguf file",
    )
    pull.add_argument("--name", dest="as_name", default=None, help="store it under this name")
    pull.add_argument(
        "--link", action="store_true", help="reference a local directory/.gguf instead of copying"
    )
    pull.add_argument("--force", action="store_true", help="fetch or import again")
    show = sub.add_parser("list", help="list local models (store and Hugging Face cache)")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.add_argument("--no-hf-cache", action="store_true", help="only the mlxcel store")
    rm = sub.add_parser("rm", help="remove a local model (files and entry)")
    rm.add_argument("name")
    rm.add_argument("--force", action="store_true", help="unload it first if the daemon has it")
    rm.add_argument("--socket", default=None, help="control socket path")
    info = sub.add_parser("show", help="a model's config, template and capabilities")
    info.add_argument("name")
    info.add_argument("--json", action="store_true", help="print JSON")
    run = sub.add_parser("run", help="greedy-generate an answer to one chat prompt")
    run.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    run.add_argument("--model", default=DEFAULT_MODEL, help="alias, directory, .gguf or repo id")
    run.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    run.add_argument("--max-tokens", type=int, default=64)
    _add_pin_parsers(sub)
    parser.set_defaults(func=run_models)
    return parser


def _add_pin_parsers(subparsers: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """`pin NAME` / `unpin NAME` (both `mlxcel-daemon pin` and `mlxcel-daemon models pin`)."""
    pin = subparsers.add_parser(
        "pin", help="keep a model resident in the running daemon (loads it first if need be)"
    )
    pin.add_argument("name", help="a local model name, alias, repo id or path")
    unpin = subparsers.add_parser(
        "unpin", help="let the running daemon evict or keep-alive unload a pinned model again"
    )
    unpin.add_argument("name")
    for command, parser in (("pin", pin), ("unpin", unpin)):
        parser.add_argument("--socket", default=None, help="control socket path")
        parser.set_defaults(func=run_host, host_command=command)
    return [pin, unpin]


def add_host_parsers(subparsers: argparse._SubParsersAction) -> None:
    """`load NAME`, `unload [NAME]`, `pin NAME`, `unpin NAME`, `ps`: the running daemon's
    models."""
    load = subparsers.add_parser("load", help="load a model into the running daemon")
    load.add_argument("name", help="a local model name, alias, repo id or path")
    unload = subparsers.add_parser("unload", help="unload a model (default: all) from the daemon")
    unload.add_argument("name", nargs="?", default=None)
    ps = subparsers.add_parser("ps", help="the models the running daemon holds")
    ps.add_argument("--json", action="store_true", help="print JSON")
    for command, parser in (("load", load), ("unload", unload), ("ps", ps)):
        parser.add_argument("--socket", default=None, help="control socket path")
        parser.set_defaults(func=run_host, host_command=command)
    _add_pin_parsers(subparsers)


# --- talking to the running daemon ------------------------------------------------------------


class NotRunning(Exception):
    pass


def daemon_call(
    method: str, params: dict[str, Any] | None, socket: str | None, timeout: float
) -> Any:
    """One control call; NotRunning when no daemon answers, ModelLoadError when it refuses."""
    from mlxcel.daemon.cli import control_commands as cli_control
    from mlxcel.daemon.process.lifecycle import running_pid
    from mlxcel.shared.control_client import ControlError, NotConnected
    from mlxcel.shared.paths import get_paths

    paths = get_paths()
    if socket is None and running_pid(paths) is None:
        raise NotRunning("mlxcel-daemon is not running")
    try:
        return cli_control.call(cli_control.socket_for(paths, socket), method, params, timeout)
    except ControlError as exc:
        raise ModelLoadError(str(exc)) from None
    except (NotConnected, OSError, asyncio.TimeoutError) as exc:
        raise NotRunning(f"the daemon's control socket does not answer ({exc})") from None


def loaded_models(socket: str | None = None) -> list[dict[str, Any]] | None:
    """The running daemon's models (`model.list`), or None when no daemon answers."""
    try:
        return list(daemon_call("model.list", {}, socket, QUERY_TIMEOUT_S)["models"])
    except NotRunning:
        return None


def _is_loaded(name: str, loaded: list[dict[str, Any]] | None) -> bool:
    if not loaded:
        return False
    try:
        target = resolve_alias(name)
    except ModelLoadError:
        target = name
    return any(
        name in m.get("names", ()) or target in m.get("names", ()) or m.get("name") == target
        for m in loaded
    )


# --- the commands -------------------------------------------------------------------------


def _pull(args: argparse.Namespace) -> int:
    from mlxcel.daemon.models.pull import pull

    result = pull(args.name, name=args.as_name, link=args.link, force=args.force)
    print(result.describe())
    return 0


def _list(args: argparse.Namespace) -> int:
    models = list_models(include_hf_cache=not args.no_hf_cache)
    loaded = loaded_models()
    rows = [(m, _is_loaded(m.name, loaded)) for m in models]
    if args.json:
        print(json.dumps([{**m.to_dict(), "loaded": flag} for m, flag in rows], indent=2))
        return 0
    if not models:
        print(f"no local models (run `mlxcel-daemon models pull` to fetch {DEFAULT_MODEL})")
        return 0
    header = ("NAME", "FAMILY", "SIZE", "QUANTIZATION", "CONTEXT", "LOADED", "KIND", "SOURCE")
    table = [header] + [
        (
            m.name,
            m.family or "-",
            _format_size(m.size_bytes),
            m.quantization or "-",
            str(m.context_length or "-"),
            "yes" if flag else ("broken" if not m.complete else "no"),
            m.kind,
            m.source,
        )
        for m, flag in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def _rm(args: argparse.Namespace) -> int:
    from mlxcel.daemon.models.pull import remove

    loaded = loaded_models(args.socket)
    if _is_loaded(args.name, loaded):
        if not args.force:
            raise ModelLoadError(
                f"{args.name!r} is loaded in the running daemon; unload it first "
                f"(`mlxcel-daemon unload {args.name}`) or pass --force"
            )
        daemon_call("model.unload", {"name": args.name}, args.socket, LOAD_TIMEOUT_S)
        print(f"unloaded {args.name} from the daemon")
    for path in remove(args.name):
        print(f"removed {args.name} ({path})")
        for cached in _forget_prompt_cache(path):
            print(f"removed its prompt cache on disk ({cached})")
    return 0


def _forget_prompt_cache(model_path: Path) -> list[Path]:
    """The disk tier's folders of a removed model, where the config puts the tier."""
    from mlxcel.daemon.engine.disk_cache import forget_model
    from mlxcel.daemon.process.option_sources import resolve_config
    from mlxcel.shared.paths import get_paths

    paths = get_paths()
    try:
        cfg, _ = resolve_config({}, paths.config_file)
        root = Path(cfg.prompt_cache_dir) if cfg.prompt_cache_dir else paths.prompt_cache_dir
    except Exception:  # a broken config file: the default place
        root = paths.prompt_cache_dir
    return forget_model(root, model_path)


def _show(args: argparse.Namespace) -> int:
    from mlxcel.daemon.models.inspect import describe_model

    info = describe_model(args.name)
    info["loaded"] = _is_loaded(args.name, loaded_models())
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    caps = info["capabilities"]
    print(f"{info['name']}  ({info['source']})")
    print(f"  path:          {info['path']}")
    print(f"  family:        {info['family']}")
    print(f"  size:          {_format_size(info['size_bytes'])}")
    print(f"  quantization:  {info['quantization']}")
    gguf = info.get("gguf")
    if gguf:
        print(f"  gguf source:   {gguf['source']}")
        became = gguf.get("converted_to") or {}
        for cls, kind in gguf["tensor_types"].items():
            print(f"    {cls}: {kind}" + (f" -> {became[cls]}" if cls in became else ""))
    print(f"  kind:          {info.get('kind', 'chat')}")
    embedding = info.get("embedding")
    if embedding:
        norm = "L2-normalised" if embedding["normalize"] else "not normalised"
        print(f"  embedding:     {embedding['width']} wide, {embedding['pooling']} pooling, {norm}")
    print(f"  context:       {info['context_length'] or '-'}")
    print(f"  loaded:        {'yes' if info['loaded'] else 'no'}")
    can_batch = "yes" if caps["can_batch"] else f"no ({caps['batch_reason']})"
    print(f"  can batch:     {can_batch}")
    print(f"  tool calling:  {'yes' if caps['tools'] else 'no'}")
    print(f"  chat template: {'yes' if info['template'] else 'none'}")
    print("  config:")
    for key, value in info["config"].items():
        print(f"    {key}: {value}")
    if info["template"]:
        print("  template:")
        for line in info["template"].splitlines()[:20]:
            print(f"    {line}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from mlxcel.daemon.forward.blas import ensure_fast_blas

    # Before mlx is imported: re-exec with the system OpenBLAS preloaded (Linux).
    ensure_fast_blas()
    import mlx_lm
    from mlxcel.daemon.models.loader import load_model

    start = time.perf_counter()
    loaded = load_model(args.model, args.dtype)
    info = loaded.info
    print(
        f"[mlxcel] {info.name}: {info.family}, {info.dtype}, {info.backend}/{info.blas}, "
        f"loaded in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    messages = [{"role": "user", "content": args.prompt}]
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = mlx_lm.generate(loaded.model, loaded.tokenizer, prompt, max_tokens=args.max_tokens)
    print(text.strip())
    return 0


def run_models(args: argparse.Namespace) -> int:
    """Run a parsed `models ...` command; one-line errors on stderr, exit status returned."""
    handlers = {"pull": _pull, "list": _list, "rm": _rm, "show": _show, "run": _run}
    if args.models_command in ("pin", "unpin"):
        return run_host(args)
    try:
        return handlers[args.models_command](args)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # `models list | head`: the CLI's main says nothing more
    except OSError as exc:  # a file the command reads or writes (disk full, permissions)
        what = exc.strerror or str(exc) or type(exc).__name__
        print(f"error: {what}" + (f" ({exc.filename})" if exc.filename else ""), file=sys.stderr)
        return 1
    except NotRunning as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except KeyboardInterrupt:
        return 130


def _print_models(status: dict[str, Any]) -> None:
    models = status.get("models") or []
    if not models:
        print(
            "no model loaded"
            + (f" (default: {status['default']})" if status.get("default") else "")
        )
    for m in models:
        if m.get("state") == "loading":
            print(f"{m['name']}  loading")
            continue
        expires = m.get("expires_in_s")
        until = (
            "pinned"
            if m.get("pinned")
            else "forever"
            if m.get("keep_alive_s", status.get("keep_alive_s")) is None
            else ("busy" if expires is None else f"unloads in {expires:.0f} s")
        )
        print(
            f"{m['name']}  {m.get('state')}  {m.get('family')}  "
            f"weights {_format_size(int(m.get('weights_bytes') or 0))}  "
            f"loaded in {m.get('load_s', 0):.2f} s  {m.get('active_requests', 0)} active  {until}"
        )
    budget = status.get("models_memory")
    if budget is not None:
        used = int(status.get("resident_weights_bytes") or 0)
        print(f"models memory {_format_size(used)} of {_format_size(int(budget))}")
    print(
        f"loads {status.get('loads', 0)}, unloads {status.get('unloads', 0)}, "
        f"failed loads {status.get('load_failures', 0)}, "
        f"load time {status.get('load_seconds_total', 0):.2f} s"
    )


def run_host(args: argparse.Namespace) -> int:
    """`load` / `unload` / `pin` / `unpin` / `ps` against the running daemon."""
    command = getattr(args, "host_command", None) or args.command
    try:
        if command == "load":
            started = time.perf_counter()
            state = daemon_call("model.load", {"name": args.name}, args.socket, LOAD_TIMEOUT_S)
            print(f"loaded {state['name']} in {time.perf_counter() - started:.1f} s")
        elif command == "unload":
            params = {"name": args.name} if args.name else {}
            result = daemon_call("model.unload", params, args.socket, LOAD_TIMEOUT_S)
            names = ", ".join(result["unloaded"]) or "nothing"
            kept = result.get("pinned") or []
            print(f"unloaded {names}" + (f" (kept pinned: {', '.join(kept)})" if kept else ""))
        elif command in ("pin", "unpin"):
            state = daemon_call(
                f"model.{command}", {"name": args.name}, args.socket, LOAD_TIMEOUT_S
            )
            print(f"{command}ned {state['name']}")
        else:
            status = daemon_call("model.list", {}, args.socket, QUERY_TIMEOUT_S)
            if args.json:
                print(json.dumps(status, indent=2))
            else:
                _print_models(status)
        return 0
    except ModelLoadError as exc:
        print(f"mlxcel-daemon: error: {exc}", file=sys.stderr)
        return 1
    except NotRunning as exc:
        print(f"mlxcel-daemon: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.daemon.cli.model_commands")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    # Standalone, `models` is implied: `python -m mlxcel.daemon.cli.model_commands pull`.
    if argv[:1] != ["models"] and argv[:1] not in (["-h"], ["--help"]):
        argv.insert(0, "models")
    return run_models(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
