"""transformers references for the sampling surface: full forward passes in float32, one
token at a time (no KV cache, nothing shared with noria's code), and the masks written
out from vLLM's definitions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Edit = Callable[[torch.Tensor, list[int]], torch.Tensor]  # (logits [V], outputs so far) -> logits


def forward_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of one unbatched forward pass."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def greedy_with(model: Any, prompt: list[int], max_new: int, edit: Edit) -> list[int]:
    """Greedy decoding where each step's last-position logits go through `edit` first."""
    out: list[int] = []
    for _ in range(max_new):
        logits = edit(forward_logits(model, prompt + out)[-1].clone(), out)
        out.append(int(logits.argmax()))
    return out


def bias_edit(bias: dict[int, float]) -> Edit:
    def edit(logits: torch.Tensor, _out: list[int]) -> torch.Tensor:
        for t, v in bias.items():
            logits[t] += v
        return logits
    return edit


def allowed_edit(allowed: list[int]) -> Edit:
    def edit(logits: torch.Tensor, _out: list[int]) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = logits[allowed]
        return keep
    return edit


def banned_by_bad_words(words: list[list[int]], outputs: list[int]) -> set[int]:
    """vLLM: a word's last token is banned when the outputs end with the rest of the word."""
    banned = set()
    for w in words:
        *prefix, last = w
        if not prefix or (len(outputs) >= len(prefix) and outputs[len(outputs) - len(prefix):] == prefix):
            banned.add(last)
    return banned


def bad_words_edit(words: list[list[int]]) -> Edit:
    def edit(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for t in banned_by_bad_words(words, out):
            logits[t] = float("-inf")
        return logits
    return edit


def prompt_logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is log_softmax at position i, which scores prompt token i + 1."""
    return torch.log_softmax(forward_logits(model, prompt)[:-1], dim=-1)


def check_prompt_logprobs(got: list[Any] | None, prompt: list[int], ref: torch.Tensor, k: int, atol: float) -> None:
    """`got` (noria's Logprob entries) against the reference: the first entry None, each
    prompt token's logprob, and top-k ids whose reference values are the k largest."""
    assert got is not None and len(got) == len(prompt), "one entry per prompt token"
    assert got[0] is None
    for i, entry in enumerate(got[1:]):
        row = ref[i]
        assert entry.token_id == prompt[i + 1]
        assert abs(entry.logprob - float(row[prompt[i + 1]])) <= atol, f"position {i + 1}"
        assert len(entry.top_token_ids) == len(entry.top_logprobs) == k
        if k:
            ref_top = row.topk(k).values
            got_ref = row[entry.top_token_ids]
            # The same k values (ties within tolerance may order ids differently).
            assert torch.allclose(got_ref, ref_top, atol=atol), f"position {i + 1} top-{k}"
            assert torch.allclose(torch.tensor(entry.top_logprobs), ref_top, atol=atol)
