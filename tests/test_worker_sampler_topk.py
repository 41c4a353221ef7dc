"""top-k / top-p over torch.topk's k largest against the full-sort path it shortcuts: the same
kept logits, and the same greedy and seeded tokens from Sampler.sample."""

from __future__ import annotations

import pytest
import torch

from noria.protocol.sampling import EngineSamplingParams
from noria.worker import sampler as sampler_module
from noria.worker.sampler import Sampler, SamplingState

CPU = torch.device("cpu")
V = 300


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def _full_sort_reference(logits: torch.Tensor, params: list[EngineSamplingParams]) -> torch.Tensor:
    """Independent: per row, sort everything, keep the top_k ranks, then the shortest prefix
    whose probability mass reaches top_p (a token goes when the mass before it already does)."""
    out = torch.full_like(logits, float("-inf"))
    for i, p in enumerate(params):
        values, order = logits[i].double().sort(descending=True)
        keep = len(values) if p.top_k <= 0 else min(p.top_k, len(values))
        probs = values[:keep].softmax(-1)
        before = probs.cumsum(-1) - probs
        if p.top_p < 1.0:
            keep = int((before < p.top_p).sum())
        out[i, order[:keep]] = logits[i, order[:keep]]
    return out


PARAM_SETS = {
    "top_k": [EngineSamplingParams(temperature=1.0, top_k=k) for k in (1, 5, 40, 299)],
    "top_k_top_p": [EngineSamplingParams(temperature=1.0, top_k=k, top_p=p)
                    for k, p in ((3, 0.5), (50, 0.9), (7, 1.0), (200, 0.3))],
    "mixed_no_top_k": [EngineSamplingParams(temperature=1.0, top_k=10),
                       EngineSamplingParams(temperature=1.0, top_p=0.8)],
}


@pytest.mark.parametrize("name", list(PARAM_SETS))
def test_masks_match_full_sort(name: str) -> None:
    params = PARAM_SETS[name]
    sampler = Sampler(V, CPU)
    use_top_k = any(0 < p.top_k < V for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    for seed in range(5):
        logits = _logits(len(params), seed)
        got = sampler._top_k_top_p(logits.clone(), params, use_top_k, use_top_p)
        assert torch.equal(got, _full_sort_reference(logits, params))


def test_small_k_skips_the_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_sort = torch.Tensor.sort

    def counting_sort(self: torch.Tensor, *a: object, **kw: object) -> object:
        calls.append(self.shape)
        return real_sort(self, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    params = PARAM_SETS["top_k_top_p"]
    Sampler(V, CPU)._top_k_top_p(_logits(len(params), 0), params, True, True)
    assert calls == []


def _sample_run(params: list[EngineSamplingParams], steps: int) -> list[list[int]]:
    sampler = Sampler(V, CPU, seed=5)
    states = [SamplingState(p, [1, 2, 3], 3, [], V, CPU) for p in params]
    return [sampler.sample(_logits(len(params), 100 + step), states)[0] for step in range(steps)]


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_tokens_match_full_sort(seeded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    params = [EngineSamplingParams(temperature=t, top_k=k, top_p=p, seed=(11 + i if seeded else None))
              for i, (t, k, p) in enumerate(((0.7, 5, 1.0), (1.3, 40, 0.9), (0.0, 3, 1.0), (1.0, 100, 0.5)))]
    fast = _sample_run(params, 20)
    monkeypatch.setattr(sampler_module, "TOPK_SMALL", 0)  # every step through the full sort
    assert fast == _sample_run(params, 20)
