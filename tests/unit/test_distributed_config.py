"""One model across several ranks (docs/distributed.md), without a group: the hosts file, the
split plan, the common KV budget, the options, and the group as `status` and the console show
it. Real groups are tests/e2e/test_distributed.py's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from daemon_helpers import async_wait_until
from mlxcel.daemon.distributed.hosts import (
    HostsError,
    group_available_bytes,
    parse_hosts,
    plan_sharding,
)
from mlxcel.daemon.distributed.status import group_lines
from mlxcel.shared.config import ConfigError, build_config
from mlxcel.shared.snapshot import GroupInfo, RankInfo

SMOLLM2 = {
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
}


def test_hosts_file_gives_each_rank_an_address() -> None:
    hosts = parse_hosts(
        {
            "starting_port": 40000,
            "hosts": [
                {"ssh": "mac1", "ips": ["10.0.0.1"]},
                {"ssh": "mac2", "ips": ["10.0.0.2:5000"]},
                "10.0.0.3",
            ],
        }
    )
    assert [h.ssh for h in hosts.hosts] == ["mac1", "mac2", "10.0.0.3"]
    assert hosts.ring_hostfile() == [["10.0.0.1:40000"], ["10.0.0.2:5000"], ["10.0.0.3:40002"]]


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([{"ssh": "a", "ips": ["1.2.3.4"]}], "at least 2 hosts"),
        ({"hosts": "a,b"}, "at least 2 hosts"),
        ([{"ssh": "a", "ips": ["1.1.1.1"]}, {"ssh": "b"}], "host 1 (b) needs ips"),
        ([{"ssh": "a", "ips": ["h:1"]}, {"ssh": "b", "ips": ["h:1"]}], "share the address h:1"),
    ],
)
def test_bad_hosts_files_are_refused_in_one_line(data: Any, words: str) -> None:
    with pytest.raises(HostsError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        parse_hosts(data)
    assert "\n" not in str(info.value)


def test_plan_takes_tensor_when_heads_divide_else_pipeline_else_refuses() -> None:
    tiny = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
    assert plan_sharding(tiny, 2, "auto", has_shard=True, has_pipeline=False) == "tensor"
    assert plan_sharding(SMOLLM2, 3, "auto", has_shard=True, has_pipeline=False) == "tensor"
    # SmolLM2's 3 KV heads do not divide by 2; a family with pipeline() falls back to it
    assert plan_sharding(SMOLLM2, 2, "auto", has_shard=True, has_pipeline=True) == "pipeline"
    with pytest.raises(HostsError) as info:
        plan_sharding(SMOLLM2, 2, "auto", has_shard=True, has_pipeline=False)
    assert str(info.value) == (
        "cannot split the model across 2 ranks: tensor parallel: llama has 9 attention heads, "
        "which do not divide by 2; pipeline: llama has no pipeline() in mlx-lm"
    )
    with pytest.raises(HostsError, match="cannot run pipeline parallel on 2 ranks"):
        plan_sharding(tiny, 2, "pipeline", has_shard=True, has_pipeline=False)
    with pytest.raises(HostsError, match="2 layers, fewer than 3 ranks"):
        plan_sharding({"num_hidden_layers": 2}, 3, "pipeline", has_shard=False, has_pipeline=True)


def test_common_kv_budget_is_what_the_tightest_rank_holds() -> None:
    # (available bytes, KV bytes per token) per rank: rank 1 holds only 50 tokens
    table = [[1000, 10], [1000, 20]]
    assert group_available_bytes(table, 0) == 500
    assert group_available_bytes(table, 1) == 1000


def test_distributed_options_parse() -> None:
    values = {"hosts": "h.json", "distributed_mode": "Tensor", "distributed_timeout": "5"}
    cfg = build_config(values)
    assert (cfg.hosts, cfg.distributed_mode, cfg.distributed_timeout) == ("h.json", "tensor", 5.0)
    with pytest.raises(ConfigError, match="distributed_mode must be one of"):
        build_config({"distributed_mode": "ring"})
    with pytest.raises(ConfigError, match="distributed_timeout must be between 1 and 86400"):
        build_config({"distributed_timeout": "0"})


def degraded_group() -> GroupInfo:
    return GroupInfo(
        size=2,
        mode="tensor",
        backend="ring",
        status="degraded",
        reason="rank 1 (mac2, pid 2) exited with status -9; run `mlxcel-daemon restart`",
        comm_ms=3.25,
        timeout_s=10,
        ranks=(
            RankInfo(0, "localhost", 1, 400 << 20, 35.2, 10),
            RankInfo(1, "mac2", 2, 300 << 20, 18.0, 10),
        ),
    )


def test_status_lines_show_each_rank_and_the_state() -> None:
    lines = group_lines(degraded_group().to_dict())
    assert lines[0] == (
        "  group:   2 ranks, tensor parallel (ring), step exchange 3.2 ms, timeout 10 s"
    )
    assert lines[1].startswith("  state:   DEGRADED: rank 1 (mac2, pid 2) exited")
    assert lines[3] == "    rank 1: mac2 pid 2, memory 300.0 MiB, last step 18.0 ms, 10 steps"
    assert group_lines(None) == []


async def test_console_header_shows_the_group_and_degraded() -> None:
    from mlxcel.tui.app import make_app
    from tui_fakes import CannedDaemon, connected_with_snapshot, fixed_clock, make_snapshot

    snap = replace(make_snapshot(False), group=degraded_group())
    with CannedDaemon(snap) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(200, 40)):
            await async_wait_until(lambda: connected_with_snapshot(app))
            assert app.snapshot.group == degraded_group()  # through the socket and back
            text = str(app.query_one("#header").render())
    assert "2 ranks tensor" in text
    assert "r0@localhost 400" in text and "35ms" in text
    assert "r1@mac2 300" in text and "18ms" in text
    assert "⚠ group degraded" in text
