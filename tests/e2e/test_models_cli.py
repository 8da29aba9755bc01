"""The models CLI's `run` (daemon/cli/model_commands.py) as a subprocess: its greedy text on the
tiny model equals greedy decoding by hand, and an unreachable hub is one clear error line.
load_model itself is tests/integration/test_models.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlxcel.daemon.models import LoadedModel, load_model
from mlxcel.daemon.models.loader import backend_name

ON_CPU = backend_name() == "cpu"
CLI = (sys.executable, "-m", "mlxcel.daemon.cli.model_commands")


def test_unreachable_hub_is_one_clear_line(mlxcel_home: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(mlxcel_home / "hf")}
    proc = subprocess.run(
        [*CLI, "run", "--model", "someone/model-x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "error: cannot reach the Hugging Face hub to fetch 'someone/model-x'"
    )
    assert "local directory" in lines[0]


def _greedy_text(loaded: LoadedModel, prompt: str, max_tokens: int) -> str:
    """Greedy decoding by hand: argmax of the full forward, token by token."""
    messages = [{"role": "user", "content": prompt}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(mx.argmax(loaded.model(mx.array([ids + out]))[0, -1]).item())
        if token in loaded.info.eos_token_ids:
            break
        out.append(token)
    return loaded.tokenizer.decode(out)


def test_cli_run_on_tiny_model(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [*CLI, "run", "hello", "--model", str(tiny_model_dir), "--max-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "llama, float32, cpu/" in proc.stderr or not ON_CPU
    expected = _greedy_text(load_model(str(tiny_model_dir)), "hello", 6)
    assert expected.strip() and proc.stdout.strip() == expected.strip()
