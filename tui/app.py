"""The `mlxcel-top` App: owns the console state; widgets only render what it gives them.

Data flow: DaemonLink (worker) posts messages -> handlers here change the App's reactives
-> `data_bind` pushes them down to the widgets. Control actions run as workers that post
their answers back as messages; no worker touches a widget.

Why one module: the Textual `App`: its bindings, actions and message handlers act on one widget
tree; the widgets, screens, formatting and state are modules of their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from mlxcel.shared.alerts import ALERT_PANELS, AlertRules, AlertTracker
from mlxcel.shared.control_client import ControlError, NotConnected
from mlxcel.shared.paths import default_socket_path
from mlxcel.shared.protocol import EV_CONFIG, EV_SHUTDOWN
from mlxcel.shared.snapshot import EffectiveConfig, Snapshot
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.events import Resize
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import DataTable, Footer, RichLog

from . import events
from .commands import COMMANDS, bindings
from .controls import ControlsBar
from .format import fmt_bytes
from .gauges import CacheGauge, KVGauge, ProcessGauge
from .header import StatusHeader
from .latency import LatencyPanel
from .link import DaemonLink
from .logpane import DaemonLogPane, next_level
from .messages import (
    CommandFailed,
    ConfigAnswered,
    ConnectAttemptFailed,
    ConnectionLost,
    ConnectionMade,
    DaemonEventReceived,
    HistoryReceived,
    LogLinesReceived,
    ProtocolMismatched,
    RequestCancelled,
    RequestInfoReceived,
    SettingsSaved,
    SnapshotReceived,
)
from .models_panel import ModelsScreen
from .screens import CapScreen, ConfirmScreen, DetailScreen, HelpScreen
from .state import (
    ChangeDedupe,
    History,
    Link,
    LinkState,
    Sample,
    Timelines,
    describe_change,
    long_samples,
    parse_changes,
)
from .tables import KeyedTable, QueueTable, SlotsTable

DEFAULT_INTERVAL_MS = 1000
LONG_REFRESH_S = 10.0  # the daemon's 15-minute history moves one point per 10 s
# Actions that change the daemon: disabled on a read-only (remote) key.
CONTROL_ACTIONS = frozenset({"parallel", "prefill_cap", "toggle_cache", "save", "cancel_request"})
NARROW_BELOW = 100  # columns


class MlxcelTop(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "mlxcel-top"
    BINDINGS: ClassVar[list[BindingType]] = [
        *bindings(),
        Binding("m", "models", "models", id="models.panel", show=False,
                tooltip="Models: loaded and on disk; load, unload (docs/models.md)"),
    ]  # fmt: skip
    # textual annotates these `ClassVar[...] | None`, which mypy reads as instance variables
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [  # type: ignore[misc]
        (0, "-narrow"),
        (NARROW_BELOW, "-wide"),
    ]
    VERTICAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-short"), (32, "-tall")]  # type: ignore[misc]

    # `var`: the App itself never repaints on these (a full-screen repaint each tick);
    # the widgets bound to them repaint what changed.
    snapshot: var[Snapshot | None] = var(None)  # what is displayed (frozen on pause)
    link_state: var[LinkState] = var(LinkState)
    received_at: var[float | None] = var(None)
    samples: var[tuple[Sample, ...]] = var(tuple)
    paused: var[bool] = var(False)

    def __init__(
        self,
        socket_path: str,
        interval_ms: int = DEFAULT_INTERVAL_MS,
        clock: Callable[[], float] = time.time,
        retry_s: float = 1.0,
        api_key: str | None = None,
        alert_rules: AlertRules | None = None,
    ) -> None:
        super().__init__()
        self.alerts = AlertTracker(alert_rules or AlertRules())
        self.socket_path = socket_path  # or the daemon's http:// URL (--url)
        self.interval_ms = interval_ms
        self.clock = clock
        self.latest: Snapshot | None = None  # newest received, even while paused
        self.history = History()
        self.timelines = Timelines()  # each request's phases, for its detail screen
        self.dedupe = ChangeDedupe()
        self.link = DaemonLink(
            socket_path, interval_ms, self.post_message, clock, retry_s, api_key=api_key
        )
        self.read_only = False  # a remote read-only key: the controls are disabled
        self.long_span = False  # h: the sparklines show the daemon's 15 minutes
        self._daemon_pid: Any = None
        self._parallel_target: int | None = None
        self._calls_in_flight = 0

    # --- layout ---

    def compose(self) -> ComposeResult:
        app = MlxcelTop
        yield StatusHeader(self.socket_path, self.interval_ms, self.clock, id="header").data_bind(
            app.snapshot, app.link_state, app.received_at, app.paused
        )
        with Horizontal(id="gauges"):
            yield KVGauge(id="kv", classes="gauge").data_bind(app.snapshot)
            yield CacheGauge(id="cache", classes="gauge").data_bind(app.snapshot)
            yield ProcessGauge(id="process", classes="gauge").data_bind(app.snapshot)
        yield SlotsTable(id="slots").data_bind(app.snapshot)
        yield QueueTable(id="queue").data_bind(app.snapshot)
        yield LatencyPanel(id="latency").data_bind(app.snapshot, app.samples)
        yield ControlsBar(id="controls").data_bind(app.snapshot)
        yield RichLog(id="log", max_lines=1000, wrap=True, markup=False)
        yield DaemonLogPane(id="daemon-log")
        yield Footer()

    def on_mount(self) -> None:
        events_log = self.query_one("#log", RichLog)
        events_log.border_title = "events"
        events_log.border_subtitle = "l daemon log"
        self.log_event("console started", "dim")
        self.run_worker(self.link.run(), name="daemon-link", group="link", exclusive=True)

    def watch_link_state(self, state: LinkState) -> None:
        # What is shown while offline is the last known state: dim it.
        self.screen_stack[0].set_class(state.link is not Link.CONNECTED, "-offline")

    def on_resize(self, event: Resize) -> None:
        # A compact footer keeps every key visible in 80 columns.
        self.query_one(Footer).compact = event.size.width < NARROW_BELOW

    def watch_snapshot(self, snapshot: Snapshot | None) -> None:
        if snapshot is None:
            return
        slots = snapshot.engine.slots
        busy = sum(1 for s in slots if s.state != "idle")
        waiting = len(snapshot.engine.queue)
        # The main screen's panels, also while a panel or detail screen is on top of it (the app's
        # own query looks at the top screen) or while the app is closing (no panels then).
        main = self.screen_stack[0] if self.screen_stack else None
        if main is None:
            return
        for panel in main.query("#slots"):
            panel.border_title = f"slots · {busy}/{len(slots)} busy"
        for panel in main.query("#queue"):
            panel.border_title = f"queue · {waiting} waiting"

    # --- what the link reports ---

    def on_connection_made(self, message: ConnectionMade) -> None:
        hello = message.hello
        pid = hello.get("pid")
        was = self.link_state.link
        self.link_state = LinkState(Link.CONNECTED, "", tuple(hello.items()))
        self.read_only = hello.get("access") == "read-only"
        self.refresh_bindings()
        who = f"{hello.get('model', '?')} (mlxcel {hello.get('version', '?')}, pid {pid})"
        if self._daemon_pid is None:
            self.log_event(f"connected to {who}", "green")
        elif pid != self._daemon_pid:
            self.history.clear()
            self.alerts.clear()
            self._show_alerts()
            self.log_event(f"reconnected: daemon restarted, now {who}", "green")
        else:
            self.log_event(f"reconnected to {who}", "green")
        if was is not Link.CONNECTING:
            self.notify(f"connected to {who}", title="daemon")
        self._daemon_pid = pid
        if self.read_only:
            self.log_event("read-only key: watching only, the controls are disabled", "yellow")

    def on_connect_attempt_failed(self, message: ConnectAttemptFailed) -> None:
        if self.link_state.link is Link.DISCONNECTED and message.attempt > 1:
            return  # still down: said once already
        self.link_state = LinkState(Link.DISCONNECTED, message.reason)
        self.log_event(f"no daemon: {message.reason} — retrying every second", "yellow")
        if message.attempt == 1 and self._daemon_pid is None:
            self.log_event("start one with `mlxcel-daemon start` (or pass --socket PATH)", "dim")

    def on_connection_lost(self, message: ConnectionLost) -> None:
        self.link_state = LinkState(Link.DISCONNECTED, message.reason)
        self.log_event(f"disconnected: {message.reason} — retrying", "red")
        self.notify("daemon connection lost — retrying", title="daemon", severity="warning")

    def on_protocol_mismatched(self, message: ProtocolMismatched) -> None:
        if self.link_state.link is not Link.MISMATCH:
            self.log_event(f"cannot talk to the daemon: {message.message}", "red")
            self.notify(message.message, title="protocol mismatch", severity="error", timeout=15)
        self.link_state = LinkState(Link.MISMATCH, message.message)

    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        self.latest = message.snapshot
        self.history.add(message.snapshot, message.received_at)
        self.timelines.add(message.snapshot, message.received_at)
        changes = self.alerts.update(message.snapshot, message.received_at)
        for change in changes:
            if change.active:
                self.log_event(f"alert: {change.message}", "bold red")
                self.notify(change.message, title="alert", severity="error", timeout=8)
            else:
                self.log_event(f"alert over: {change.name} back under its threshold", "green")
        if changes:
            self._show_alerts()
        if not self._calls_in_flight:
            self._parallel_target = None
        if self.paused:
            return
        self.received_at = message.received_at
        if not self.long_span:
            self.samples = self.history.samples()
        self.snapshot = message.snapshot

    def on_daemon_event_received(self, message: DaemonEventReceived) -> None:
        if message.name == EV_CONFIG:
            for change in parse_changes(message.data):
                if self.dedupe.is_new(change, self.clock()):
                    severity, text = describe_change(change)
                    self.log_event(text, events.STYLE[severity])
            return
        if message.name == EV_SHUTDOWN:
            self.link_state = replace(self.link_state, detail="daemon shutting down")
        line = events.describe_event(message.name, message.data)
        if line is not None:
            self.log_event(*line)

    def on_config_answered(self, message: ConfigAnswered) -> None:
        self._calls_in_flight -= 1
        if "parallel" in message.config:
            self._parallel_target = message.config["parallel"]
        for change in message.changes:
            severity, text = describe_change(change)
            if self.dedupe.is_new(change, self.clock()):
                self.log_event(text, events.STYLE[severity])
            self.notify(text, title="daemon answered", severity=events.SEVERITY[severity])

    def on_command_failed(self, message: CommandFailed) -> None:
        if message.counted:
            self._calls_in_flight -= 1
        self.log_event(f"{message.what} failed: {message.message}", "red")
        self.notify(message.message, title=f"{message.what} failed", severity="error")

    def on_settings_saved(self, message: SettingsSaved) -> None:
        self.log_event(f"settings saved to {message.path}", "green")
        self.notify(f"saved to {message.path}", title="settings")

    def on_log_lines_received(self, message: LogLinesReceived) -> None:
        for pane in self._main_query(DaemonLogPane):
            pane.add_lines(message.lines, message.replace)

    def action_toggle_log(self) -> None:
        """The bottom pane: the console's event log, or the daemon's own log."""
        screen = self.screen_stack[0]
        showing = not screen.has_class("-daemon-log")
        screen.set_class(showing, "-daemon-log")
        if showing:  # lines written while hidden wrapped to a guessed width: rewrap
            pane = self.query_one("#daemon-log", DaemonLogPane)
            self.call_after_refresh(pane.set_level, pane.level)

    def action_log_level(self) -> None:
        pane = self.query_one("#daemon-log", DaemonLogPane)
        pane.set_level(next_level(pane.level))
        self.screen_stack[0].set_class(True, "-daemon-log")
        self.notify(f"daemon log: {pane.level} and up", title="log level", timeout=2)

    def action_history_span(self) -> None:
        """The sparklines: this console's last 60 s, or the daemon's last 15 minutes."""
        self.long_span = not self.long_span
        panel = self.query_one("#latency", LatencyPanel)
        if self.long_span:
            panel.border_title = "last 15 min"
            self._fetch_history()
            self._history_timer = self.set_interval(LONG_REFRESH_S, self._fetch_history)
        else:
            panel.border_title = "last 60 s"
            timer = getattr(self, "_history_timer", None)
            if timer is not None:
                timer.stop()
            self.samples = self.history.samples()

    def _fetch_history(self) -> None:
        self.run_worker(self._get_history(), group="history", exclusive=True)

    async def _get_history(self) -> None:
        try:
            result = await self.link.call("history")
        except (ControlError, NotConnected, asyncio.TimeoutError) as exc:
            self.post_message(CommandFailed("history", str(exc) or "no answer", counted=False))
            return
        if isinstance(result, dict) and isinstance(result.get("points"), list):
            self.post_message(HistoryReceived(result["points"], float(result.get("step_s", 0))))

    def on_history_received(self, message: HistoryReceived) -> None:
        if self.long_span:
            self.samples = long_samples(message.points)

    def _main_query(self, selector: Any) -> list[Any]:
        """Widgets of the main screen, under any dialog; none while the app closes."""
        return list(self.screen_stack[0].query(selector)) if self.screen_stack else []

    def _show_alerts(self) -> None:
        """The panel of each active alert gets `-alert` (red frame and title)."""
        active = {ALERT_PANELS[name] for name in self.alerts.active}
        for panel in set(ALERT_PANELS.values()):
            for widget in self._main_query(f"#{panel}"):
                widget.set_class(panel in active, "-alert")

    def log_event(self, text: str, style: str = "") -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.clock()))
        self.query_one("#log", RichLog).write(events.log_line(stamp, text, style))

    # --- actions (keys and command palette) ---

    def action_parallel(self, delta: int) -> None:
        cfg = self._config()
        if cfg is None:
            return
        base = self._parallel_target if self._parallel_target is not None else cfg.parallel
        self._parallel_target = base + delta
        self._send_changes({"parallel": base + delta})

    def action_prefill_cap(self) -> None:
        cfg = self._config()
        if cfg is None:
            return

        def chosen(value: int | None) -> None:
            if value is not None:
                self._send_changes({"max_batch_prefill_tokens": value})

        self.push_screen(CapScreen(cfg.max_batch_prefill_tokens), chosen)

    def action_toggle_cache(self) -> None:
        cfg = self._config()
        if cfg is None or self.latest is None:
            return
        if not cfg.prompt_cache:
            self._send_changes({"prompt_cache": True})
            return
        pc = self.latest.engine.prompt_cache
        question = (
            f"Turn the prompt cache off? It drops {pc.entries} cached prefixes "
            f"({fmt_bytes(pc.bytes)}); requests then prefill their whole prompt."
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self._send_changes({"prompt_cache": False})

        self.push_screen(ConfirmScreen(question, yes="Turn off"), answered)

    def action_toggle_speculative(self) -> None:
        """Speculative decoding off, or back on: with the draft model where one is loaded,
        else by prompt lookup (ngram)."""
        cfg = self._config()
        if cfg is None:
            return
        on = "draft" if cfg.draft_model else "ngram"
        self._send_changes({"speculative": on if cfg.speculative == "off" else "off"})

    def action_save(self) -> None:
        self.run_worker(self._save(), group="control")

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused and self.latest is not None:
            if not self.long_span:
                self.samples = self.history.samples()
            self.snapshot = self.latest
        self.log_event("display paused" if self.paused else "display resumed", "dim")

    # --- one request: detail and cancel ---

    def _selected_table(self) -> KeyedTable:
        focused = self.focused
        if isinstance(focused, KeyedTable):
            return focused
        return self.query_one("#slots", SlotsTable)

    def _selected_request(self) -> str | None:
        table = self._selected_table()
        request_id = table.selected_request()
        if request_id is None:
            what = "slot is idle" if isinstance(table, SlotsTable) else "queue is empty"
            self.notify(f"nothing to act on: the selected {what}", severity="warning")
        return request_id

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_detail()

    def action_detail(self) -> None:
        request_id = self._selected_request()
        if request_id is not None and not isinstance(self.screen, DetailScreen):
            self.push_screen(
                DetailScreen(
                    request_id, lambda: self.latest, self.confirm_cancel, self.timelines.describe
                )
            )
            self.run_worker(self._request_info(request_id), group="control")

    async def _request_info(self, request_id: str) -> None:
        try:
            info = await self.link.call("request.info", {"request_id": request_id})
        except (ControlError, NotConnected, asyncio.TimeoutError):
            return  # gone already, or an older daemon: the detail shows what snapshots carry
        if isinstance(info, dict):
            self.post_message(RequestInfoReceived(request_id, info))

    def on_request_info_received(self, message: RequestInfoReceived) -> None:
        screen = self.screen
        if isinstance(screen, DetailScreen) and screen.request_id == message.request_id:
            screen.info = message.info

    def action_sort(self) -> None:
        table = self._selected_table()
        label = table.cycle_sort()
        self.notify(f"{table.BORDER_TITLE} by {label}", title="sort", timeout=2)

    def action_cancel_request(self) -> None:
        request_id = self._selected_request()
        if request_id is not None:
            self.confirm_cancel(request_id)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Controls are shown disabled (dimmed in the footer, inert) on a read-only key."""
        if self.read_only and action in CONTROL_ACTIONS:
            return None
        return True

    def confirm_cancel(self, request_id: str) -> None:
        if self.read_only:
            self.notify("read-only key: cannot cancel requests", severity="warning")
            return
        if self.link_state.link is not Link.CONNECTED:
            self.notify("not connected to the daemon", severity="warning")
            return
        question = (
            f"Cancel request {request_id}? Its client's stream ends now "
            '(finish_reason "abort"); its slot and KV blocks are freed.'
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._cancel(request_id), group="control")

        self.push_screen(ConfirmScreen(question, yes="Kill request"), answered)

    async def _cancel(self, request_id: str) -> None:
        what = f"cancel {request_id}"
        try:
            await self.link.call("request.cancel", {"request_id": request_id, "by": "mlxcel-top"})
            self.post_message(RequestCancelled(request_id))
        except ControlError as exc:
            self.post_message(CommandFailed(what, exc.message, counted=False))
        except (NotConnected, asyncio.TimeoutError) as exc:
            message = str(exc) or "no answer from the daemon"
            self.post_message(CommandFailed(what, message, counted=False))

    def on_request_cancelled(self, message: RequestCancelled) -> None:
        # The event log line comes with the daemon's request_cancelled event (who and what).
        self.notify(f"request {message.request_id} cancelled", title="daemon answered")

    def action_models(self) -> None:
        self.push_screen(ModelsScreen(self.link.call, self.log_event, read_only=self.read_only))

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for cmd in COMMANDS:
            if cmd.action != "quit":
                yield SystemCommand(cmd.title, cmd.help, partial(self.run_action, cmd.action))

    # --- control calls (workers: they post the answer, they never touch widgets) ---

    def _config(self) -> EffectiveConfig | None:
        if self.latest is None or self.link_state.link is not Link.CONNECTED:
            self.notify("not connected to the daemon", severity="warning")
            return None
        return self.latest.engine.config

    def _send_changes(self, changes: dict[str, Any]) -> None:
        self._calls_in_flight += 1
        self.run_worker(self._config_set(changes), group="control")

    async def _config_set(self, changes: dict[str, Any]) -> None:
        what = "set " + ", ".join(f"{k}={v}" for k, v in changes.items())
        try:
            result = await self.link.set_config(changes)
            effective = result.get("effective", result.get("config", {}))
            self.post_message(ConfigAnswered(parse_changes(result), effective))
        except ControlError as exc:
            self.post_message(CommandFailed(what, exc.message))
        except (NotConnected, asyncio.TimeoutError) as exc:
            self.post_message(CommandFailed(what, str(exc) or "no answer from the daemon"))

    async def _save(self) -> None:
        try:
            result = await self.link.call("config.save")
            path = result.get("path", "?") if isinstance(result, dict) else "?"
            self.post_message(SettingsSaved(str(path)))
        except ControlError as exc:
            self.post_message(CommandFailed("save", exc.message, counted=False))
        except (NotConnected, asyncio.TimeoutError) as exc:
            message = str(exc) or "no answer from the daemon"
            self.post_message(CommandFailed("save", message, counted=False))


def make_app(
    socket_path: str | Path | None = None,
    interval_ms: int = DEFAULT_INTERVAL_MS,
    clock: Callable[[], float] = time.time,
    retry_s: float = 1.0,
    url: str | None = None,
    api_key: str | None = None,
    alert_rules: AlertRules | None = None,
) -> MlxcelTop:
    """The one factory: used by `mlxcel-top` and by the tests. `url`: a remote daemon's
    http://HOST:PORT (its WebSocket control endpoint) instead of the socket."""
    path = str(socket_path) if socket_path is not None else str(default_socket_path())
    target = url if url is not None else path
    return MlxcelTop(
        target,
        interval_ms=interval_ms,
        clock=clock,
        retry_s=retry_s,
        api_key=api_key,
        alert_rules=alert_rules,
    )
