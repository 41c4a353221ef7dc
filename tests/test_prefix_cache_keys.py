"""Prefix-cache keys: sha256 chains over token ids and tagged extra keys (`cache_salt`,
the sample group), and a hit check that holds even when keys collide.

Collisions are made on purpose by swapping the key's hash for a weak one. The worker
stand-in here remembers, for every KV slot, the whole sequence it was computed after
(not only its token and position, as `FakeWorker` does), so a block served to a request
whose earlier tokens differ from the block's own history fails the step that attends it.
"""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import noria.scheduler.kv_cache_manager as kvm
from noria.bench.fake_worker import FakeWorker, next_token
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest, EngineSample
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import StepPlan, StepResult
from noria.scheduler.scheduler import Scheduler

VOCAB = 50
EOS = VOCAB - 1
BS = 4


class ContextWorker(FakeWorker):
    """`FakeWorker` whose KV slots also hold the whole sequence up to them, checked
    wherever a step attends: a block computed after other tokens is caught even where
    its own tokens and positions agree."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, vocab=VOCAB)
        self.ctx: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> tokens up to it

    def execute(self, plan: StepPlan) -> StepResult:
        assert not plan.swap_out and not plan.swap_in, "these tests run without swap"
        result = super().execute(plan)
        bs = self.block_size
        for rid, n in plan.scheduled:  # every layer writes the step's KV before it attends
            st_ = self.reqs[rid]
            for pos in range(st_["computed"] - n, st_["computed"]):
                self.ctx[st_["blocks"][pos // bs], pos % bs] = tuple(st_["tokens"][: pos + 1])
        for rid, _ in plan.scheduled:
            st_ = self.reqs[rid]
            for pos in range(st_["computed"]):
                got = self.ctx.get((st_["blocks"][pos // bs], pos % bs))
                assert got == tuple(st_["tokens"][: pos + 1]), (
                    f"req {rid} attends position {pos} in block {st_['blocks'][pos // bs]}, computed for "
                    f"another sequence")
        return result


def _make(num_blocks: int = 64, caching: bool = True, **kw) -> tuple[Scheduler, ContextWorker]:
    cfg = EngineConfig(block_size=BS, enable_prefix_caching=caching, **kw)
    return Scheduler(cfg, num_blocks, 10_000), ContextWorker(num_blocks, BS)


def _add(s: Scheduler, rid: int, prompt: list[int], max_tokens: int = 3, salt: str | None = None, n: int = 1) -> None:
    s.add_request(EngineRequest(rid, prompt, EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True), [EOS], 0,
                                rid if n > 1 else None, more_samples=[EngineSample(rid + i, i) for i in range(1, n)],
                                cache_salt=salt))


def _step(s: Scheduler, w: ContextWorker, outputs: dict[int, list[int]], cached: dict[int, int]) -> None:
    s.update_from_result(w.execute(s.schedule()))
    for u in s.take_updates():
        assert u.error_code is None, u
        outputs.setdefault(u.req_id, []).extend(u.new_token_ids)
        cached[u.req_id] = u.num_cached_tokens


def _drain(s: Scheduler, w: ContextWorker, outputs: dict[int, list[int]] | None = None,
           cached: dict[int, int] | None = None) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Run until idle; outputs and cached-token counts per request (added to those given)."""
    outputs = {} if outputs is None else outputs
    cached = {} if cached is None else cached
    while s.has_work():
        _step(s, w, outputs, cached)
    assert s.check_blocks() is None
    return outputs, cached


def _model(prompt: list[int], k: int) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(k):
        out.append(next_token(toks, VOCAB))
        toks.append(out[-1])
    return out


class _Fixed:
    """A stand-in for a hash object whose digest is chosen by the test."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def digest(self) -> bytes:
        return self.key


def _weak(keep: int):
    """A key hash that keeps `keep` bytes of sha256: 0 makes every key collide."""
    return lambda data: _Fixed(hashlib.sha256(data).digest()[:keep])


# ---- the keys -----------------------------------------------------------------


def test_keys_are_sha256_chained_over_packed_token_ids():
    s, w = _make()
    prompt = list(range(1, 4 * BS + 2))
    _add(s, 0, prompt, max_tokens=1)
    _drain(s, w)
    twin, _ = _make()  # the request is gone: a twin's lookup computes the keys again
    _add(twin, 1, prompt)
    r = twin.requests[1]
    twin.kv.get_computed_blocks(r)
    keys = r.block_hashes
    assert len(keys) == 4 and all(len(k) == 32 for k in keys)
    for i in range(1, 4):  # an independent reference: sha256(parent key + little-endian int64 ids)
        packed = struct.pack(f"<{BS}q", *prompt[i * BS : (i + 1) * BS])
        assert keys[i] == hashlib.sha256(keys[i - 1] + packed).digest()
    assert set(keys) <= set(s.kv.pool.cached)  # the first run registered the same keys


def test_every_key_covers_every_token_and_extra_key_before_it():
    def keys(prompt, salt=None):
        s, _ = _make()
        _add(s, 0, prompt, salt=salt)
        r = s.requests[0]
        s.kv.get_computed_blocks(r)
        return r.block_hashes

    base = keys(list(range(1, 4 * BS + 2)))
    first_changed = keys([7] + list(range(2, 4 * BS + 2)))
    assert all(a != b for a, b in zip(base, first_changed, strict=True))
    for salted in (keys(list(range(1, 4 * BS + 2)), "tenant-a"), keys(list(range(1, 4 * BS + 2)), "tenant-b")):
        assert all(a != b for a, b in zip(base, salted, strict=True))
    assert keys(list(range(1, 4 * BS + 2)), "tenant-a") == keys(list(range(1, 4 * BS + 2)), "tenant-a")


@given(a=st.tuples(st.none() | st.integers(0, 2**40), st.none() | st.text(max_size=6)),
       b=st.tuples(st.none() | st.integers(0, 2**40), st.none() | st.text(max_size=6)))
@settings(max_examples=300, deadline=None)
def test_roots_tell_every_group_and_salt_apart(a, b):
    """Tagged, length-prefixed extra keys: no two (group, salt) pairs share a root, whatever
    the spelling (a group "12" and a salt "12", a salt "1" + "2"...)."""
    off = kvm.KVCacheManager(8, BS, enable_prefix_caching=False)
    on = kvm.KVCacheManager(8, BS, enable_prefix_caching=True)
    roots = {}
    for group, salt in (a, b):
        roots[(group, salt)] = off.hash_root(group, salt)
        roots[("on", salt)] = on.hash_root(group, salt)
    for (k1, r1) in roots.items():
        for (k2, r2) in roots.items():
            if k1 != k2 and r1 is not None:
                assert r1 != r2, (k1, k2)
    assert (off.hash_root(None, "x") is None) and off.hash_root(None, None) is None


# ---- collisions ------------------------------------------------------------------


def test_a_colliding_key_serves_no_other_tokens(monkeypatch):
    monkeypatch.setattr(kvm, "new_digest", _weak(0))  # every block of every request: one key
    s, w = _make()
    p = list(range(1, 3 * BS + 2))
    q = list(range(20, 20 + 3 * BS + 1))
    _add(s, 0, p)
    outputs, cached = _drain(s, w)
    _add(s, 2, p)
    _add(s, 1, q)
    more, more_cached = _drain(s, w)
    outputs.update(more)
    cached.update(more_cached)
    assert cached[1] == 0, "different tokens under the same key must miss"
    # The one key holds p's first block; p's later blocks could not register (taken key).
    assert cached[2] == BS
    _add(s, 3, q)  # p's blocks are idle now: q's first block takes the key over
    _add(s, 4, p)
    more, more_cached = _drain(s, w)
    outputs.update(more)
    cached.update(more_cached)
    assert cached[3] == 0 and cached[4] == 0
    for rid, prompt in ((0, p), (1, q), (2, p), (3, q), (4, p)):
        assert outputs[rid] == _model(prompt, 3)


def test_a_hit_needs_the_same_history_not_only_the_same_tokens(monkeypatch):
    """Keys made from a block's own tokens alone (the parent left out): the second blocks
    of `a + b` and `a2 + b` collide. A request `a2 + b + ...` may reuse a2's first block,
    but never the `b` block computed after `a`."""
    monkeypatch.setattr(kvm, "new_digest", lambda data: _Fixed(hashlib.sha256(data[-8 * BS:]).digest()))
    s, w = _make()
    a, a2, b = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    outputs: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    _add(s, 0, a + b + [13], max_tokens=40)  # stays running: its blocks stay in use
    _step(s, w, outputs, cached)
    _add(s, 1, a2 + b + [14], max_tokens=40)
    _step(s, w, outputs, cached)
    _add(s, 2, a2 + b + [15], max_tokens=3)
    _step(s, w, outputs, cached)
    assert cached[2] == BS, "only a2's block, never b computed after a"
    assert s.requests[2].block_ids[0] == s.requests[1].block_ids[0]
    assert s.requests[2].block_ids[1] not in (s.requests[0].block_ids[1], s.requests[1].block_ids[1])
    s.abort([0, 1])
    _drain(s, w, outputs, cached)
    assert outputs[2] == _model(a2 + b + [15], 3)
    # With the first requests gone, their idle blocks give way: a2 + b registers its own b.
    _add(s, 3, a2 + b + [16], max_tokens=1)
    _add(s, 4, a2 + b + [17], max_tokens=1)
    _, cached = _drain(s, w)
    assert cached[4] == 2 * BS


@pytest.mark.parametrize("keep", [0, 1])
@pytest.mark.parametrize("caching", [True, False])
def test_weak_keys_under_load_never_mix_sequences_or_salts(monkeypatch, keep, caching):
    """Many requests over shared prefixes, salts and n > 1, with keys of 0 or 1 byte: every
    step's attention reads only KV computed for its own sequence (ContextWorker), outputs
    equal the model's, no block is ever held under two salts, and the cache still hits."""
    monkeypatch.setattr(kvm, "new_digest", _weak(keep))
    rng = random.Random(keep * 2 + caching)
    s, w = _make(num_blocks=48, caching=caching, max_num_seqs=6, max_num_batched_tokens=24)
    prefixes = [[rng.randrange(EOS) for _ in range(2 * BS)] for _ in range(3)]
    prompts: dict[int, list[int]] = {}
    salt_of: dict[int, str | None] = {}
    outputs: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    rid = 0
    for _ in range(60):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 2 * BS + 1)] + [rng.randrange(EOS) for _ in range(rng.randrange(3 * BS))]
        n = rng.choice([1, 1, 2, 3])
        salt = rng.choice([None, "t1", "t2"])
        _add(s, rid, prompt, max_tokens=rng.randrange(1, 8), salt=salt, n=n)
        for i in range(n):
            prompts[rid + i], salt_of[rid + i] = prompt, salt
        rid += n
        for _ in range(rng.randrange(3)):
            if s.has_work():
                _step(s, w, outputs, cached)
                holders: dict[int, set[str | None]] = {}
                for r in s.requests.values():
                    for b in r.block_ids:
                        holders.setdefault(b, set()).add(salt_of[r.req_id])
                assert all(len(salts) == 1 for salts in holders.values()), "a block held under two salts"
    _drain(s, w, outputs, cached)
    for r, prompt in prompts.items():
        k = len(outputs[r])
        assert k >= 1 and outputs[r] == _model(prompt, k)
    assert s.stats.prefix_cache_hits > 0


# ---- salts -------------------------------------------------------------------------


def test_salts_share_blocks_only_with_the_same_salt():
    s, w = _make()
    prompt = list(range(1, 4 * BS + 2))
    cached = {}
    for rid, salt in enumerate([None, "a", "b", "a", None, "A"]):
        _add(s, rid, prompt, salt=salt)
        cached.update(_drain(s, w)[1])
    assert [cached[r] for r in range(6)] == [0, 0, 0, 4 * BS, 4 * BS, 0]


@pytest.mark.parametrize("caching", [True, False])
def test_samples_of_a_salted_request_share_their_prompt(caching):
    s, w = _make(caching=caching)
    prompt = list(range(1, 4 * BS + 2))
    _add(s, 0, prompt, max_tokens=3, salt="tenant", n=3)
    outputs: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    _step(s, w, outputs, cached)
    tables = [s.requests[r].block_ids[:4] for r in range(3)]
    assert tables[0] == tables[1] == tables[2]
    _drain(s, w, outputs, cached)
    assert all(outputs[r] == _model(prompt, 3) for r in range(3))
    if not caching:  # nothing outlives the request
        _add(s, 10, prompt, salt="tenant")
        assert _drain(s, w)[1][10] == 0


def test_a_salt_survives_a_scheduler_restart_resubmission():
    """A resumed request (outputs so far) keeps its salt: it hits only its own tenant's blocks."""
    s, w = _make()
    prompt = list(range(1, 4 * BS + 2))
    _add(s, 0, prompt, salt="a")
    _drain(s, w)
    tenant_a = set(s.kv.pool.cached.values())
    for rid, salt in ((1, "b"), (2, "a")):
        s.add_request(EngineRequest(rid, prompt, EngineSamplingParams(max_tokens=3, ignore_eos=True), [EOS],
                                    output_token_ids=[3], cache_salt=salt))
    _step(s, w, {}, {})
    assert not tenant_a & set(s.requests[1].block_ids)
    assert set(s.requests[2].block_ids[:4]) <= tenant_a
    _drain(s, w)


def test_a_hit_is_checked_by_comparing_bytes_not_by_rehashing():
    """The hit check reads what the pool keeps per cached block: its packed ids and parent."""
    s, w = _make()
    prompt = list(range(1, 2 * BS + 2))
    _add(s, 0, prompt)
    _drain(s, w)
    pool = s.kv.pool
    ids = sorted(pool.cached.values())
    assert len(ids) >= 2
    assert all(pool.tokens[b] is not None and isinstance(pool.tokens[b], bytes) for b in ids)
    # Corrupt the record of the first block: the key still matches, the hit must not.
    first = pool.cached[hashlib.sha256(s.kv.hash_root(None) + struct.pack(f"<{BS}q", *prompt[:BS])).digest()]
    pool.tokens[first] = struct.pack(f"<{BS}q", *([0] * BS))
    _add(s, 1, prompt)
    assert _drain(s, w)[1][1] == 0


def test_a_block_a_decode_fills_is_keyed_once_the_next_one_starts():
    """Decoded tokens are shared too (a conversation's next turn repeats the answer): the
    block a decode fills is keyed when the request's next block starts."""
    s, w = _make()
    outputs: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    _add(s, 0, list(range(1, 2 * BS + 1)), max_tokens=40)
    req = s.requests[0]
    while req.num_computed_tokens <= 3 * BS:  # past its third block: the fourth has started
        _step(s, w, outputs, cached)
    turn = req.token_ids[: 3 * BS] + [7]
    _add(s, 1, turn, max_tokens=2)
    _step(s, w, outputs, cached)
    assert cached[1] == 3 * BS
    s.abort([0])
    _drain(s, w, outputs, cached)
    assert outputs[1] == _model(turn, 2)
