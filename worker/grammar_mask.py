"""Applies a step's structured-output bitmask (protocol/step.py: GrammarBitmask) to the logits.

The mask is applied before sampling, as vLLM V1 does: every sampling feature
(penalties, temperature, min-p, top-k, top-p, seeds) then works on the allowed
tokens only, and logprobs are those of the constrained distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from noria.protocol.step import GrammarBitmask

_BITS: dict[torch.device, torch.Tensor] = {}


def forbidden_tokens(mask: GrammarBitmask, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] bool, True where the token is not allowed."""
    if device.type == "cpu":
        return _unpack_numpy(mask.data, len(mask.req_ids), vocab)
    return _unpack_torch(mask.data, len(mask.req_ids), vocab, device)


def _unpack_numpy(data: bytes, n: int, vocab: int) -> torch.Tensor:
    # Little-endian words: bit t of a row is bit t % 8 of its byte t // 8. numpy unpacks
    # the inverted bytes in one pass, straight into the bool mask.
    packed = np.bitwise_not(np.frombuffer(data, dtype=np.uint8).reshape(n, -1))
    if packed.shape[1] * 8 < vocab:
        raise ValueError(f"grammar bitmask has {packed.shape[1] * 8} bits per row for {vocab} logits")
    return torch.from_numpy(np.unpackbits(packed, axis=1, count=vocab, bitorder="little")).view(torch.bool)


def _unpack_torch(data: bytes, n: int, vocab: int, device: torch.device) -> torch.Tensor:
    # On an accelerator: move the packed words (32x smaller) and unpack them there.
    words = torch.frombuffer(bytearray(data), dtype=torch.int32).view(n, -1).to(device, non_blocking=True)
    if words.shape[1] * 32 < vocab:
        raise ValueError(f"grammar bitmask has {words.shape[1] * 32} bits per row for {vocab} logits")
    shifts = _BITS.get(device)
    if shifts is None:
        shifts = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return ((words[:, :, None] >> shifts) & 1).view(n, -1)[:, :vocab] == 0


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask, row_req_ids: list[int]) -> None:
    """Set the logits of forbidden tokens to -inf, in place. `row_req_ids[i]` is the request
    of logits row i; every request of `mask` must have a row (or the plan is wrong)."""
    if not mask.req_ids:
        return
    # A drafted request samples several rows (worker/spec_decode.py): its mask rows go to them in order.
    rows_of: dict[int, list[int]] = {}
    for i, rid in enumerate(row_req_ids):
        rows_of.setdefault(rid, []).append(i)
    rows = []
    for rid in mask.req_ids:
        free = rows_of.get(rid)
        if not free:
            raise ValueError(f"grammar bitmask for request {rid}, which samples no token this step" if free is None
                             else f"more grammar bitmask rows for request {rid} than it samples this step")
        rows.append(free.pop(0))
    forbidden = forbidden_tokens(mask, logits.shape[1], logits.device)
    if rows == list(range(logits.shape[0])):  # every row constrained, in order: no gather
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill_(forbidden, float("-inf"))
