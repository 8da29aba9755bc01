"""Modal screens: help, a yes/no confirmation, the prefill-cap input, a request's detail."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from mlxcel.shared.snapshot import Snapshot
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.validation import Integer
from textual.widgets import Button, Input, Label, Static

from .format import request_detail

HELP = """\
[b]keys[/b]
 [b]+ -[/b]     one more / one fewer slot (parallel); lowering drains
 [b]c[/b]       prefill token cap: padded tokens per batched prefill, 0 = uncapped
 [b]x[/b]       prompt cache on/off (turning it off drops it: asks first)
 [b]d[/b]       speculative decoding (prompt-lookup drafts) off / back on
 [b]s[/b]       save the current settings to config.toml
 [b]↑ ↓[/b]     select a slot or queued request (tab: slots / queue)
 [b]enter[/b]   the selected request's detail: tokens, TTFT, tok/s, KV, cache
 [b]k[/b]       cancel the selected request (asks first; its client gets "abort")
 [b]o[/b]       sort the selected table: age, tok/s, generated, prompt, KV
 [b]l[/b]       bottom pane: the event log / the daemon's own log
 [b]f[/b]       daemon log level: debug, info, warning, error (and up)
 [b]h[/b]       sparklines: last 60 s / the daemon's last 15 minutes (10 s points)
 [b]space[/b]   pause / resume the display (data keeps arriving)
 [b]ctrl+p[/b]  command palette: every action by name
 [b]?[/b]       this help          [b]q[/b]  quit (the daemon keeps running)

[b]panels[/b]
 KV blocks  used by requests · cached by the prompt cache · free
 prompt     hit rate by requests and by tokens; bytes held / capacity
 slots      prefill x/y = prompt progress; cached = tokens reused
 queue      why each request waits: a slot, KV blocks, the prefill cap
 last 60 s  x/y figures are p50/p95; ITL = inter-token latency
 n/a        the daemon does not know the value (never a fake 0)
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,question_mark", "dismiss", "Close", id="help.close", tooltip="Close help")
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box", classes="dialog"):
            yield Static(Content.from_markup(HELP))
            yield Label("esc to close", classes="dialog-hint")


class ConfirmScreen(ModalScreen[bool]):
    """Ask yes/no; dismisses with True for yes."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes", id="confirm.yes", tooltip="Confirm"),
        Binding("n,escape", "answer(False)", "No", id="confirm.no", tooltip="Cancel"),
    ]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.yes = yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="dialog-question")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


class CapScreen(ModalScreen[int | None]):
    """Ask for the prefill token cap; dismisses with the value or None when cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="cap.cancel", tooltip="Keep the cap")
    ]

    def __init__(self, current: int | None) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        now = "n/a" if self.current is None else str(self.current)
        with Vertical(classes="dialog"):
            yield Label(
                f"Prefill token cap (now {now}): padded tokens per batched prefill, 0 = uncapped",
                classes="dialog-question",
            )
            yield Input(
                placeholder="tokens, e.g. 4096",
                type="integer",
                validators=[Integer(minimum=0)],
                id="cap-input",
            )
            yield Label("enter to apply · esc to cancel", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.validation_result is not None and not event.validation_result.is_valid:
            self.notify("; ".join(event.validation_result.failure_descriptions), severity="error")
            return
        if not event.value.strip():
            self.dismiss(None)
            return
        self.dismiss(int(event.value))

    def action_cancel(self) -> None:
        self.dismiss(None)


def info_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """`endpoint`, `model` and `sampling` rows from a `request.info` answer (none before it)."""
    if not info:
        return []
    sampling = info.get("sampling") or {}
    text = " · ".join(f"{k} {v}" for k, v in sampling.items()) if sampling else "defaults"
    return [
        ("endpoint", str(info.get("endpoint") or "?")),
        ("model", str(info.get("model", "?"))),
        ("sampling", text),
    ]


class DetailScreen(ModalScreen[None]):
    """One request's figures, refreshed from the newest snapshot while open; `k` cancels."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,enter", "dismiss", "Close", id="detail.close", tooltip="Close"),
        Binding("k", "cancel", "Cancel request", id="detail.cancel", tooltip="Cancel it"),
    ]
    REFRESH_S = 0.25

    def __init__(
        self,
        request_id: str,
        latest: Callable[[], Snapshot | None],
        cancel: Callable[[str], None],
        phases: Callable[[str], list[str]] = lambda _: [],
    ) -> None:
        super().__init__()
        self.request_id = request_id
        self._latest = latest
        self._cancel = cancel
        self._phases = phases  # its life as this console saw it (Timelines.describe)
        self.info: dict[str, Any] = {}  # request.info: model, sampling (once, when it opens)

    def compose(self) -> ComposeResult:
        with Vertical(id="detail-box", classes="dialog"):
            yield Static(self._render_text(), id="detail-body")
            yield Label("k cancel · esc close", classes="dialog-hint")

    def on_mount(self) -> None:
        self.set_interval(self.REFRESH_S, self._refresh_body)

    def _refresh_body(self) -> None:
        self.query_one("#detail-body", Static).update(self._render_text())

    def _render_text(self) -> Content:
        snapshot = self._latest()
        rows = request_detail(snapshot, self.request_id) if snapshot is not None else None
        phases = self._phases(self.request_id)
        if rows is None:
            return Content.assemble(
                ("request ", "dim"),
                (self.request_id, "bold"),
                ("\nfinished: no longer running or waiting in the daemon", "dim"),
                ("\nlife          " if phases else "", "dim"),
                (" → ".join(phases), "bold"),
            )
        if phases:
            rows = [*rows, ("life", " → ".join(phases))]
        rows = [*rows, *info_rows(self.info)]
        width = max(len(label) for label, _ in rows)
        parts: list[Content] = [
            Content.assemble((f"{label:<{width}}  ", "dim"), (value, "bold"))
            for label, value in rows
        ]
        return Content("\n").join(parts)

    def action_cancel(self) -> None:
        self._cancel(self.request_id)
