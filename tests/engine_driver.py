"""`Driver`: a real `Engine` run step by step on the test's thread, for the engine tests."""

from __future__ import annotations

import time
from typing import Any

from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import GenerationRequest, TokenOutput
from mlxcel.shared.config import ServingConfig
from mlxcel.shared.snapshot import EngineSnapshot


class Driver:
    """Runs an engine step by step on this thread, collecting outputs and snapshots."""

    def __init__(
        self,
        model: Any,
        available_bytes: int = 1 << 30,
        split_head: bool = True,
        packed: bool = True,
        disk_tier: Any = None,
        **config: Any,
    ) -> None:
        # speculation's policy follows measured step times: off unless a test asks, so that
        # the steps a test counts are the same on a quiet machine and a loaded one
        config.setdefault("speculative", "off")
        cfg = ServingConfig(**config)
        self.engine = Engine(
            model.model,
            cfg,
            can_batch=model.info.can_batch,
            batch_reason=model.info.batch_reason,
            context_length=model.info.context_length,
            available_bytes=available_bytes,
            split_head=split_head,
            packed=packed,
            disk_tier=disk_tier,
        )
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, TokenOutput] = {}
        self.snapshots: list[EngineSnapshot] = []
        self.engine.on_output = self._on_output

    def _on_output(self, rid: str, out: TokenOutput) -> None:
        if out.token_id is not None:
            self.tokens.setdefault(rid, []).append(out.token_id)
        if out.finished:
            self.finals[rid] = out

    def add(self, *requests: GenerationRequest) -> Driver:
        for r in requests:
            self.engine.add_request(r)
        return self

    def step(self) -> EngineSnapshot:
        self.engine.step()
        self.snapshots.append(self.engine.snapshot())
        return self.snapshots[-1]

    def run(self, max_steps: int = 5000) -> Driver:
        for _ in range(max_steps):
            if not self.engine.has_work:
                if not self.engine.reading_disk:
                    return self
                time.sleep(0.005)  # a disk read runs on its own thread
            self.step()
        raise AssertionError("the engine did not finish")
