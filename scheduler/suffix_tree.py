"""A suffix tree of bounded depth with counts, for suffix decoding (scheduler/suffix_decoding.py).

It holds every substring of at most `depth` tokens of the sequences added to it, as paths from
the root, each node counting the occurrences of its path. Sequences are added a token at a time
(`extend`: a sequence's open suffixes, the nodes of its last 0 .. depth - 1 tokens, each get the
new token as a child) and removed the same way (`shrink`), so a response can be added while it
is generated and a cached one evicted. A substring's suffixes are all in the tree with it, so
whether the last L tokens of a context are a path is monotone in L: the longest is found by
bisection.

Speculation (`speculate`) follows the most frequent child from the node of the longest suffix
of the context that has a continuation, while the product of the children's frequencies along
the way stays at least `min_prob`; a path that reaches the depth limit is matched again from
the context plus what it proposed. Its score, the sum of those products, is the expected number
of proposed tokens the target keeps, if the tree's frequencies are the target's.
"""

from __future__ import annotations

from collections.abc import Callable


class Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


class SuffixTree:
    __slots__ = ("depth", "root", "size")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()
        self.size = 0  # nodes below the root: what the tree's memory grows with

    def start(self) -> list[Node]:
        """The open suffixes of an empty sequence."""
        return [self.root]

    def extend(self, active: list[Node], token: int) -> list[Node]:
        """Add `token` to the sequence whose open suffixes are `active` (by length, root first);
        the sequence's open suffixes after it."""
        new = [self.root]
        for node in active:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
                self.size += 1
            child.count += 1
            new.append(child)
        return new[:self.depth]

    def shrink(self, active: list[Node], token: int) -> list[Node]:
        """Take back what `extend(active, token)` added (the sequence's tokens in the order they
        were added); its open suffixes as `extend` gave them."""
        new = [self.root]
        for node in active:
            child = node.children[token]
            child.count -= 1
            if not child.count:
                del node.children[token]
                self.size -= 1
            new.append(child)
        return new[:self.depth]

    def _walk(self, tokens: list[int]) -> Node | None:
        node: Node | None = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def match(self, context: list[int]) -> tuple[Node, int] | None:
        """The node of the longest suffix of `context` with a continuation, and its length."""
        lo = longest_present(context, self.depth, lambda path: self._walk(path) is not None)
        for length in range(lo, 0, -1):
            node = self._walk(context[len(context) - length:])
            if node is not None and node.children:
                return node, length
        return None

    def speculate(self, context: list[int], max_tokens: int, factor: float, min_prob: float
                  ) -> tuple[list[int], float]:
        """Up to `max_tokens` tokens to follow `context` (at most `factor` times the match's
        length), and their score."""
        found = self.match(context)
        if found is None:
            return [], 0.0
        node, length = found
        limit = min(max_tokens, max(1, int(factor * length)))
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            if not node.children:
                again = self.match(context[-self.depth:] + out)
                if again is None:
                    break
                node = again[0]
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / sum(c.count for c in node.children.values())
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return out, score


def longest_present(context: list[int], limit: int, present: Callable[[list[int]], bool]) -> int:
    """The longest L <= limit whose last L tokens of `context` are `present`, for a `present`
    that holds of a sequence's suffixes whenever it holds of the sequence: by bisection."""
    lo, hi = 0, min(limit, len(context))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if present(context[len(context) - mid:]):
            lo = mid
        else:
            hi = mid - 1
    return lo
