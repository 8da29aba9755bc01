"""The engine on a scripted runner (plain Python, no model, no mlx): `ScriptedRunner` (a
`Runner` whose forwards are scripted, runner_api.py), `scripted_engine`, and `run_scenario`
(eight requests through four slots, one cancelled, parallel changed live). Used by
tests/unit/test_engine_scripted.py, test_speculative_wiring.py and
tests/child_scripts/engine_scripted_no_mlx.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.runner_api import (
    DecodeOutput,
    ModelProbe,
    PrefillProgress,
    RowSpec,
)
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest, TokenOutput
from mlxcel.shared.config import ServingConfig

VOCAB = 100
KV_BYTES_PER_TOKEN = 64


def scripted_token(uid: str, position: int) -> int:
    """The token a scripted row samples at `position` (0 = its first)."""
    return (sum(map(ord, uid)) * 7 + position * 13) % VOCAB


@dataclass
class _Row:
    spec: RowSpec
    remaining: list[int]
    generated: int = 0
    tokens: list[int] = field(default_factory=list)


@dataclass
class _Payload:
    nbytes: int


class ScriptedRunner:
    """A `Runner` (runner_api.py) whose forwards are scripted: a prefill chunk computes up to
    `chunk` tokens per row, the first token is sampled when the prompt is done, and decode
    emits `scripted_token(uid, n)`, finishing on max_tokens or a stop token."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.keep_prompt_kv = False
        self.expect_joins = False
        self._cohort: list[_Row] = []
        self._decoding: list[_Row] = []
        self.forwards = 0

    @property
    def prefill_uids(self) -> list[str]:
        return [r.spec.uid for r in self._cohort]

    @property
    def decode_uids(self) -> list[str]:
        return [r.spec.uid for r in self._decoding]

    tokens_after_chunk = False  # its prefill chunks are forwards of their own

    def start_cohort(self, rows: Sequence[RowSpec]) -> None:
        assert not self._cohort, "a cohort is already running"
        self._cohort = [_Row(r, list(r.compute_tokens), tokens=list(r.cached_tokens)) for r in rows]

    def prefill_chunk(self) -> PrefillProgress:
        progress = PrefillProgress()
        if not self._cohort:
            return progress
        self.forwards += 1
        longest = 0
        for row in self._cohort:
            n = min(self.chunk, len(row.remaining))
            row.tokens += row.remaining[:n]
            row.remaining = row.remaining[n:]
            progress.uid_to_computed[row.spec.uid] = n
            longest = max(longest, n)
        progress.padded_tokens = longest * len(self._cohort)
        for row in [r for r in self._cohort if not r.remaining]:
            self._cohort.remove(row)
            progress.graduated.append(row.spec.uid)
            if self.keep_prompt_kv:
                progress.prompt_kv.append((row.spec.uid, list(row.tokens), []))
            out = self._sample(row)
            progress.first_tokens.append(out)
            if out.finish_reason is None:
                self._decoding.append(row)
        return progress

    def decode(self, hold: bool = False) -> list[DecodeOutput]:
        if hold or not self._decoding:
            return []
        self.forwards += 1
        outs = [self._sample(row) for row in self._decoding]
        self._decoding = [
            r for r, o in zip(self._decoding, outs, strict=True) if not o.finish_reason
        ]
        return outs

    def _sample(self, row: _Row) -> DecodeOutput:
        token = scripted_token(row.spec.uid, row.generated)
        row.generated += 1
        row.tokens.append(token)
        finish = None
        if token in row.spec.stop_ids():
            finish = "stop"
        elif row.generated >= row.spec.max_tokens:
            finish = "length"
        kv = list(row.tokens) if finish else None
        return DecodeOutput(row.spec.uid, token, finish, kv, [] if finish else None)

    def remove(self, uid: str) -> bool:
        for rows in (self._cohort, self._decoding):
            for row in rows:
                if row.spec.uid == uid:
                    rows.remove(row)
                    return True
        return False

    def reset(self) -> None:
        self._cohort, self._decoding = [], []

    def decode_kv(self, uid: str) -> list[Any] | None:
        return None

    def kv_payload(self, caches: list[Any], num_tokens: int) -> _Payload:
        return _Payload(num_tokens * KV_BYTES_PER_TOKEN)


def scripted_engine(chunk: int = 8, **config: Any) -> tuple[Engine, ScriptedRunner]:
    runner = ScriptedRunner(chunk)
    engine = Engine(
        None,
        ServingConfig(**config),
        available_bytes=1 << 24,
        runner=runner,
        probe=ModelProbe(KV_BYTES_PER_TOKEN, VOCAB),
    )
    return engine, runner


def run_scenario() -> dict[str, Any]:
    """Eight requests through four slots, one cancelled mid-prefill, parallel changed live."""
    engine, runner = scripted_engine(parallel=4, max_batch_prefill=2)
    outputs: dict[str, list[TokenOutput]] = {}
    engine.on_output = lambda rid, out: outputs.setdefault(rid, []).append(out)
    prompts = {f"r{i}": tuple((i * 11 + j) % 97 + 1 for j in range(9 + 7 * i)) for i in range(8)}
    for rid, prompt in prompts.items():
        engine.add_request(GenerationRequest(rid, prompt, 5 + (rid == "r1"), GREEDY))
    running_counts = []
    cancelled_at = None
    for step in range(200):
        if not engine.has_work:
            break
        engine.step()
        running_counts.append(len(engine.running))
        if step == 1:
            engine.reconfigure({"parallel": 2})
        if step == 12:
            engine.reconfigure({"parallel": 4})
        if cancelled_at is None and "r6" in runner.prefill_uids:
            cancelled_at = step
            assert engine.abort("r6")
            assert "r6" not in runner.prefill_uids and "r6" not in engine.running
    return {
        "outputs": outputs,
        "running_counts": running_counts,
        "cancelled_at": cancelled_at,
        "kv_used": engine.kv.num_used,
        "forwards": runner.forwards,
        "steps": engine.stats.steps,
    }
