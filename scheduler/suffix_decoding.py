"""Suffix decoding (vLLM's `suffix` method, after Arctic Inference's SuffixDecoding): proposals
from the text a tenant has already been given, for workloads that repeat themselves across
requests (agents re-reading and re-writing the same code, templated answers) as well as within
one.

Two suffix trees (scheduler/suffix_tree.py) are matched against the request's last tokens, and
the proposal with the higher score wins: the request's own prompt's, built at its first
proposal (as a suffix array with the same answers, scheduler/prompt_index.py: a prompt is
fixed, and a tree of a long one is large and slow to build), and its tenant's responses: every response of a request with the same `cache_salt`
(or with none), added a token at a time while it is generated, so that concurrent requests
learn from each other, and kept once the request ends, the oldest evicted past
`suffix_decoding_max_cached_requests` responses in all. A tenant's responses are never matched
for another tenant's request (the same rule as the prefix cache's salt).

Memory: a tree holds up to `suffix_decoding_max_tree_depth` nodes per token added (a prompt's
index one position per token), so the responses kept for the tenants cost up to that per
response token: 10,000 responses of 500 tokens would be over
a hundred million nodes, tens of GB in the scheduler process. So past MAX_NODES in the
tenants' trees together the oldest finished responses are evicted too, whatever
`suffix_decoding_max_cached_requests` allows (vLLM's native trees are smaller per node; the
bound is noria's own).
"""

from __future__ import annotations

from collections import OrderedDict

from noria.protocol.speculative import SpeculativeConfig
from noria.scheduler.prompt_index import PromptIndex
from noria.scheduler.suffix_tree import Node, SuffixTree

# The tenants' trees' nodes together, at most (about 250 bytes each: a node and its dict).
MAX_NODES = 2_000_000


class SuffixCache:
    """Every tenant's response tree, and the responses in it, oldest first."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.trees: dict[str | None, SuffixTree] = {}
        # Responses in the trees, by request id: (tenant, tokens); the live ones too (evicted
        # only once ended, which `ended` tells).
        self.responses: OrderedDict[int, tuple[str | None, list[int]]] = OrderedDict()
        self.ended: set[int] = set()

    def tree(self, tenant: str | None) -> SuffixTree:
        tree = self.trees.get(tenant)
        if tree is None:
            tree = self.trees[tenant] = SuffixTree(self.spec.suffix_decoding_max_tree_depth)
        return tree

    def end(self, req_id: int) -> None:
        """The request's response is complete: kept, and the oldest complete ones past the
        limits (responses, nodes) evicted."""
        self.ended.add(req_id)
        limit = self.spec.suffix_decoding_max_cached_requests
        while self.ended and (len(self.ended) > limit or self.nodes() > MAX_NODES):
            oldest = next(r for r in self.responses if r in self.ended)
            self._evict(oldest)

    def nodes(self) -> int:
        return sum(tree.size for tree in self.trees.values())

    def _evict(self, req_id: int) -> None:
        tenant, tokens = self.responses.pop(req_id)
        self.ended.discard(req_id)
        tree = self.trees[tenant]
        active = tree.start()
        for t in tokens:
            active = tree.shrink(active, t)
        if not tree.root.children:
            del self.trees[tenant]


class SuffixProposer:
    """One request's proposer (`Request.ngram`'s place): its prompt's tree, and its response as
    it grows in its tenant's tree."""

    __slots__ = ("cache", "req_id", "tenant", "num_prompt", "prompt", "added", "active")

    def __init__(self, cache: SuffixCache, req_id: int, tenant: str | None, num_prompt: int) -> None:
        self.cache, self.req_id, self.tenant, self.num_prompt = cache, req_id, tenant, num_prompt
        self.prompt: PromptIndex | None = None
        self.added = 0  # response tokens added to the tenant's tree
        self.active: list[Node] = []

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `tokens` (the whole sequence so far)."""
        spec, cache = self.cache.spec, self.cache
        if self.prompt is None:
            self.prompt = PromptIndex(tokens[:self.num_prompt], spec.suffix_decoding_max_tree_depth)
        self._add_response(tokens)
        context = tokens[len(tokens) - spec.suffix_decoding_max_tree_depth:]
        factor, min_prob = spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob
        best, score = self.prompt.speculate(context, k, factor, min_prob)
        shared = cache.trees.get(self.tenant)
        if shared is not None:
            other, other_score = shared.speculate(context, k, factor, min_prob)
            if other_score > score:
                best = other
        return best

    def _add_response(self, tokens: list[int]) -> None:
        """Its response tokens since the last call, into its tenant's tree."""
        if self.added == len(tokens) - self.num_prompt:
            return
        tree = self.cache.tree(self.tenant)
        if not self.active:
            self.active = tree.start()
            self.cache.responses[self.req_id] = (self.tenant, [])
        kept = self.cache.responses[self.req_id][1]
        for t in tokens[self.num_prompt + self.added:]:
            self.active = tree.extend(self.active, t)
            kept.append(t)
        self.added = len(tokens) - self.num_prompt

    def finish(self, tokens: list[int]) -> None:
        """The request ended with `tokens`: its whole response stays in its tenant's tree."""
        self._add_response(tokens)
        self.prompt = None
        if self.req_id in self.cache.responses:
            self.cache.end(self.req_id)
