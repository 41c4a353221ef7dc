"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, swap to
CPU blocks, freeing.

Allocation answers None when it does not fit, so the scheduler owns every
preemption decision. Exactly one place (`free`) releases a request's device
blocks; `free_swapped` its CPU blocks. Only full blocks are ever shared (prefix
hits, which is also how the n samples of a request share their prompt), and a
full block is never written again, so no block ever needs a copy-on-write.
"""

from __future__ import annotations

from noria.scheduler.block_pool import BlockPool
from noria.scheduler.request import Request

# Root of every hash chain; hashing a tuple of ints is stable across processes.
_ROOT_HASH = 0x6E6F726961
_NO_BLOCKS: list[int] = []  # shared, never mutated: "no block added"


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def hash_root(self, sample_group: int | None) -> int | None:
        """Where a request's hash chain starts: the common root with prefix caching
        on. With it off, the samples of one client request (same `sample_group`)
        still share their prompt blocks, with each other only: their chain starts
        at a root of their own. None: nothing hashed, nothing shared."""
        if self.enable_prefix_caching:
            return _ROOT_HASH
        # Not chain_hash: no block's tokens are behind this root.
        return None if sample_group is None else hash((_ROOT_HASH, sample_group))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes, bs, tokens = req.block_hashes, self.block_size, req.token_ids
        parent = hashes[-1] if hashes else req.hash_root
        for i in range(len(hashes), num_full_blocks):
            parent = chain_hash(parent, tuple(tokens[i * bs : (i + 1) * bs]))
            hashes.append(parent)

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The longest run of cached blocks for the request's known tokens.

        The last token is never served from cache: its logits are needed.
        """
        if req.hash_root is None or req.needs_prompt_logits:
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

        Returns the block ids appended to the table, or None when it does not
        fit (then nothing changed).
        """
        hits = computed_blocks or []
        total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = max(0, self.blocks_needed(total) - len(req.block_ids) - len(hits))
        # Hit blocks that sit in the free list stop being allocatable once touched.
        reclaimed = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free - reclaimed:
            return None
        self.pool.touch(hits)
        added = hits + (self.pool.allocate(need) or []) if need else list(hits)
        req.block_ids.extend(added)
        if req.hash_root is not None:
            self._cache_full_blocks(req, min(total, req.num_tokens) // self.block_size)
        return added

    def append_slot(self, req: Request) -> list[int] | None:
        """`allocate_slots(req, 1)` for a decode (no prefix hit), without the general
        case's work: every step calls it for the running requests at a block edge, an
        eighth of them at the default block size (one starts a block, one fills one)."""
        bs = self.block_size
        total = req.num_computed_tokens + 1
        block_ids = req.block_ids
        added = _NO_BLOCKS
        if total > len(block_ids) * bs:
            need = -(-total // bs) - len(block_ids)
            pool = self.pool
            if need > len(pool.free):
                return None
            added = [pool.take()] if need == 1 else pool.allocate(need) or _NO_BLOCKS
            block_ids += added
        if req.hash_root is not None:
            # A block that the token on its way (async scheduling) fills is hashed a step later.
            full = min(total, len(req.token_ids)) // bs
            cached = req.num_cached_blocks
            if full == cached + 1 and len(req.block_hashes) == cached:  # exactly one block filled
                tokens = req.token_ids
                h = chain_hash(req.block_hashes[-1] if cached else req.hash_root,
                               tuple(tokens[cached * bs : full * bs]))
                req.block_hashes.append(h)
                self.pool.cache(block_ids[cached], h)
                req.num_cached_blocks = full
            elif full > cached:
                self._cache_full_blocks(req, full)
        return added

    def _cache_full_blocks(self, req: Request, num_full: int) -> None:
        # Registered when planned: every layer writes the step's KV before it
        # attends, so even a request planned later in the same step may hit it.
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

    # ---- swap ------------------------------------------------------------

    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the request's KV to CPU blocks and free its device blocks;
        None (nothing changed) when the swap area is too full."""
        n = len(req.block_ids)
        if n > len(self.cpu_free):
            return None
        cpu = [self.cpu_free.pop() for _ in range(n)]
        pairs = list(zip(req.block_ids, cpu, strict=True))
        req.swapped_blocks = cpu
        self.free(req)
        return pairs

    def swap_in(self, req: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more."""
        n = len(req.swapped_blocks)
        total = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        if max(n, total) > self.pool.num_free:
            return None
        dev = self.pool.allocate(n) or []
        pairs = list(zip(dev, req.swapped_blocks, strict=True))
        req.block_ids = dev
        self.free_swapped(req)
        return pairs

    def free_swapped(self, req: Request) -> None:
        self.cpu_free.extend(req.swapped_blocks)
        req.swapped_blocks = []

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks if self.pool.num_blocks else 0.0
