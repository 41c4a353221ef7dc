"""Async scheduling (`async_scheduling=True`): step N+1 is planned while the worker runs step N.

The scheduler-level state machine (tests/test_scheduler_state_machine.py) draws it on and off
against a brute-force model; here: a request id used again while the old request's token is
on its way, and the whole engine, whose outputs must be the same with and without it, token
for token, across a mix of greedy and seeded sampling, n > 1, stop strings and stop tokens,
max_tokens and min_tokens, logprobs, prompt logprobs, structured output, and preemption by
recompute and by swap; every request ends exactly once and every block is free afterwards.
"""

from __future__ import annotations

import random

import pytest

from noria import LLM, SamplingParams, StructuredOutput
from noria.bench.fake_worker import FakeWorker, next_token
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.sampling import EngineSamplingParams
from noria.scheduler.scheduler import Scheduler

EOS = 99


def test_a_reused_id_gets_no_token_of_the_ended_request():
    s = Scheduler(EngineConfig(block_size=4), 32, 1000)
    w = FakeWorker(32, 4, vocab=100)
    w.forced[7] = [EOS, 5]  # request 7 stops on its first token; step 2 was planned before it was known
    s.add_request(EngineRequest(7, [1, 2, 3], EngineSamplingParams(max_tokens=10), [EOS]))
    r1 = w.execute(s.schedule())
    r2 = w.execute(s.schedule())  # planned ahead: request 7 decodes the token on its way
    assert r2.req_ids == [7] and s.requests[7].num_in_flight == 2
    s.update_from_result(r1)
    (done,) = s.take_updates()
    assert (done.new_token_ids, done.finish_reason) == ([EOS], "stop")
    s.add_request(EngineRequest(7, [4, 5, 6, 7, 8], EngineSamplingParams(max_tokens=3), [EOS]))  # the id again
    s.update_from_result(r2)  # the ended request's token: not the new one's
    assert s.take_updates() == [] and s.stats.tokens_discarded == 1
    out: list[int] = []
    pending = None
    while s.has_work() or pending is not None:
        result = w.execute(s.schedule()) if s.has_work() else None
        result, pending = pending, result
        if result is not None:
            s.update_from_result(result)
        for u in s.take_updates():
            out += u.new_token_ids
    tokens = [4, 5, 6, 7, 8]
    for t in out:
        assert t == next_token(tokens, 100)
        tokens.append(t)
    assert len(out) == 3 and s.check_blocks() is None and s.kv.num_free_blocks == 32


def _mix(llm_outputs: list[list[int]] | None = None) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    system = [rng.randrange(5, 700) for _ in range(40)]
    prompts = [system + [rng.randrange(5, 700) for _ in range(rng.randint(1, 30))] for _ in range(9)]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    params = [
        SamplingParams(max_tokens=24, **greedy),
        SamplingParams(max_tokens=1, **greedy),
        SamplingParams(max_tokens=17, min_tokens=5, **greedy),
        SamplingParams(max_tokens=20, n=3, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, prompt_logprobs=1, **greedy),
        SamplingParams(max_tokens=16, structured_output=StructuredOutput(choice=["yes", "no way", "maybe"]), **greedy),
        SamplingParams(max_tokens=30, **greedy),  # a stop string from its greedy text (below)
        SamplingParams(max_tokens=30, **greedy),  # a stop token from its greedy ids (below)
    ]
    if llm_outputs is not None:
        text_ids, stop_ids = llm_outputs
        params[7] = SamplingParams(max_tokens=30, stop=[text_ids], **greedy)  # type: ignore[list-item]
        params[8] = SamplingParams(max_tokens=30, stop_token_ids=[stop_ids[9]], **greedy)  # type: ignore[index]
    return prompts, params


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, list[float]]:
    """Per prompt, its samples' (index, ids, text, finish reason); and every logprob in order
    (compared within float noise: a step's batch differs with async scheduling)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    samples = [[(c.index, c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    values: list[float] = []
    for o in outs:
        lps = [lp for c in o.outputs for lp in c.logprobs or []] + [lp for lp in o.prompt_logprobs or [] if lp]
        for lp in lps:
            values += [lp.token_id, lp.logprob, *lp.top_token_ids, *lp.top_logprobs]
    return samples, values


@pytest.mark.parametrize(
    "flags",
    [{}, {"num_kv_blocks": 14, "preemption_mode": "recompute"},
     {"num_kv_blocks": 14, "preemption_mode": "swap", "swap_space": 0.01}],
    ids=["default", "recompute", "swap"],
)
def test_outputs_are_identical_with_and_without_async_scheduling(demo_path, flags):
    # Whether a stop lands while the next step is planned, and whether a request is preempted,
    # depends on how the requests' arrivals interleave with the steps: every run must give the
    # same outputs, and the paths in question must be taken in one of a few runs.
    for _ in range(3):
        stats = _same_outputs(flags)
        exercised = stats[True].tokens_discarded > 0  # the stops left wasted slots behind
        if "preemption_mode" in flags:
            exercised &= all(st.num_preemptions > 0 for st in stats.values())
        if flags.get("preemption_mode") == "swap":
            exercised &= all(st.num_swap_outs > 0 for st in stats.values())
        if exercised:
            return
    raise AssertionError(f"three runs never preempted / discarded as the flags ask: {stats}")


def _same_outputs(flags: dict) -> dict:
    results, stats = {}, {}
    for ahead in (False, True):
        with LLM("demo", async_scheduling=ahead, **flags) as llm:
            prompts, params = _mix()
            if not ahead:  # stop conditions that really end generation early, taken from the greedy text
                first = llm.generate(prompts[7:9], params[7:9], use_tqdm=False)
                text = first[0].outputs[0].text
                stop_text = text[len(text) // 2: len(text) // 2 + 3]
                stop_at = first[1].outputs[0].token_ids
                mix = _mix([stop_text, stop_at])  # type: ignore[list-item]
            results[ahead] = _run(llm, *mix)
            stats[ahead] = llm.stats()
    assert results[True][0] == results[False][0]
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-4)
    assert len(results[False][1]) > 20 * 3 + 40  # the logprobs and prompt logprobs are there
    plain = results[False][0]
    assert plain[7][0][3] == "stop" and len(plain[7][0][1]) < 30  # the stop string ended it
    assert plain[8][0][3] == "stop" and len(plain[8][0][1]) <= 10  # the stop token ended it
    assert [len(r) for r in plain] == [1, 1, 1, 3, 1, 1, 1, 1, 1]
    assert all(c[3] in ("stop", "length") for r in plain for c in r)  # every sample ended
    for ahead, st in stats.items():
        assert st.blocks_consistent and st.num_free_blocks == st.num_kv_blocks and st.num_running == 0
        assert (st.steps_planned_ahead > 0) == ahead, st
    return stats
