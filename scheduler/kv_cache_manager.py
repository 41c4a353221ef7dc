"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, swap to
CPU blocks, freeing.

Allocation answers None when it does not fit, so the scheduler owns every
preemption decision. Exactly one place (`free`) releases a request's device
blocks; `free_swapped` its CPU blocks. Only full blocks are ever shared (prefix
hits, which is also how the n samples of a request share their prompt), and a
full block is never written again, so no block ever needs a copy-on-write.

Prefix-cache keys. A full block's key is the sha256 digest of its parent's key
and its token ids (little-endian int64); the first block's "parent" is the
request's root: a fixed root digest followed by the request's extra keys, each
tagged with its kind and length-prefixed (`extra_key`), so that a salt and some
other key spelled alike never meet. The extra keys are the `cache_salt` (requests
with different salts, or a salt and none, never share a block) and, with prefix
caching off, the request's sample group (the samples of one client request share
their prompt with each other only). Through the chain, every key covers every
token and extra key before it.

Why a cryptographic digest: a key that is a short unkeyed hash can be matched on
purpose, and a request that finds another tenant's key reads that tenant's KV
(vLLM's GHSA-rm76-4mrf-v9r8); a salt separates tenants only if keys cannot be
forged. Digests are made once per full block, incrementally; sha256 rather than
blake2b because OpenSSL's, on CPUs with SHA instructions, is the cheaper of the two
for a block's 160 bytes (the call, not the bytes, costs most). Why the hit check
too: even a colliding digest (`new_digest` is swapped for one in tests) must not
serve a block computed for other tokens, so a hit must also hold the same tokens
after the same content as the request's own (`BlockPool.lookup`).
"""

from __future__ import annotations

import hashlib
import struct

from noria.scheduler.block_pool import BlockPool
from noria.scheduler.request import Request

# The hash that makes the keys: a block's key is `new_digest(parent + packed_tokens).digest()`.
# Read at each use, so that a test may swap in a colliding one.
new_digest = hashlib.sha256
_ROOT = hashlib.sha256(b"noria prefix cache").digest()  # where every chain starts, before the extra keys
_NO_BLOCKS: list[int] = []  # shared, never mutated: "no block added"


def extra_key(kind: bytes, value: str) -> bytes:
    """One extra key, tagged with its kind and length-prefixed: unambiguous in a sequence."""
    raw = value.encode(errors="surrogatepass")
    return kind + b":" + len(raw).to_bytes(8, "little") + raw


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self._pack = struct.Struct(f"<{block_size}q").pack  # a full block's token ids, as digested
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def hash_root(self, sample_group: int | None, cache_salt: str | None = None) -> bytes | None:
        """Where a request's key chain starts (its first block's parent): the root
        digest, then the request's extra keys. With prefix caching on, requests with
        the same `cache_salt` (or none) share blocks. With it off, the samples of one
        client request (same `sample_group`) still share their prompt blocks, with
        each other only. None: nothing hashed, nothing shared."""
        if self.enable_prefix_caching:
            root = _ROOT
        elif sample_group is None:
            return None
        else:
            root = _ROOT + extra_key(b"group", str(sample_group))
        return root if cache_salt is None else root + extra_key(b"salt", cache_salt)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes, bs, tokens, pack, digest = req.block_hashes, self.block_size, req.token_ids, self._pack, new_digest
        parent = hashes[-1] if hashes else req.hash_root
        for i in range(len(hashes), num_full_blocks):
            parent = digest(parent + pack(*tokens[i * bs : (i + 1) * bs])).digest()
            hashes.append(parent)

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The longest run of cached blocks for the request's known tokens.

        The last token is never served from cache: its logits are needed.
        """
        if req.hash_root is None or req.needs_all_positions:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        self._ensure_hashes(req, max_blocks)
        pool, tokens, pack = self.pool, req.token_ids, self._pack
        parent: bytes | int | None = req.hash_root
        hits: list[int] = []
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            if h not in pool.cached:
                break
            block = pool.lookup(h, parent, pack(*tokens[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
            parent = pool.content_id[block]
        return hits

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None, cache: bool = True
    ) -> list[int] | None:
        """Give `req` blocks for `num_new_tokens` more tokens (after any prefix hit).

        Returns the block ids appended to the table, or None when it does not
        fit (then nothing changed). `cache` False: the new blocks are not keyed for prefix
        hits yet (their KV is pulled from another engine: `cache_full_blocks` once it is in).
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
        if req.hash_root is not None and cache:
            self._cache_full_blocks(req, min(total, req.num_tokens) // self.block_size)
        return added

    def append_slot(self, req: Request) -> list[int] | None:
        """`allocate_slots(req, 1)` for a decode (no prefix hit), without the general
        case's work: every step calls it for the running requests that start a block, a
        sixteenth of them at the default block size. It keys the block filled before
        (the scheduler calls nothing when a decode fills a block): a block is hashed a
        step after it fills, before any request of a later step looks it up, and a
        request that ends as it fills a block leaves that block unkeyed."""
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
            # A block filled by the token on its way (async scheduling) waits for the next call.
            full = min(total, len(req.token_ids)) // bs
            cached = req.num_cached_blocks
            if full == cached + 1 and len(req.block_hashes) == cached:  # exactly one block filled
                packed = self._pack(*req.token_ids[cached * bs : full * bs])
                pool = self.pool
                if cached:
                    h = new_digest(req.block_hashes[-1] + packed).digest()
                    pool.cache(block_ids[cached], h, pool.content_id[block_ids[cached - 1]], packed,
                               req.block_hashes[-1])
                else:
                    h = new_digest(req.hash_root + packed).digest()
                    pool.cache(block_ids[0], h, req.hash_root, packed)
                req.block_hashes.append(h)
                req.num_cached_blocks = full
            elif full > cached:
                self._cache_full_blocks(req, full)
        return added

    def cache_full_blocks(self, req: Request, num_full: int) -> None:
        """Key the request's first `num_full` blocks for prefix hits (those not keyed yet)."""
        self._cache_full_blocks(req, num_full)

    def _cache_full_blocks(self, req: Request, num_full: int) -> None:
        # Registered when planned: every layer writes the step's KV before it
        # attends, so even a request planned later in the same step may hit it.
        if num_full <= req.num_cached_blocks:
            return
        pool, bs, tokens, block_ids, hashes = self.pool, self.block_size, req.token_ids, req.block_ids, req.block_hashes
        pack, digest = self._pack, new_digest
        for i in range(req.num_cached_blocks, num_full):
            block = block_ids[i]
            if pool.block_hash[block] is not None:
                continue  # a prefix hit: registered, with its content id, already
            packed = pack(*tokens[i * bs : (i + 1) * bs])
            if i == len(hashes):
                hashes.append(digest((hashes[i - 1] if i else req.hash_root) + packed).digest())
            # In order: the block before has its content id by now.
            pool.cache(block, hashes[i], pool.content_id[block_ids[i - 1]] if i else req.hash_root, packed,
                       hashes[i - 1] if i else None)
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
