"""The group's lines in `mlxcel-daemon status` (plain Python: the CLI imports no mlx)."""

from __future__ import annotations

from typing import Any

from mlxcel.shared.config import format_size


def group_lines(group: dict[str, Any] | None) -> list[str]:
    """A distributed group as status lines (none for a single process)."""
    if not group:
        return []
    comm = "n/a" if group.get("comm_ms") is None else f"{group['comm_ms']:.1f} ms"
    state = "ok" if group["status"] == "ok" else f"DEGRADED: {group.get('reason')}"
    lines = [
        f"  group:   {group['size']} ranks, {group['mode']} parallel ({group['backend']}), "
        f"step exchange {comm}, timeout {group['timeout_s']:g} s",
        f"  state:   {state}",
    ]
    for rank in group.get("ranks", []):
        memory = "n/a" if rank.get("memory_bytes") is None else format_size(rank["memory_bytes"])
        step = "n/a" if rank.get("step_ms") is None else f"{rank['step_ms']:.1f} ms"
        lines.append(
            f"    rank {rank['rank']}: {rank['host']} pid {rank.get('pid') or 'n/a'}, "
            f"memory {memory}, last step {step}, {rank.get('steps', 0)} steps"
        )
    return lines
