"""Applies a step's structured-output bitmask (protocol/step.py: GrammarBitmask) to the logits.

The mask is applied before sampling, as vLLM V1 does: every sampling feature
(penalties, temperature, min-p, top-k, top-p, seeds) then works on the allowed
tokens only, and logprobs are those of the constrained distribution.
"""

from __future__ import annotations

import torch

from noria.protocol.step import GrammarBitmask

_BITS: dict[torch.device, torch.Tensor] = {}


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask, row_req_ids: list[int]) -> None:
    """Set the logits of forbidden tokens to -inf, in place. `row_req_ids[i]` is the request
    of logits row i; every request of `mask` must have a row (or the plan is wrong)."""
    if not mask.req_ids:
        return
    row_of = {rid: i for i, rid in enumerate(row_req_ids)}
    try:
        rows = [row_of[rid] for rid in mask.req_ids]
    except KeyError as e:
        raise ValueError(f"grammar bitmask for request {e.args[0]}, which samples no token this step") from None
    n, vocab = len(rows), logits.shape[1]
    words = torch.frombuffer(bytearray(mask.data), dtype=torch.int32).view(n, -1).to(logits.device)
    if words.shape[1] * 32 < vocab:
        raise ValueError(f"grammar bitmask has {words.shape[1] * 32} bits per row for {vocab} logits")
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> bits) & 1).view(n, -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
