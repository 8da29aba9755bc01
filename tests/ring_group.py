"""Distributed groups on 127.0.0.1 for the e2e tests (docs/distributed.md): free ports outside
the kernel's ephemeral range, a hosts file of `ranks` local ranks, `start_group` (a daemon
with its worker ranks, retried on ports another process took meanwhile), the worker ranks'
pids and their SIGKILL. Used by tests/e2e/test_distributed.py and
test_distributed_secure_ring.py."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
from pathlib import Path

from daemon_helpers import RunningDaemon, start_daemon


def _listen_range() -> range:
    """Ports to listen on that no outgoing connection can take meanwhile: below the
    kernel's ephemeral range (the ring's own connects, HTTP clients and the other daemons
    of the suite draw from that range, and one of them took a rank's port once in CI)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return range(max(1024, low - 12000), low)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports on 127.0.0.1 that are free now, outside the ephemeral range."""
    ports: list[int] = []
    candidates = list(_listen_range())
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports on 127.0.0.1")


def write_hosts(path: Path, ranks: int) -> Path:
    hosts = [{"ssh": "localhost", "ips": [f"127.0.0.1:{p}"]} for p in free_ports(ranks)]
    path.write_text(json.dumps(hosts))
    return path


def start_group(home: Path, model_dir: Path, ranks: int, *flags: str, **env: str) -> RunningDaemon:
    """A daemon with `ranks` ranks on fresh ports; a start that lost a port to another
    process between the pick and the bind is tried again on new ports (twice at most)."""
    for attempt in range(3):
        hosts = write_hosts(home.parent / f"{home.name}-hosts.json", ranks)
        try:
            return start_daemon(home, model_dir, "--hosts", str(hosts), *flags, **env)
        except AssertionError as err:
            if "Couldn't bind" not in str(err) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def rank_pids(daemon: RunningDaemon) -> list[int]:
    group = daemon.status()["group"]
    return [r["pid"] for r in group["ranks"][1:]]


def kill_ranks(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
