"""Prompt-prefix KV cache policy (docs/internals.md): which KV to keep, find and evict.

Plain Python.

NOTE on the algorithm
    An entry is the KV payload (opaque here; it only has to report its bytes) of any token
    sequence, kept when a request's prompt is done and again when it finishes. Reuse is to the
    token: a new prompt reuses the longest common prefix it has with any entry, whatever its
    length (also under one block, e.g. a chat template's system prompt). KV accounting stays in
    blocks of 32 tokens: an entry of n tokens holds ceil(n / 32) blocks.
    Finding the match: a token sequence is cut into blocks of 32 tokens; block i is named by a
    chain hash h_i = hash((h_{i-1}, tokens of block i)), so equal hashes mean equal prefixes.
    Every full-block hash of an entry maps to that entry, so walking the prompt's own chain
    until a hash is unknown gives the entries sharing the most full blocks (d blocks); with
    d = 0 the candidates are the entries starting with the prompt's first token. Among those
    candidates (the MAX_CANDIDATES most recently used) the match is extended token by token
    past the d blocks; tokens are compared, so a hash collision is a miss, never wrong KV.
    A match never covers the whole prompt: at most len - 1 tokens, so the last prompt token
    is always recomputed (its logits give the first new token). Entries are kept in LRU order
    within a byte budget (and within the block room the KV budget leaves); a hit or a
    re-insert refreshes an entry. An insert that is a prefix of an existing entry is dropped;
    one that extends older entries replaces them (they are a prefix of it and would only waste
    memory).
    Disabled: no lookups, no inserts, and every entry is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.shared.config import KV_BLOCK_SIZE

# Entries compared token by token per lookup (the most recently used first): bounds the cost
# of a lookup when many entries share the same first blocks (one system prompt, many chats).
MAX_CANDIDATES = 64


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


def common_prefix(a: Sequence[int], b: Sequence[int], start: int, limit: int) -> int:
    """Length of the common prefix of `a` and `b`, given that the first `start` agree,
    counted up to `limit`."""
    n = start
    end = min(limit, len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


@dataclass
class CacheEntry:
    entry_id: int
    tokens: tuple[int, ...]
    hashes: tuple[int, ...]  # chain hashes of its full blocks
    payload: Any
    nbytes: int
    num_blocks: int  # ceil(len(tokens) / block size): what it holds of the KV budget


@dataclass(frozen=True)
class PrefixMatch:
    num_tokens: int  # matched prefix length, to the token
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
        self._first_to_entries: dict[int, dict[int, None]] = {}  # by first token
        self._next_id = 0
        self.num_bytes = 0
        self.num_blocks = 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_match_blocks(self, prompt_len: int) -> int:
        return max(prompt_len - 1, 0) // self.block_size

    def prompt_hashes(self, tokens: Sequence[int]) -> list[int]:
        """The chain hashes a prompt may match (a caller may keep them: prompts do not change)."""
        return chain_hashes(tokens, self.max_match_blocks(len(tokens)), self.block_size)

    def match(
        self, tokens: Sequence[int], hashes: Sequence[int] | None = None
    ) -> PrefixMatch | None:
        """The longest cached prefix of `tokens` (at most all but the last token), without
        counting or refreshing anything."""
        limit = len(tokens) - 1
        if not self.enabled or not self._entries or limit < 1:
            return None
        depth, candidates = 0, None
        for h in self.prompt_hashes(tokens) if hashes is None else hashes:
            entry_ids = self._hash_to_entries.get(h)
            if not entry_ids:
                break
            depth, candidates = depth + 1, entry_ids
        if candidates is None:
            candidates = self._first_to_entries.get(tokens[0])
            if not candidates:
                return None
        start = depth * self.block_size
        head = tuple(tokens[:start])
        best: PrefixMatch | None = None
        for entry in self._recent(candidates):
            if entry.tokens[:start] != head:
                continue  # a hash collision
            n = common_prefix(entry.tokens, tokens, start, limit)
            if n > (best.num_tokens if best else 0):
                best = PrefixMatch(n, entry)
                if n == limit:
                    break
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
        """True when an entry already holds KV for all of these tokens."""
        return self._covering(tuple(tokens)) is not None

    def insert(
        self, tokens: Sequence[int], payload: Any, nbytes: int, max_blocks: int | None = None
    ) -> bool:
        """Keep `payload`, the KV of `tokens`; False when it was not kept.

        `max_blocks` bounds the blocks the cache may hold afterwards (the KV budget's room).
        """
        tokens = tuple(tokens)
        num_blocks = self.blocks_for(len(tokens))
        if not self.enabled or num_blocks == 0:
            return False
        if nbytes > self.capacity_bytes or (max_blocks is not None and num_blocks > max_blocks):
            return False
        covering = self._covering(tokens)
        if covering is not None:
            self._entries.move_to_end(covering.entry_id)
            return False
        for entry in self._prefix_entries(tokens):
            self._remove(entry)  # superseded by the longer sequence, not an eviction
        hashes = chain_hashes(tokens, len(tokens) // self.block_size, self.block_size)
        entry = CacheEntry(self._next_id, tokens, tuple(hashes), payload, nbytes, num_blocks)
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
        self._first_to_entries.clear()
        self.num_bytes = self.num_blocks = 0
        return freed

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            self.clear()

    def _recent(self, entry_ids: Iterable[int]) -> list[CacheEntry]:
        """The MAX_CANDIDATES most recently used of these entries."""
        entries = [self._entries[i] for i in entry_ids]
        if len(entries) > MAX_CANDIDATES:
            order = {eid: pos for pos, eid in enumerate(self._entries)}
            entries.sort(key=lambda e: order[e.entry_id], reverse=True)
            entries = entries[:MAX_CANDIDATES]
        return entries

    def _candidates(self, tokens: tuple[int, ...]) -> list[CacheEntry]:
        """Every entry that shares the first token of `tokens`."""
        return [self._entries[i] for i in self._first_to_entries.get(tokens[0], ())]

    def _covering(self, tokens: tuple[int, ...]) -> CacheEntry | None:
        """An entry whose tokens start with `tokens`."""
        if not tokens:
            return None
        n = len(tokens)
        full = n // self.block_size
        if full:
            last = chain_hashes(tokens, full, self.block_size)[-1]
            pool = [self._entries[i] for i in self._hash_to_entries.get(last, ())]
        else:
            pool = self._candidates(tokens)
        return next((e for e in pool if e.tokens[:n] == tokens), None)

    def _prefix_entries(self, tokens: tuple[int, ...]) -> list[CacheEntry]:
        """Entries whose tokens are a prefix of `tokens`."""
        return [
            e
            for e in self._candidates(tokens)
            if len(e.tokens) <= len(tokens) and tokens[: len(e.tokens)] == e.tokens
        ]

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
        self._first_to_entries.setdefault(entry.tokens[0], {})[entry.entry_id] = None
        self.num_bytes += entry.nbytes
        self.num_blocks += entry.num_blocks

    def _remove(self, entry: CacheEntry) -> None:
        del self._entries[entry.entry_id]
        for h in entry.hashes:
            entry_ids = self._hash_to_entries[h]
            entry_ids.pop(entry.entry_id, None)
            if not entry_ids:
                del self._hash_to_entries[h]
        first = self._first_to_entries[entry.tokens[0]]
        first.pop(entry.entry_id, None)
        if not first:
            del self._first_to_entries[entry.tokens[0]]
        self.num_bytes -= entry.nbytes
        self.num_blocks -= entry.num_blocks
