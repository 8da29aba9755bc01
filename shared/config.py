"""Serving configuration: the options of docs/configuration.md, their defaults, parsing, checks.

Plain data and pure functions; the daemon owns where values come from (flags, env, toml).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
KV_BLOCK_SIZE = 32
MIN_CTX_PER_SLOT = 512

# Keys that `config.set` may change while the daemon runs (docs/configuration.md).
RUNTIME_KEYS = (
    "parallel",
    "max_batch_prefill",
    "max_batch_prefill_tokens",
    "prompt_cache",
    "speculative",
)

UNBOUNDED_WORDS = frozenset({"none", "off", "disabled", "unbounded", "0"})
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "ki": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "mi": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "gi": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "ti": 1024**4,
}


MAX_SIZE_BYTES = 1 << 50  # 1 PiB: any size option above it is a typo, not a machine


class ConfigError(ValueError):
    """A configuration value was refused; the message says why."""


def parse_size(text: str | int) -> int:
    """Parse `8GiB`, `500MB`, `1024` into bytes."""
    if isinstance(text, bool):
        raise ConfigError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must be >= 0, got {text}")
        if text > MAX_SIZE_BYTES:
            raise ConfigError(f"size {text} is over the largest allowed (1 PiB)")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"not a size: {text!r} (use e.g. 8GiB, 500MB or bytes)")
    unit = (m.group(2) or "").lower()
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"unknown size unit in {text!r}")
    number = float(m.group(1))
    if number * _SIZE_UNITS[unit] > MAX_SIZE_BYTES:  # also a 400-digit number (inf)
        raise ConfigError(f"size {str(text).strip()[:40]!r} is over the largest allowed (1 PiB)")
    return int(number * _SIZE_UNITS[unit])


def format_size(num_bytes: float | None, none: str = "unbounded") -> str:
    """Bytes in binary units: "512 B", "1.5 KiB" ... "2.0 TiB"; None prints as `none`. The one
    byte formatter of the CLI, the console and the logs."""
    if num_bytes is None:
        return none
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_duration(seconds: float) -> str:
    """An uptime or an age in its two largest units: "5s", "4m05s", "3h05m", "1d02h"."""
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def parse_kv_budget(text: str | int | None) -> str | int | None:
    """`auto` -> "auto"; unbounded words -> None; a size -> bytes."""
    if text is None:
        return None
    if isinstance(text, str):
        word = text.strip().lower()
        if word == "auto":
            return "auto"
        if word in UNBOUNDED_WORDS:
            return None
    size = parse_size(text)
    return None if size == 0 else size


def parse_models_memory(text: str | int | None) -> int | None:
    """`models_memory`: a size -> bytes; None, "" or an unbounded word (`none`, `off`, `0`)
    -> None (no budget: only the free-memory check)."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", *UNBOUNDED_WORDS)):
        return None
    size = parse_size(text)
    return None if size == 0 else size


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("1", "true", "yes", "on", "enabled"):
            return True
        if word in ("0", "false", "no", "off", "disabled"):
            return False
    raise ConfigError(f"not a boolean: {value!r} (use true/false, on/off)")


def parse_hosts(value: Any) -> tuple[str, ...]:
    """`a,b` or a list -> extra Host names the HTTP API answers (`*` answers any); empty -> none."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(h, str) for h in items):
        raise ConfigError(f"allowed_hosts must be a comma-separated string or a list: {value!r}")
    hosts = tuple(h.strip().lower() for h in items if h.strip())
    bad = [h for h in hosts if h != "*" and not re.fullmatch(r"[a-z0-9._:\[\]-]+", h)]
    if bad:
        raise ConfigError(f"allowed_hosts: {bad[0]!r} is not a host name or address")
    return hosts


def parse_origins(value: Any) -> tuple[str, ...]:
    """`a,b` or a list -> origins (`*` allows any); empty -> none."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(o, str) for o in items):
        raise ConfigError(f"allowed_origins must be a comma-separated string or a list: {value!r}")
    origins = tuple(o.strip().rstrip("/") for o in items if o.strip())
    bad = [o for o in origins if o != "*" and "://" not in o]
    if bad:
        raise ConfigError(f"allowed_origins: {bad[0]!r} is not an origin (scheme://host[:port])")
    return origins


def _parse_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {value}")
    return value


MAX_DURATION_S = 10 * 365 * 86400.0  # ten years: longer is `forever`
FOREVER_WORDS = frozenset({"forever", "never", "none", "off", "inf", "infinite", "-1"})
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1, "": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(name: str, value: Any) -> float | None:
    """`30s`, `5m`, `1h`, `1.5`, `0` (unload after each request) -> seconds;
    `forever` / `-1` / `never` -> None (never unloaded)."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a duration, got {value!r}")
    if isinstance(value, (int, float)):
        if value != value:  # NaN
            raise ConfigError(f"{name} must be a duration, got NaN")
        if value < 0:
            return None
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        if text in FOREVER_WORDS:
            return None
        m = _DURATION_RE.match(text)
        if not m:
            raise ConfigError(
                f"{name} must be a duration like 30s, 5m, 1h or forever, got {str(value)[:40]!r}"
            )
        seconds = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "").lower()]
    if seconds > MAX_DURATION_S:  # also inf and 1e999: say forever instead
        raise ConfigError(f"{name} must be at most {MAX_DURATION_S:.0f} s (or forever)")
    return seconds


MAX_PARALLEL = 256


@dataclass(frozen=True)
class ServingConfig:
    """Every serving option of docs/configuration.md, already parsed and validated."""

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    readonly_api_key: str | None = None  # a key that only watches (/v1/control, docs/console.md)
    socket: str | None = None  # None: platformdirs runtime dir
    parallel: int = 4
    max_batch_prefill: int = 4
    prefill_chunk_size: int = 2048  # the step token budget (docs/tuning.md)
    max_batch_prefill_tokens: int | None = None  # None: derived; 0: uncapped
    prompt_cache: bool = True
    prompt_cache_bytes: int | None = None  # None: derived from memory
    # the prompt cache's disk tier (docs/tuning.md): its folder (None: the user cache dir's
    # mlxcel/prompt-cache) and byte budget (None: 1/4 of the free disk, at most 32 GiB; 0: off)
    prompt_cache_dir: str | None = None
    prompt_cache_disk_bytes: int | None = None
    warm_prompts: str | None = None  # a JSON file of prompts prefilled at start
    kv_cache_budget: str | int | None = "auto"  # "auto" | bytes | None (unbounded)
    ctx_size: int = 0
    max_queue_depth: int = 64
    dtype: str = "auto"
    strict_api: bool = False  # refuse unknown request fields instead of ignoring them
    allowed_origins: tuple[str, ...] = ()  # CORS origins allowed to call the HTTP API
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback and `host`
    api_key_file: str | None = None  # a file whose first line is the API key (read at start)
    # a file of API keys, one per line with its default priority lane (read at start)
    api_keys_file: str | None = None
    stream_timeout: float = 60.0  # seconds a streaming client may read nothing before it is cut
    header_timeout: float = 30.0  # seconds a client has to send a request's headers
    max_connections: int = 512  # open HTTP connections; more are closed at once
    reasoning_budget: int | None = None  # reasoning tokens per answer; None: unbounded
    stream_interval: int = 1  # tokens per streamed chunk (more: less host time per token)
    keep_alive: float | None = None  # seconds an idle model stays loaded; None: forever
    max_loaded_models: int = 1  # models resident at once (switching unloads the LRU one)
    # bytes the resident models' weights may take together (docs/tuning.md, "Several models
    # resident"); None: only the free-memory check
    models_memory: int | None = None
    request_timeout: float | None = None  # seconds a request may take by default; None: no limit
    preemption: bool = True  # a waiting higher-lane request may preempt a lower-lane one
    priority_aging: float = 10.0  # seconds a waiting request takes to rise one lane (0: never)
    # seconds one engine step may take before the watchdog fails its requests and restarts the
    # engine (docs/reliability.md, "Step watchdog"); None: no watchdog
    step_timeout: float | None = 600.0
    # speculative decoding (docs/tuning.md): `ngram` drafts by prompt lookup, and its policy
    # verifies drafts only while that pays; `draft`: a draft model (`draft_model`) drafts;
    # `off`: one token per row and step
    speculative: str = "ngram"
    # sampling for a request that does not set it (docs/api.md, "Sampling defaults"); None: the
    # API's own default (temperature 1, top_p 1, top_k and min_p off)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # a smaller model of the same tokenizer that drafts for `speculative = draft` (a model spec
    # as for `model`); loaded beside every model that shares its tokenizer
    draft_model: str | None = None
    hosts: str | None = None  # a hosts file: serve one model across ranks (docs/distributed.md)
    distributed_mode: str = "auto"  # auto | tensor | pipeline
    distributed_timeout: float = 60.0  # seconds a step may wait on the other ranks
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def effective_max_batch_prefill_tokens(self) -> int:
        if self.max_batch_prefill_tokens is not None:
            return self.max_batch_prefill_tokens
        return derived_prefill_token_cap(self.max_batch_prefill, self.prefill_chunk_size)

    def replace(self, **changes: Any) -> ServingConfig:
        return dataclasses.replace(self, **changes)

    def sampling_set(self) -> dict[str, float]:
        """The sampling defaults set (`temperature`, ...), name -> value; empty: the API's own."""
        return {n: getattr(self, n) for n in SAMPLING_DEFAULTS if getattr(self, n) is not None}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        d["max_batch_prefill_tokens"] = self.effective_max_batch_prefill_tokens
        return d


def derived_prefill_token_cap(max_batch_prefill: int, chunk: int) -> int:
    """docs/configuration.md: 2 x max_batch_prefill x min(chunk, 512)."""
    return 2 * max_batch_prefill * min(chunk, 512)


# The sampling options a request's own fields override (docs/api.md, "Sampling defaults").
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DISTRIBUTED_MODES = ("auto", "tensor", "pipeline")
# `speculative`: the same tuple as daemon/engine/speculative.py's (shared/ imports no daemon
# module; tests/unit/test_shared_config.py checks that the two agree)
SPECULATIVE_MODES = ("off", "ngram", "draft")


def _parse_fraction(name: str, value: Any, maximum: float) -> float | None:
    """A sampling default: a number in [0, maximum]; empty: None (the API's own default)."""
    if value in (None, ""):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not 0.0 <= number <= maximum:
        raise ConfigError(f"{name} must be between 0 and {maximum:g}, got {value!r}")
    return number


def _parse_seconds(name: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not 1.0 <= seconds <= 86400.0:
        raise ConfigError(f"{name} must be between 1 and 86400 seconds, got {value!r}")
    return seconds


# Option name -> parser of a raw value (flag text, env text or toml value).
_PARSERS: dict[str, Any] = {
    "model": lambda v: _nonempty("model", v),
    "host": lambda v: _nonempty("host", v),
    "port": lambda v: _parse_int("port", v, 0, 65535),
    "api_key": lambda v: None if v in (None, "") else str(v),
    "readonly_api_key": lambda v: None if v in (None, "") else str(v),
    "socket": lambda v: None if v in (None, "") else str(v),
    "parallel": lambda v: _parse_int("parallel", v, 1, MAX_PARALLEL),
    "max_batch_prefill": lambda v: _parse_int("max_batch_prefill", v, 1, MAX_PARALLEL),
    "prefill_chunk_size": lambda v: _parse_int("prefill_chunk_size", v, 16, 1 << 20),
    "max_batch_prefill_tokens": lambda v: _parse_int("max_batch_prefill_tokens", v, 0, 1 << 24),
    "prompt_cache": parse_bool,
    "prompt_cache_bytes": lambda v: parse_size(v),
    "prompt_cache_dir": lambda v: None if v in (None, "") else str(v),
    "prompt_cache_disk_bytes": lambda v: parse_size(v),
    "warm_prompts": lambda v: None if v in (None, "") else str(v),
    "kv_cache_budget": parse_kv_budget,
    "ctx_size": lambda v: _parse_int("ctx_size", v, 0, 1 << 24),
    "max_queue_depth": lambda v: _parse_int("max_queue_depth", v, 0, 1 << 20),
    "stream_interval": lambda v: _parse_int("stream_interval", v, 1, 64),
    "dtype": lambda v: _choice("dtype", v, DTYPES),
    "strict_api": parse_bool,
    "allowed_origins": lambda v: parse_origins(v),
    "allowed_hosts": lambda v: parse_hosts(v),
    "api_key_file": lambda v: None if v in (None, "") else str(v),
    "api_keys_file": lambda v: None if v in (None, "") else str(v),
    "stream_timeout": lambda v: _parse_seconds("stream_timeout", v),
    "header_timeout": lambda v: _parse_seconds("header_timeout", v),
    "max_connections": lambda v: _parse_int("max_connections", v, 1, 1 << 16),
    "reasoning_budget": lambda v: (
        None if v in (None, "", -1, "-1") else _parse_int("reasoning_budget", v, 0, 1 << 24)
    ),
    "hosts": lambda v: None if v in (None, "") else str(v),
    "distributed_mode": lambda v: _choice("distributed_mode", v, DISTRIBUTED_MODES),
    "distributed_timeout": lambda v: _parse_seconds("distributed_timeout", v),
    "keep_alive": lambda v: parse_duration("keep_alive", v),
    "max_loaded_models": lambda v: _parse_int("max_loaded_models", v, 1, 64),
    "models_memory": parse_models_memory,
    "preemption": parse_bool,
    "request_timeout": lambda v: (
        None if v in (None, "", 0, "0") else _parse_seconds("request_timeout", v)
    ),
    "step_timeout": lambda v: (
        None if v in (None, "", 0, "0") else _parse_seconds("step_timeout", v)
    ),
    "priority_aging": lambda v: 0.0 if v in (0, "0") else _parse_seconds("priority_aging", v),
    "speculative": lambda v: _choice("speculative", v, SPECULATIVE_MODES),
    "draft_model": lambda v: None if v in (None, "") else _nonempty("draft_model", v),
    "temperature": lambda v: _parse_fraction("temperature", v, 2.0),
    "top_p": lambda v: _parse_fraction("top_p", v, 1.0),
    "top_k": lambda v: None if v in (None, "") else _parse_int("top_k", v, 0, 1 << 20),
    "min_p": lambda v: _parse_fraction("min_p", v, 1.0),
}

OPTION_NAMES = tuple(_PARSERS)


def _nonempty(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be a non-empty string")
    return value.strip()


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value.lower()


def parse_option(name: str, value: Any) -> Any:
    """Parse one option value; raises ConfigError naming the option."""
    key = name.replace("-", "_")
    if key not in _PARSERS:
        raise ConfigError(f"unknown option {name!r}")
    try:
        return _PARSERS[key](value)
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(key) else f"{key}: {msg}") from None


def build_config(values: dict[str, Any]) -> ServingConfig:
    """Build a validated ServingConfig from raw option values (unknown keys refused)."""
    parsed = {k.replace("-", "_"): parse_option(k, v) for k, v in values.items()}
    cfg = ServingConfig(**parsed)
    validate_config(cfg)
    return cfg


def validate_config(cfg: ServingConfig) -> None:
    from ipaddress import ip_address

    if cfg.host not in ("localhost",):
        try:
            loopback = ip_address(cfg.host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and not cfg.api_key and not cfg.api_keys_file:
            raise ConfigError(
                f"host {cfg.host} is not loopback: --api-key is required (or --api-keys-file)"
            )
    if cfg.speculative == "draft" and not cfg.draft_model:
        raise ConfigError("speculative draft needs a draft model: --draft-model NAME")
    if cfg.ctx_size and cfg.ctx_size // cfg.parallel < MIN_CTX_PER_SLOT:
        raise ConfigError(
            f"ctx_size {cfg.ctx_size} split across {cfg.parallel} slots gives "
            f"{cfg.ctx_size // cfg.parallel} tokens per slot, below the minimum {MIN_CTX_PER_SLOT}"
        )


def runtime_change(name: str, value: Any) -> tuple[str, Any]:
    """Validate one runtime change (`config.set`); returns (key, parsed value)."""
    key = name.replace("-", "_")
    if key not in RUNTIME_KEYS:
        raise ConfigError(
            f"{name!r} cannot be changed at runtime (runtime keys: {', '.join(RUNTIME_KEYS)})"
        )
    return key, parse_option(key, value)
