"""The slots table and the waiting queue, updated in place by row key.

Rows are added, removed and updated cell by cell as snapshots arrive; the table is only
rebuilt when its column set changes (a resize across the compact width) or rows reorder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.shared.snapshot import Snapshot
from rich.text import Text
from textual.coordinate import Coordinate
from textual.reactive import reactive
from textual.widgets import DataTable

from .format import QUEUE_COLUMNS, SLOT_COLUMNS, Column, queue_cells, slot_cells

COMPACT_BELOW = 96  # table width under which the compact column set is used

Row = tuple[str, dict[str, str]]  # (row key, column key -> cell text)


@dataclass(frozen=True)
class Sort:
    """One order `o` cycles through: a name for the border and a key over the row's item."""

    label: str
    key: Callable[[Any], Any]


class KeyedTable(DataTable):
    """A DataTable kept equal to a list of keyed rows with the fewest changes."""

    snapshot: reactive[Snapshot | None] = reactive(None)
    sort_index: reactive[int] = reactive(0)
    COLUMNS: Sequence[Column] = ()
    SORTS: Sequence[Sort] = ()

    def __init__(self, **kw) -> None:
        # A row cursor (arrows / mouse) picks a request for the detail (enter) and cancel (k);
        # it shows only while the table has focus.
        super().__init__(cursor_type="row", zebra_stripes=True, show_cursor=False, **kw)
        self._columns_now: tuple[Column, ...] = ()
        self._cells: dict[str, dict[str, str]] = {}

    def rows_for(self, snapshot: Snapshot) -> list[Row]:
        raise NotImplementedError

    def watch_snapshot(self) -> None:
        self._sync()

    def watch_sort_index(self) -> None:
        sort = self.current_sort
        self.border_subtitle = None if self.sort_index == 0 else f"by {sort.label} (o)"
        self._sync()

    @property
    def current_sort(self) -> Sort:
        return self.SORTS[self.sort_index % len(self.SORTS)]

    def cycle_sort(self) -> str:
        """The next order (the first is the table's natural one); returns its label."""
        self.sort_index = (self.sort_index + 1) % len(self.SORTS)
        return self.current_sort.label

    def on_focus(self) -> None:
        self.show_cursor = True

    def on_blur(self) -> None:
        self.show_cursor = False

    def selected_key(self) -> str | None:
        """The row key under the cursor, or None when the table is empty."""
        if not self.row_count:
            return None
        row = min(max(self.cursor_row, 0), self.row_count - 1)
        return self.coordinate_to_cell_key(Coordinate(row, 0)).row_key.value

    def selected_request(self) -> str | None:
        """The request id of the row under the cursor (None for an idle slot)."""
        raise NotImplementedError

    def on_resize(self) -> None:
        self._sync()

    def _wanted_columns(self) -> tuple[Column, ...]:
        compact = 0 < self.size.width < COMPACT_BELOW
        return tuple(c for c in self.COLUMNS if c.compact or not compact)

    def _sync(self) -> None:
        columns = self._wanted_columns()
        if columns != self._columns_now:
            self.clear(columns=True)
            self._cells.clear()
            for col in columns:
                self.add_column(_label(col), width=col.width, key=col.key)
            self._columns_now = columns
        rows = self.rows_for(self.snapshot) if self.snapshot is not None else []
        self._apply_rows(rows)

    def _apply_rows(self, rows: list[Row]) -> None:
        wanted = [key for key, _ in rows]
        for key in [k for k in self._cells if k not in set(wanted)]:
            self.remove_row(key)
            del self._cells[key]
        kept = [k for k in self._cells]
        selected = None
        if kept != wanted[: len(kept)]:
            # Reordered (a sort by a moving figure): rebuild the rows, keep the columns and
            # the cursor on the same request.
            selected = self.selected_key()
            self.clear()
            self._cells.clear()
        for key, cells in rows:
            if key in self._cells:
                self._update_row(key, cells)
            else:
                self.add_row(*self._render_cells(cells), key=key)
                self._cells[key] = cells
        if selected is not None and selected in wanted:
            self.move_cursor(row=wanted.index(selected), animate=False)

    def _update_row(self, key: str, cells: dict[str, str]) -> None:
        old = self._cells[key]
        for col in self._columns_now:
            if old.get(col.key) != cells.get(col.key):
                self.update_cell(key, col.key, _cell(col, cells.get(col.key, "")))
        self._cells[key] = cells

    def _render_cells(self, cells: dict[str, str]) -> Iterable[Text]:
        return [_cell(col, cells.get(col.key, "")) for col in self._columns_now]


def _label(col: Column) -> Text:
    return Text(col.label, justify="right" if col.right else "left")


def _cell(col: Column, value: str) -> Text:
    style = "dim" if value in ("-", "idle") else ""
    if col.key == "state" and value.startswith("prefill"):
        style = "bold yellow"
    elif col.key == "state" and value == "decode":
        style = "bold green"
    return Text(value, style=style, justify="right" if col.right else "left", no_wrap=True)


class SlotsTable(KeyedTable):
    """One row per slot, idle ones too."""

    COLUMNS = SLOT_COLUMNS
    BORDER_TITLE = "slots"
    # Busy slots first, the biggest figure on top; idle ones keep slot order at the bottom.
    SORTS = (
        Sort("slot", lambda s: s.id),
        Sort("age", lambda s: (s.state == "idle", -s.age_s, s.id)),
        Sort("tok/s", lambda s: (s.state == "idle", -(s.tokens_per_s or 0.0), s.id)),
        Sort("generated", lambda s: (s.state == "idle", -s.generated_tokens, s.id)),
        Sort("prompt", lambda s: (s.state == "idle", -s.prompt_tokens, s.id)),
        Sort("KV blocks", lambda s: (s.state == "idle", -s.kv_blocks, s.id)),
    )

    def rows_for(self, snapshot: Snapshot) -> list[Row]:
        slots = sorted(snapshot.engine.slots, key=self.current_sort.key)
        return [(str(s.id), slot_cells(s)) for s in slots]

    def selected_request(self) -> str | None:
        key = self.selected_key()
        if key is None or self.snapshot is None:
            return None
        slot = next((s for s in self.snapshot.engine.slots if str(s.id) == key), None)
        return slot.request_id if slot is not None and slot.state != "idle" else None


class QueueTable(KeyedTable):
    """Waiting requests in queue order, each with why it waits."""

    COLUMNS = QUEUE_COLUMNS
    BORDER_TITLE = "queue"
    # Items are (queue position, entry); "#" stays the queue position in every order.
    SORTS = (
        Sort("position", lambda item: item[0]),
        Sort("age", lambda item: (-item[1].age_s, item[0])),
        Sort("prompt", lambda item: (-item[1].prompt_tokens, item[0])),
    )

    def rows_for(self, snapshot: Snapshot) -> list[Row]:
        items = sorted(enumerate(snapshot.engine.queue, start=1), key=self.current_sort.key)
        return [(entry.request_id, queue_cells(pos, entry)) for pos, entry in items]

    def selected_request(self) -> str | None:
        return self.selected_key()
