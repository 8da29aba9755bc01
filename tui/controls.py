"""The controls bar: the runtime settings the keys change, as the daemon reports them."""

from __future__ import annotations

from mlxcel.shared.snapshot import EffectiveConfig, Snapshot
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

SEP = ("  │  ", "dim")


def cap_text(cap: int) -> str:
    return "uncapped" if cap == 0 else f"{cap} tok"


def parallel_text(cfg: EffectiveConfig, reason: bool = True) -> str:
    text = str(cfg.parallel)
    if cfg.parallel_clamp_reason:
        text += f" (asked {cfg.parallel_requested}, limit {cfg.parallel_limit}"
        text += f": {cfg.parallel_clamp_reason})" if reason else ")"
    elif cfg.parallel != cfg.parallel_requested:
        # Lowering drains down: running sequences finish first.
        text += f" (→ {cfg.parallel_requested})"
    return text


class ControlsBar(Widget):
    """One line of settings; a second line with the reason while `parallel` is clamped."""

    snapshot: reactive[Snapshot | None] = reactive(None)

    def watch_snapshot(self, old: Snapshot | None, new: Snapshot | None) -> None:
        if _clamp_reason(old) != _clamp_reason(new):
            self.refresh(layout=True)  # the bar grows or shrinks by a line

    def render(self) -> Content:
        if self.snapshot is None:
            return Content.styled("settings: n/a (not connected)", "dim")
        cfg = self.snapshot.engine.config
        line = self._settings_line(cfg)
        if not cfg.parallel_clamp_reason:
            return line
        why = Content.styled(f"parallel clamped: {cfg.parallel_clamp_reason}", "$warning")
        return Content("\n").join([line, why.truncate(self.content_size.width, ellipsis=True)])

    def _settings_line(self, cfg: EffectiveConfig) -> Content:
        cache = ("on", "bold $success") if cfg.prompt_cache else ("off", "bold $error")
        parallel = parallel_text(cfg, reason=False)
        full = Content.assemble(
            ("[+/-] parallel ", "dim"),
            (parallel, "bold"),
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
            (parallel, "bold"),
            short_sep,
            ("prefill cap ", "dim"),
            (cap_text(cfg.max_batch_prefill_tokens), "bold"),
            short_sep,
            ("prompt cache ", "dim"),
            cache,
        ).truncate(self.content_size.width, ellipsis=True)


def _clamp_reason(snapshot: Snapshot | None) -> str | None:
    return snapshot.engine.config.parallel_clamp_reason if snapshot else None
