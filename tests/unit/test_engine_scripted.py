"""The engine on a scripted runner (plain Python, no model): scheduling, the request lifecycle,
KV books, cancel and live changes in milliseconds, and proof that none of it imports mlx. The
scripted runner and the scenario are tests/scripted_engine.py's."""

from __future__ import annotations

import subprocess
import sys

from mlxcel.daemon.engine.types import GREEDY, GenerationRequest, TokenOutput
from repo_paths import TESTS
from scripted_engine import run_scenario, scripted_engine, scripted_token


def test_scripted_runner_drives_the_engine() -> None:
    result = run_scenario()
    outputs = result["outputs"]
    assert set(outputs) == {f"r{i}" for i in range(8)}
    for rid, outs in outputs.items():
        final = outs[-1]
        if rid == "r6":
            assert final.finish_reason == "abort" and final.completion_tokens == 0
            continue
        max_tokens = 6 if rid == "r1" else 5
        expected = [scripted_token(rid, n) for n in range(max_tokens)]
        assert [o.token_id for o in outs] == expected
        assert final.finish_reason == "length" and final.completion_tokens == max_tokens
    assert result["cancelled_at"] is not None
    assert result["kv_used"] == 0  # every reservation released
    counts = result["running_counts"]
    assert max(counts) == 4 and 2 in counts[3:12]  # parallel 2 drained down, then back to 4


def test_prompt_cache_reuse_with_a_scripted_runner() -> None:
    engine, runner = scripted_engine(parallel=2)
    runner.keep_prompt_kv = engine.effective.prompt_cache
    finals: dict[str, TokenOutput] = {}
    engine.on_output = lambda rid, out: finals.__setitem__(rid, out) if out.finished else None
    prompt = tuple(range(1, 80))
    engine.add_request(GenerationRequest("a", prompt, 3, GREEDY))
    while engine.has_work:
        engine.step()
    engine.add_request(GenerationRequest("b", (*prompt, 5, 6), 3, GREEDY))
    while engine.has_work:
        engine.step()
    assert finals["a"].cached_tokens == 0
    assert finals["b"].cached_tokens >= len(prompt)  # the first prompt (and answer) reused
    assert engine.kv.num_used == 0 and engine.prefix_cache.num_blocks > 0


def test_the_scripted_engine_imports_no_mlx() -> None:
    """The scenario above in a fresh interpreter: engine, scheduler, KV, prefix cache, stats,
    snapshots and a runner through the protocol, with mlx and mlx_lm never imported."""
    script = TESTS / "child_scripts" / "engine_scripted_no_mlx.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
