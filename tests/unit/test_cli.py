"""`mlxcel-daemon` commands that need no running daemon, run in-process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from mlxcel.daemon import cli
from mlxcel.daemon.cli import control_commands as cli_control
from mlxcel.daemon.process.lifecycle import PidLock, clean_stale, running_pid
from mlxcel.shared.paths import get_paths


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_serving_flags_survive_the_trip_through_argv() -> None:
    words = "start --parallel 6 --no-prompt-cache --kv-cache-budget 2GiB --api-key secret --port 0"
    args = cli.build_parser().parse_args(words.split())
    flags = cli.serving_flags(args)
    assert flags == {
        "parallel": "6",
        "kv_cache_budget": "2GiB",
        "api_key": "secret",
        "port": "0",
        "prompt_cache": False,
    }
    argv = cli.flags_to_argv(flags)
    assert "secret" not in argv  # the key travels in the environment
    assert cli.argv_to_flags(argv) == {k: v for k, v in flags.items() if k != "api_key"}


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert code == 2 and "usage: mlxcel-daemon" in err


@pytest.mark.usefixtures("mlxcel_home")
def test_status_stop_and_set_when_nothing_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "status") == (3, "mlxcel-daemon is not running\n", "")
    assert run(capsys, "status", "--json")[:2] == (3, '{"running": false}\n')
    assert run(capsys, "stop") == (0, "mlxcel-daemon is not running\n", "")
    code, _, err = run(capsys, "set", "parallel=2")
    assert code == 1 and err == "mlxcel-daemon: error: mlxcel-daemon is not running\n"


@pytest.mark.usefixtures("mlxcel_home")
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["start", "--parallel", "0"], "parallel must be >= 1"),
        (["start", "--host", "0.0.0.0"], "--api-key is required"),
        (["start", "--ctx-size", "1000", "--parallel", "4"], "below the minimum 512"),
        (["start", "--socket", "/tmp/" + "s" * 120], "over the 103-byte limit"),
        (["set", "parallel"], "expected KEY=VALUE"),
    ],
)
def test_bad_options_fail_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("mlxcel-daemon: error: ") and needle in err


def test_a_corrupt_config_file_fails_start_with_its_line(
    mlxcel_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = get_paths().config_file
    config.parent.mkdir(parents=True)
    config.write_text("parallel = 4\n\nport = [\n")
    code, _, err = run(capsys, "start")
    assert code == 1 and f"{config} line 3" in err and err.count("\n") == 1
    assert config.read_text() == "parallel = 4\n\nport = [\n"


def test_logs_prints_the_last_lines(mlxcel_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "logs")[0] == 1
    log = get_paths().log_file
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    assert run(capsys, "logs", "-n", "3") == (0, "line 7\nline 8\nline 9\n", "")


def test_the_pid_lock_decides_who_runs(mlxcel_home: Path) -> None:
    paths = get_paths()
    lock = PidLock(paths.pid_file)
    lock.acquire()
    try:
        assert running_pid(paths) is not None
        assert clean_stale(paths) == []
        with pytest.raises(cli.LifecycleError, match="already running"):
            PidLock(paths.pid_file).acquire()
    finally:
        lock.release()
    paths.pid_file.write_text("999999\n")  # a dead daemon's leftover: unlocked
    paths.state_file.write_text("{}")
    assert running_pid(paths) is None
    assert sorted(p.name for p in clean_stale(paths)) == ["daemon.json", "daemon.pid"]


def test_set_output_lines() -> None:
    assert cli_control.parse_assignments(["parallel=2", "prompt-cache=off"]) == {
        "parallel": "2",
        "prompt_cache": "off",
    }
    applied = {"key": "parallel", "applied": True, "previous": 4, "effective": 2, "reason": None}
    clamped = {**applied, "effective": 1, "reason": "clamped to 1: hybrid cache"}
    refused = {**applied, "applied": False, "effective": 4, "reason": "must be >= 1"}
    assert cli_control.format_change(applied) == "parallel: 4 -> 2"
    assert cli_control.format_change(clamped) == "parallel: 4 -> 1 (clamped to 1: hybrid cache)"
    assert cli_control.format_change(refused) == "parallel: refused: must be >= 1 (still 4)"


@pytest.mark.usefixtures("mlxcel_home")
def test_status_text_is_rendered_from_the_typed_snapshot() -> None:
    from mlxcel.shared import snapshot as sn

    clamp = "lfm2 cannot batch"
    cfg = sn.EffectiveConfig(2, 4, 256, clamp, 4, 0, 512, True, 1 << 30, None, 64, 2048)
    engine = sn.EngineSnapshot(
        0.0, cfg, (sn.SlotInfo(0, state="decode"), sn.SlotInfo(1)), (),
        sn.KVInfo(blocks_used=3, blocks_cached=1),
        sn.PromptCacheInfo(entries=1, bytes=1536, capacity_bytes=1 << 30, lookups=4, hits=3),
        sn.LatencyInfo(), sn.Counters(),
    )  # fmt: skip
    daemon = sn.DaemonInfo("0.1.0", 42, 3725.0, "tiny", "cpu", "float32", rss_bytes=5 << 20)
    wire = sn.Snapshot(daemon, engine).to_dict()  # what the socket carries
    text = cli_control.format_status(sn.Snapshot.from_dict(wire), {"log_file": "/l"})
    assert "running (pid 42), up 1h02m" in text
    assert "slots:   1/2 busy, 0 waiting" in text
    assert "parallel 2 (clamped: lfm2 cannot batch)" in text
    assert "kv:      3/unbounded blocks used, 1 cached" in text
    assert "cache:   1 entries, 1.5 KiB of 1.0 GiB, 3/4 hits" in text
    assert "process: rss 5.0 MiB, cpu n/a" in text and "mlx:     n/a" in text
    assert "  speculative: off\n" in text  # the config's default for an older daemon's snapshot
    assert "sampling:" not in text  # no defaults set: the API's own
    sampled = replace(daemon, sampling={"temperature": 0.3, "top_k": 40})
    wire = sn.Snapshot(sampled, engine).to_dict()
    text = cli_control.format_status(sn.Snapshot.from_dict(wire), {"log_file": "/l"})
    assert "  sampling: temperature 0.3, top_k 40 (a request's own fields win)\n" in text
    spec = sn.Counters(spec_steps=40, spec_rows=80, spec_drafted=100, spec_accepted=50)
    cfg = replace(cfg, speculative="ngram")
    wire = sn.Snapshot(daemon, replace(engine, config=cfg, counters=spec)).to_dict()
    text = cli_control.format_status(sn.Snapshot.from_dict(wire), {"log_file": "/l"})
    assert "  speculative: ngram, 50% accepted, 1.6 tokens per verification step, 40 " in text
    assert "pays" not in text  # no break-even estimate yet
    for rows, says in (
        (3, "pays up to 3 rows\n"),
        (1, "pays up to 1 row\n"),
        (0, "pays at no row count\n"),
    ):
        est = replace(spec, spec_break_even_rows=rows)
        wire = sn.Snapshot(daemon, replace(engine, config=cfg, counters=est)).to_dict()
        assert says in cli_control.format_status(sn.Snapshot.from_dict(wire), {"log_file": "/l"})
    drafting = replace(cfg, speculative="draft", draft_model="smol-4bit")
    wire = sn.Snapshot(daemon, replace(engine, config=drafting, counters=spec)).to_dict()
    text = cli_control.format_status(sn.Snapshot.from_dict(wire), {"log_file": "/l"})
    assert "  speculative: draft (smol-4bit), 50% accepted," in text


def test_speculative_flag_round_trips_and_says_what_it_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = cli.argv_to_flags(["--speculative", "off", "--no-preemption"])
    assert flags == {"speculative": "off", "preemption": False}
    assert cli.flags_to_argv(flags) == ["--speculative", "off", "--no-preemption"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["start", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--speculative VALUE speculative decoding: ngram (the default) drafts tokens by " in text
    assert "prompt lookup, draft drafts with" in text
    assert "the policy turns itself off while that does not pay" in text
    assert "--draft-model VALUE a smaller model of the same tokenizer" in text


def test_start_help_states_the_prefill_cap_default_the_config_derives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mlxcel.shared.config import ServingConfig, derived_prefill_token_cap

    cfg = ServingConfig()
    cap = derived_prefill_token_cap(cfg.max_batch_prefill, cfg.prefill_chunk_size)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["start", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"max-batch-prefill x min(chunk, 512) = {cap};" in text  # configuration.md says so too
