"""Per-request logits edits with vLLM's meanings: `allowed_token_ids`, `bad_words`, `logit_bias`.

vLLM V1 applies them in this order after the raw logprobs are taken and before
penalties and sampling: the allowed-ids mask, the bad-words ban, then the bias.
A banned token's logit is -inf, so a bias cannot bring it back.

Bad words (the frontend tokenizes each word with and without a leading space,
`EngineSamplingParams.bad_words_token_ids`): a one-token word is never sampled; the
last token of a longer word is banned whenever the request's latest output
tokens equal the rest of that word. As in vLLM only output tokens count, not
the prompt.
"""

from __future__ import annotations

import torch

from noria.protocol.sampling import EngineSamplingParams


class LogitsProcessors:
    """One request's edits, built once; `record` follows its output tokens."""

    __slots__ = ("bias_ids", "bias_values", "disallowed", "always_banned", "prefixed", "recent", "keep")

    def __init__(self, params: EngineSamplingParams, output_ids: list[int], vocab_size: int, device: torch.device) -> None:
        bias = {t: v for t, v in (params.logit_bias or {}).items() if 0 <= t < vocab_size and v != 0.0}
        self.bias_ids = list(bias)
        self.bias_values = list(bias.values())
        self.disallowed: torch.Tensor | None = None  # True where a token may not be sampled
        if params.allowed_token_ids:
            self.disallowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
            allowed = [t for t in params.allowed_token_ids if 0 <= t < vocab_size]
            self.disallowed[torch.tensor(allowed, dtype=torch.long, device=device)] = False
        words = [w for w in params.bad_words_token_ids or () if w]
        self.always_banned = sorted({w[0] for w in words if len(w) == 1})
        self.prefixed = [(tuple(w[:-1]), w[-1]) for w in words if len(w) > 1]
        self.keep = max((len(p) for p, _ in self.prefixed), default=0)
        self.recent = output_ids[-self.keep:] if self.keep else []

    @property
    def empty(self) -> bool:
        return not (self.bias_ids or self.disallowed is not None or self.always_banned or self.prefixed)

    def record(self, token_id: int) -> None:
        if self.keep:
            self.recent.append(token_id)
            if len(self.recent) > self.keep:
                del self.recent[0]

    def banned_now(self) -> list[int]:
        """Bad-word tokens banned at the next position."""
        banned = list(self.always_banned)
        recent = self.recent
        for prefix, last in self.prefixed:
            n = len(prefix)
            if n <= len(recent) and tuple(recent[-n:]) == prefix:
                banned.append(last)
        return banned


def make_processors(
    params: EngineSamplingParams, output_ids: list[int], vocab_size: int, device: torch.device
) -> LogitsProcessors | None:
    if not (params.logit_bias or params.allowed_token_ids or params.bad_words_token_ids):
        return None
    procs = LogitsProcessors(params, output_ids, vocab_size, device)
    return None if procs.empty else procs


def apply_processors(logits: torch.Tensor, procs: list[LogitsProcessors | None]) -> None:
    """Edit `logits` [B, V] in place, row i by procs[i] (None: untouched)."""
    masked = [i for i, p in enumerate(procs) if p is not None and p.disallowed is not None]
    if masked:
        mask = torch.stack([procs[i].disallowed for i in masked])  # type: ignore[union-attr,misc]
        logits[masked] = logits[masked].masked_fill(mask, float("-inf"))
    rows: list[int] = []
    cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for i, p in enumerate(procs):
        if p is None:
            continue
        banned = p.banned_now()
        rows += [i] * len(banned)
        cols += banned
        bias_rows += [i] * len(p.bias_ids)
        bias_cols += p.bias_ids
        bias_vals += p.bias_values
    if rows:
        logits[rows, cols] = float("-inf")
    if bias_rows:
        dev = logits.device
        index = (torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev))
        logits.index_put_(index, torch.tensor(bias_vals, dtype=logits.dtype, device=dev), accumulate=True)
