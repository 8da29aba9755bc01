"""The controls bar: the runtime settings the keys change, as the daemon reports them."""

from __future__ import annotations

from mlxcel.shared.snapshot import EffectiveConfig, Snapshot
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

SEP = ("  │  ", "dim")


def cap_text(cap: int) -> str:
    return "uncapped" if cap == 0 else f"{cap} tok"


def parallel_text(cfg: EffectiveConfig) -> str:
    text = str(cfg.parallel)
    if cfg.parallel_clamp_reason:
        text += f" (asked {cfg.parallel_requested}, limit {cfg.parallel_limit}: "
        text += f"{cfg.parallel_clamp_reason})"
    elif cfg.parallel != cfg.parallel_requested:
        # Lowering drains down: running sequences finish first.
        text += f" (→ {cfg.parallel_requested})"
    return text


class ControlsBar(Widget):
    snapshot: reactive[Snapshot | None] = reactive(None)

    def render(self) -> Content:
        if self.snapshot is None:
            return Content.styled("settings: n/a (not connected)", "dim")
        cfg = self.snapshot.engine.config
        cache = ("on", "bold $success") if cfg.prompt_cache else ("off", "bold $error")
        full = Content.assemble(
            ("[+/-] parallel ", "dim"),
            (parallel_text(cfg), "bold"),
            SEP,
            ("[c] prefill cap ", "dim"),
            (cap_text(cfg.max_batch_prefill_tokens), "bold"),
            SEP,
            ("[x] prompt cache ", "dim"),
            cache,
            SEP,
            ("batch prefill ", "dim"),
            (str(cfg.max_batch_prefill), "bold"),
        )
        if full.cell_length <= self.content_size.width:
            return full
        short_sep = (" │ ", "dim")
        return Content.assemble(
            ("parallel ", "dim"),
            (parallel_text(cfg), "bold"),
            short_sep,
            ("prefill cap ", "dim"),
            (cap_text(cfg.max_batch_prefill_tokens), "bold"),
            short_sep,
            ("prompt cache ", "dim"),
            cache,
        ).truncate(self.content_size.width, ellipsis=True)
