"""Prompt logprobs (vLLM's `prompt_logprobs`): for each prompt token after the first, the
logprob the model gave it at the position before, with the top-k alternatives.

The hidden state at position p predicts token p + 1, so every prefill chunk
yields the entries of the prompt tokens it computes, and the prompt's last
position predicts the first output token (that is sampling, not a prompt
logprob). A tracker collects the entries over a request's chunks and hands
the whole list over with the request's first sampled token.

Every position must be computed here for this to work, so the scheduler
(scheduler/kv_cache_manager.py, scheduler/scheduler.py) takes no prefix-cache
hits for a request that still waits for its prompt logprobs (a cached block has
KV but no logits: vLLM makes the same choice) and preempts it by recompute,
never by swap, until its first token is out. A recomputed request starts over
with a fresh tracker; once its first token is out it needs none.
Logprobs are float32 `log_softmax` of the raw logits.
"""

from __future__ import annotations

from typing import Protocol

import torch

from noria.protocol.client import Logprob
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import NewRequestData

# Rows of [rows, vocab] float32 logits made at once: bounds the memory of a long prefill chunk.
MAX_ROWS = 1024


class _LogitsModel(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...


class PromptLogprobs:
    __slots__ = ("prompt", "k", "entries", "next_pos")

    def __init__(self, prompt: list[int], k: int) -> None:
        self.prompt = prompt
        self.k = k
        self.entries: list[Logprob | None] = [None]  # filled on rank 0 only
        self.next_pos = 0  # the first position no chunk has covered yet (on every rank)

    @classmethod
    def for_request(cls, new: NewRequestData, params: EngineSamplingParams) -> PromptLogprobs | None:
        k = params.prompt_logprobs
        if k is None or new.sample_index != 0 or len(new.token_ids) > new.num_prompt_tokens:
            return None  # not asked for, another sample's to compute, or sent with the first output token
        if new.num_computed_tokens:
            raise ValueError(f"request {new.req_id} wants prompt logprobs but starts with "
                             f"{new.num_computed_tokens} tokens computed (they have no logits)")
        return cls(new.token_ids[: new.num_prompt_tokens], k)

    @property
    def complete(self) -> bool:
        return self.next_pos >= len(self.prompt) - 1

    def span(self, start: int, num_tokens: int) -> tuple[int, int]:
        """(first position, count) of the positions a chunk [start, start + num_tokens)
        computes that predict a prompt token."""
        end = min(start + num_tokens, len(self.prompt) - 1)
        if end <= start:
            return start, 0
        if start != self.next_pos:
            raise ValueError(f"prompt logprobs: a chunk starts at position {start} but "
                             f"{self.next_pos} positions are done")
        self.next_pos = end
        return start, end - start


Span = tuple[PromptLogprobs, int, int, int]  # (tracker, flat row of the first position, first position, count)


def collect(model: _LogitsModel, hidden: torch.Tensor, spans: list[Span]) -> None:
    """Compute the spans' logits (every tensor-parallel rank takes part) and, where they
    arrive (rank 0), append each position's entry to its tracker."""
    rows = torch.cat([torch.arange(flat, flat + n) for _, flat, _, n in spans]).to(hidden.device)
    owners = [(t, first + j) for t, _, first, n in spans for j in range(n)]
    k_max = max(t.k for t, _, _, _ in spans)
    for lo in range(0, len(owners), MAX_ROWS):
        logits = model.compute_logits(hidden[rows[lo : lo + MAX_ROWS]])
        if logits is None:
            continue
        part = owners[lo : lo + MAX_ROWS]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor([t.prompt[p + 1] for t, p in part], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top_values: list[list[float]] = [[] for _ in part]
        top_ids: list[list[int]] = [[] for _ in part]
        if k_max:
            values, ids = logprobs.topk(k_max, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for j, (t, p) in enumerate(part):
            t.entries.append(Logprob(token_id=t.prompt[p + 1], logprob=chosen[j],
                                     top_token_ids=top_ids[j][: t.k], top_logprobs=top_values[j][: t.k]))


class _Tracked(Protocol):
    prompt_logprobs: PromptLogprobs | None


def take_complete(requests: list[_Tracked]) -> list[list[Logprob | None] | None] | None:
    """The finished lists of the requests that sample this step, parallel to them (None where
    none is due; None for all when none is), each handed over once."""
    out: list[list[Logprob | None] | None] = [None] * len(requests)
    found = False
    for j, r in enumerate(requests):
        t = r.prompt_logprobs
        if t is not None and t.complete:
            out[j], r.prompt_logprobs, found = t.entries, None, True
    return out if found else None
