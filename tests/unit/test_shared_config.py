"""ServingConfig parsing and validation (docs/configuration.md)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlxcel.shared.config import (
    SPECULATIVE_MODES,
    ConfigError,
    ServingConfig,
    build_config,
    derived_prefill_token_cap,
    parse_bool,
    parse_kv_budget,
    parse_option,
    parse_size,
    runtime_change,
)


def test_defaults_match_spec() -> None:
    cfg = ServingConfig()
    assert (cfg.model, cfg.host, cfg.port) == ("smollm2-135m-instruct", "127.0.0.1", 8080)
    # the step budget's default is measured (docs/tuning.md, prefill_chunk_size)
    assert (cfg.parallel, cfg.max_batch_prefill, cfg.prefill_chunk_size) == (4, 4, 2048)
    assert cfg.effective_max_batch_prefill_tokens == 4096
    assert cfg.prompt_cache and cfg.kv_cache_budget == "auto"
    assert (cfg.ctx_size, cfg.max_queue_depth, cfg.dtype) == (0, 64, "auto")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 << 30), ("500MB", 500_000_000), ("1024", 1024), ("1.5 KiB", 1536), ("2g", 2e9)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-5", "8XB", "1e5"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize("word", ["none", "off", "disabled", "unbounded", "0", "OFF", 0])
def test_kv_budget_unbounded_words(word: str | int) -> None:
    assert parse_kv_budget(word) is None


def test_kv_budget_auto_and_size() -> None:
    assert parse_kv_budget("auto") == "auto"
    assert parse_kv_budget("8GiB") == 8 << 30


def test_derived_cap_uses_chunk_below_512() -> None:
    assert derived_prefill_token_cap(4, 512) == 4096
    assert derived_prefill_token_cap(4, 128) == 1024
    assert derived_prefill_token_cap(2, 2048) == 2048
    assert build_config({"max_batch_prefill": 2}).effective_max_batch_prefill_tokens == 2048
    assert build_config({"max_batch_prefill_tokens": 0}).effective_max_batch_prefill_tokens == 0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("parallel", 0),
        ("parallel", "x"),
        ("parallel", True),
        ("port", 70000),
        ("dtype", "int4"),
        ("temperature", 2.5),
        ("temperature", "warm"),
        ("top_p", -0.1),
        ("top_k", 1.5),
        ("min_p", True),
    ],
)
def test_bad_values_are_refused_with_the_option_name(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_option(key, value)


def test_sampling_defaults_are_unset_unless_given() -> None:
    assert (ServingConfig().temperature, ServingConfig().top_k) == (None, None)
    cfg = build_config({"temperature": "0", "top_p": 0.95, "top_k": "20", "min_p": ""})
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p) == (0.0, 0.95, 20, None)


def test_unknown_option_refused() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        build_config({"paralel": 4})


def test_non_loopback_host_needs_api_key() -> None:
    with pytest.raises(ConfigError, match="api-key"):
        build_config({"host": "0.0.0.0"})
    assert build_config({"host": "0.0.0.0", "api_key": "k"}).host == "0.0.0.0"
    assert build_config({"host": "::1"}).host == "::1"


def test_ctx_size_floor_per_slot() -> None:
    with pytest.raises(ConfigError, match="below the minimum 512"):
        build_config({"ctx_size": 2000, "parallel": 4})
    assert build_config({"ctx_size": 2048, "parallel": 4}).ctx_size == 2048


def test_speculative_option() -> None:
    from mlxcel.daemon.engine import speculative

    assert SPECULATIVE_MODES == speculative.SPECULATIVE_MODES  # shared/ cannot import it
    assert ServingConfig().speculative == "ngram"
    assert build_config({"speculative": "OFF"}).speculative == "off"
    with pytest.raises(
        ConfigError, match="speculative must be one of off, ngram, draft, got 'eagle'"
    ):
        build_config({"speculative": "eagle"})
    with pytest.raises(ConfigError, match="speculative must be one of"):
        parse_option("speculative", False)
    assert runtime_change("speculative", "off") == ("speculative", "off")


def test_runtime_change_only_runtime_keys() -> None:
    assert runtime_change("parallel", "3") == ("parallel", 3)
    assert runtime_change("prompt_cache", "off") == ("prompt_cache", False)
    with pytest.raises(ConfigError, match="cannot be changed at runtime"):
        runtime_change("model", "x")
    with pytest.raises(ConfigError):
        runtime_change("parallel", -1)


@given(st.one_of(st.text(), st.integers(), st.booleans(), st.none(), st.floats()))
def test_parse_option_never_crashes(value: object) -> None:
    for key in ("parallel", "kv_cache_budget", "prompt_cache", "prompt_cache_bytes", "dtype"):
        try:
            parse_option(key, value)
        except ConfigError:
            pass


@given(st.text())
def test_parse_bool_total(text: str) -> None:
    try:
        assert isinstance(parse_bool(text), bool)
    except ConfigError:
        pass
