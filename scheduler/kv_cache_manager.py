"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, freeing.

Allocation answers None when it does not fit, so the scheduler owns every
preemption decision. Exactly one place (`free`) releases a request's blocks.
"""

from __future__ import annotations

from scheduler.block_pool import BlockPool
from scheduler.request import Request

# Root of every hash chain; hashing a tuple of ints is stable across processes.
_ROOT_HASH = 0x6E6F726961


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes, bs, tokens = req.block_hashes, self.block_size, req.token_ids
        parent = hashes[-1] if hashes else _ROOT_HASH
        for i in range(len(hashes), num_full_blocks):
            parent = chain_hash(parent, tuple(tokens[i * bs : (i + 1) * bs]))
            hashes.append(parent)

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The longest run of cached blocks for the request's known tokens.

        The last token is never served from cache: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._ensure_hashes(req, max_blocks)
        hits: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Give `req` blocks for `num_new_tokens` more tokens (after any prefix hit).

        Returns the block ids appended to its table, or None (nothing changed).
        """
        hits = computed_blocks or []
        num_computed = req.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        need = max(0, self.blocks_needed(total) - len(req.block_ids) - len(hits))
        # Hit blocks that sit in the free list stop being allocatable once touched.
        reclaimed = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free - reclaimed:
            return None
        self.pool.touch(hits)
        added = hits + (self.pool.allocate(need) or []) if need > 0 else list(hits)
        req.block_ids.extend(added)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, total // self.block_size)
        return added

    def _cache_full_blocks(self, req: Request, num_full: int) -> None:
        # Registered when planned: the KV is written in this step, before any
        # later step can read it through a hit.
        if num_full <= req.num_cached_blocks:
            return
        self._ensure_hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            self.pool.cache(req.block_ids[i], req.block_hashes[i])
        req.num_cached_blocks = num_full

    def free(self, req: Request) -> None:
        # Tail first, so LRU eviction never orphans a cached prefix.
        self.pool.release(req.block_ids[::-1])
        req.block_ids = []
        req.num_cached_blocks = 0

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks if self.pool.num_blocks else 0.0
