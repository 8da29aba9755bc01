"""Option layers (flag > env > config.toml > default) and config.toml reading and saving."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlxcel.daemon.process.option_sources import (
    ConfigFileError,
    env_name,
    env_values,
    read_config_file,
    resolve_config,
    save_runtime_values,
)
from mlxcel.shared.config import ConfigError

COMMENTED = """\
# My mlxcel settings
# keep parallel low on this laptop
parallel = 3  # was 4
model = "smollm2-135m-instruct"

# end of file
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_missing_file_gives_defaults(tmp_path: Path) -> None:
    cfg, sources = resolve_config({}, tmp_path / "absent.toml", environ={})
    assert cfg.parallel == 4 and cfg.port == 8080 and sources == {}


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = write(tmp_path, "parallel = 3\nport = 9000\nmax_queue_depth = 7\n")
    env = {"MLXCEL_PARALLEL": "5", "MLXCEL_PORT": "9100"}
    cfg, sources = resolve_config({"parallel": "6"}, path, environ=env)
    assert (cfg.parallel, cfg.port, cfg.max_queue_depth, cfg.prefill_chunk_size) == (
        6,
        9100,
        7,
        2048,
    )
    assert sources == {"parallel": "flag", "port": "env", "max_queue_depth": "config.toml"}


def test_speculative_from_each_layer(tmp_path: Path) -> None:
    path = write(tmp_path, 'speculative = "off"\n')
    assert resolve_config({}, path, environ={})[0].speculative == "off"
    env = {"MLXCEL_SPECULATIVE": "ngram"}
    assert resolve_config({}, path, environ=env)[0].speculative == "ngram"
    assert resolve_config({"speculative": "off"}, path, environ=env)[0].speculative == "off"
    with pytest.raises(ConfigError, match="MLXCEL_SPECULATIVE: speculative must be one of"):
        resolve_config({}, path, environ={"MLXCEL_SPECULATIVE": "yes"})


def test_env_names_and_empty_env_values_are_ignored() -> None:
    assert env_name("max_batch_prefill_tokens") == "MLXCEL_MAX_BATCH_PREFILL_TOKENS"
    env = {"MLXCEL_PARALLEL": "", "MLXCEL_PROMPT_CACHE": "off", "MLXCEL_HOME": "/x"}
    assert env_values(env) == {"prompt_cache": "off"}


def test_bad_env_value_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MLXCEL_PARALLEL"):
        resolve_config({}, tmp_path / "absent.toml", environ={"MLXCEL_PARALLEL": "many"})


def test_ctx_size_below_the_per_slot_floor_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="below the minimum 512"):
        resolve_config({"ctx_size": "1024", "parallel": "4"}, tmp_path / "a.toml", environ={})
    cfg, _ = resolve_config({"ctx_size": "2048", "parallel": "4"}, tmp_path / "a.toml", environ={})
    assert cfg.ctx_size == 2048


def test_non_loopback_host_needs_an_api_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="api-key"):
        resolve_config({"host": "0.0.0.0"}, tmp_path / "a.toml", environ={})
    cfg, _ = resolve_config({"host": "0.0.0.0", "api_key": "k"}, tmp_path / "a.toml", environ={})
    assert cfg.api_key == "k"


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("parallel = 4\nport = = 1\n", 2, "Unexpected character"),
        ("# c\n\nparallel = 0\n", 3, "parallel must be >= 1"),
        ("parallel = 2\nbogus = 1\n", 2, "unknown option 'bogus'"),
        ("[parallel]\nx = 1\n", 1, "must be a plain value"),
        ("[serving]\nparallel = 2\n", 1, "unknown option .serving."),
        ('dtype = "float8"\n', 1, "dtype must be one of"),
        ('parallel = 2\nspeculative = "eagle"\n', 2, "speculative must be one of off, ngram"),
    ],
)
def test_bad_file_is_reported_with_its_line(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError, match=message) as err:
        read_config_file(path)
    assert f"{path} line {line}:" in str(err.value)
    assert "\n" not in str(err.value)


def test_non_utf8_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b"parallel = 4\n\xff\xfe = 1\n")
    with pytest.raises(ConfigFileError, match="UTF-8"):
        read_config_file(path)


def test_dashed_keys_and_native_types(tmp_path: Path) -> None:
    path = write(
        tmp_path, 'max-batch-prefill = 2\nprompt_cache = false\nkv_cache_budget = "1GiB"\n'
    )
    assert read_config_file(path) == {
        "max_batch_prefill": 2,
        "prompt_cache": False,
        "kv_cache_budget": "1GiB",
    }


def test_save_updates_values_and_keeps_comments(tmp_path: Path) -> None:
    path = write(tmp_path, COMMENTED)
    save_runtime_values(path, {"parallel": 6, "prompt_cache": False})
    text = path.read_text()
    assert "# My mlxcel settings" in text and "# keep parallel low on this laptop" in text
    assert "parallel = 6  # was 4" in text and "# end of file" in text
    assert read_config_file(path) == {
        "parallel": 6,
        "model": "smollm2-135m-instruct",
        "prompt_cache": False,
    }


def test_save_creates_a_commented_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "config.toml"
    save_runtime_values(path, {"max_batch_prefill_tokens": 2048})
    assert path.read_text().startswith("# mlxcel-daemon configuration")
    assert read_config_file(path) == {"max_batch_prefill_tokens": 2048}


def test_save_never_overwrites_a_corrupt_file(tmp_path: Path) -> None:
    corrupt = "parallel = 4\nthis is not toml\n"
    path = write(tmp_path, corrupt)
    with pytest.raises(ConfigFileError, match="line 2"):
        save_runtime_values(path, {"parallel": 2})
    assert path.read_text() == corrupt
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]


def test_save_refuses_non_runtime_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not runtime keys: port"):
        save_runtime_values(tmp_path / "config.toml", {"port": 1})


def test_atomic_write_replaces_whole_and_keeps_or_sets_the_mode(tmp_path: Path) -> None:
    from mlxcel.shared.paths import atomic_write

    path = tmp_path / "sub" / "state.json"
    atomic_write(path, "one", mode=0o600)
    assert path.read_text() == "one" and path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o640)
    atomic_write(path, "two")  # no mode: the existing file's stays
    assert path.read_text() == "two" and path.stat().st_mode & 0o777 == 0o640
    with pytest.raises(TypeError):
        atomic_write(path, b"bytes")  # type: ignore[arg-type]  # fails mid-write
    assert path.read_text() == "two" and [p.name for p in path.parent.iterdir()] == ["state.json"]
