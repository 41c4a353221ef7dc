"""A pooling engine's last step per request: the prompt's final hidden states (after the model's
final norm) pooled into one vector, as vLLM's embedding runner does for decoder checkpoints.

A long prompt is computed in chunks over several steps, so the pooling carries over: `last`
takes the last row of the chunk that completes the prompt, `cls` keeps the first position's
row from the first chunk, and `mean` keeps a running float32 sum of every chunk's rows and
divides by the prompt's length at the end. The scheduler makes mean and cls requests compute
every position themselves (no prefix-cache hit, recompute rather than swap:
`Request.needs_all_positions`), so the sum and the first row are always this request's own.

The vector goes back unnormalized, as little-endian float32 bytes; the frontend truncates it
to the `dimensions` asked for and normalizes it (frontend/embeddings.py). An engine that
classifies (protocol/score.py) pools the last token and sends its logits instead: the row
times the score head (worker/score_head.py), in float32.
"""

from __future__ import annotations

from typing import Protocol

import torch

from noria.protocol.pooling import PoolingSpec


class PoolingRequest(Protocol):
    req_id: int
    token_ids: list[int]
    pooled: torch.Tensor | None  # cls: the first row; mean: the running sum
    num_pooled: int  # positions in `pooled` (mean)


class Pooler:
    def __init__(self, spec: PoolingSpec, head: torch.Tensor | None = None) -> None:
        """`head`: a classifier's [num_labels, hidden] float32 rows (last-token pooling only)."""
        if head is not None and spec.mode != "last":
            raise ValueError(f"a classifying engine pools the last token, not {spec.mode}")
        self.mode = spec.mode
        self.head = head

    def pool(self, hidden: torch.Tensor, states: list[PoolingRequest], query_lens: list[int],
             seq_lens: list[int]) -> tuple[list[int], list[bytes]]:
        """Carry this step's rows of `hidden` (a ragged batch: `query_lens[i]` rows for
        `states[i]`, ending at position `seq_lens[i]`) into each request's pooling; the ids
        and vectors of the requests whose prompt the step completes."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        done = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids)]
        if self.mode == "last":
            if not done:
                return [], []
            rows = hidden[torch.tensor([starts[i + 1] - 1 for i in done], device=hidden.device)].float()
        elif self.mode == "cls":
            for i, s in enumerate(states):
                if seq_lens[i] == query_lens[i]:  # the chunk starts at position 0
                    s.pooled, s.num_pooled = hidden[starts[i]].float().clone(), 1
            rows = self._finished(states, done, "the first position")
        else:
            segment = torch.repeat_interleave(torch.arange(len(states), device=hidden.device),
                                              torch.tensor(query_lens, device=hidden.device))
            sums = torch.zeros(len(states), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, segment, hidden[: starts[-1]].float())
            for i, s in enumerate(states):
                if seq_lens[i] == query_lens[i]:
                    s.pooled, s.num_pooled = sums[i], 0
                elif s.pooled is None or s.num_pooled != seq_lens[i] - query_lens[i]:
                    raise ValueError(f"request {s.req_id}: a mean pooling chunk at position "
                                     f"{seq_lens[i] - query_lens[i]} after {s.num_pooled} pooled positions")
                else:
                    s.pooled = s.pooled + sums[i]
                s.num_pooled = seq_lens[i]
            rows = self._finished(states, done, "every position")
            if done:
                rows = rows / torch.tensor([[seq_lens[i]] for i in done], dtype=torch.float32, device=rows.device)
        if not done:
            return [], []
        if self.head is not None:
            rows = rows @ self.head.T
        vectors = rows.cpu().numpy().astype("<f4", copy=False)
        return [states[i].req_id for i in done], [v.tobytes() for v in vectors]

    @staticmethod
    def _finished(states: list[PoolingRequest], done: list[int], what: str) -> torch.Tensor:
        rows = []
        for i in done:
            pooled = states[i].pooled
            if pooled is None:
                raise ValueError(f"request {states[i].req_id}: its prompt completed without {what} computed")
            rows.append(pooled)
        return torch.stack(rows) if rows else torch.empty(0)
