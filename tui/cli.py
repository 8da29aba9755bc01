"""`mlxcel-top [--socket PATH | --url URL [--api-key KEY]] [--interval MS] [--once [--json]]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from mlxcel.shared.control_client import ControlError, NotConnected
from mlxcel.shared.paths import default_socket_path
from mlxcel.shared.snapshot import Snapshot

EXIT_UNREACHABLE = 1
EXIT_MISMATCH = 3


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mlxcel-top", description="Live operator console for the mlxcel daemon."
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        default=None,
        help=f"control socket (default: {default_socket_path()})",
    )
    parser.add_argument(
        "--interval",
        metavar="MS",
        type=int,
        default=1000,
        help="refresh interval in milliseconds (default 1000, at least 100)",
    )
    parser.add_argument(
        "--url",
        metavar="URL",
        default=None,
        help="watch a daemon over HTTP instead (http://HOST:PORT; its /v1/control WebSocket)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("MLXCEL_API_KEY") or None,
        help="the key for --url (default $MLXCEL_API_KEY); a read-only key watches only",
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print the snapshot JSON")
    args = parser.parse_args(argv)
    if args.json and not args.once:
        parser.error("--json needs --once")
    if args.interval < 100:
        parser.error("--interval must be at least 100 ms")
    return args


async def fetch_status(
    socket_path: str, api_key: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hello, status) from the daemon; raises NotConnected, VersionMismatch, ControlError."""
    from .link import open_client

    client = await open_client(socket_path, api_key=api_key)
    try:
        return dict(client.hello), await client.call("status", timeout=10.0)
    finally:
        await client.close()


def run_once(socket_path: str, as_json: bool, api_key: str | None = None) -> int:
    from .frame import render_frame
    from .link import VersionMismatch

    try:
        _, status = asyncio.run(fetch_status(socket_path, api_key))
    except NotConnected as exc:
        print(f"mlxcel-top: no daemon reachable ({exc})", file=sys.stderr)
        return EXIT_UNREACHABLE
    except VersionMismatch as exc:
        print(f"mlxcel-top: {exc}", file=sys.stderr)
        return EXIT_MISMATCH
    except ControlError as exc:
        print(f"mlxcel-top: the daemon refused status: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    text = json.dumps(status, indent=2, sort_keys=True) + "\n" if as_json else None
    try:
        sys.stdout.write(text or render_frame(Snapshot.from_dict(status)))
        sys.stdout.flush()
    except BrokenPipeError:
        # `mlxcel-top --once | head`: the reader left; say nothing more (Python docs recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    socket_path = str(args.socket or default_socket_path())
    if args.once:
        return run_once(args.url or socket_path, args.json, args.api_key)
    from mlxcel.shared.alerts import read_alert_rules
    from mlxcel.shared.config import ConfigError
    from mlxcel.shared.paths import get_paths

    from .app import make_app

    try:
        rules = read_alert_rules(get_paths().config_file)
    except ConfigError as exc:
        print(f"mlxcel-top: [alerts]: {exc}", file=sys.stderr)
        return 2
    app = make_app(
        socket_path,
        interval_ms=args.interval,
        url=args.url,
        api_key=args.api_key,
        alert_rules=rules,
    )
    app.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
