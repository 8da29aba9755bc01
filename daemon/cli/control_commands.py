"""The CLI commands that talk to a running daemon: stop, status, set, logs."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from mlxcel.daemon.process.lifecycle import kill, read_state, running_pid, terminate, wait_for_exit
from mlxcel.shared.config import format_duration, format_size
from mlxcel.shared.control_client import ControlClient, ControlError, NotConnected
from mlxcel.shared.paths import Paths, get_paths
from mlxcel.shared.snapshot import (
    Counters,
    DaemonInfo,
    EffectiveConfig,
    ModelHostInfo,
    Snapshot,
)

EXIT_NOT_RUNNING = 3
CALL_TIMEOUT_S = 10.0
EXIT_GRACE_S = 10.0


class ControlCommandError(RuntimeError):
    """The daemon refused or could not be reached; one line for the operator."""


def socket_for(paths: Paths, override: str | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    state = read_state(paths) or {}
    return Path(state["socket"]) if state.get("socket") else paths.socket_path


async def _calls(
    socket: Path, calls: list[tuple[str, dict[str, Any]]], timeout: float
) -> list[Any]:
    client = ControlClient(socket)
    await client.connect(timeout=CALL_TIMEOUT_S)
    try:
        return [await client.call(m, p, timeout=timeout) for m, p in calls]
    finally:
        await client.close()


def call(socket: Path, method: str, params: dict[str, Any] | None = None, timeout: float = 30.0):
    return asyncio.run(_calls(socket, [(method, params or {})], timeout))[0]


# --- stop ---------------------------------------------------------------------------------


def stop_daemon(paths: Paths, pid: int, timeout: float) -> str:
    """Drain and stop over the socket; SIGTERM when the socket does not answer."""
    try:
        call(socket_for(paths), "shutdown", {"drain": True, "timeout": timeout})
        how = "drained and stopped"
    except (NotConnected, ControlError, OSError, asyncio.TimeoutError):
        how = "stopped with SIGTERM (the control socket did not answer)"
        terminate(pid, 0)
    if wait_for_exit(pid, timeout + EXIT_GRACE_S):
        return f"mlxcel-daemon {how} (pid {pid})"
    if terminate(pid, EXIT_GRACE_S):
        return f"mlxcel-daemon stopped with SIGTERM after {timeout:.0f} s (pid {pid})"
    kill(pid)
    return f"mlxcel-daemon did not exit; killed (pid {pid})"


# --- status -------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    paths = get_paths()
    pid = running_pid(paths)
    if pid is None:
        if args.json:
            print(json.dumps({"running": False}))
        else:
            print("mlxcel-daemon is not running")
        return EXIT_NOT_RUNNING
    state = read_state(paths) or {}
    try:
        snap = call(socket_for(paths, args.socket), "status", timeout=CALL_TIMEOUT_S)
    except (NotConnected, ControlError, OSError, asyncio.TimeoutError):
        what = "starting (loading the model)" if state.get("status") == "loading" else "running"
        if args.json:
            print(json.dumps({"running": True, "pid": pid, "status": state.get("status"), **state}))
        else:
            print(f"mlxcel-daemon is {what} (pid {pid}); the control socket does not answer yet")
            _print_addresses(state)
        return 0
    if args.json:
        print(json.dumps(snap, indent=2))
    else:
        print(format_status(Snapshot.from_dict(snap), state))
    return 0


def _print_addresses(state: dict[str, Any]) -> None:
    for key in ("http_url", "socket", "log_file"):
        if state.get(key):
            print(f"  {key.split('_')[0]}: {state[key]}")


def _mlx_memory_line(d: DaemonInfo) -> str:
    """MLX's active / cache / peak memory (where a GPU keeps the weights and KV)."""
    if d.mlx_active_bytes is None:
        return "n/a"
    figures = (
        ("active", d.mlx_active_bytes),
        ("cache", d.mlx_cache_bytes),
        ("peak", d.mlx_peak_bytes),
    )
    return ", ".join(f"{name} {format_size(value, none='n/a')}" for name, value in figures)


def format_status(snap: Snapshot, state: dict[str, Any]) -> str:
    """`mlxcel-daemon status` as text, from the typed snapshot the console renders too."""
    d, e = snap.daemon, snap.engine
    cfg, kv, pc = e.config, e.kv, e.prompt_cache
    busy = sum(1 for s in e.slots if s.state != "idle")
    clamp = f" (clamped: {cfg.parallel_clamp_reason})" if cfg.parallel_clamp_reason else ""
    total = "unbounded" if kv.blocks_total is None else kv.blocks_total
    cpu = "n/a" if d.cpu_percent is None else f"{d.cpu_percent:.0f}%"
    lines = [
        f"mlxcel-daemon {d.version} running (pid {d.pid}), up {format_duration(d.uptime_s)}",
        f"  model:   {d.model} ({d.backend}, {d.dtype}, blas {d.blas or 'n/a'})",
        *([f"  native:  {d.native}"] if d.native else []),
        f"  http:    {d.http_url}",
        f"  socket:  {d.socket_path}",
        f"  log:     {state.get('log_file', 'n/a')}",
        f"  config:  {get_paths().config_file}",
        f"  slots:   {busy}/{len(e.slots)} busy, {len(e.queue)} waiting",
        f"  serving: parallel {cfg.parallel}{clamp}, max_batch_prefill "
        f"{cfg.max_batch_prefill}, max_batch_prefill_tokens "
        f"{cfg.max_batch_prefill_tokens}, prompt_cache {'on' if cfg.prompt_cache else 'off'}",
        *([f"  sampling: {_sampling_line(d.sampling)}"] if d.sampling else []),
        f"  kv:      {kv.blocks_used}/{total} blocks used, {kv.blocks_cached} cached",
        f"  cache:   {pc.entries} entries, {format_size(pc.bytes)} of "
        f"{format_size(pc.capacity_bytes)}, {pc.hits}/{pc.lookups} hits",
        *([f"  disk:    {pc.disk.summary()}"] if pc.disk is not None else []),
        f"  speculative: {speculative_line(_spec_mode(cfg), e.counters)}",
        f"  process: rss {format_size(d.rss_bytes, none='n/a')}, cpu {cpu}",
        f"  mlx:     {_mlx_memory_line(d)}",
    ]
    if d.host is not None:  # the models held (docs/models.md)
        lines.append(f"  models:  {_models_line(d.host)}")
        for m in d.host.models:  # the forward plan of each (docs/models.md)
            if m.forward:
                who = f"{m.name}: " if len(d.host.models) > 1 else ""
                lines.append(f"  forward: {who}{m.forward}")
    from mlxcel.daemon.distributed.status import group_lines

    group = None if snap.group is None else snap.group.to_dict()
    lines += group_lines(group)  # a distributed group (docs/distributed.md)
    return "\n".join(lines)


def _sampling_line(sampling: dict[str, float]) -> str:
    """`temperature 0.3, top_k 40 (a request's own fields win)`: the daemon's defaults."""
    values = ", ".join(f"{name} {value:g}" for name, value in sampling.items())
    return f"{values} (a request's own fields win)"


def _spec_mode(cfg: EffectiveConfig) -> str:
    """`draft (NAME)` while a draft model drafts, else the mode."""
    if cfg.speculative == "draft" and cfg.draft_model:
        return f"draft ({cfg.draft_model})"
    return cfg.speculative


def speculative_line(mode: str, c: Counters) -> str:
    """`ngram, 78% accepted, 2.9 tokens per verification step, 1204 verification steps`; the
    counts since the start, so a mode switched off still shows what it did."""
    if not c.spec_steps:
        return f"{mode}, no verification step yet" if mode != "off" else "off"
    acceptance = c.spec_acceptance
    accepted = "n/a" if acceptance is None else f"{100 * acceptance:.0f}%"
    per_step = c.spec_tokens_per_step or 0.0
    rows = c.spec_break_even_rows
    if rows is None:
        pays = ""
    elif rows:
        pays = f", pays up to {rows} row{'s' if rows > 1 else ''}"
    else:
        pays = ", pays at no row count"
    return (
        f"{mode}, {accepted} accepted, {per_step:.1f} tokens per verification step, "
        f"{c.spec_steps} verification steps{pays}"
    )


def _models_line(host: ModelHostInfo) -> str:
    held = ", ".join(
        f"{m.name} ({m.state}{', pinned' if m.pinned else ''}, "
        f"{format_size(m.weights_bytes, none='n/a')})"
        for m in host.models
    )
    keep = "forever" if host.keep_alive_s is None else format_duration(host.keep_alive_s)
    budget = (
        ""
        if host.models_memory is None
        else f"; models memory {format_size(host.resident_weights_bytes)} of "
        f"{format_size(host.models_memory)}"
    )
    return (
        f"{held or 'none loaded (the next request loads one)'}{budget}; keep-alive {keep}; "
        f"loads {host.loads}, unloads {host.unloads}, failed {host.load_failures}"
    )


# --- set ----------------------------------------------------------------------------------


def parse_assignments(words: list[str]) -> dict[str, str]:
    values = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key.strip():
            raise ControlCommandError(f"expected KEY=VALUE, got {word!r}")
        values[key.strip().replace("-", "_")] = value.strip()
    return values


def format_change(change: dict[str, Any]) -> str:
    key = change["key"]
    if not change["applied"]:
        kept = "" if change["previous"] is None else f" (still {change['previous']})"
        return f"{key}: refused: {change['reason']}{kept}"
    line = f"{key}: {change['previous']} -> {change['effective']}"
    return f"{line} ({change['reason']})" if change.get("reason") else line


def cmd_set(args: argparse.Namespace) -> int:
    values = parse_assignments(args.assignments)
    paths = get_paths()
    if running_pid(paths) is None:
        raise ControlCommandError("mlxcel-daemon is not running")
    calls: list[tuple[str, dict[str, Any]]] = [("config.set", {"values": values})]
    try:
        (result,) = asyncio.run(_calls(socket_for(paths, args.socket), calls, CALL_TIMEOUT_S))
        changes = result["changes"]
        for change in changes:
            print(format_change(change))
        refused = [c for c in changes if not c["applied"]]
        if args.save and not refused:
            saved = call(socket_for(paths, args.socket), "config.save", timeout=CALL_TIMEOUT_S)
            print(f"saved to {saved['path']}")
        elif args.save:
            print("not saved: a change was refused", file=sys.stderr)
    except ControlError as exc:
        raise ControlCommandError(exc.message) from None
    except (NotConnected, OSError, asyncio.TimeoutError) as exc:
        raise ControlCommandError(f"cannot reach the daemon: {exc}") from None
    return 1 if refused else 0


# --- logs ---------------------------------------------------------------------------------


def cmd_logs(args: argparse.Namespace) -> int:
    log_file = get_paths().log_file
    if not log_file.exists():
        raise ControlCommandError(f"no log yet at {log_file}")
    with open(log_file, encoding="utf-8", errors="replace") as f:
        # -n 10**400 means "all of it": deque's maxlen is a C ssize_t.
        for line in deque(f, maxlen=min(max(args.n, 0), sys.maxsize)):
            sys.stdout.write(line)
        sys.stdout.flush()
        if args.follow:
            follow(f, log_file)
    return 0


def follow(f: Any, log_file: Path, poll_s: float = 0.25) -> None:
    """Print lines as they are appended; reopen when the log rotates."""
    inode = log_file.stat().st_ino
    while True:
        line = f.readline()
        if line:
            sys.stdout.write(line)
            sys.stdout.flush()
            continue
        time.sleep(poll_s)
        try:
            st = log_file.stat()
        except FileNotFoundError:
            continue
        if st.st_ino != inode or st.st_size < f.tell():
            f.close()
            f = open(log_file, encoding="utf-8", errors="replace")  # noqa: SIM115
            inode = st.st_ino
