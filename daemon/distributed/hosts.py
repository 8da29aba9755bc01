"""The hosts file, the ring backend's hostfile and the sharding plan (plain Python, no mlx).

The hosts file is `mlx.launch`'s JSON format (docs/distributed.md): a list of hosts, or an
object with `hosts` and optional `python` (the interpreter on every host, default this one),
and `starting_port` (default 32323). Each host is `{"ssh": "name", "ips": ["10.0.0.2"]}`;
the first host is rank 0, the daemon itself. An IP may carry its port (`"127.0.0.1:40001"`);
otherwise rank r listens on `starting_port + r`.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_STARTING_PORT = 32323
MODES = ("auto", "tensor", "pipeline")
LOCAL_NAMES = frozenset({"", "localhost", "127.0.0.1", "::1"})


class HostsError(ValueError):
    """A hosts file or sharding plan that cannot work; the message is one line."""


@dataclass(frozen=True)
class Host:
    ssh: str  # where to start the rank ("localhost": a local process)
    ip: str  # the address (with port) the ring backend listens on for this rank


@dataclass(frozen=True)
class HostsFile:
    hosts: tuple[Host, ...]
    python: str | None = None  # the interpreter to run on remote hosts

    @property
    def size(self) -> int:
        return len(self.hosts)

    def ring_hostfile(self) -> list[list[str]]:
        """The JSON `MLX_HOSTFILE` of the ring backend: one address list per rank."""
        return [[h.ip] for h in self.hosts]


def parse_hosts(data: Any, source: str = "hosts file") -> HostsFile:
    python = None
    starting_port = DEFAULT_STARTING_PORT
    if isinstance(data, dict):
        python = data.get("python")
        starting_port = data.get("starting_port", starting_port)
        if not isinstance(starting_port, int) or not 0 < starting_port < 65536:
            raise HostsError(f"{source}: starting_port must be a port number")
        data = data.get("hosts")
    if not isinstance(data, list) or len(data) < 2:
        raise HostsError(f"{source}: needs a list of at least 2 hosts (rank 0 is the first)")
    hosts = []
    for rank, item in enumerate(data):
        if isinstance(item, str):
            item = {"ssh": item, "ips": [item]}
        if not isinstance(item, dict):
            raise HostsError(f"{source}: host {rank} must be an object with ssh and ips")
        ssh = str(item.get("ssh") or "localhost")
        ips = item.get("ips") or []
        if not isinstance(ips, list) or not ips or not all(isinstance(i, str) for i in ips):
            raise HostsError(f"{source}: host {rank} ({ssh}) needs ips (the ring backend's)")
        ip = ips[0]
        if not _has_port(ip):
            ip = f"{ip}:{starting_port + rank}"
        hosts.append(Host(ssh, ip))
    seen = [h.ip for h in hosts]
    if len(set(seen)) != len(seen):
        raise HostsError(f"{source}: two ranks share the address {_first_dup(seen)}")
    return HostsFile(tuple(hosts), python if isinstance(python, str) else None)


def read_hosts_file(path: str | Path) -> HostsFile:
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HostsError(f"hosts file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise HostsError(f"hosts file {path}: {exc}") from None
    return parse_hosts(data, f"hosts file {path}")


def is_local(ssh: str) -> bool:
    return ssh in LOCAL_NAMES or ssh == socket.gethostname()


def _has_port(ip: str) -> bool:
    if ip.startswith("["):
        return "]:" in ip
    return ip.count(":") == 1


def _first_dup(items: list[str]) -> str:
    return next(i for n, i in enumerate(items) if i in items[:n])


def plan_sharding(
    config: dict[str, Any], size: int, mode: str, has_shard: bool, has_pipeline: bool
) -> str:
    """`tensor` or `pipeline` for this model on `size` ranks, or HostsError saying why not.

    `auto` takes tensor parallel when the model has `shard()` and its head counts (and MLP
    width) divide by the group size, else pipeline when it has `pipeline()`."""
    if mode not in MODES:
        raise HostsError(f"distributed_mode must be one of {', '.join(MODES)}, got {mode!r}")
    name = config.get("model_type", "this model")
    tensor_problem = _tensor_problem(config, size, name) if has_shard else None
    if not has_shard:
        tensor_problem = f"{name} has no tensor-parallel shard() in mlx-lm"
    pipeline_problem = _pipeline_problem(config, size, name) if has_pipeline else None
    if not has_pipeline:
        pipeline_problem = f"{name} has no pipeline() in mlx-lm"
    if mode in ("auto", "tensor") and tensor_problem is None:
        return "tensor"
    if mode in ("auto", "pipeline") and pipeline_problem is None:
        return "pipeline"
    if mode == "tensor":
        raise HostsError(f"cannot run tensor parallel on {size} ranks: {tensor_problem}")
    if mode == "pipeline":
        raise HostsError(f"cannot run pipeline parallel on {size} ranks: {pipeline_problem}")
    raise HostsError(
        f"cannot split the model across {size} ranks: tensor parallel: {tensor_problem}; "
        f"pipeline: {pipeline_problem}"
    )


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's `text_config`, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _tensor_problem(config: dict[str, Any], size: int, name: str) -> str | None:
    text = _text_config(config)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    checks = (
        ("attention heads", heads),
        ("KV heads", kv_heads),
        ("MLP width (intermediate_size)", text.get("intermediate_size")),
    )
    for what, value in checks:
        if isinstance(value, int) and value % size:
            return f"{name} has {value} {what}, which do not divide by {size}"
    return None


def _pipeline_problem(config: dict[str, Any], size: int, name: str) -> str | None:
    text = _text_config(config)
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and layers < size:
        return f"{name} has {layers} layers, fewer than {size} ranks"
    return None


def group_available_bytes(table: list[list[int]], rank: int) -> int:
    """Memory for this rank's caches such that every rank gets the same number of KV blocks:
    the tokens the tightest rank can hold, times this rank's KV bytes per token. `table` has
    one (available bytes, KV bytes per token) row per rank."""
    tokens = min(avail // max(per_token, 1) for avail, per_token in table)
    return tokens * max(table[rank][1], 1)
