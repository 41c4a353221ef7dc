"""Speculative decoding's parts on their own: `--speculative-config` as vLLM spells it, the n-gram
proposer against a brute-force lookup, and the worker's verification against the plain sampler:
the distribution of what it keeps by a chi-square test against the target's exact probabilities,
a seeded request's tokens equal to sampling position by position, and penalties / min_tokens /
bad words at a draft position equal to a request that had generated the draft; and the switch
that drafts only where drafting has delivered more tokens per second.

The scheduler's block accounting and rollback under speculation is in the state machine
(tests/test_scheduler_state_machine.py); the whole engine in tests/test_spec_decode.py.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from noria.frontend.startup import make_config
from noria.protocol.errors import ParamError
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.speculative import Draft, SpeculativeConfig, parse_speculative_config
from noria.protocol.step import StepPlan
from noria.scheduler.ngram import NgramIndex
from noria.scheduler.spec_governor import EXPLORE, HOPELESS, TRUSTED, DraftSwitch, size_class
from noria.worker.sampler import Sampler, SamplingState
from noria.worker.spec_decode import DraftRowState, take_drafts, verify
from noria.worker.step_inputs import RequestState

CPU = torch.device("cpu")

# -- configuration ---------------------------------------------------------------------


def test_config_takes_vllms_keys_and_defaults() -> None:
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}') == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 5}
    one_end = parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (one_end["method"], one_end["prompt_lookup_min"], one_end["prompt_lookup_max"]) == ("ngram", 4, 4)
    old = parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                    "enforce_eager": True, "draft_tensor_parallel_size": 1})
    assert (old["method"], old["model"], old["prompt_lookup_max"]) == ("ngram", None, 2)
    config = make_config("demo", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                                     "disable_by_batch_size": 8})
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1,
                                                          prompt_lookup_max=3, disable_by_batch_size=8)
    # A model alone means a draft model, as in vLLM; its context is vLLM's max_model_len key.
    draft = parse_speculative_config({"model": "/ckpt/draft", "num_speculative_tokens": 3, "max_model_len": 512})
    assert (draft["method"], draft["model"], draft["max_model_len"]) == ("draft_model", "/ckpt/draft", 512)
    described = SpeculativeConfig(method="draft_model", model="/d", num_speculative_tokens=3).describe()
    assert described == "speculative decoding: draft_model, 3 tokens, draft model /d"
    described = SpeculativeConfig(method="eagle3", model="/h", num_speculative_tokens=3).describe()
    assert described == "speculative decoding: eagle3, 3 tokens, EAGLE-3 head /h"
    # mtp names no model: the served one's own layer (startup fills its folder in).
    assert parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2})["method"] == "mtp"
    described = SpeculativeConfig(method="mtp", model="/m", num_speculative_tokens=2).describe()
    assert described == "speculative decoding: mtp, 2 tokens, the MTP layer of /m"


@pytest.mark.parametrize(("value", "says"), [
    ("{", "is not JSON"),
    ("[1]", "JSON object"),
    ({"method": "mtp"}, "needs num_speculative_tokens"),
    ({"method": "eagle", "model": "/h", "num_speculative_tokens": 2}, "EAGLE-1 heads are not read"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "has no key 'lookahead'"),
    ({"num_speculative_tokens": 0}, ">= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "is above"),
])
def test_config_refusals_are_one_sentence(value, says) -> None:
    with pytest.raises(ValueError, match=says):
        parse_speculative_config(value)
    if isinstance(value, dict):
        with pytest.raises(ParamError, match=says):
            make_config("demo", speculative_config=value)


# -- the n-gram proposer ---------------------------------------------------------------


def _brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix n-gram, continued periodically."""
    n_tokens = len(tokens)
    for n in range(min(hi, n_tokens - 1), lo - 1, -1):
        suffix = tokens[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                seq = list(tokens)
                after = start + n
                while len(seq) < n_tokens + k:
                    seq.append(seq[after + len(seq) - n_tokens])
                return seq[n_tokens:n_tokens + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), cuts=st.lists(st.integers(1, 8), max_size=12),
       lo=st.integers(1, 3), extra=st.integers(0, 2), k=st.integers(1, 6))
def test_ngram_index_equals_a_brute_force_lookup(tokens, cuts, lo, extra, k) -> None:
    """Looked up as the sequence grows (the index extended, not rebuilt), at every length."""
    index = NgramIndex(lo, lo + extra)
    end = 1
    for cut in [*cuts, len(tokens)]:
        end = min(len(tokens), end + cut)
        seq = tokens[:end]
        assert index.propose(seq, k) == _brute_force(seq, k, lo, lo + extra), seq


def test_ngram_examples() -> None:
    assert NgramIndex(1, 3).propose([5, 5, 5], 4) == [5, 5, 5, 5]
    assert NgramIndex(1, 3).propose([1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 3) == []
    assert NgramIndex(2, 2).propose([7, 1, 2, 9, 3, 1, 2], 2) == [9, 3]  # the bigram (1, 2), not (2,)


# -- verification -----------------------------------------------------------------------


def _request(req_id: int, params: EngineSamplingParams, tokens: list[int], vocab: int, prompt: int = 2
             ) -> RequestState:
    sampling = SamplingState(params, tokens, prompt, [], vocab, CPU)
    return RequestState(req_id=req_id, token_ids=list(tokens), num_computed_tokens=len(tokens) - 1, row=0,
                        sampling=sampling, num_prompt_tokens=prompt)


def _verify(sampler: Sampler, requests: list[RequestState], drafts: dict[int, list[int]],
            logits: torch.Tensor):
    plan = StepPlan(1, [(r.req_id, 1 + len(drafts.get(r.req_id, []))) for r in requests],
                    drafts=[Draft(rid, d) for rid, d in drafts.items()])
    drafted = take_drafts(plan, {r.req_id: r for r in requests}, logits.shape[1])

    def sample_rows(rows_logits, states):
        return sampler.sample(rows_logits, states, record=False)

    return verify(plan, logits, requests, drafted, sample_rows)


def _target_probs(logits: torch.Tensor, p: EngineSamplingParams) -> torch.Tensor:
    """float64: temperature, then top-k, renormalized."""
    x = logits.double() / p.temperature
    if p.top_k:
        x = torch.where(x >= x.topk(p.top_k).values[-1], x, float("-inf"))
    return x.softmax(-1)


@pytest.mark.parametrize("params", [EngineSamplingParams(temperature=1.0),
                                    EngineSamplingParams(temperature=0.7, top_k=4)], ids=["plain", "top_k"])
def test_kept_tokens_follow_the_targets_distribution(params) -> None:
    """Each of 30,000 requests verifies the draft (d1, d2) over fixed logits; the sequence each
    keeps is (t0) with t0 != d1, (d1, t1) with t1 != d2, or (d1, d2, t2): its frequencies
    against the probabilities the target gives it, by a chi-square test."""
    vocab, draws = 6, 30_000
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(3, vocab, generator=g) * 1.5
    p = [_target_probs(rows[j], params) for j in range(3)]
    d1, d2 = int(p[0].argsort()[-2]), int(p[1].argsort()[-1])  # likely, but not certain, guesses
    requests = [_request(i, params, [1, 2], vocab) for i in range(draws)]
    result = _verify(Sampler(vocab, CPU, seed=9), requests, {i: [d1, d2] for i in range(draws)},
                     rows.repeat(draws, 1))
    kept: dict[int, list[int]] = {}
    for rid, tok in zip(result.req_ids, result.token_ids, strict=True):
        kept.setdefault(rid, []).append(tok)
    observed: dict[tuple[int, ...], int] = {}
    for seq in kept.values():
        observed[tuple(seq)] = observed.get(tuple(seq), 0) + 1
    expected: dict[tuple[int, ...], float] = {}
    for t in range(vocab):
        if t != d1:
            expected[(t,)] = float(p[0][t])
        if t != d2:
            expected[(d1, t)] = float(p[0][d1] * p[1][t])
        expected[(d1, d2, t)] = float(p[0][d1] * p[1][d2] * p[2][t])
    assert set(observed) <= {s for s, e in expected.items() if e > 0}, "a sequence the target never gives"
    cells = [s for s, e in expected.items() if e * draws >= 5]
    chi2 = sum((observed.get(s, 0) - expected[s] * draws) ** 2 / (expected[s] * draws) for s in cells)
    df = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert p_value > 1e-4, f"chi2 {chi2:.1f} on {df} degrees of freedom"
    # The acceptance rate of the first guess is the target's probability of it.
    accepted = sum(1 for seq in kept.values() if len(seq) > 1) / draws
    assert math.isclose(accepted, float(p[0][d1]), abs_tol=5 * (0.25 / draws) ** 0.5)
    # Every request records exactly what it kept.
    assert all(r.sampling.num_outputs == len(kept[r.req_id]) for r in requests)
    assert all(r.token_ids == [1, 2, *kept[r.req_id]] and r.num_computed_tokens == len(r.token_ids) - 1
               for r in requests)


def test_a_seeded_request_keeps_the_tokens_of_sampling_one_at_a_time() -> None:
    """Its noise is drawn from (seed, output index), so the tokens it keeps at each position are
    the ones the plain sampler draws there; logprobs as well."""
    vocab = 12
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(4, vocab, generator=g)
    params = EngineSamplingParams(temperature=0.9, top_p=0.9, seed=11, logprobs=2)
    plain = _request(1, params, [3, 4], vocab)
    one_by_one = [Sampler(vocab, CPU).sample(rows[j:j + 1].clone(), [plain.sampling])  # type: ignore[list-item]
                  for j in range(4)]
    tokens = [t[0][0] for t in one_by_one]
    # A draft that agrees for two positions, then differs.
    draft = [tokens[0], tokens[1], (tokens[2] + 1) % vocab]
    spec = _request(1, params, [3, 4], vocab)
    result = _verify(Sampler(vocab, CPU), [spec], {1: draft}, rows.clone())
    assert result.token_ids == tokens[:3] and result.req_ids == [1, 1, 1]
    assert result.logprobs is not None
    assert [lp.logprob for lp in result.logprobs] == pytest.approx([t[1][0].logprob for t in one_by_one[:3]])


def test_a_draft_positions_state_counts_the_draft_as_output() -> None:
    """Penalties, min_tokens and bad words at draft position j see the first j draft tokens as
    outputs: the row samples as a request that had generated them would."""
    vocab = 10
    params = EngineSamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5,
                                  presence_penalty=0.3, min_tokens=3, bad_words_token_ids=[[4, 5], [6, 7, 8]])
    prompt = [1, 2]
    base = SamplingState(params, prompt, 2, [9], vocab, CPU)
    draft = [6, 7, 4]
    g = torch.Generator().manual_seed(1)
    for j in range(len(draft) + 1):
        logits = torch.randn(1, vocab, generator=g)
        generated = SamplingState(params, prompt + draft[:j], 2, [9], vocab, CPU)
        row = DraftRowState(base, draft[:j])
        want, _ = Sampler(vocab, CPU).sample(logits.clone(), [generated], record=False)
        got, _ = Sampler(vocab, CPU).sample(logits.clone(), [row], record=False)  # type: ignore[list-item]
        assert got == want, j
        assert row.min_tokens_active == generated.min_tokens_active
        assert row.processors is not None and generated.processors is not None
        assert row.processors.banned_now() == generated.processors.banned_now()
    assert base.num_outputs == 0 and base.processors is not None and base.processors.recent == []


def test_plans_the_worker_cannot_verify_are_refused() -> None:
    vocab = 8
    state = _request(1, EngineSamplingParams(temperature=0.0), [1, 2, 3], vocab)
    requests = {1: state}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        take_drafts(StepPlan(1, [(1, 2)], drafts=[Draft(1, [vocab])]), requests, vocab)
    state.num_computed_tokens = 1  # a prefill chunk, not a decode
    with pytest.raises(ValueError, match="only a decode is drafted"):
        take_drafts(StepPlan(1, [(1, 2)], drafts=[Draft(1, [3])]), requests, vocab)


# -- whether a step drafts -------------------------------------------------------------------


def test_size_classes_are_powers_of_two() -> None:
    assert [size_class(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_a_class_drafts_where_drafting_delivered_more_and_explores_the_other() -> None:
    switch = DraftSwitch()
    assert switch.choose(3) is False  # plain steps are measured first
    switch.observe(3, False, 3, 0.010)  # 3 decodes in 10 ms
    assert switch.choose(4) is True  # then a drafted one (3 and 4 decodes: one class)
    switch.observe(4, True, 9, 0.012)  # 750 tokens/s against 4 / 10 ms = 400 plain (3's figure)
    assert switch.gain[4] == pytest.approx(750 / 400)
    for _ in range(TRUSTED - 1):  # one step decides nothing: the class is measured a few times
        assert switch.choose(4) is True
        switch.observe(4, True, 9, 0.012)
    choices = [switch.choose(4) for _ in range(3 * EXPLORE)]
    assert choices.count(False) == 3 and choices[EXPLORE - 2 - TRUSTED] is False  # every EXPLORE-th step of the class
    # Larger batches are their own class: there, drafting costs more than it brings.
    assert switch.choose(32) is False
    switch.observe(32, False, 32, 0.035)
    for _ in range(2):  # the nearest class drafts: so does this one, until it knows
        assert switch.choose(32) is True
        switch.observe(32, True, 40, 0.060)
    assert switch.gain[32] < HOPELESS  # so costly that two steps decide
    assert [switch.choose(32) for _ in range(4 * EXPLORE)].count(True) == 1  # a costly try, seldom
    # A class with no figure of its own takes the nearest one's: 64 does not draft.
    switch.observe(64, False, 64, 0.060)
    assert [switch.choose(64) for _ in range(4 * EXPLORE - 1)].count(True) == 0
    # A figure that changes moves the choice: drafting at 32 becomes cheap.
    for _ in range(30):
        switch.observe(32, True, 60, 0.036)
    assert [switch.choose(32) for _ in range(EXPLORE)].count(True) == EXPLORE - 1


def test_a_class_is_measured_a_few_times_and_a_try_that_measured_nothing_is_retried() -> None:
    switch = DraftSwitch()
    switch.choose(16)
    switch.observe(16, False, 16, 0.010)
    for _ in range(TRUSTED):  # a gain below the margin but not hopeless: measured TRUSTED times
        assert switch.choose(16) is True
        switch.observe(16, True, 15, 0.010)
    assert HOPELESS < switch.gain[16] < 1
    choices = [switch.choose(16) for _ in range(4 * EXPLORE)]
    assert choices.count(True) == 1
    tried = choices.index(True)
    switch = DraftSwitch()  # the same, with the try's step spent catching up
    switch.choose(16)
    switch.observe(16, False, 16, 0.010)
    for _ in range(TRUSTED):
        switch.choose(16)
        switch.observe(16, True, 15, 0.010)
    for i in range(4 * EXPLORE):
        drafts = switch.choose(16)
        assert drafts is (i == tried)
        if drafts:
            assert switch.trying
            switch.retry()
            assert switch.choose(16) is True and switch.trying  # tried again at once


def test_would_draft_foretells_choose_and_skipped_steps_bring_the_tries_round() -> None:
    """With async scheduling the process asks `would_draft` before planning ahead, and a plan
    made ahead counts its step by `skip`: the foretold answer is the next choice's, and a class
    that does not draft still tries every 4 * EXPLORE steps, skipped ones included."""
    switch = DraftSwitch()
    switch.choose(16)
    switch.observe(16, False, 16, 0.010)
    for _ in range(2):
        switch.choose(16)
        switch.observe(16, True, 16, 0.020)  # hopeless: the class does not draft
    answers = []
    for i in range(8 * EXPLORE):
        if switch.would_draft(16):
            answers.append(i)
            assert switch.choose(16) is True  # the try, planned after the result
        else:
            switch.skip(16)  # planned ahead, drafting nothing
    assert len(answers) == 2 and answers[1] - answers[0] == 4 * EXPLORE
    for n in (1, 3, 16, 64):  # nothing changes by asking
        before = (dict(switch.steps), switch._again)
        assert switch.would_draft(n) is switch.would_draft(n)
        assert (dict(switch.steps), switch._again) == before
        assert switch.would_draft(n) is switch.choose(n)
