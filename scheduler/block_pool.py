"""Fixed-size KV blocks with reference counts and an LRU of reusable cached blocks.

A block is either owned (ref_cnt > 0) or free. Free blocks sit in one ordered
dict used as an LRU: uncached blocks at the front (taken first), freed cached
blocks at the back, so a cached prefix survives as long as possible.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        """Take n free blocks (evicting their cached contents), or None if too few."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._uncache(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def take(self) -> int:
        """`allocate(1)` for a caller that checked a block is free."""
        block, _ = self.free.popitem(last=False)
        if self.block_hash[block] is not None:
            self._uncache(block)
        self.ref_cnt[block] = 1
        return block

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[int]) -> None:
        """Add a reference to each block (a prefix hit or a shared fork)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free[block]
            self.ref_cnt[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; callers pass the tail first so the
        LRU evicts a sequence's tail before its (more shareable) head."""
        for block in blocks:
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: int) -> None:
        """Register a full block's contents; an existing entry for the hash wins
        (no dedup: block tables stay append-only)."""
        if self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def check(self) -> str | None:
        """Internal consistency: every block is owned xor free; cache map agrees."""
        for b in range(self.num_blocks):
            owned = self.ref_cnt[b] > 0
            if owned == (b in self.free) or self.ref_cnt[b] < 0:
                return f"block {b}: ref_cnt={self.ref_cnt[b]} free={b in self.free}"
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                return f"cache entry {h} -> block {b} whose hash is {self.block_hash[b]}"
        return None
