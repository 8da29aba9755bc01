"""Rank 0's start of a group, and the steps every rank takes the same way.

Order (every collective in the same order on every rank):
1. rank 0 reads the hosts file and plans the split from the model's config.json (a model or
   head count that cannot split is refused here, in one line, before anything starts);
2. rank 0 writes the ring backend's hostfile, starts ranks 1..n-1 (local hosts as child
   processes, others over ssh), and every rank joins `mx.distributed.init(backend=...)`;
3. rank 0 sends the serving config and the plan (`Channel.exchange`);
4. every rank loads the model and keeps its shard (`model.shard()` or `model.model.pipeline()`;
   mlxcel's fused CPU forward is off in a group: it would fuse the sharded linears);
5. every rank measures the memory it has left and a token's KV; the KV budget is the one the
   tightest rank can hold (`group_available_bytes`), the same block count everywhere;
6. every rank builds its engine (rank 0: `DistributedEngine`) with the same arguments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlxcel.daemon.distributed.channel import Channel, RankFigures, memory_bytes
from mlxcel.daemon.distributed.hosts import (
    HostsError,
    HostsFile,
    group_available_bytes,
    is_local,
    plan_sharding,
)
from mlxcel.daemon.distributed.wire import ChannelError, GroupKey
from mlxcel.daemon.engine.mlx_support import generation_stream
from mlxcel.shared.config import ServingConfig
from mlxcel.shared.switches import switch_value

log = logging.getLogger("mlxcel.distributed")

BACKEND_ENV = "MLXCEL_DISTRIBUTED_BACKEND"  # ring (default), mpi, jaccl: passed to init
FAST_FORWARD_ENV = "MLXCEL_NO_FAST_FORWARD"
START_TIMEOUT_S = 900.0  # join, load and shard: a big checkpoint takes minutes
STOP_WAIT_S = 5.0


class GroupStartError(RuntimeError):
    """The group cannot start; the message is one line."""


@dataclass
class Ranks:
    """The processes rank 0 started (ranks 1..n-1), to watch and to end."""

    hosts: HostsFile
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path | None = None
    hostfile_path: Path | None = None
    key: GroupKey = field(default_factory=GroupKey.new)  # the group's secret (never on argv)

    def dead(self) -> str | None:
        """The first rank that is gone, in words; None while every one runs."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                host = self.hosts.hosts[rank].ssh
                return f"rank {rank} ({host}, pid {proc.pid}) exited with status {code}"
        return None

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Wait for the ranks to exit (after a stop message), then kill what is left."""
        deadline = time.monotonic() + wait_s
        for proc in self.procs.values():
            left = max(deadline - time.monotonic(), 0.0)
            try:
                proc.wait(left)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        if self.hostfile_path is not None:
            self.hostfile_path.unlink(missing_ok=True)


def backend() -> str:
    value = switch_value(BACKEND_ENV)  # "ring" when unset: its registered default
    assert value is not None
    return value


def plan(cfg: ServingConfig, size: int) -> tuple[str, Path]:
    """The split (`tensor` | `pipeline`) for `cfg.model` on `size` ranks, and its directory."""
    from mlx_lm.models.pipeline import PipelineMixin
    from mlxcel.daemon.mlx_lm_compat import get_model_classes
    from mlxcel.daemon.models.loader import download_hf, resolve_spec

    resolved = resolve_spec(cfg.model, progress=log.info)
    path = resolved.path
    if resolved.source == "hf":
        path = download_hf(cfg.model)
    if resolved.source == "gguf" or path is None:
        raise HostsError("a distributed group serves MLX / Hugging Face directories, not GGUF")
    config = json.loads((Path(path) / "config.json").read_text())
    try:
        model_cls, _ = get_model_classes(config)
    except Exception as exc:
        raise HostsError(f"cannot split {cfg.model}: {exc}") from None
    module = sys.modules[model_cls.__module__]
    has_pipeline = any(
        isinstance(v, type) and issubclass(v, PipelineMixin) and v is not PipelineMixin
        for v in vars(module).values()
    )
    mode = plan_sharding(
        config, size, cfg.distributed_mode, hasattr(model_cls, "shard"), has_pipeline
    )
    return mode, Path(path)


def worker_env(base: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The environment a rank is started with: this one without the API keys (a worker serves
    no HTTP; docs/distributed.md)."""
    return {k: v for k, v in base.items() if not _is_key_name(k)}


def _is_key_name(name: str) -> bool:
    upper = name.upper()
    return upper.startswith("MLXCEL_") and "API_KEY" in upper


def start_ranks(hosts: HostsFile, log_dir: Path) -> Ranks:
    """Write the ring hostfile and start ranks 1..n-1 (this process is rank 0). Each rank gets
    the group's key (`Ranks.key`, made here) as one line on its stdin: not in its argv (process
    listings show those) nor in its environment."""
    fd, name = tempfile.mkstemp(prefix="mlxcel-ring-", suffix=".json")
    ring = json.dumps(hosts.ring_hostfile())
    with os.fdopen(fd, "w") as f:
        f.write(ring)
    ranks = Ranks(hosts, log_dir=log_dir, hostfile_path=Path(name))
    os.environ["MLX_HOSTFILE"] = name
    os.environ["MLX_RANK"] = "0"
    os.environ[FAST_FORWARD_ENV] = "1"
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank, host in enumerate(hosts.hosts):
        if rank == 0:
            continue
        if is_local(host.ssh):
            env = dict(worker_env(os.environ), MLX_RANK=str(rank), MLX_HOSTFILE=name)
            cmd = [sys.executable, "-m", "mlxcel.daemon.distributed.worker"]
        else:  # ssh passes its stdin to the remote command: the key travels that way too
            env = worker_env(os.environ)
            cmd = ["ssh", host.ssh, _remote_script(rank, ring, hosts.python or sys.executable)]
        log_path = log_dir / f"rank{rank}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE
            )
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # a rank that exited at once: the guard reports it
            proc.stdin.write(ranks.key.line())
            proc.stdin.close()
        ranks.procs[rank] = proc
        log.info("rank %d: %s pid %d (log %s)", rank, host.ssh, proc.pid, log_path)
    return ranks


def _remote_script(rank: int, ring: str, python: str) -> str:
    """The shell line ssh runs on a remote host (like mlx.launch's: hostfile in a temp file)."""
    exports = f"export MLX_RANK={rank} {FAST_FORWARD_ENV}=1 {BACKEND_ENV}={shlex.quote(backend())}"
    return (
        f"f=$(mktemp); echo {shlex.quote(ring)} > $f; export MLX_HOSTFILE=$f; {exports}; "
        f"exec {shlex.quote(python)} -m mlxcel.daemon.distributed.worker"
    )


def read_group_key() -> GroupKey:
    """A worker: the group's key, the first line on its stdin (written by its rank 0)."""
    if sys.stdin is None or sys.stdin.isatty():  # started by hand: no key will come
        raise GroupStartError("no group key on stdin (a rank is started by its rank 0)")
    try:
        return GroupKey.from_line(sys.stdin.buffer.readline(256))
    except ChannelError as exc:
        raise GroupStartError(str(exc)) from None


def join_group() -> Any:
    """`mx.distributed.init` for this rank (run it under `guarded`)."""
    try:
        return mx.distributed.init(strict=True, backend=backend())
    except Exception as exc:
        raise GroupStartError(f"cannot form the {backend()} group: {exc}") from None


@contextlib.contextmanager
def guarded(ranks: Ranks | None, timeout_s: float = START_TIMEOUT_S) -> Iterator[None]:
    """Watch the start of a group from another process. `mx.distributed.init` waits for every
    rank for ever and holds the GIL while it does (no thread here runs meanwhile), and until
    the engine's watchdog runs nothing else notices a rank that stops answering. The guard
    process ends this process (and, on rank 0, the ranks it started) when one of them exits
    or the start takes longer than `timeout_s`, after writing the reason as this daemon's
    FATAL line (which the CLI's `start` reports); nothing waits for ever."""
    if ranks is not None:  # rank 0: watch the ranks it started
        peers = {rank: proc.pid for rank, proc in ranks.procs.items()}
        log_file = ranks.log_dir / "daemon.log" if ranks.log_dir else None
        guard = _start_guard(peers, timeout_s, log_file, _log_hint(ranks, "{rank}"))
    else:  # a worker: its rank 0 (the parent of a local rank) must stay, or it ends too
        parent = os.getppid()
        guard = _start_guard({0: parent} if parent > 1 else {}, timeout_s, None, "")
    try:
        yield
    finally:
        guard.kill()
        guard.wait()


GUARD_CODE = r"""
import os, signal, sys, time
import psutil
parent, timeout_s, log_path, hint = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
ranks = [tuple(int(v) for v in a.split(":")) for a in sys.argv[5:]]
def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
end = time.monotonic() + timeout_s
while not gone(parent):
    reason = next((f"rank {r} (pid {p}) exited before the group formed"
                   + hint.replace("{rank}", str(r)) for r, p in ranks if gone(p)), None)
    if reason is None and time.monotonic() > end:
        reason = f"the group did not start within {timeout_s:.0f} s" + hint.replace("{rank}", "N")
    if reason is not None:
        print(f"FATAL {reason}", file=sys.stderr, flush=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S,000")
        with open(log_path, "a") as f:
            f.write(f"{stamp} ERROR mlxcel.distributed: FATAL {reason}\n")
        for _, p in ranks:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        os.kill(parent, signal.SIGKILL)
        break
    time.sleep(0.2)
"""


def _start_guard(
    peers: dict[int, int], timeout_s: float, log_file: Path | None, hint: str
) -> subprocess.Popen[bytes]:
    """The guard of this process's init: `peers` (rank -> pid) must stay alive."""
    log_path = str(log_file) if log_file is not None else os.devnull
    args = [str(os.getpid()), str(timeout_s), log_path, hint]
    args += [f"{rank}:{pid}" for rank, pid in peers.items()]
    return subprocess.Popen([sys.executable, "-c", GUARD_CODE, *args], stdin=subprocess.DEVNULL)


def _log_hint(ranks: Ranks | None, rank: int | str = "N") -> str:
    return f" (see {ranks.log_dir}/rank{rank}.log)" if ranks and ranks.log_dir else ""


def load_shard(cfg: ServingConfig, mode: str, group: Any) -> Any:
    """Load the model and keep this rank's shard (every rank, same order)."""
    from mlxcel.daemon.models import load_model

    os.environ[FAST_FORWARD_ENV] = "1"
    loaded = load_model(cfg.model, cfg.dtype, progress=log.info)
    try:
        if mode == "tensor":
            loaded.model.shard(group)
        else:
            loaded.model.model.pipeline(group)
    except Exception as exc:
        raise HostsError(f"cannot split {cfg.model} ({mode}): {exc}") from None
    mx.eval(loaded.model.parameters())
    return loaded


def gather_ints(group: Any, values: list[int]) -> list[list[int]]:
    """Every rank's `values`, on every rank."""
    table = np.zeros((group.size(), len(values)), dtype=np.int64)
    table[group.rank()] = values
    with mx.stream(generation_stream):
        out = mx.distributed.all_sum(mx.array(table), group=group)
        mx.eval(out)
    return np.array(out).tolist()


def group_config(cfg: ServingConfig, mode: str) -> ServingConfig:
    """The config every rank serves with: no API key on the wire (a worker serves no HTTP;
    `wire.encode_config` leaves the key fields out as well); no speculative decoding (its
    policy decides on each process's own step timings, and every rank must run the same
    steps); a pipeline group runs without the prompt cache (each rank's KV differs in size, so
    byte-bounded caches would evict differently and the ranks would drift apart)."""
    cfg = cfg.replace(api_key=None, readonly_api_key=None, api_key_file=None, api_keys_file=None)
    cfg = cfg.replace(speculative="off")
    return cfg.replace(prompt_cache=False) if mode == "pipeline" else cfg


def build_engine(
    link: Channel, loaded: Any, cfg: ServingConfig, engine_cls: type, **extra: Any
) -> Any:
    """Every rank: the engine on the group's common KV budget (steps 5 and 6)."""
    from mlxcel.daemon.engine import mlx_support

    model = loaded.model
    available = mlx_support.available_memory_bytes(model, cfg.parallel)
    per_token = mlx_support.probe_model(model).kv_bytes_per_token
    table = gather_ints(link.group, [available, per_token])
    mine = group_available_bytes(table, link.rank)
    info = loaded.info
    mx.random.seed(0)
    engine = engine_cls(
        model,
        cfg,
        info.can_batch,
        info.batch_reason,
        info.context_length,
        available_bytes=mine,
        tokenizer=loaded.tokenizer,
        **extra,
    )
    blocks = engine.kv.total_blocks
    totals = gather_ints(link.group, [-1 if blocks is None else blocks])
    if blocks is not None:
        engine.kv.total_blocks = min(t[0] for t in totals)
        engine.effective = engine._effective(engine.effective.prompt_cache_bytes)
        engine.publish()
    return engine


def figures(steps: int = 0, step_us: int = 0) -> RankFigures:
    return RankFigures(memory_bytes(), step_us, os.getpid(), steps)


def load_group(cfg: ServingConfig, log_dir: Path) -> tuple[Any, Any, Ranks]:
    """Rank 0: start the group and return (LoadedModel, DistributedEngine, Ranks)."""
    from mlxcel.daemon.distributed.hosts import read_hosts_file

    assert cfg.hosts is not None
    hosts = read_hosts_file(cfg.hosts)
    mode, _path = plan(cfg, hosts.size)
    log.info("distributed: %d ranks, %s parallel, %s backend", hosts.size, mode, backend())
    ranks = start_ranks(hosts, log_dir)
    try:
        with guarded(ranks):
            loaded, engine = _form_group(cfg, mode, hosts, ranks)
    except BaseException as exc:
        dead = ranks.dead()
        ranks.stop(0.0)
        if isinstance(exc, (HostsError, GroupStartError)):
            raise
        if dead is not None:
            raise GroupStartError(f"{dead} while the group started{_log_hint(ranks)}") from None
        raise
    log.info("distributed group ready: %s", engine.group_info().to_dict())
    return loaded, engine, ranks


def _form_group(cfg: ServingConfig, mode: str, hosts: HostsFile, ranks: Ranks) -> tuple[Any, Any]:
    """Rank 0's steps 2-6 (see the module doc), once the ranks are started."""
    from mlxcel.daemon.distributed.group_engine import DistributedEngine

    group = join_group()
    if group.size() != hosts.size:
        found = group.size()
        raise GroupStartError(f"the group has {found} ranks, the hosts file {hosts.size}")
    channel = Channel(group, ranks.key)
    serve_cfg = group_config(cfg, mode)
    try:
        channel.exchange({"kind": "setup", "config": serve_cfg, "mode": mode}, figures())
    except ChannelError as exc:
        raise GroupStartError(f"cannot send the serving config to the ranks: {exc}") from None
    loaded = load_shard(serve_cfg, mode, group)
    engine = build_engine(
        channel,
        loaded,
        serve_cfg,
        DistributedEngine,
        channel=channel,
        hosts=[h.ssh for h in hosts.hosts],
        mode=mode,
        backend=backend(),
        timeout_s=cfg.distributed_timeout,
    )
    engine.describe_fault = ranks.dead
    engine.ranks = ranks
    channel.exchange({"kind": "ping", "commands": [], "seed": 0}, figures())
    return loaded, engine
