"""Prompt lookup (vLLM's `ngram` method): the tokens that followed the latest earlier occurrence
of the request's last n tokens, for the longest n in [min_n, max_n] that has one. Where that
occurrence is so recent that fewer than k tokens follow it, the proposal goes on as the match
would (the sequence repeats with that period).

Each request keeps an index from every n-gram it has seen to the position after that n-gram's
latest occurrence, extended by the tokens added since the last lookup: a lookup costs a few
dictionary probes, not a scan of the whole sequence (a prompt of thousands of tokens is indexed
once, then a token at a time). The n-gram that ends the sequence is indexed only once a token
follows it, so a lookup never finds the suffix itself.
"""

from __future__ import annotations


class NgramIndex:
    __slots__ = ("min_n", "max_n", "seen", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # Per n (n - min_n): n-gram -> the position just after its latest occurrence.
        self.seen: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self.indexed = 0  # positions p < indexed have had the n-grams ending before them indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `tokens` (the whole sequence so far); [] when no n-gram of
        its end occurred before."""
        n_tokens = len(tokens)
        self._extend(tokens, n_tokens - 1)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            after = self.seen[n - self.min_n].get(tuple(tokens[n_tokens - n:]))
            if after is not None:
                # Past the known tokens the match continues into its own proposal: a run that
                # repeats with period p proposes k tokens, not p.
                out = tokens[after:after + k]
                while len(out) < k:
                    out.append(out[after + len(out) - n_tokens])
                return out
        return []

    def _extend(self, tokens: list[int], end: int) -> None:
        """Index the n-grams that end before each position in [indexed, end]: each has a token
        after it."""
        lo, seen = self.min_n, self.seen
        for p in range(max(self.indexed, lo), end + 1):
            for n in range(lo, min(self.max_n, p) + 1):
                seen[n - lo][tuple(tokens[p - n:p])] = p
        self.indexed = max(self.indexed, end + 1)
