"""The HTTP API's two options, strict_api and allowed_origins: parsing from every layer."""

from __future__ import annotations

import pytest
from mlxcel.daemon.cli import argv_to_flags, flags_to_argv
from mlxcel.shared.config import ConfigError, build_config


def test_defaults_are_tolerant_and_closed() -> None:
    cfg = build_config({})
    assert cfg.strict_api is False and cfg.allowed_origins == ()


@pytest.mark.parametrize(
    ("raw", "origins"),
    [
        (
            "http://localhost:3000, https://chat.example/",
            ("http://localhost:3000", "https://chat.example"),
        ),
        (["*"], ("*",)),
        ("", ()),
    ],
)
def test_allowed_origins_parse(raw: object, origins: tuple[str, ...]) -> None:
    assert build_config({"allowed_origins": raw}).allowed_origins == origins


@pytest.mark.parametrize("raw", ["localhost:3000", 5, ["http://a", 1]])
def test_bad_origins_are_refused_naming_the_option(raw: object) -> None:
    with pytest.raises(ConfigError, match="allowed_origins"):
        build_config({"allowed_origins": raw})


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("off", False), (True, True)])
def test_strict_api_parses_booleans(raw: object, value: bool) -> None:
    assert build_config({"strict_api": raw}).strict_api is value


def test_the_flags_survive_the_detached_start() -> None:
    flags = argv_to_flags(["--strict-api", "--allowed-origins", "http://a,http://b"])
    assert flags == {"strict_api": True, "allowed_origins": "http://a,http://b"}
    assert argv_to_flags(flags_to_argv(flags)) == flags
    assert argv_to_flags([]) == {}
