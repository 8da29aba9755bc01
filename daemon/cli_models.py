"""`mlxcel-daemon models pull [NAME] | list [--json] | run PROMPT`.

`add_models_parser(subparsers)` plugs these into the daemon's argparse tree; `run_models(args)`
executes them. `python -m mlxcel.daemon.cli_models ...` works on its own too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.daemon.models.registry import ALIASES, DEFAULT_MODEL, list_models
from mlxcel.shared.config import format_size as _format_size

DEFAULT_PROMPT = "What is the capital of France?"


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `models` command (pull / list / run) to an argparse subparsers object."""
    parser = subparsers.add_parser("models", help="fetch, list and try local models")
    sub = parser.add_subparsers(dest="models_command", metavar="{pull,list,run}", required=True)
    pull = sub.add_parser("pull", help="download and convert a model alias")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(ALIASES))
    pull.add_argument("--force", action="store_true", help="fetch and convert again")
    show = sub.add_parser("list", help="list local models")
    show.add_argument("--json", action="store_true", help="print JSON")
    run = sub.add_parser("run", help="greedy-generate an answer to one chat prompt")
    run.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    run.add_argument("--model", default=DEFAULT_MODEL, help="alias, directory, .gguf or repo id")
    run.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    run.add_argument("--max-tokens", type=int, default=64)
    parser.set_defaults(func=run_models)
    return parser


def _pull(args: argparse.Namespace) -> int:
    from mlxcel.daemon.models.pull import pull_model

    path = pull_model(args.name, force=args.force)
    print(path)
    return 0


def _list(args: argparse.Namespace) -> int:
    models = list_models()
    if args.json:
        print(json.dumps([m.to_dict() for m in models], indent=2))
        return 0
    if not models:
        print(f"no local models (run `mlxcel-daemon models pull` to fetch {DEFAULT_MODEL})")
        return 0
    width = max(len(m.name) for m in models)
    for m in models:
        print(f"{m.name:<{width}}  {_format_size(m.size_bytes):>10}  {m.source}  {m.path}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from mlxcel.daemon.models.blas import ensure_fast_blas

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
    handlers = {"pull": _pull, "list": _list, "run": _run}
    try:
        return handlers[args.models_command](args)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.daemon.cli_models")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    # Standalone, `models` is implied: `python -m mlxcel.daemon.cli_models pull`.
    if argv[:1] != ["models"] and argv[:1] not in (["-h"], ["--help"]):
        argv.insert(0, "models")
    return run_models(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
