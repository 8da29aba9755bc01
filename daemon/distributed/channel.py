"""Rank 0's messages to the other ranks, and every rank's figures back, over `mx.distributed`.

One exchange is one `all_sum` of an int64 header (more only for a message over the inline
room): rank 0 writes the message length and the message bytes, every rank writes its own
figures into its row (memory, last step time, pid, steps) and zeros elsewhere, so after the
sum every rank holds rank 0's message and everyone's figures. No transport of our own: the
bytes ride MLX's ring (or MPI, JACCL) backend like the model's own collectives.

The message is typed JSON (`wire.encode`), never a pickle, sealed with the group's HMAC key and
a sequence number (`wire.Sealer`); a receiver checks the MAC and the sequence number, then the
shape and bounds, before it returns anything, and raises `ChannelError` for a message it drops
(docs/distributed.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlxcel.daemon.distributed.wire import (
    MAX_MESSAGE_BYTES,
    ChannelError,
    GroupKey,
    Sealer,
    decode,
    encode,
)
from mlxcel.daemon.engine.mlx_support import generation_stream

__all__ = ["Channel", "ChannelError", "GroupKey", "RankFigures", "memory_bytes"]

INLINE_BYTES = 1024  # a message up to this size travels in the header's one all_sum
FIGURES = 4  # per rank: memory bytes, last step µs, pid, steps


@dataclass(frozen=True)
class RankFigures:
    memory_bytes: int
    step_us: int
    pid: int
    steps: int


class Channel:
    def __init__(self, group: Any, key: GroupKey) -> None:
        self.group = group
        self.sealer = Sealer(key)
        self.rank = group.rank()
        self.size = group.size()
        self._fig_at = 1
        self._inline_at = 1 + FIGURES * self.size
        self._header_len = self._inline_at + INLINE_BYTES // 8
        self.figures: list[RankFigures | None] = [None] * self.size
        self.last_exchange_s = 0.0  # how long the last exchange waited (rank 0: comm + sync)

    def exchange(self, message: Any, mine: RankFigures) -> Any:
        """Rank 0: send `message` (a `wire` message) to every rank; the others: receive it.
        Everyone's figures land in `self.figures`. Raises RuntimeError when a peer is gone,
        and on ranks 1..n-1 ChannelError for a message that is dropped (not authentic, not
        new, not one of the messages that travel): the caller logs it and goes on."""
        frame = self.sealer.seal(encode(message)) if self.rank == 0 else b""
        data = self.transfer(frame, mine)
        return message if self.rank == 0 else decode(self.sealer.open(data))

    def transfer(self, frame: bytes, mine: RankFigures) -> bytes:
        """One exchange of raw bytes: rank 0's `frame` to every rank (the others pass b"")."""
        start = time.perf_counter()
        header = np.zeros(self._header_len, dtype=np.int64)
        if self.rank == 0:
            header[0] = len(frame)
            inline = frame[:INLINE_BYTES].ljust(INLINE_BYTES, b"\0")
            header[self._inline_at :] = np.frombuffer(inline, dtype=np.int64)
        row = self._fig_at + FIGURES * self.rank
        header[row : row + FIGURES] = (mine.memory_bytes, mine.step_us, mine.pid, mine.steps)
        summed = np.array(self._all_sum(header))
        for r in range(self.size):
            at = self._fig_at + FIGURES * r
            self.figures[r] = RankFigures(*(int(v) for v in summed[at : at + FIGURES]))
        length = int(summed[0])
        if not 0 <= length <= MAX_MESSAGE_BYTES:  # never allocate what a bad header says
            self.last_exchange_s = time.perf_counter() - start
            raise ChannelError(
                f"dropped a message that failed authentication from rank 0 (length {length})"
            )
        data = summed[self._inline_at :].tobytes()[: min(length, INLINE_BYTES)]
        if length > INLINE_BYTES:
            rest = np.zeros(length - INLINE_BYTES, dtype=np.uint8)
            if self.rank == 0:
                rest[:] = np.frombuffer(frame[INLINE_BYTES:], dtype=np.uint8)
            data += np.array(self._all_sum(rest)).tobytes()
        self.last_exchange_s = time.perf_counter() - start
        return data

    def _all_sum(self, values: np.ndarray) -> mx.array:
        # On the stream of the engine's forwards: a forward queued with async_eval runs its
        # collectives (tensor parallel all_sum) there; on another stream this exchange could
        # overtake them on one rank and not on the other, and the ranks would read each
        # other's bytes.
        with mx.stream(generation_stream):
            out = mx.distributed.all_sum(mx.array(values), group=self.group)
            mx.eval(out)
        return out


def memory_bytes() -> int:
    """This rank's memory in use: MLX's active memory (weights, KV), else the RSS."""
    try:
        active = int(mx.get_active_memory())
    except Exception:
        active = 0
    if active:
        return active
    import psutil

    return int(psutil.Process().memory_info().rss)
