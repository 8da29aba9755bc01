"""Key bindings and the matching command-palette entries: one table for both."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class Command:
    key: str
    action: str
    label: str  # footer
    binding_id: str
    title: str  # command palette
    help: str
    key_display: str | None = None
    show: bool = True  # in the footer (80 columns hold no more); help and palette list all


COMMANDS = (
    Command("plus", "parallel(1)", "par+", "parallel.up", "Parallel: one more slot",
            "Raise parallel (decode slots) by one", "+"),
    Command("minus", "parallel(-1)", "par-", "parallel.down", "Parallel: one fewer slot",
            "Lower parallel by one; running requests finish first", "-"),
    Command("c", "prefill_cap", "cap", "prefill.cap", "Set prefill token cap",
            "Cap on padded tokens in one batched prefill (0 = uncapped)"),
    Command("x", "toggle_cache", "cache", "prompt.cache", "Prompt cache on/off",
            "Turn the prompt-prefix cache off (drops it) or back on"),
    Command("d", "toggle_speculative", "spec", "speculative", "Speculative decoding on/off",
            "Turn speculative decoding (prompt-lookup drafts) off, or back on (ngram)",
            show=False),
    Command("enter", "detail", "detail", "request.detail", "Request detail",
            "Open the selected slot's or queued request's detail", "⏎"),
    Command("k", "cancel_request", "kill", "request.cancel", "Cancel the selected request",
            "End the selected request (asks first); its client gets finish_reason abort"),
    Command("o", "sort", "sort", "table.sort", "Sort the selected table",
            "Cycle the slots' (or the queue's) order: age, tok/s, generated, prompt, KV",
            show=False),
    Command("l", "toggle_log", "log", "log.toggle", "Daemon log / event log",
            "Switch the bottom pane between the console's event log and the daemon's log"),
    Command("f", "log_level", "level", "log.level", "Daemon log: level filter",
            "Cycle the daemon log's level: debug, info, warning, error (and up)", show=False),
    Command("h", "history_span", "span", "history.span", "History: 60 s / 15 minutes",
            "Switch the sparklines between the last 60 s and the daemon's last 15 minutes",
            show=False),
    Command("s", "save", "save", "settings.save", "Save settings to config.toml",
            "Write the daemon's current runtime settings to config.toml", show=False),
    Command("space", "toggle_pause", "pause", "display.pause", "Pause/resume display",
            "Freeze the display; data keeps arriving", "space"),
    Command("question_mark", "help", "help", "help", "Help: keys and fields",
            "What each key does and what the panels mean", "?"),
    Command("q", "quit", "quit", "quit", "Quit mlxcel-top",
            "Leave the console (the daemon keeps running)"),
)  # fmt: skip


def bindings() -> list[Binding]:
    return [
        Binding(
            c.key,
            c.action,
            c.label,
            key_display=c.key_display,
            id=c.binding_id,
            tooltip=c.help,
            show=c.show,
        )
        for c in COMMANDS
    ]
