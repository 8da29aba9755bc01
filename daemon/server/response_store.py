"""The stored responses of the Responses API (`store: true`, OpenAI's default), in memory.

Each entry keeps the response object as last answered, the request's own input items (for
`GET /v1/responses/{id}/input_items`) and the whole conversation up to and including its output
(for `previous_response_id`: the chained request's prompt begins with the same tokens, so the
prompt-prefix cache serves them). Bounded in bytes and in count (docs/api.md, "Responses"); the
oldest entry goes first. A conversation shares its items with the entry it chained from, but
each entry is charged the whole of its conversation's JSON: what is counted is never less than
what is held. Everything runs on the event loop: no locks.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mlxcel.http")

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_COUNT = 1000


def json_size(value: Any) -> int:
    """The bytes of `value` as compact JSON (what the store charges for it)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


@dataclass
class StoredResponse:
    id: str
    response: dict[str, Any]  # the response object, as last answered
    input_items: list[dict[str, Any]]  # this request's own input items, with ids
    conversation: list[dict[str, Any]]  # every item up to and including the output
    conversation_bytes: int = 0
    size: int = 0
    abort: Callable[[], None] | None = None  # while in flight: stops the generation
    cancelled: bool = False
    deleted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def in_flight(self) -> bool:
        return self.response.get("status") in ("queued", "in_progress")


class ResponseStore:
    """Stored responses by id, oldest first; at most `max_count` of them and `max_bytes`."""

    def __init__(
        self, max_bytes: int = DEFAULT_MAX_BYTES, max_count: int = DEFAULT_MAX_COUNT
    ) -> None:
        self.max_bytes = max_bytes
        self.max_count = max_count
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def put(self, entry: StoredResponse) -> bool:
        """Store or update `entry` (an update keeps its place); False when it alone is over
        `max_bytes` (then nothing of it is kept). Older entries go until both bounds hold."""
        old = self._entries.get(entry.id)
        if old is not None:
            self.bytes -= old.size
        # The input items are items of the conversation: charged there once.
        entry.size = entry.conversation_bytes + json_size(entry.response)
        if entry.deleted or entry.size > self.max_bytes:
            if not entry.deleted:
                log.warning(
                    "response %s not stored: %d bytes, over the store's %d",
                    entry.id,
                    entry.size,
                    self.max_bytes,
                )
            self._entries.pop(entry.id, None)
            return False
        self._entries[entry.id] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            oldest_id, oldest = next(iter(self._entries.items()))
            del self._entries[oldest_id]
            self.bytes -= oldest.size
            self.evicted += 1
        return entry.id in self._entries

    def delete(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
            entry.deleted = True
        return entry
