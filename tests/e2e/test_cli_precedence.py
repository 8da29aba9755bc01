"""Option precedence through the real command line (docs/configuration.md): a flag beats the
MLXCEL_<NAME> environment variable, which beats config.toml. Each case is a detached
`mlxcel-daemon start` under its own MLXCEL_HOME, read back with `mlxcel-daemon status`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemon_helpers import cli, start_daemon


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (("--parallel", "6"), {"MLXCEL_PARALLEL": "5"}, 6),  # flag > env > config.toml
        ((), {"MLXCEL_PARALLEL": "5"}, 5),  # env > config.toml
        ((), {}, 3),  # config.toml > default (4)
    ],
    ids=["flag", "env", "config"],
)
def test_flag_beats_env_beats_config_file(
    tiny_model_dir: Path, tmp_path: Path, flags: tuple[str, ...], env: dict[str, str], expected: int
) -> None:
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "config.toml").write_text("parallel = 3\n")
    daemon = start_daemon(home, tiny_model_dir, *flags, **env)
    try:
        text = cli(home, "status")
        data = cli(home, "status", "--json")
    finally:
        daemon.stop()
    assert text.returncode == 0, text.stderr
    assert f"serving: parallel {expected}," in text.stdout, text.stdout
    engine = json.loads(data.stdout)["engine"]
    assert engine["config"]["parallel"] == expected
    assert len(engine["slots"]) == expected
