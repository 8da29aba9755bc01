"""Token ids -> text for one response: incremental detokenization and stop strings.

Stop strings are matched on the detokenized text. Text that could be the start of a stop
string is held back until it is known not to be one, so a streamed response never shows
part of a stop sequence; on a match the text before it is returned and generation ends.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


class StopMatcher:
    """Finds stop strings in text fed piece by piece; emits only text that is safe."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._max_hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""  # text not emitted yet (a stop can only start here)
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, piece: str) -> str:
        """Add text; returns the newly safe text (everything before a stop, on a match)."""
        if self.stopped:
            return ""
        if not self.stops:  # nothing to find or hold back: the piece is safe as it is
            return piece
        pending = self._pending + piece
        hits = [(i, s) for s in self.stops if (i := pending.find(s)) >= 0]
        if hits:
            end, self.matched = min(hits)
            self.stopped = True
        else:
            end = len(pending) - self._held_back(pending)
        self._pending = pending[end:]
        return pending[:end]

    def flush(self) -> str:
        """The held-back text, when generation ends without a stop string."""
        if self.stopped:
            return ""
        out, self._pending = self._pending, ""
        return out

    def _held_back(self, pending: str) -> int:
        for k in range(min(self._max_hold, len(pending)), 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class TextAssembler:
    """Detokenizes one response's tokens and applies stop strings."""

    def __init__(self, detokenizer: Any, stops: tuple[str, ...], skip_ids: Collection[int]) -> None:
        self._detok = detokenizer
        self._detok.reset()
        self._stops = StopMatcher(stops)
        self._skip_ids = skip_ids

    @property
    def stopped(self) -> bool:
        """A stop string matched: the caller aborts the engine request."""
        return self._stops.stopped

    @property
    def matched_stop(self) -> str | None:
        return self._stops.matched

    def add(self, token_id: int) -> str:
        if token_id in self._skip_ids:
            return ""
        self._detok.add_token(token_id)
        return self._stops.feed(self._detok.last_segment)

    def finish(self) -> str:
        """Flush what the detokenizer and the stop matcher still hold."""
        if self._stops.stopped:
            return ""
        self._detok.finalize()
        # A response cut (max_tokens, a deadline) inside a character that spans several
        # tokens ends with that character's first bytes, which decode to one U+FFFD: no client
        # wants it as the last character, so it is dropped. A run of them is bytes that are
        # not UTF-8 at all (a broken model's output): kept, as the tokenizer decodes them.
        tail = self._detok.last_segment
        if tail.endswith("\ufffd") and not tail.endswith("\ufffd\ufffd"):
            tail = tail[:-1]
        return self._stops.feed(tail) + self._stops.flush()
