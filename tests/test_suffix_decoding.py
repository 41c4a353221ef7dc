"""Suffix decoding's trees and proposer (scheduler/suffix_tree.py, scheduler/suffix_decoding.py)
against brute force: the counts are every substring's occurrences as sequences are added and
taken back; a proposal is the greedy walk over those counts from the longest suffix of the
context that has a continuation; a tenant's responses are proposed to that tenant only; the
oldest finished responses are evicted past the limit. Through the engine, outputs equal
speculation off (tests/test_spec_decode.py runs the sampling mix with `suffix` too).
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from noria.protocol.speculative import SpeculativeConfig, parse_speculative_config
from noria.scheduler import suffix_decoding
from noria.scheduler.prompt_index import PromptIndex
from noria.scheduler.suffix_decoding import SuffixCache, SuffixProposer
from noria.scheduler.suffix_tree import Node, SuffixTree


def _counts(node: Node, path: tuple[int, ...] = ()) -> Counter:
    out: Counter = Counter()
    for t, child in node.children.items():
        out[(*path, t)] = child.count
        out.update(_counts(child, (*path, t)))
    return out


def _substrings(seqs: list[list[int]], depth: int) -> Counter:
    out: Counter = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                out[tuple(seq[i:j])] += 1
    return out


def _add(tree: SuffixTree, seq: list[int], take_back: bool = False) -> None:
    active = tree.start()
    for t in seq:
        active = tree.shrink(active, t) if take_back else tree.extend(active, t)


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=5),
       depth=st.integers(1, 6), removed=st.sets(st.integers(0, 4)))
def test_counts_are_every_substrings_occurrences(seqs, depth, removed) -> None:
    tree = SuffixTree(depth)
    for seq in seqs:
        _add(tree, seq)
    assert _counts(tree.root) == _substrings(seqs, depth)
    assert tree.size == len(_substrings(seqs, depth))  # a node per distinct substring
    for i in sorted(removed & set(range(len(seqs)))):
        _add(tree, seqs[i], take_back=True)
    kept = [s for i, s in enumerate(seqs) if i not in removed]
    assert _counts(tree.root) == _substrings(kept, depth)  # nodes at zero are gone too
    assert tree.size == len(_substrings(kept, depth))


def _brute_speculate(seqs: list[list[int]], depth: int, context: list[int], k: int, factor: float,
                     min_prob: float) -> tuple[list[int], float]:
    """The same walk over counted substrings: ties go to the continuation seen first."""
    counts = _substrings(seqs, depth)
    order = {}
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                order.setdefault(tuple(seq[i:j]), len(order))

    def match(ctx: list[int]) -> tuple[tuple[int, ...], int] | None:
        for length in range(min(depth, len(ctx)), 0, -1):
            path = tuple(ctx[len(ctx) - length:])
            if path in counts and any(len(p) == length + 1 and p[:-1] == path for p in counts):
                return path, length
        return None

    found = match(context)
    if found is None:
        return [], 0.0
    path, length = found
    limit = min(k, max(1, int(factor * length)))
    out: list[int] = []
    prob = score = 0.0
    prob = 1.0
    while len(out) < limit:
        nexts = [p for p in counts if len(p) == len(path) + 1 and p[:-1] == path]
        if not nexts:
            again = match(context[-depth:] + out)
            if again is None:
                break
            path = again[0]
            nexts = [p for p in counts if len(p) == len(path) + 1 and p[:-1] == path]
        best = max(nexts, key=lambda p: (counts[p], -order[p]))
        prob *= counts[best] / sum(counts[p] for p in nexts)
        if prob < min_prob:
            break
        out.append(best[-1])
        score += prob
        path = best
    return out, score


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=4),
       context=st.lists(st.integers(0, 3), min_size=1, max_size=12), depth=st.integers(2, 8),
       k=st.integers(1, 10), factor=st.sampled_from([0.5, 1.0, 3.0]), min_prob=st.sampled_from([0.0, 0.1, 0.5]))
def test_speculation_equals_a_brute_force_walk(seqs, context, depth, k, factor, min_prob) -> None:
    tree = SuffixTree(depth)
    for seq in seqs:
        _add(tree, seq)
    got, score = tree.speculate(context, k, factor, min_prob)
    want, want_score = _brute_speculate(seqs, depth, context, k, factor, min_prob)
    assert got == want
    assert score == pytest.approx(want_score)


@settings(max_examples=400, deadline=None)
@given(seq=st.lists(st.integers(0, 3), max_size=60), context=st.lists(st.integers(0, 3), min_size=1, max_size=12),
       depth=st.integers(1, 8), k=st.integers(1, 12), factor=st.sampled_from([0.5, 1.0, 3.0]),
       min_prob=st.sampled_from([0.0, 0.1, 0.5]))
def test_a_prompts_index_proposes_what_its_tree_would(seq, context, depth, k, factor, min_prob) -> None:
    """The prompt's suffix array against the tree of the prompt alone: the same tokens (ties
    included) and score."""
    tree = SuffixTree(depth)
    _add(tree, seq)
    got, score = PromptIndex(seq, depth).speculate(context, k, factor, min_prob)
    want, want_score = tree.speculate(context, k, factor, min_prob)
    assert got == want
    assert score == pytest.approx(want_score)


def _spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", num_speculative_tokens=8, **kw)


def test_a_tenant_is_proposed_its_own_responses_only() -> None:
    cache = SuffixCache(_spec())
    answer = [40, 41, 42, 43, 44, 45]
    first = SuffixProposer(cache, 1, "alice", 2)
    first.finish([9, 9, *answer])  # alice's first request answered this
    prompt = [7, 40, 41]  # a new prompt ending as the answer began
    assert SuffixProposer(cache, 2, "alice", 3).propose(prompt, 8) == answer[2:4]  # factor 1 x a 2-token match
    assert SuffixProposer(cache, 3, "bob", 3).propose(prompt, 8) == []
    assert SuffixProposer(cache, 4, None, 3).propose(prompt, 8) == []


def test_the_prompt_tree_proposes_what_followed_in_the_prompt() -> None:
    cache = SuffixCache(_spec())
    prompt = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2]
    proposer = SuffixProposer(cache, 1, None, len(prompt))
    assert proposer.propose(prompt, 8) == [3, 4]  # a 2-token match: at most factor 1 x 2 tokens
    proposer.finish(prompt)


def test_live_responses_are_shared_and_the_oldest_finished_are_evicted() -> None:
    cache = SuffixCache(_spec(suffix_decoding_max_cached_requests=1))
    a = SuffixProposer(cache, 1, None, 1)
    a.propose([0, 50, 51, 52, 53], 4)  # a's response so far is in the tree while it runs
    b = SuffixProposer(cache, 2, None, 1)
    assert b.propose([5, 50, 51], 4) == [52, 53]
    a.finish([0, 50, 51, 52, 53])
    b.finish([5, 50, 51, 60])  # b ends: one kept, so a's (older) goes
    assert set(cache.responses) == {2}
    c = SuffixProposer(cache, 3, None, 1)
    assert c.propose([6, 50, 51], 4) == [60]
    c.finish([6, 50, 51])
    assert set(cache.responses) == {3}
    assert _counts(cache.trees[None].root) == _substrings([[50, 51]], 24)


def test_the_oldest_finished_responses_go_past_the_node_budget(monkeypatch) -> None:
    """However many responses max_cached_requests allows, the tenants' trees together stay
    within MAX_NODES: the oldest finished responses are evicted, live ones never."""
    monkeypatch.setattr(suffix_decoding, "MAX_NODES", 444 + 5 * 36)
    cache = SuffixCache(_spec(suffix_decoding_max_cached_requests=1000))
    live = SuffixProposer(cache, 0, "t", 1)
    live.propose([0, *range(1000, 1030)], 2)  # 30 distinct tokens, depth 24: 444 substrings
    for rid in range(1, 30):  # 8 distinct tokens each: 36 substrings; tenants in turn
        SuffixProposer(cache, rid, None if rid % 2 else "t", 1).finish([0, *range(rid * 10, rid * 10 + 8)])
        assert cache.nodes() <= suffix_decoding.MAX_NODES, (rid, cache.nodes())
    assert set(cache.responses) == {0, 25, 26, 27, 28, 29}  # the live one and the newest five
    for tenant, tree in cache.trees.items():
        kept = [tokens for t, tokens in cache.responses.values() if t == tenant]
        assert tree.size == len(_substrings(kept, 24))


def test_config() -> None:
    value = parse_speculative_config({"method": "suffix"})
    assert value["num_speculative_tokens"] == 24  # vLLM's default: the trees' depth
    spec = SpeculativeConfig(**value)
    assert spec.describe() == "speculative decoding: suffix, 24 tokens, suffix trees of depth 24, 10000 responses kept"
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        parse_speculative_config({"method": "suffix", "suffix_decoding_min_token_prob": 2})
