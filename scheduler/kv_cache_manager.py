"""Maps requests to KV blocks: prefix-cache lookup, slot allocation with
copy-on-write, forks for parallel samples, swap to CPU blocks, freeing.

Allocation answers None when it does not fit, so the scheduler owns every
preemption decision. Exactly one place (`free`) releases a request's device
blocks; `free_swapped` its CPU blocks. Copies and block-table replacements
made while planning a step are collected here and taken by the plan.
"""

from __future__ import annotations

from noria.scheduler.block_pool import BlockPool
from noria.scheduler.request import Request

# Root of every hash chain; hashing a tuple of ints is stable across processes.
_ROOT_HASH = 0x6E6F726961


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write this step
        self.replaced: dict[int, list[tuple[int, int]]] = {}  # req_id -> (table index, new block)

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

        If the first new token lands in a block shared with another request,
        that block is copied first. Returns the block ids appended to the
        table, or None when it does not fit (then nothing changed).
        """
        hits = computed_blocks or []
        num_computed = req.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        need = max(0, self.blocks_needed(total) - len(req.block_ids) - len(hits))
        table = req.block_ids
        cow = num_new_tokens > 0 and num_computed % self.block_size != 0 and self.pool.ref_cnt[table[-1]] > 1
        # Hit blocks that sit in the free list stop being allocatable once touched.
        reclaimed = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if need + cow > self.pool.num_free - reclaimed:
            return None
        self.pool.touch(hits)
        if cow:
            src = table[-1]
            (dst,) = self.pool.allocate(1) or ()
            self.copies.append((src, dst))
            self.pool.release([src])
            table[-1] = dst
            self.replaced.setdefault(req.req_id, []).append((len(table) - 1, dst))
        added = hits + (self.pool.allocate(need) or []) if need else list(hits)
        table.extend(added)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, total // self.block_size)
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

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (a later write copies first)."""
        child.block_ids = list(parent.block_ids)
        self.pool.touch(child.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, req: Request) -> None:
        # Tail first, so LRU eviction never orphans a cached prefix.
        self.pool.release(req.block_ids[::-1])
        req.block_ids = []
        req.num_cached_blocks = 0
        self.replaced.pop(req.req_id, None)

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

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.copies = self.copies, []
        return out

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks if self.pool.num_blocks else 0.0
