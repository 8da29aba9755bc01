"""KV block accounting (docs/internals.md, "KV budget"): plain Python, no arrays.

KV is counted in blocks of 32 tokens. A request reserves ceil((prompt + max_tokens) / 32)
blocks when it is admitted ("reserve ahead"), so a running request never runs out of KV. The
prompt cache holds blocks too; they are evictable, so admission treats them as free space once
the cache has been evicted.
"""

from __future__ import annotations

from mlxcel.shared.config import KV_BLOCK_SIZE

# Share of the memory left after the weights that `auto` gives the KV budget.
AUTO_BUDGET_FRACTION = 0.6


def blocks_for(num_tokens: int, block_size: int = KV_BLOCK_SIZE) -> int:
    return -(-max(num_tokens, 0) // block_size)


def resolve_budget_bytes(setting: str | int | None, available_bytes: int) -> int | None:
    """`auto` -> a share of the memory available after the weights; None stays unbounded."""
    if setting is None:
        return None
    if setting == "auto":
        return int(available_bytes * AUTO_BUDGET_FRACTION)
    return int(setting)


class KVBudget:
    """Reservations per request plus the prompt cache's share, against a block total."""

    def __init__(
        self, total_blocks: int | None, bytes_per_block: int, block_size: int = KV_BLOCK_SIZE
    ) -> None:
        self.total_blocks = total_blocks
        self.bytes_per_block = bytes_per_block
        self.block_size = block_size
        self.num_cached = 0  # blocks held by the prompt cache (kept in sync by the engine)
        self._owner_to_blocks: dict[str, int] = {}

    @classmethod
    def from_budget(
        cls, budget_bytes: int | None, bytes_per_block: int, block_size: int = KV_BLOCK_SIZE
    ) -> KVBudget:
        total = None if budget_bytes is None else budget_bytes // max(bytes_per_block, 1)
        return cls(total, bytes_per_block, block_size)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.total_blocks is None else self.total_blocks * self.bytes_per_block

    @property
    def num_used(self) -> int:
        return sum(self._owner_to_blocks.values())

    @property
    def num_free(self) -> int | None:
        """Blocks neither reserved nor cached (None: unbounded)."""
        if self.total_blocks is None:
            return None
        return max(self.total_blocks - self.num_used - self.num_cached, 0)

    @property
    def num_free_after_eviction(self) -> int | None:
        """Blocks free once the whole prompt cache is evicted."""
        if self.total_blocks is None:
            return None
        return max(self.total_blocks - self.num_used, 0)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def never_fits(self, num_tokens: int) -> bool:
        """True when even an empty engine could not hold this many tokens."""
        return self.total_blocks is not None and self.blocks_for(num_tokens) > self.total_blocks

    def reserve(self, owner: str, num_tokens: int) -> int:
        """Reserve blocks for `owner`. The caller has made room: the admission plan counted
        them against `num_free_after_eviction` and the engine evicted cache blocks first."""
        blocks = self.blocks_for(num_tokens)
        self._owner_to_blocks[owner] = self._owner_to_blocks.get(owner, 0) + blocks
        return blocks

    def blocks_of(self, owner: str) -> int:
        """The blocks `owner` holds now."""
        return self._owner_to_blocks.get(owner, 0)

    def release(self, owner: str) -> int:
        return self._owner_to_blocks.pop(owner, 0)
