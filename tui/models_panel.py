"""The models panel (`m`): the daemon's loaded models and the local ones, load and unload.

Reads `model.list` over the control socket every few seconds while open (never mlx or the
daemon package); `enter` loads the selected model (`model.load`), `u` unloads it after a
confirmation (`model.unload`: its running requests finish first), `p` pins or unpins it
(`model.pin` / `model.unpin`; a pinned model's state reads `loaded, pinned`: it is never
evicted nor unloaded by keep-alive). Answers go to the
console's event log through `report`. On a read-only (remote) key load and unload are shown
disabled and refused here (the daemon refuses them too). docs/models.md describes what the
daemon does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from .format import fmt_bytes
from .screens import ConfirmScreen

Call = Callable[[str, dict[str, Any]], Awaitable[Any]]
Report = Callable[[str, str], None]
COLUMNS = ("model", "state", "family", "size", "load", "active", "unloads in", "forward")
PIN_MARK = ", pinned"  # after the state of a pinned model


def model_rows(listing: dict[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, cells) for each loaded model, then each other local one."""
    rows: list[tuple[str, tuple[str, ...]]] = []
    for m in listing.get("models") or []:
        forever = m.get("keep_alive_s", listing.get("keep_alive_s")) is None
        expires = m.get("expires_in_s")
        until = "never" if forever else ("busy" if expires is None else f"{expires:.0f} s")
        if m.get("pinned"):
            until = "never"  # neither keep-alive nor another model's load unloads it
        load = m.get("load_s")
        state = m.get("state", "loaded")
        cells: tuple[str, ...] = (
            m["name"],
            state + PIN_MARK if m.get("pinned") else state,
            m.get("family") or "",
            fmt_bytes(m.get("weights_bytes")),
            "" if load is None else f"{load:.1f} s",
            str(m.get("active_requests", "")),
            until if state == "loaded" else "",
            m.get("forward") or "",  # the forward plan's line (docs/models.md)
        )
        rows.append((m["name"], cells))
    loaded = {name for name, _ in rows}
    for m in listing.get("available") or []:
        if m["name"] not in loaded:
            cells = (m["name"], "on disk", m.get("family") or "", fmt_bytes(m.get("size_bytes")))
            rows.append((m["name"], (*cells, "", "", "", "")))
    return rows


class ModelsScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "load", "Load", id="models.load", tooltip="Load the selected model"),
        Binding("u", "unload", "Unload", id="models.unload", tooltip="Unload it (asks first)"),
        Binding("p", "pin", "Pin", id="models.pin", tooltip="Pin it (load it first) or unpin it"),
        Binding("escape,m,q", "dismiss", "Close", id="models.close", tooltip="Close"),
    ]
    REFRESH_S = 2.0
    CONTROLS = frozenset({"load", "unload", "pin"})

    def __init__(self, call: Call, report: Report, read_only: bool = False) -> None:
        super().__init__()
        self._call = call
        self._report = report
        self.read_only = read_only  # a remote read-only key: load and unload are disabled
        self.listing: dict[str, Any] = {}

    def compose(self) -> ComposeResult:
        with Vertical(id="models-box", classes="dialog"):
            yield Label("models", classes="dialog-question")
            yield DataTable(id="models-table", cursor_type="row", zebra_stripes=True)
            yield Label("", id="models-summary", classes="dialog-hint")
            hint = (
                "read-only key: watching only"
                if self.read_only
                else "enter load · u unload · p pin/unpin"
            )
            yield Label(f"{hint} · esc close", id="models-hint", classes="dialog-hint")

    def on_mount(self) -> None:
        table = self.query_one("#models-table", DataTable)
        for column in COLUMNS:
            table.add_column(column, key=column)
        self.run_worker(self.refresh_models(), group="models-refresh", exclusive=True)
        self.set_interval(self.REFRESH_S, self._tick)

    def _tick(self) -> None:
        self.run_worker(self.refresh_models(), group="models-refresh", exclusive=True)

    async def refresh_models(self) -> None:
        try:
            listing = await self._call("model.list", {})
        except Exception as exc:  # not connected, or an old daemon without models
            self.query_one("#models-summary", Label).update(f"model.list failed: {exc}")
            return
        self.listing = listing if isinstance(listing, dict) else {}
        self._render_rows()

    def _render_rows(self) -> None:
        table = self.query_one("#models-table", DataTable)
        selected = self.selected()
        table.clear()
        for name, cells in model_rows(self.listing):
            table.add_row(*cells, key=name)
        if selected is not None and selected in table.rows:
            table.move_cursor(row=table.get_row_index(selected))
        info = self.listing
        self.query_one("#models-summary", Label).update(
            f"loads {info.get('loads', 0)} · unloads {info.get('unloads', 0)} · "
            f"failed {info.get('load_failures', 0)} · "
            f"max loaded {info.get('max_loaded_models', 1)}"
            # each loaded model's forward plan in full: the table's last column is often
            # past the dialog's width (docs/models.md, "The forward plan")
            + "".join(
                f"\n{m['name']}: {m['forward']}"
                for m in info.get("models") or []
                if m.get("forward")
            )
        )

    def selected(self) -> str | None:
        table = self.query_one("#models-table", DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return None if key.value is None else str(key.value)

    def _is_loaded(self, name: str) -> bool:
        return any(m["name"] == name for m in self.listing.get("models") or [])

    def _is_pinned(self, name: str) -> bool:
        return any(m["name"] == name and m.get("pinned") for m in self.listing.get("models") or [])

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Load and unload are shown disabled (dimmed in the footer, inert) on a read-only key."""
        return None if self.read_only and action in self.CONTROLS else True

    def _refused(self) -> bool:
        if self.read_only:
            self._report("read-only key: cannot load or unload models", "yellow")
        return self.read_only

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()  # `enter` on the table selects its row: load that model
        self.action_load()

    def action_load(self) -> None:
        name = self.selected()
        if name is None or self._refused():
            return
        if self._is_loaded(name):
            self._report(f"{name} is already loaded", "dim")
            return
        self._report(f"loading {name}…", "")
        self.run_worker(self._do("model.load", name), group="models-call")

    def action_unload(self) -> None:
        if self._refused():
            return
        name = self.selected()
        if name is None or not self._is_loaded(name):
            self._report("select a loaded model to unload", "dim")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._do("model.unload", name), group="models-call")

        question = f"Unload {name}? Its running requests finish first."
        self.app.push_screen(ConfirmScreen(question, yes="Unload"), answered)

    def action_pin(self) -> None:
        """Pin the selected model (a model on disk is loaded first), or unpin a pinned one."""
        name = self.selected()
        if name is None or self._refused():
            return
        method = "model.unpin" if self._is_pinned(name) else "model.pin"
        self._report(f"{method.removeprefix('model.')}ning {name}…", "")
        self.run_worker(self._do(method, name), group="models-call")

    async def _do(self, method: str, name: str) -> None:
        try:
            result = await self._call(method, {"name": name})
        except TimeoutError:
            self._report(f"{method} {name}: still running (the events show when it is done)", "")
            return
        except Exception as exc:
            self._report(f"{method} {name} failed: {exc}", "red")
            return
        if method == "model.load":
            self._report(f"loaded {name} ({result.get('load_s', 0):.1f} s)", "green")
        elif method in ("model.pin", "model.unpin"):
            self._report(f"{method.removeprefix('model.')}ned {name}", "green")
        else:
            self._report(f"unloaded {', '.join(result.get('unloaded', [])) or name}", "green")
        await self.refresh_models()
