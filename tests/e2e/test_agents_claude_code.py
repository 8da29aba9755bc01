"""Claude Code itself (`claude -p`, npm `@anthropic-ai/claude-code`, installed once into a
cache folder) for one turn against a daemon subprocess on SmolLM2 (docs/agents.md): it probes
`HEAD /`, and its `POST /v1/messages` are answered 200. Skipped without node/npm, the network
for the first install, or the pulled model. What it sends, on the tiny model in-process, is
tests/integration/test_api_agents_compat.py's."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from daemon_helpers import running_daemon, wait_until
from npm_tools import npm_binary

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"  # the version these notes were taken with
# Claude Code asks max_tokens 32000 at temperature 1: a 135M model may ramble to the end of
# its context (~5,000 tokens, minutes on a CPU). Capped, each answer is short; one that hits
# the cap is continued by Claude Code (up to 3 times), then reported as an API error.
MAX_OUTPUT_TOKENS = "64"
CAPPED = "output token maximum"


def _claude_binary() -> Path:
    """`claude` from the test cache, installed there with npm the first time."""
    return npm_binary(CLAUDE_CODE, "claude-code", "claude")


def test_claude_code_runs_one_turn(default_model_dir: Path, tmp_path: Path) -> None:
    claude = _claude_binary()
    with running_daemon(tmp_path / "home", default_model_dir, "--parallel", "1") as daemon:
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(tmp_path / "claude-home"),  # its settings and session files
            "ANTHROPIC_BASE_URL": daemon.http_url,
            "ANTHROPIC_API_KEY": "dummy",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": MAX_OUTPUT_TOKENS,
        }
        (tmp_path / "claude-home").mkdir()
        cmd = [str(claude), "-p", "Say hi", "--model", default_model_dir.name]
        done = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        # the access line is written as the response ends, which may be just after the
        # client has read the last event and exited
        posted = wait_until(
            lambda: "POST /v1/messages" in daemon.log_text() or done.returncode != 0,
            timeout=10,
            what=f"a POST /v1/messages in the access log (Claude Code said {done.stdout[-500:]!r})",
        )
        log = daemon.log_text()
    answered = done.returncode == 0 and done.stdout.strip()
    capped = CAPPED in done.stdout + done.stderr  # it parsed our stop_reason max_tokens
    assert answered or capped, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "HEAD / 200" in log
    assert posted and "POST /v1/messages 200" in log, log[-3000:]
    assert not re.search(r"POST /v1/messages 4\d\d", log), log[-3000:]
