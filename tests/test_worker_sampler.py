"""The sampler against independent float64 references of vLLM's semantics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from noria.protocol.config import EngineConfig
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import NewRequestData, StepPlan
from noria.worker.model_runner import ModelRunner
from noria.worker.sampler import Sampler, SamplingState, apply_penalties
from tests.tiny_models import make_checkpoint

CPU = torch.device("cpu")
V = 48


def _state(params: EngineSamplingParams, tokens: list[int] | None = None, num_prompt: int | None = None,
           eos: list[int] | None = None) -> SamplingState:
    tokens = tokens if tokens is not None else [1, 2, 3]
    return SamplingState(params, tokens, len(tokens) if num_prompt is None else num_prompt,
                         eos or [], V, CPU)


def _logits(step: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(rows, V, generator=g) * 2).float()


# -- seeds ----------------------------------------------------------------------


def _run_seeded(batch_builder: Callable[[], list[SamplingState]], steps: int = 25) -> list[int]:
    sampler = Sampler(V, CPU, seed=123)
    target = _state(EngineSamplingParams(temperature=0.9, top_p=0.95, seed=4242))
    others = batch_builder()
    out = []
    row = len(others[:2])
    for step in range(steps):
        states = [*others[:2], target, *others[2:]]
        logits = torch.cat([_logits(step + 50 * i) for i in range(len(states))])
        logits[row] = _logits(step)[0]  # the target always sees the same logits
        tokens, _ = sampler.sample(logits, states)
        out.append(tokens[row])
    return out


def test_seeded_request_is_reproducible_in_any_batch() -> None:
    alone = _run_seeded(lambda: [])
    noisy = _run_seeded(lambda: [_state(EngineSamplingParams(temperature=1.0)),
                                 _state(EngineSamplingParams(temperature=0.0)),
                                 _state(EngineSamplingParams(temperature=0.5, seed=7, top_k=5))])
    two = _run_seeded(lambda: [_state(EngineSamplingParams(temperature=1.0, seed=4242)),
                               _state(EngineSamplingParams(temperature=1.3, min_p=0.2))])
    assert alone == noisy == two
    assert len(set(alone)) > 3  # it really sampled


def test_seed_changes_output_and_resumes_where_it_left_off() -> None:
    def run(seed: int, tokens: list[int], num_prompt: int, steps: range) -> list[int]:
        sampler = Sampler(V, CPU)
        state = _state(EngineSamplingParams(temperature=1.0, seed=seed), tokens, num_prompt)
        return [sampler.sample(_logits(s), [state])[0][0] for s in steps]

    full = run(9, [5, 6], 2, range(12))
    assert full != run(10, [5, 6], 2, range(12))
    # Rebuilt after a preemption with 4 outputs known: continues the same sequence.
    assert run(9, [5, 6, *full[:4]], 2, range(4, 12)) == full[4:]


def test_seeded_request_reproduces_through_model_runner(tmp_path: Path) -> None:
    path = make_checkpoint("llama", tmp_path / "llama", seed=2)
    seeded = EngineSamplingParams(temperature=1.0, seed=77, top_k=50)

    def generate(params: list[EngineSamplingParams], extra: list[NewRequestData], target_params: int = 0,
                 sample_index: int = 0) -> list[int]:
        runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=32, swap_space=0, num_threads=2))
        target = NewRequestData(0, list(range(10, 40)), [0, 1, 2], 0, target_params, 30, [], sample_index)
        news = [*extra, target]
        out = []
        res = runner.execute(StepPlan(0, [(r.req_id, len(r.token_ids)) for r in news], new_requests=news,
                                      params=params))
        out.append(res.token_ids[res.req_ids.index(0)])
        for step in range(1, 10):
            res = runner.execute(StepPlan(step, [(r.req_id, 1) for r in news]))
            out.append(res.token_ids[res.req_ids.index(0)])
        return out

    alone = generate([seeded], [])
    crowd = generate([EngineSamplingParams(temperature=1.0), seeded, EngineSamplingParams(temperature=0.7, seed=77)], [
        NewRequestData(1, list(range(100, 150)), [3, 4, 5, 6], 0, 0, 50),
        NewRequestData(2, [7, 8, 9], [7], 0, 2, 3),
    ], target_params=1)
    assert alone == crowd
    # Samples share one params entry: sample 3 of a request seeded 77 draws what a request
    # seeded 80 draws (vLLM's seed + index), whatever sample 0 beside it draws.
    third = generate([seeded], [NewRequestData(1, list(range(10, 40)), [3, 4, 5], 0, 0, 30)], sample_index=3)
    assert third == generate([msgspec.structs.replace(seeded, seed=80)], [])
    assert third != alone


# -- truncation -------------------------------------------------------------------


def _reference_probs(logits: torch.Tensor, p: EngineSamplingParams) -> torch.Tensor:
    """float64 reference: temperature -> min_p -> top_k -> top_p -> renormalize."""
    x = logits.double() / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = torch.where(probs >= p.min_p * probs.max(), x, float("-inf"))
    order = x.argsort(descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k > 0:
        keep[order[p.top_k:]] = False
    x = torch.where(keep, x, float("-inf"))
    if p.top_p < 1:
        probs = x.softmax(-1)
        mass_before = 0.0
        for t in order.tolist():
            if mass_before >= p.top_p:
                keep[t] = False
            mass_before += probs[t].item()
    return torch.where(keep, x, float("-inf")).softmax(-1)


@pytest.mark.parametrize("params", [
    EngineSamplingParams(temperature=1.0, top_k=5),
    EngineSamplingParams(temperature=1.0, top_p=0.6),
    EngineSamplingParams(temperature=1.0, min_p=0.15),
    EngineSamplingParams(temperature=0.7, top_k=12, top_p=0.85, min_p=0.02),
    EngineSamplingParams(temperature=1.5),
    EngineSamplingParams(temperature=1.0, top_k=1),
], ids=["top_k", "top_p", "min_p", "all", "temperature", "top_k=1"])
def test_truncation_never_emits_excluded_tokens(params: EngineSamplingParams) -> None:
    logits = _logits(7)[0]
    expected = _reference_probs(logits, params)
    draws = 20_000
    sampler = Sampler(V, CPU, seed=1)
    states = [_state(params) for _ in range(draws)]
    tokens, _ = sampler.sample(logits.expand(draws, V).clone(), states)
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double() / draws
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, f"excluded tokens drawn: {torch.nonzero(counts * ~allowed).flatten()}"
    # ... and the allowed ones in proportion (5 sigma of a binomial at p=0.5).
    assert (counts - expected).abs().max() < 5 * (0.25 / draws) ** 0.5
    assert bool((counts[expected > 0.01] > 0).all())


def test_mixed_batch_keeps_per_row_settings() -> None:
    logits = _logits(3, rows=1).expand(4, V).clone()
    p_topk = EngineSamplingParams(temperature=1.0, top_k=2)
    p_free = EngineSamplingParams(temperature=1.0)
    sampler = Sampler(V, CPU, seed=5)
    top2 = set(logits[0].topk(2).indices.tolist())
    seen_free: set[int] = set()
    for _ in range(200):
        states = [_state(p_topk), _state(EngineSamplingParams(temperature=0.0)), _state(p_free), _state(p_topk)]
        tokens, _ = sampler.sample(logits.clone(), states)
        assert tokens[0] in top2 and tokens[3] in top2
        assert tokens[1] == int(logits[0].argmax())
        seen_free.add(tokens[2])
    assert len(seen_free) > 2


# -- logprobs ------------------------------------------------------------------------


def test_logprobs_match_float64_log_softmax() -> None:
    logits = _logits(11, rows=4)
    params = [EngineSamplingParams(temperature=0.0, logprobs=0), EngineSamplingParams(temperature=0.0),
              EngineSamplingParams(temperature=0.5, logprobs=5, repetition_penalty=1.5),
              EngineSamplingParams(temperature=1.0, logprobs=20, top_k=3)]
    states = [_state(p) for p in params]
    tokens, logprobs = Sampler(V, CPU).sample(logits.clone(), states)
    assert logprobs is not None and logprobs[1] is None
    reference = torch.log_softmax(logits.double(), dim=-1)  # raw: before temperature and penalties
    for i, p in enumerate(params):
        lp = logprobs[i]
        if p.logprobs is None:
            continue
        assert lp is not None
        assert lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(reference[i, tokens[i]].item(), abs=1e-5)
        k = p.logprobs
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == k
        assert lp.top_token_ids == reference[i].topk(k).indices.tolist()
        assert lp.top_logprobs == pytest.approx(reference[i].topk(k).values.tolist(), abs=1e-5)


def test_logprobs_are_raw_whatever_edits_the_logits() -> None:
    """vLLM's default logprobs mode ("raw_logprobs"): allowed ids, bad words, logit bias,
    penalties, the min_tokens ban and temperature change what is drawn, never the logprobs,
    the sampled token's included (here one the edits forced, with a low raw logprob)."""
    logits = _logits(12, rows=1)
    reference = torch.log_softmax(logits.double(), dim=-1)[0]
    forced = int(reference.argmin())  # the model's least likely token: only the edits pick it
    edits = EngineSamplingParams(temperature=0.0, logprobs=4, allowed_token_ids=[forced, 2], logit_bias={forced: 50.0},
                                 bad_words_token_ids=[[2]], presence_penalty=1.5, frequency_penalty=0.5,
                                 repetition_penalty=1.7, min_tokens=3)
    state = _state(edits, tokens=[1, 2, 3, forced, 2], num_prompt=3, eos=[int(reference.argmax())])
    tokens, logprobs = Sampler(V, CPU).sample(logits.clone(), [state])
    assert tokens == [forced] and logprobs is not None and logprobs[0] is not None
    lp = logprobs[0]
    assert lp.logprob == pytest.approx(reference[forced].item(), abs=1e-5)
    assert lp.top_token_ids == reference.topk(4).indices.tolist()
    assert lp.top_logprobs == pytest.approx(reference.topk(4).values.tolist(), abs=1e-5)


def test_no_logprobs_field_when_nobody_asks() -> None:
    _, logprobs = Sampler(V, CPU).sample(_logits(0, rows=2), [_state(EngineSamplingParams()) for _ in range(2)])
    assert logprobs is None


# -- penalties -------------------------------------------------------------------------


def test_penalties_follow_vllm_formulas() -> None:
    prompt = [1, 4, 4, 9]
    outputs = [9, 9, 20, 4, 33, 33, 33]
    params = [
        EngineSamplingParams(repetition_penalty=1.7),
        EngineSamplingParams(frequency_penalty=0.6),
        EngineSamplingParams(presence_penalty=-0.8),
        EngineSamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1),
    ]
    states = [_state(p, prompt + outputs, len(prompt)) for p in params]
    logits = _logits(5, rows=len(params))
    got = apply_penalties(logits.clone(), states)

    expected = logits.double().clone()
    counts = {t: outputs.count(t) for t in set(outputs)}
    for i, p in enumerate(params):
        for t in range(V):
            x = expected[i, t].item()
            if t in prompt or t in counts:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * counts.get(t, 0)
            x -= p.presence_penalty * (1.0 if t in counts else 0.0)
            expected[i, t] = x
    assert torch.allclose(got.double(), expected, atol=1e-6)


def test_penalty_steers_greedy_and_counts_new_outputs() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 3.0, 2.0
    state = _state(EngineSamplingParams(temperature=0.0, frequency_penalty=0.7), [1, 2], 2)
    sampler = Sampler(V, CPU)
    # 5 wins until its own outputs have cost it more than the 1.0 gap.
    assert [sampler.sample(logits.clone(), [state])[0][0] for _ in range(3)] == [5, 5, 6]


# -- min_tokens -------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, V)
    logits[0, 2], logits[0, 7], logits[0, 30] = 9.0, 8.0, 1.0  # EOS, stop token, filler
    sampler = Sampler(V, CPU)
    state = _state(EngineSamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]), eos=[2])
    assert [sampler.sample(logits.clone(), [state])[0][0] for _ in range(5)] == [30, 30, 30, 2, 2]
    state = _state(EngineSamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7], ignore_eos=True), eos=[2])
    assert sampler.sample(logits.clone(), [state])[0][0] == 2  # ignore_eos: EOS is not a stop token
    sampled = _state(EngineSamplingParams(temperature=1.0, min_tokens=50, stop_token_ids=[7], seed=1), eos=[2])
    assert all(sampler.sample(logits.clone() * 3, [sampled])[0][0] not in (2, 7) for _ in range(50))
