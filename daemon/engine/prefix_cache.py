"""Prompt-prefix KV cache policy (SPEC §3): which KV to keep, find and evict. Plain Python.

NOTE on the algorithm
    A token sequence is cut into blocks of 32 tokens; block i is named by a chain hash
    h_i = hash((h_{i-1}, tokens of block i)), so equal hashes mean equal prefixes (the tokens
    are compared too, against collisions). An entry is the KV payload (opaque here; it only
    has to report its bytes) of a block-aligned token sequence, kept when a request finishes.
    Every block hash of an entry maps to that entry, so the longest cached prefix of a new
    prompt is found by walking the prompt's own chain until a hash is unknown.
    A match covers at least one block and never the whole prompt: at most
    floor((len - 1) / 32) blocks, so the last prompt token is always recomputed (its logits
    give the first new token). Entries are kept in LRU order within a byte budget (and within
    the block room the KV budget leaves); a hit or a re-insert refreshes an entry. An insert
    whose chain is already covered by a longer entry is dropped; one that extends older
    entries replaces them (they are a prefix of it and would only waste memory).
    Disabled: no lookups, no inserts, and every entry is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.shared.config import KV_BLOCK_SIZE


def chain_hashes(
    tokens: Sequence[int], num_blocks: int, block_size: int = KV_BLOCK_SIZE
) -> list[int]:
    """Chain hashes of the first `num_blocks` full blocks of `tokens`."""
    hashes: list[int] = []
    parent = 0
    for i in range(num_blocks):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class CacheEntry:
    entry_id: int
    tokens: tuple[int, ...]  # block-aligned
    hashes: tuple[int, ...]
    payload: Any
    nbytes: int

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True)
class PrefixMatch:
    num_tokens: int  # matched prefix length (a multiple of the block size)
    entry: CacheEntry


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    evictions: int = 0
    inserts: int = 0


class PrefixCache:
    def __init__(
        self, capacity_bytes: int, block_size: int = KV_BLOCK_SIZE, enabled: bool = True
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()  # LRU first
        self._hash_to_entries: dict[int, dict[int, None]] = {}
        self._next_id = 0
        self.num_bytes = 0
        self.num_blocks = 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def entry_ids(self) -> list[int]:
        """Entry ids from least to most recently used."""
        return list(self._entries)

    def max_match_blocks(self, prompt_len: int) -> int:
        return max(prompt_len - 1, 0) // self.block_size

    def prompt_hashes(self, tokens: Sequence[int]) -> list[int]:
        """The chain hashes a prompt may match (a caller may keep them: prompts do not change)."""
        return chain_hashes(tokens, self.max_match_blocks(len(tokens)), self.block_size)

    def match(
        self, tokens: Sequence[int], hashes: Sequence[int] | None = None
    ) -> PrefixMatch | None:
        """The longest cached prefix of `tokens`, without counting or refreshing anything."""
        if not self.enabled or not self._entries:
            return None
        best: PrefixMatch | None = None
        for i, h in enumerate(self.prompt_hashes(tokens) if hashes is None else hashes):
            entry_ids = self._hash_to_entries.get(h)
            if not entry_ids:
                break
            entry = self._entries[next(iter(entry_ids))]
            best = PrefixMatch((i + 1) * self.block_size, entry)
        if best is not None and best.entry.tokens[: best.num_tokens] != tuple(
            tokens[: best.num_tokens]
        ):
            return None  # a hash collision: treat as a miss
        return best

    def lookup(
        self, tokens: Sequence[int], hashes: Sequence[int] | None = None
    ) -> PrefixMatch | None:
        """`match`, counted in the stats; a hit refreshes the entry."""
        if not self.enabled:
            return None
        found = self.match(tokens, hashes)
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        if found is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.hit_tokens += found.num_tokens
        self._entries.move_to_end(found.entry.entry_id)
        return found

    def covers(self, tokens: Sequence[int]) -> bool:
        """True when an entry already holds KV for all of these block-aligned tokens."""
        num_blocks = len(tokens) // self.block_size
        if not num_blocks:
            return False
        last = chain_hashes(tokens, num_blocks, self.block_size)[-1]
        return bool(self._hash_to_entries.get(last))

    def insert(
        self, tokens: Sequence[int], payload: Any, nbytes: int, max_blocks: int | None = None
    ) -> bool:
        """Keep `payload`, the KV of block-aligned `tokens`; False when it was not kept.

        `max_blocks` bounds the blocks the cache may hold afterwards (the KV budget's room).
        """
        num_blocks = len(tokens) // self.block_size
        if not self.enabled or num_blocks == 0 or len(tokens) % self.block_size:
            return False
        if nbytes > self.capacity_bytes or (max_blocks is not None and num_blocks > max_blocks):
            return False
        hashes = chain_hashes(tokens, num_blocks, self.block_size)
        covering = self._hash_to_entries.get(hashes[-1])
        if covering:
            self._entries.move_to_end(next(iter(covering)))
            return False
        for entry in self._prefix_entries(hashes):
            self._remove(entry)  # superseded by the longer sequence, not an eviction
        entry = CacheEntry(self._next_id, tuple(tokens), tuple(hashes), payload, nbytes)
        self._next_id += 1
        self._add(entry)
        self.stats.inserts += 1
        self._evict_to_fit(max_blocks, keep=entry.entry_id)
        return True

    def evict_blocks(self, num_blocks: int) -> int:
        """Evict LRU entries until at least `num_blocks` are freed (or none is left)."""
        freed = 0
        while freed < num_blocks and self._entries:
            freed += self._evict_lru().num_blocks
        return freed

    def clear(self) -> tuple[int, int]:
        """Drop every entry; returns (entries, bytes) freed."""
        freed = (len(self._entries), self.num_bytes)
        self._entries.clear()
        self._hash_to_entries.clear()
        self.num_bytes = self.num_blocks = 0
        return freed

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            self.clear()

    def set_capacity(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._evict_to_fit(None)

    def _prefix_entries(self, hashes: list[int]) -> list[CacheEntry]:
        """Entries whose whole chain is a prefix of `hashes`."""
        found = []
        for i, h in enumerate(hashes):
            for entry_id in self._hash_to_entries.get(h, ()):
                entry = self._entries[entry_id]
                if entry.num_blocks == i + 1:
                    found.append(entry)
        return found

    def _evict_to_fit(self, max_blocks: int | None, keep: int | None = None) -> None:
        while self._entries and (
            self.num_bytes > self.capacity_bytes
            or (max_blocks is not None and self.num_blocks > max_blocks)
        ):
            if next(iter(self._entries)) == keep and len(self._entries) == 1:
                break
            self._evict_lru(skip=keep)

    def _evict_lru(self, skip: int | None = None) -> CacheEntry:
        victim = next(e for e in self._entries.values() if e.entry_id != skip)
        self._remove(victim)
        self.stats.evictions += 1
        return victim

    def _add(self, entry: CacheEntry) -> None:
        self._entries[entry.entry_id] = entry
        for h in entry.hashes:
            self._hash_to_entries.setdefault(h, {})[entry.entry_id] = None
        self.num_bytes += entry.nbytes
        self.num_blocks += entry.num_blocks

    def _remove(self, entry: CacheEntry) -> None:
        del self._entries[entry.entry_id]
        for h in entry.hashes:
            entry_ids = self._hash_to_entries[h]
            entry_ids.pop(entry.entry_id, None)
            if not entry_ids:
                del self._hash_to_entries[h]
        self.num_bytes -= entry.nbytes
        self.num_blocks -= entry.num_blocks
