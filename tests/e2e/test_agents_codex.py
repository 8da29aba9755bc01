"""OpenAI's Codex CLI (`codex exec`, npm `@openai/codex`) against a real daemon on SmolLM2.

Codex speaks the Responses API (`POST /v1/responses`, streamed, `store: false`, the whole
history each turn; docs/api.md "Responses API"). Two ways to point it at mlxcel, both tested
here on one daemon subprocess:

- a custom provider in `$CODEX_HOME/config.toml` (`wire_api = "responses"`, `base_url` the
  daemon's `/v1`);
- `--oss --local-provider ollama` with `CODEX_OSS_BASE_URL`: Codex first asks `/api/version`
  (it needs 0.13.4 or newer) and `/api/tags` (the model's name there, else `/api/pull`), then
  the same `/v1/responses`.

Codex sends no `max_output_tokens` and no `temperature`: a 135M model at temperature 1 may
ramble to the end of its context (minutes), so the daemon runs with `--temperature 0`, the
default a request without one gets (docs/agents.md): SmolLM2's greedy answer to "Say hi" ends
by itself. The daemon's context is made just larger than Codex's prompt (~4,600 tokens) so an
answer is at most ~500 tokens; one that reaches it ends `incomplete` (`max_output_tokens`),
which Codex reports as an error (exit 1): that attempt is repeated, at most ATTEMPTS times
(Codex's prompt names the attempt's working folder, so it differs a little). e2e: skipped
without node/npm, the network for the first install, or the pulled default model.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_helpers import RunningDaemon, running_daemon
from npm_tools import npm_binary

CODEX = "@openai/codex@0.171.0"  # the version these notes were taken with
# Codex's prompt on SmolLM2 is ~4,600 tokens (its instructions and skills text; SmolLM2's
# template has no tool markup, so the tools' schemas do not reach the prompt). One slot with
# this context leaves an answer ~500 tokens (~25 s on the shared CPU) at most.
CTX_SIZE = "5120"
ATTEMPTS = 5
INCOMPLETE = "Incomplete response returned, reason: max_output_tokens"
RUN_TIMEOUT_S = 240


def _codex_binary() -> Path:
    """`codex` from the cache folder, installed there with npm the first time; it is a native
    binary inside the npm package, so check that it runs here."""
    binary = npm_binary(CODEX, "codex", "codex")
    version = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    if version.returncode != 0:
        pytest.skip(f"codex --version does not run here: {version.stderr.strip()[-200:]}")
    return binary


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    answer: str  # the last agent message (`-o FILE`)
    attempts: int


@pytest.fixture(scope="module")
def codex() -> Path:
    return _codex_binary()


@pytest.fixture(scope="module")
def daemon(
    default_model_dir: Path, codex: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    home = tmp_path_factory.mktemp("codex-daemon")
    flags = ("--parallel", "1", "--ctx-size", CTX_SIZE, "--temperature", "0")
    with running_daemon(home, default_model_dir, *flags) as running:
        yield running


def codex_exec(
    codex: Path, root: Path, *args: str, config: str | None = None, env: dict[str, str]
) -> Run:
    """`codex exec ARGS "Say hi"` in a fresh CODEX_HOME (holding `config` as its config.toml)
    and working folder under `root`, repeated while the answer was cut at the context's end
    (module docstring)."""
    for attempt in range(ATTEMPTS):
        base = root / f"try{attempt}"
        for folder in ("work", "home", "codex-home"):
            (base / folder).mkdir(parents=True)
        if config is not None:
            (base / "codex-home" / "config.toml").write_text(config)
        full_env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(base / "home"),
            "CODEX_HOME": str(base / "codex-home"),  # config, sessions, logs
            **env,
        }
        last = base / "last-message.txt"
        cmd = [
            str(codex),
            "exec",
            "--skip-git-repo-check",  # the working folder is no git repository
            "--sandbox",
            "read-only",
            "--ephemeral",
            "--color",
            "never",
            "--output-last-message",
            str(last),
            *args,
            "Say hi",
        ]
        done = subprocess.run(
            cmd,
            env=full_env,
            cwd=base / "work",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        answer = last.read_text(errors="replace").strip() if last.exists() else ""
        run = Run(done.returncode, done.stdout, done.stderr, answer, attempt + 1)
        if not (run.returncode != 0 and INCOMPLETE in run.stdout + run.stderr):
            break
    return run


def provider_config(daemon: RunningDaemon, model: str) -> str:
    """The custom provider block (docs: Codex's config.toml `model_providers`)."""
    return (
        f'model = "{model}"\n'
        'model_provider = "mlxcel"\n'
        "\n"
        "[model_providers.mlxcel]\n"
        'name = "mlxcel"\n'
        f'base_url = "{daemon.http_url}/v1"\n'
        'wire_api = "responses"\n'
    )


def assert_served(run: Run, daemon: RunningDaemon) -> None:
    shown = (run.attempts, run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    assert run.returncode == 0, shown
    assert run.answer, shown  # a non-empty agent message
    log = daemon.log_text()
    assert "POST /v1/responses 200" in log, log[-3000:]
    assert not re.search(r"POST /v1/responses [45]\d\d", log), log[-3000:]


def test_codex_exec_with_a_custom_provider(
    codex: Path, daemon: RunningDaemon, default_model_dir: Path, tmp_path: Path
) -> None:
    config = provider_config(daemon, default_model_dir.name)
    run = codex_exec(codex, tmp_path, config=config, env={})
    assert_served(run, daemon)
    assert "provider: mlxcel" in run.stderr, run.stderr[-2000:]


def test_codex_exec_oss_talks_to_the_ollama_routes(
    codex: Path, daemon: RunningDaemon, default_model_dir: Path, tmp_path: Path
) -> None:
    # The model's name as /api/tags lists it (the daemon serves the directory by its path),
    # so Codex finds it there and asks for no pull.
    run = codex_exec(
        codex,
        tmp_path,
        "--oss",
        "--local-provider",
        "ollama",
        "--model",
        str(default_model_dir),
        env={"CODEX_OSS_BASE_URL": f"{daemon.http_url}/v1"},
    )
    assert_served(run, daemon)
    log = daemon.log_text()
    assert "GET /api/version 200" in log and "GET /api/tags 200" in log, log[-3000:]
    assert "POST /api/pull" not in log, log[-3000:]
