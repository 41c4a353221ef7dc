"""A request's prompt for suffix decoding (scheduler/suffix_decoding.py): the same proposals as
a SuffixTree of the prompt alone (scheduler/suffix_tree.py), from a suffix array.

A tree holds a node per distinct substring of at most `depth` tokens: for a 4,000-token
prompt at vLLM's depth 24, about 90,000 nodes, 25 MB and 0.3 s of the scheduler's loop to
build, every other request's step waiting. The prompt never changes once the request runs, so
its suffixes sorted by their first `depth` tokens (a list of n positions, built by one sort)
answer the same questions: the suffixes that start with a substring are one run of that
order (two bisections), the substring's count is the run's length, and its children are the
tokens that follow it there, each counted, ties going to the one that occurs first in the
prompt, as the tree's insertion order has it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from noria.scheduler.suffix_tree import longest_present

# A substring's run of the order: (its first index, one past its last, its length).
Run = tuple[int, int, int]


class PromptIndex:
    __slots__ = ("depth", "tokens", "order")

    def __init__(self, tokens: list[int], depth: int) -> None:
        self.depth, self.tokens = depth, tokens
        self.order = sorted(range(len(tokens)), key=lambda i: tokens[i:i + depth])

    def _run(self, pattern: list[int], lo: int = 0, hi: int | None = None) -> Run | None:
        n, tokens = len(pattern), self.tokens

        def key(i: int) -> list[int]:
            return tokens[i:i + n]

        hi = len(self.order) if hi is None else hi
        start = bisect_left(self.order, pattern, lo, hi, key=key)
        end = bisect_right(self.order, pattern, start, hi, key=key)
        return (start, end, n) if start < end else None

    def _children(self, run: Run) -> dict[int, list[int]]:
        """Each token that follows the run's substring: [count, its first position]."""
        start, end, length = run
        out: dict[int, list[int]] = {}
        if length >= self.depth:
            return out
        tokens, n = self.tokens, len(self.tokens)
        for i in self.order[start:end]:
            if i + length < n:
                entry = out.get(tokens[i + length])
                if entry is None:
                    out[tokens[i + length]] = [1, i]
                else:
                    entry[0] += 1
                    entry[1] = min(entry[1], i)
        return out

    def match(self, context: list[int]) -> Run | None:
        """The run of the longest suffix of `context` with a continuation (SuffixTree.match)."""
        # A walk through text the prompt repeats matches again at the longest length that can
        # have a continuation: one lookup, not a bisection.
        longest = min(self.depth - 1, len(context))
        if longest > 0:
            run = self._run(context[len(context) - longest:])
            if run is not None and self._children(run):
                return run
        lo = longest_present(context, self.depth, lambda pattern: self._run(pattern) is not None)
        for length in range(lo, 0, -1):
            run = self._run(context[len(context) - length:])
            if run is not None and self._children(run):
                return run
        return None

    def speculate(self, context: list[int], max_tokens: int, factor: float, min_prob: float
                  ) -> tuple[list[int], float]:
        """SuffixTree.speculate's proposal and score over the prompt."""
        run = self.match(context)
        if run is None:
            return [], 0.0
        limit = min(max_tokens, max(1, int(factor * run[2])))
        out: list[int] = []
        path = list(context[len(context) - run[2]:])
        prob, score = 1.0, 0.0
        while len(out) < limit:
            children = self._children(run)
            if not children:
                again = self.match(context[-self.depth:] + out)
                if again is None:
                    break
                run, path = again, (context[-self.depth:] + out)[-again[2]:]
                children = self._children(run)
            token, (count, _) = max(children.items(), key=lambda kv: (kv[1][0], -kv[1][1]))
            prob *= count / sum(c for c, _ in children.values())
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            path = [*path, token]
            found = self._run(path, run[0], run[1])
            assert found is not None
            run = found
        return out, score
