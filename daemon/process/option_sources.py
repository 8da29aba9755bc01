"""Where serving options come from: flag > env `MLXCEL_<NAME>` > config.toml > derived default.

The config file is TOML with one top-level key per option (`parallel = 4`). It is read with
tomlkit so that `config.save` can update values in place and keep the operator's comments.
A corrupt file is reported with its line and never overwritten.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.exceptions
from mlxcel.shared.alerts import ALERTS_TABLE, parse_alerts
from mlxcel.shared.config import (
    OPTION_NAMES,
    RUNTIME_KEYS,
    ConfigError,
    ServingConfig,
    build_config,
    parse_option,
)
from mlxcel.shared.paths import atomic_write

ENV_PREFIX = "MLXCEL_"
ALIASES_TABLE = "aliases"
NEW_FILE_HEADER = (
    "# mlxcel-daemon configuration: one `option = value` per line (see docs/configuration.md).\n"
    "# Precedence: command-line flag > MLXCEL_<OPTION> environment variable > this file.\n"
)


class ConfigFileError(ConfigError):
    """config.toml cannot be read or holds a bad value; the message names the file and line."""


# Where a value may come from, lowest first (flag > env > config.toml).
LAYER_RANK = {"config.toml": 0, "env": 1, "flag": 2}
API_KEY_FILE_MAX_BYTES = 64 * 1024


def read_api_key_file(path: Path) -> str:
    """The API key: the first line of `path`, stripped (docs/configuration.md, api_key_file).

    Refused with one line: a missing or unreadable file, one that is not a regular file, one
    that other users may read or write (mode & 077, as ssh refuses a private key: chmod 600
    it), an empty first line, or a key holding control characters.
    """
    where = f"api_key_file {path}"
    line = _read_private(path, where).split(b"\n", 1)[0]
    if len(line) > API_KEY_FILE_MAX_BYTES:
        raise ConfigError(f"{where}: the first line is over {API_KEY_FILE_MAX_BYTES} bytes")
    key = _decode_key(line, where)
    if not key:
        raise ConfigError(f"{where}: the first line is empty (the key goes there)")
    return key


def read_api_keys_file(path: Path) -> dict[str, str]:
    """API keys and each one's priority lane (docs/api.md, "Priority and timeouts"): a line
    per key, `KEY [LANE]` (`high`, `normal`, `low` or vLLM's integer; default `normal`), blank
    lines and `#` comments skipped. The file is refused as `read_api_key_file` refuses one,
    and so are a bad lane, a key listed twice and a file with no key."""
    from mlxcel.daemon.engine.lanes import parse_lane

    where = f"api_keys_file {path}"
    data = _read_private(path, where)
    if len(data) > API_KEY_FILE_MAX_BYTES:
        raise ConfigError(f"{where}: over {API_KEY_FILE_MAX_BYTES} bytes")
    keys: dict[str, str] = {}
    for number, raw in enumerate(data.split(b"\n"), 1):
        line = _decode_key(raw.replace(b"\t", b" "), f"{where} line {number}")
        if not line or line.startswith("#"):
            continue
        key, _, lane = line.partition(" ")
        try:
            lane = parse_lane(lane.strip() or "normal")
        except ValueError as exc:
            raise ConfigError(f"{where} line {number}: {exc}") from None
        if key in keys:
            raise ConfigError(f"{where} line {number}: the key is listed twice")
        keys[key] = lane
    if not keys:
        raise ConfigError(f"{where}: no key in it (one per line: KEY [high|normal|low])")
    return keys


def _read_private(path: Path, where: str) -> bytes:
    """The head of a file only its owner may read (a regular file, mode & 077 clear)."""
    try:
        # O_NONBLOCK: a named pipe there must not hang the start; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"{where}: not a regular file")
            mode = stat.S_IMODE(info.st_mode)
            if mode & 0o077:
                raise ConfigError(
                    f"{where}: other users may read it (mode {mode:04o}); chmod 600 {path}"
                )
            return f.read(API_KEY_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from None


def _decode_key(line: bytes, where: str) -> str:
    try:
        text = line.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: the key is not valid UTF-8") from None
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text):
        raise ConfigError(f"{where}: the key holds control characters")
    return text


def _apply_api_key_file(merged: dict[str, Any], sources: dict[str, str]) -> None:
    """Set `api_key` from `api_key_file` unless an `api_key` was given at the same layer or a
    higher one (`--api-key` beats `--api-key-file`; `--api-key-file` beats a config.toml
    `api_key`)."""
    if "api_key_file" not in merged:
        return
    key_file = parse_option("api_key_file", merged["api_key_file"])
    if key_file is None:
        return
    has_key = parse_option("api_key", merged.get("api_key")) is not None
    if has_key and LAYER_RANK[sources["api_key"]] >= LAYER_RANK[sources["api_key_file"]]:
        return
    merged["api_key"] = read_api_key_file(Path(key_file).expanduser())
    sources["api_key"] = sources["api_key_file"]


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def env_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Options set through `MLXCEL_<NAME>` variables (empty values are ignored)."""
    env = os.environ if environ is None else environ
    return {name: env[env_name(name)] for name in OPTION_NAMES if env.get(env_name(name))}


def _line_of(text: str, key: str) -> int | None:
    pattern = re.compile(rf"^[ \t]*[\"']?{re.escape(key)}[\"']?[ \t]*=", re.MULTILINE)
    table = re.compile(rf"^[ \t]*\[+[ \t]*{re.escape(key)}[ \t]*\]", re.MULTILINE)
    m = pattern.search(text) or table.search(text)
    return text.count("\n", 0, m.start()) + 1 if m else None


def _where(path: Path, text: str, key: str) -> str:
    line = _line_of(text, key)
    return f"{path} line {line}" if line else str(path)


def _parse_document(path: Path) -> tuple[tomlkit.TOMLDocument, str]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")  # a BOM (some editors write one) is no error
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigFileError(f"{path} line {line}: not valid UTF-8") from None
    try:
        return tomlkit.parse(text), text
    except tomlkit.exceptions.ParseError as exc:
        raise ConfigFileError(f"{path} line {exc.line}: {_parse_message(exc)}") from None


def _parse_message(exc: tomlkit.exceptions.ParseError) -> str:
    # tomlkit appends " at line L col C"; the line is already in our prefix.
    return re.sub(r"\s+at line \d+ col \d+$", "", str(exc)) + f" (column {exc.col})"


def read_config_file(path: Path) -> dict[str, Any]:
    """Raw option values from config.toml ({} when the file is absent), each validated."""
    if not path.exists():
        return {}
    doc, text = _parse_document(path)
    values: dict[str, Any] = {}
    for key, item in doc.unwrap().items():
        if key == ALIASES_TABLE:  # model names, read by the model registry (docs/models.md)
            continue
        if key == ALERTS_TABLE:  # console alert thresholds (docs/console.md): checked here
            try:
                parse_alerts(item)
            except ConfigError as exc:
                raise ConfigFileError(f"{_where(path, text, key)}: {exc}") from None
            continue
        name = key.replace("-", "_")
        if name not in OPTION_NAMES:
            raise ConfigFileError(
                f"{_where(path, text, key)}: unknown option {key!r} "
                f"(known: {', '.join(OPTION_NAMES)})"
            )
        if isinstance(item, (dict, list)):
            raise ConfigFileError(f"{_where(path, text, key)}: {key} must be a plain value")
        if name in values:  # `max-batch-prefill` and `max_batch_prefill`: which one holds?
            raise ConfigFileError(f"{_where(path, text, key)}: {name} is set twice")
        try:
            parse_option(name, item)
        except ConfigError as exc:
            raise ConfigFileError(f"{_where(path, text, key)}: {exc}") from None
        values[name] = item
    return values


def resolve_config(
    flags: Mapping[str, Any],
    config_path: Path,
    environ: Mapping[str, str] | None = None,
) -> tuple[ServingConfig, dict[str, str]]:
    """Merge the layers; returns the config and, per option set anywhere, where it came from."""
    layers = (
        ("config.toml", read_config_file(config_path)),
        ("env", env_values(environ)),
        ("flag", {k: v for k, v in flags.items() if v is not None}),
    )
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, values in layers:
        for key, value in values.items():
            merged[key] = value
            sources[key] = source
    for key, source in sources.items():
        if source == "env":
            try:
                parse_option(key, merged[key])
            except ConfigError as exc:
                raise ConfigError(f"{env_name(key)}: {exc}") from None
    _apply_api_key_file(merged, sources)
    keys_file = parse_option("api_keys_file", merged.get("api_keys_file"))
    if keys_file is not None:  # refused here, with one line, before the daemon starts
        keys_path = Path(keys_file).expanduser().absolute()  # the daemon may run elsewhere
        read_api_keys_file(keys_path)
        merged["api_keys_file"] = str(keys_path)
    return build_config(merged), sources


def save_runtime_values(path: Path, values: Mapping[str, Any]) -> list[str]:
    """Write runtime keys into config.toml, keeping comments; returns the keys written.

    A file that does not parse is refused (ConfigFileError) and left untouched.
    """
    unknown = [k for k in values if k not in RUNTIME_KEYS]
    if unknown:
        raise ConfigError(f"not runtime keys: {', '.join(unknown)}")
    if path.exists():
        doc, _ = _parse_document(path)
    else:
        doc = tomlkit.parse(NEW_FILE_HEADER)
    for key, value in values.items():
        spelled = next((k for k in doc if k.replace("-", "_") == key), key)
        doc[spelled] = value  # in place, in the operator's own spelling
    atomic_write(path, tomlkit.dumps(doc))
    return list(values)
