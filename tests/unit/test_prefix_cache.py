"""Prompt-prefix cache policy: block chains, longest match, limits, exact LRU eviction order."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st
from mlxcel.daemon.engine.prefix_cache import PrefixCache, chain_hashes

B = 32


@dataclass
class Payload:
    name: str
    nbytes: int


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def put(cache: PrefixCache, tokens: list[int], name: str, nbytes: int = 100, **kw) -> bool:
    return cache.insert(tokens, Payload(name, nbytes), nbytes, **kw)


def lru_names(cache: PrefixCache) -> list[str]:
    """The entries' names from least to most recently used."""
    return [e.payload.name for e in cache._entries.values()]


def test_chain_hashes_depend_on_every_earlier_block() -> None:
    a = seq(0, 3 * B)
    b = a.copy()
    b[5] = 999  # first block differs
    ha, hb = chain_hashes(a, 3), chain_hashes(b, 3)
    assert len(ha) == 3 and all(x != y for x, y in zip(ha, hb, strict=True))
    assert chain_hashes([*a, 7], 3) == ha  # a trailing partial block is ignored


def test_longest_prefix_match_to_the_token_and_the_last_token_is_never_cached() -> None:
    cache = PrefixCache(10_000)
    assert put(cache, seq(0, 4 * B), "four")
    # exactly the cached 128 tokens: all but the last one match
    found = cache.lookup(seq(0, 4 * B))
    assert found is not None and (found.num_tokens, found.entry.payload.name) == (4 * B - 1, "four")
    # one more token: all 128
    assert cache.lookup(seq(0, 4 * B + 1)).num_tokens == 4 * B
    # diverging inside block 2: to the token
    prompt = seq(0, 4 * B)
    prompt[2 * B + 3] = 9999
    assert cache.lookup(prompt).num_tokens == 2 * B + 3
    # under one block: to the token as well; a different first token: miss
    assert cache.lookup(seq(0, B)).num_tokens == B - 1
    assert cache.lookup(seq(1, 4 * B)) is None
    st = cache.stats
    assert (st.lookups, st.hits, st.misses) == (5, 4, 1)
    assert st.hit_tokens == (4 * B - 1) + 4 * B + (2 * B + 3) + (B - 1)
    assert st.lookup_tokens == 4 * B + (4 * B + 1) + 4 * B + B + 4 * B


def test_a_prefix_shorter_than_one_block_is_reused() -> None:
    system = seq(500, 24)  # a chat template's system prompt
    cache = PrefixCache(10_000)
    assert put(cache, [*system, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "turn-1")  # 35 tokens
    assert put(cache, [*system, 7], "short")  # under one block: kept, one block of room
    assert cache.num_blocks == 2 + 1
    found = cache.match([*system, 42, 43, 44])
    assert found is not None and found.num_tokens == 24
    found = cache.match([*system, 7, 99])  # the short entry goes one token further
    assert found is not None and (found.num_tokens, found.entry.payload.name) == (25, "short")
    # a prompt that is the system prompt plus one token reuses all of the system prompt
    assert cache.match([*system, 5]).num_tokens == 24
    assert cache.match(system[:1]) is None  # one token: nothing may be reused


def test_a_partial_last_block_extends_a_full_block_match() -> None:
    cache = PrefixCache(10_000)
    put(cache, seq(0, 2 * B + 10), "a")  # 2 full blocks + 10 tokens
    put(cache, [*seq(0, B), *seq(900, B)], "b")  # shares block 0 only
    found = cache.match([*seq(0, 2 * B + 6), 5, 5, 5])
    assert (found.num_tokens, found.entry.payload.name) == (2 * B + 6, "a")
    found = cache.match([*seq(0, B), *seq(900, 20), 1])
    assert (found.num_tokens, found.entry.payload.name) == (B + 20, "b")


def test_a_hash_collision_is_a_miss_not_wrong_kv(monkeypatch) -> None:
    import mlxcel.daemon.engine.prefix_cache as pc

    monkeypatch.setattr(pc, "chain_hashes", lambda tokens, n, bs=B: list(range(n)))
    cache = pc.PrefixCache(10_000)
    put(cache, seq(0, 2 * B), "a")
    other = [0, *seq(5000, 2 * B)]  # same first token, same (fake) hashes, other tokens
    assert cache.match(other, hashes=[0, 1]) is None


def test_match_does_not_count_or_refresh() -> None:
    cache = PrefixCache(10_000)
    put(cache, seq(0, 2 * B), "a")
    put(cache, seq(1000, 2 * B), "b")
    assert cache.match(seq(0, 2 * B + 1)).num_tokens == 2 * B
    assert cache.stats.lookups == 0
    assert lru_names(cache) == ["a", "b"]


def test_lru_eviction_order_within_the_byte_budget() -> None:
    cache = PrefixCache(300)
    for name, start in (("a", 0), ("b", 1000), ("c", 2000)):
        assert put(cache, seq(start, B), name)
    cache.lookup(seq(0, B + 1))  # a becomes most recent: order b, c, a
    assert put(cache, seq(3000, B), "d")  # over budget: evicts b
    names = lru_names(cache)
    assert names == ["c", "a", "d"]
    assert put(cache, seq(4000, B), "e", nbytes=200)  # evicts c, then a
    assert lru_names(cache) == ["d", "e"]
    assert cache.stats.evictions == 3
    assert cache.num_bytes == 300 and cache.num_blocks == 2
    assert cache.lookup(seq(1000, B + 1)) is None  # b's hashes are gone too


def test_block_room_and_explicit_eviction() -> None:
    cache = PrefixCache(10_000)
    put(cache, seq(0, 2 * B), "a")
    put(cache, seq(1000, 2 * B), "b")
    assert put(cache, seq(2000, 2 * B), "c", max_blocks=4)  # 6 blocks > 4: evicts a
    assert lru_names(cache) == ["b", "c"]
    assert not put(cache, seq(3000, 5 * B), "too-big", max_blocks=4)
    assert cache.evict_blocks(1) == 2  # whole entries: b goes
    assert lru_names(cache) == ["c"]


def test_covered_inserts_are_dropped_and_extensions_replace_their_prefix() -> None:
    cache = PrefixCache(10_000)
    put(cache, seq(0, 2 * B), "short")
    put(cache, seq(500, B), "other")
    assert put(cache, seq(0, 3 * B), "long")  # supersedes "short", not an eviction
    names = lru_names(cache)
    assert names == ["other", "long"] and cache.stats.evictions == 0
    assert not put(cache, seq(0, 2 * B), "again")  # already covered by "long"
    assert cache.covers(seq(0, 2 * B)) and not cache.covers(seq(0, 4 * B))
    assert cache.num_blocks == 4 and cache.num_bytes == 200


def test_unaligned_oversized_and_disabled() -> None:
    cache = PrefixCache(150)
    assert put(cache, seq(0, B + 1), "unaligned", nbytes=50)
    assert cache.num_blocks == 2  # accounting stays in blocks: 33 tokens hold two
    assert not put(cache, seq(0, B), "covered")  # a prefix of the entry above
    assert not put(cache, seq(100, B), "huge", nbytes=151)
    assert put(cache, seq(100, B), "ok")
    cache.set_enabled(False)
    assert cache.num_entries == 0 and cache.num_bytes == 0
    assert cache.lookup(seq(0, 2 * B)) is None and cache.stats.lookups == 0
    assert not put(cache, seq(0, B), "ignored")
    assert not put(cache, seq(0, 3), "ignored")
    cache.set_enabled(True)
    assert put(cache, seq(0, B), "back")


def test_clear_after_evictions_to_the_byte_capacity() -> None:
    cache = PrefixCache(250)
    for i in range(5):
        put(cache, seq(1000 * i, B), str(i))
    assert lru_names(cache) == ["3", "4"]
    assert cache.clear() == (2, 200)
    assert cache.num_entries == cache.num_bytes == cache.num_blocks == 0


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4 * B)), min_size=1, max_size=30))
def test_accounting_stays_consistent(ops: list[tuple[int, int]]) -> None:
    cache = PrefixCache(700)
    for family, length in ops:
        tokens = seq(family * 10_000, length)
        put(cache, tokens, f"{family}/{length}", nbytes=-(-length // B) * 50)
        probe = [*tokens, 1]
        found = cache.lookup(probe)
        if found is not None:
            assert 0 < found.num_tokens <= len(tokens)
            assert found.entry.tokens[: found.num_tokens] == tuple(probe[: found.num_tokens])
        entries = list(cache._entries.values())
        assert cache.num_bytes == sum(e.nbytes for e in entries) <= 700
        assert cache.num_blocks == sum(-(-len(e.tokens) // B) for e in entries)
        # no entry is a prefix of another (extensions replace, covered inserts are dropped)
        for e in entries:
            assert not any(o is not e and o.tokens[: len(e.tokens)] == e.tokens for o in entries)
