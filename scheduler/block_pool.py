"""Fixed-size KV blocks with reference counts and an LRU of reusable cached blocks.

A block is either owned (ref_cnt > 0) or free. Free blocks sit in one ordered
dict used as an LRU: uncached blocks at the front (taken first), freed cached
blocks at the back, so a cached prefix survives as long as possible.

A cached block is found by its key (a digest: kv_cache_manager.py) and served only
if it holds what the asker's block would: the same tokens after the same content.
"The same content" is a content id, given to each block whose KV is registered and
never reused; two blocks share one only when they were computed from equal tokens
after equal content. The check costs a compare per hit, and with it even two
requests whose keys collide can never read each other's blocks.

With KV-cache events on (scheduler/kv_events.py), `events` is a list that gets one
record per change to the set of keys in `cached`: `(key, parent_key, tokens)` when a
key is registered, `key` alone when it leaves; None (the default) records nothing.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block key -> block id
        # Of a filled block: the id of its content (None: a private block, see `cache`),
        # valid while the block is owned or cached.
        self.content_id: list[int | None] = [None] * num_blocks
        # Of a cached block: what it was computed after (its request's root for a first
        # block, else the content id of the block before) and its token ids, packed as
        # digested (bytes: compared at C speed, and nothing for the garbage collector).
        self.parent: list[bytes | int | None] = [None] * num_blocks
        self.tokens: list[bytes | None] = [None] * num_blocks
        self._last_content_id = 0
        # Shared with the events publisher, which also puts None in it: "all blocks cleared".
        self.events: list[tuple[bytes, bytes | None, bytes] | bytes | None] | None = None

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

    def lookup(self, block_hash: bytes, parent: bytes | int | None, tokens: bytes) -> int | None:
        """The cached block under `block_hash` if it holds `tokens` after `parent`."""
        block = self.cached.get(block_hash)
        if block is None or self.parent[block] != parent or self.tokens[block] != tokens:
            return None
        return block

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

    def cache(self, block: int, block_hash: bytes, parent: bytes | int | None, tokens: bytes,
              parent_hash: bytes | None = None) -> None:
        """Register a just-filled block, which holds `tokens` after `parent` (as in
        `lookup`), and give it its content id. An entry with the same content wins
        (no dedup: block tables stay append-only) and lends the block its id.
        `parent_hash`: the key of the block before (None for a first block), for events."""
        if self.block_hash[block] is not None:
            return  # a prefix hit: registered, with its id, already
        if parent is None:  # after a private block: nobody can ask for this one either
            self.content_id[block] = None
            return
        existing = self.cached.get(block_hash)
        if existing is not None:
            if self.tokens[existing] == tokens and self.parent[existing] == parent:
                self.content_id[block] = self.content_id[existing]
                return
            if self.ref_cnt[existing]:
                # The key is taken by other content in use (a collision): this block stays
                # private, and so do the blocks after it.
                self.content_id[block] = None
                return
            self._uncache(existing)  # an idle entry for other content gives way
            self.free.move_to_end(existing, last=False)
        self._last_content_id += 1
        self.content_id[block] = self._last_content_id
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        self.parent[block] = parent
        self.tokens[block] = tokens
        if self.events is not None:
            self.events.append((block_hash, parent_hash, tokens))

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            self.tokens[block] = self.parent[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.events is not None:
                    self.events.append(h)

    def check(self) -> str | None:
        """Internal consistency: every block is owned xor free; cache map agrees."""
        for b in range(self.num_blocks):
            owned = self.ref_cnt[b] > 0
            if owned == (b in self.free) or self.ref_cnt[b] < 0:
                return f"block {b}: ref_cnt={self.ref_cnt[b]} free={b in self.free}"
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                return f"cache entry {h.hex()} -> block {b} whose key is {self.block_hash[b]}"
            if self.content_id[b] is None or self.parent[b] is None or self.tokens[b] is None:
                return f"cached block {b} has no content id, parent or tokens"
        return None
