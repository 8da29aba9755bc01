"""A corrupt config.toml (docs/reliability.md): `mlxcel-daemon start` refuses it in one line
naming the line, never a traceback, and never touches the file; `set --save` keeps comments,
spellings and unrelated keys, and refuses to write over a file that went bad meanwhile.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomlkit
from daemon_helpers import attach, cli, running_daemon
from mlxcel.daemon.process.option_sources import read_config_file

# (name, file bytes, what the one-line error must contain)
CORRUPT = [
    ("syntax", b"parallel = 2\nthis is = = broken\n", "config.toml line 2"),
    ("unterminated string", b'# mine\nparallel = 2\ndtype = "auto\n', "config.toml line 3"),
    ("unknown key", b"parallel = 2\n\n\nparalel = 3\n", "config.toml line 4: unknown option"),
    ("bad value", b'# a\nparallel = "many"\n', "config.toml line 2: parallel"),
    ("negative", b"max_queue_depth = -1\n", "config.toml line 1: max_queue_depth"),
    ("bad size", b'parallel = 2\nprompt_cache_bytes = "lots"\n', "config.toml line 2"),
    ("list value", b"parallel = [1, 2]\n", "config.toml line 1: parallel must be a plain value"),
    ("table", b"parallel = 2\n[server]\nport = 1\n", "config.toml line 2: unknown option"),
    ("duplicate key", b"parallel = 2\nparallel = 3\n", "config.toml line 2"),
    ("dashed duplicate", b"max-batch-prefill = 2\nmax_batch_prefill = 3\n", "config.toml line 2"),
    ("not UTF-8", b"parallel = 2\n# caf\xe9\n", "config.toml line 2: not valid UTF-8"),
    ("binary junk", b"\x00\x01\x02\xff\xfe", "config.toml line 1"),
    ("bad port", b"port = 99999\n", "config.toml line 1: port"),
    ("bad bool", b'prompt_cache = "maybe"\n', "config.toml line 1: prompt_cache"),
]


@pytest.mark.parametrize(("name", "text", "needle"), CORRUPT, ids=[c[0] for c in CORRUPT])
def test_a_corrupt_config_is_refused_by_line_and_left_alone(
    tiny_model_dir: Path, tmp_path: Path, name: str, text: bytes, needle: str
) -> None:
    home = tmp_path / "home"
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_bytes(text)
    done = cli(home, "start", "--model", str(tiny_model_dir), "--port", "0", timeout=60)
    if done.returncode == 0:  # it should not have started: never leave it running
        attach(home).stop()
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel-daemon: error: "), done.stderr
    assert needle in lines[0] and "Traceback" not in done.stderr, lines[0]
    assert config.read_bytes() == text  # never overwritten
    assert not (home / "run" / "daemon.pid").exists()  # no daemon came up


def test_a_utf8_bom_is_accepted(tmp_path: Path) -> None:
    """Editors on Windows write one; it is not corruption."""
    config = tmp_path / "config.toml"
    config.write_bytes("\ufeff# settings\nparallel = 3\n".encode())
    assert read_config_file(config) == {"parallel": 3}


CONFIG = """\
# mlxcel settings, written by hand
# (every comment and key below must survive a save)

max_queue_depth = 32  # plenty
parallel = 4 # will change
max-batch-prefill = 3  # dashed spelling, changed in place

# the prompt cache
prompt-cache-bytes = "64MiB"
dtype = "auto"   # leave it
"""


def test_set_save_keeps_comments_spellings_and_unrelated_keys(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(CONFIG)
    with running_daemon(home, tiny_model_dir) as d:
        done = cli(home, "set", "parallel=2", "max_batch_prefill=2", "--save", timeout=60)
        assert done.returncode == 0, done.stderr
        assert d.status()["engine"]["config"]["parallel"] == 2
        saved = config.read_text()
        # Everything else, byte for byte; only the two values changed, in place.
        expected = CONFIG.replace("parallel = 4 #", "parallel = 2 #").replace(
            "max-batch-prefill = 3", "max-batch-prefill = 2"
        )
        assert saved.startswith(expected), saved
        doc = tomlkit.parse(saved).unwrap()
        spellings = {k.replace("-", "_") for k in doc}
        assert len(spellings) == len(doc), f"an option written twice: {sorted(doc)}"
        assert doc["max_queue_depth"] == 32 and doc["prompt-cache-bytes"] == "64MiB"
        assert doc["parallel"] == 2 and doc["max-batch-prefill"] == 2

        # The file goes bad while the daemon runs: a save is refused and writes nothing.
        broken = saved.encode() + b"oops = = =\n"
        config.write_bytes(broken)
        refused = cli(home, "set", "parallel=3", "--save", timeout=60)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert "config.toml line" in refused.stderr, refused.stderr
        assert config.read_bytes() == broken
        assert d.alive()
