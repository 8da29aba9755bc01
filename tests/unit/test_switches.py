"""The `MLXCEL_*` switches are one registry (shared/switches.py): every such name in the code is
a serving option's variable or a registered switch, every registered switch is used, the
readers keep the old semantics, docs/configuration.md's table is the generated one, and
`status --json` reports the ones set in the daemon's environment. The native thresholds read
once at import (a fresh interpreter) are tests/e2e/test_switches_import.py's."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from mlxcel.daemon.process.option_sources import env_name
from mlxcel.shared import switches as sw
from mlxcel.shared.config import OPTION_NAMES
from repo_paths import ROOT

NAME = re.compile(r"MLXCEL_[A-Z0-9_]+")
QUOTED = re.compile(r"\"(MLXCEL_[A-Z0-9_]+)\"")  # C: getenv("MLXCEL_...") (macros are not)
REGISTRY = ROOT / "shared" / "switches.py"
OPTION_ENV = {env_name(option) for option in OPTION_NAMES}


def scanned_files() -> list[tuple[Path, re.Pattern[str]]]:
    """Where the code names switches, with the pattern that finds them there: the Python of
    the product and the scripts (comments and docstrings too: a doc naming a switch that does
    not exist is wrong), setup.py, the shell scripts and CI entry, the native kernels' string
    literals (their getenv calls), and the test suite's helpers (not its test modules, which
    make up environments for the code under test)."""
    python = [
        p
        for folder in ("daemon", "tui", "shared", "scripts")
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts and p != REGISTRY
    ]
    helpers = [p for p in (ROOT / "tests").glob("*.py") if not p.name.startswith("test_")]
    shell = [*(ROOT / "scripts").glob("*.sh"), ROOT / ".ci" / "run"]
    native = [
        p for p in (ROOT / "daemon" / "forward" / "native").rglob("*") if p.suffix in (".c", ".h")
    ]
    files = [*python, ROOT / "setup.py", *helpers, *shell]
    return [(p, NAME) for p in sorted(files) if p.is_file()] + [(p, QUOTED) for p in native]


def occurrences() -> list[tuple[str, str]]:
    """(name, "file:line") for every MLXCEL_* name in the scanned files."""
    found = []
    for path, pattern in scanned_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in pattern.finditer(line):
                name = m.group(1) if pattern.groups else m.group(0)
                found.append((name, f"{path.relative_to(ROOT)}:{n}"))
    return found


def test_every_mlxcel_name_in_the_code_is_an_option_or_a_registered_switch() -> None:
    found = occurrences()
    assert len(found) > 50  # the scan does see the code
    unknown = [
        f"{where}: {name}" for name, where in found if name not in OPTION_ENV | set(sw.SWITCHES)
    ]
    assert unknown == [], (
        "MLXCEL_* names that are neither a serving option's variable nor in shared/switches.py "
        "(register them there, then run scripts/gen_switches_doc.py):\n" + "\n".join(unknown)
    )


def test_every_registered_switch_is_used_somewhere() -> None:
    used = {name for name, _ in occurrences()}
    assert sorted(set(sw.SWITCHES) - used) == []


def test_the_registry_is_well_formed() -> None:
    names = [s.name for s in sw.SWITCH_LIST]
    assert len(names) == len(set(names)) == len(sw.SWITCHES)
    assert sorted(set(names) & OPTION_ENV) == []  # a switch is never an option's variable
    for s in sw.SWITCH_LIST:
        assert NAME.fullmatch(s.name), s.name
        assert s.kind in sw.KINDS, s
        assert s.meaning and "|" not in s.meaning and not s.meaning.endswith("."), s.name
        if s.kind == "flag":
            assert s.default is None, s.name  # a flag's default is off: unset
        if s.kind == "int" and s.default is not None:
            int(s.default)
    assert not any(s.secret for s in sw.SWITCH_LIST)  # none is today: status shows them all


# --- the readers -------------------------------------------------------------------------


def test_a_flag_is_on_with_any_non_empty_value() -> None:
    name = "MLXCEL_NO_PACKED_STEP"
    assert sw.switch_flag(name, {}) is False
    assert sw.switch_flag(name, {name: ""}) is False
    assert sw.switch_flag(name, {name: "1"}) is True
    assert sw.switch_flag(name, {name: "0"}) is True  # as `os.environ.get(...)` always read it


def test_values_fall_back_to_the_registered_default() -> None:
    assert sw.switch_value("MLXCEL_DISTRIBUTED_BACKEND", {}) == "ring"
    assert sw.switch_value("MLXCEL_DISTRIBUTED_BACKEND", {"MLXCEL_DISTRIBUTED_BACKEND": ""}) == ""
    assert sw.switch_value("MLXCEL_HOME", {}) is None
    assert sw.switch_int("MLXCEL_NATIVE_MIN_ROWS", {}) == 8
    assert sw.switch_int("MLXCEL_NATIVE_ELEMENTWISE_MIN", {}) == 16384
    assert sw.switch_int("MLXCEL_NATIVE_MIN_ROWS", {"MLXCEL_NATIVE_MIN_ROWS": "3"}) == 3
    with pytest.raises(ValueError):
        sw.switch_int("MLXCEL_NATIVE_MIN_ROWS", {"MLXCEL_NATIVE_MIN_ROWS": "many"})


def test_an_unregistered_name_is_refused() -> None:
    with pytest.raises(KeyError, match="MLXCEL_NOT_A_SWITCH is not a registered switch"):
        sw.switch_value("MLXCEL_NOT_A_SWITCH", {})


def test_call_sites_read_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.daemon.process.service_units import managed_by_service
    from mlxcel.shared.paths import get_paths

    assert managed_by_service({"MLXCEL_SERVICE": "systemd"}) == "systemd"
    assert managed_by_service({"MLXCEL_SERVICE": "cron"}) is None
    monkeypatch.setenv("MLXCEL_HOME", "/tmp/switch-home")
    assert get_paths().config_dir == Path("/tmp/switch-home").resolve() / "config"


# --- status --json ------------------------------------------------------------------------


def test_set_switches_lists_the_registered_ones_present(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"MLXCEL_NO_PACKED_STEP": "1", "MLXCEL_HOME": "/h", "MLXCEL_NO_MALLOPT": ""}
    env |= {"MLXCEL_API_KEY": "sk-1", "MLXCEL_PARALLEL": "2", "PATH": "/bin", "MLXCEL_ELSE": "x"}
    assert sw.set_switches(env) == {
        "MLXCEL_HOME": "/h",
        "MLXCEL_NO_MALLOPT": "",  # set, though a flag reads it as off
        "MLXCEL_NO_PACKED_STEP": "1",
    }  # in registry order; options (the API key among them) and unknown names are not there
    secret = sw.Switch("MLXCEL_TOKEN", None, "str", "a test secret", secret=True)
    monkeypatch.setattr(sw, "SWITCH_LIST", (*sw.SWITCH_LIST, secret))
    assert sw.set_switches({"MLXCEL_TOKEN": "t0p"}) == {"MLXCEL_TOKEN": sw.REDACTED}


def test_status_json_shows_the_daemons_switches(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlxcel.daemon.cli import control_commands as cli_control
    from mlxcel.daemon.server.daemon_runtime import DaemonIdentity, DaemonRuntime
    from mlxcel.shared import snapshot as sn
    from mlxcel.shared.config import ServingConfig

    cfg = sn.EffectiveConfig(2, 4, 256, None, 4, 0, 512, True, 1 << 30, None, 64, 2048)
    engine = sn.EngineSnapshot(
        0.0, cfg, (sn.SlotInfo(0),), (), sn.KVInfo(), sn.PromptCacheInfo(), sn.LatencyInfo(),
        sn.Counters(),
    )  # fmt: skip

    class Bridge:
        def snapshot(self) -> sn.EngineSnapshot:
            return engine

        def add_listener(self, listener: object) -> None:
            pass

    identity = DaemonIdentity("m", "/m", "llama", "metal", "float32", None, "http://h", "/s")
    runtime = DaemonRuntime(Bridge(), identity, ServingConfig(), Path("/c"), lambda *a: None)
    for name in list(sw.SWITCHES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLXCEL_NO_PACKED_STEP", "1")
    monkeypatch.setenv("MLXCEL_GEMM_ISA", "avx2")
    monkeypatch.setenv("MLXCEL_API_KEY", "sk-never-shown")
    # `status --json` as the CLI runs it, the socket call answered by the runtime itself
    monkeypatch.setattr(cli_control, "running_pid", lambda paths: 4242)
    monkeypatch.setattr(cli_control, "read_state", lambda paths: {})
    monkeypatch.setattr(cli_control, "call", lambda *a, **k: runtime.snapshot_dict())
    assert cli_control.cmd_status(argparse.Namespace(json=True, socket=None)) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["daemon"]["switches"] == {
        "MLXCEL_GEMM_ISA": "avx2",
        "MLXCEL_NO_PACKED_STEP": "1",
    }
    assert "sk-never-shown" not in out
    back = sn.Snapshot.from_dict(json.loads(out))  # the console reads the same document
    assert back.daemon.switches == {"MLXCEL_GEMM_ISA": "avx2", "MLXCEL_NO_PACKED_STEP": "1"}
    assert sn.DaemonInfo.from_dict({**back.daemon.to_dict(), "switches": None}).switches is None


# --- docs/configuration.md ----------------------------------------------------------------


def test_the_docs_switches_table_is_the_generated_one() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert sw.render_doc(doc) == doc, "run scripts/gen_switches_doc.py"
    for s in sw.SWITCH_LIST:
        assert f"| `{s.name}` |" in doc


def test_the_generator_checks_and_rewrites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gen_switches_doc

    assert gen_switches_doc.main(["--check"]) == 0
    stale = tmp_path / "configuration.md"
    stale.write_text(f"intro\n{sw.TABLE_BEGIN}\n| old |\n{sw.TABLE_END}\nrest\n")
    monkeypatch.setattr(gen_switches_doc, "DOC", stale)
    assert gen_switches_doc.main(["--check"]) == 1
    assert gen_switches_doc.main([]) == 0
    text = stale.read_text()
    assert "| old |" not in text and sw.switches_table() in text and text.endswith("rest\n")
    with pytest.raises(ValueError, match="markers"):
        sw.render_doc("no markers here")
