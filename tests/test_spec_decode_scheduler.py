"""The scheduler's side of speculative decoding against the brute-force worker (bench/fake_worker.py),
whose model here looks at the last token only, so its outputs soon repeat and n-gram drafts are
kept (every step takes as long: drafting pays): who is drafted, how far, and what a draft may
never do (preempt, or reach past max_tokens).
The random interleavings are the state machine's (tests/test_scheduler_state_machine.py)."""

from __future__ import annotations

from noria.bench.fake_worker import FakeWorker, next_token
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.speculative import SpeculativeConfig
from noria.protocol.structured import StructuredOutput
from noria.scheduler.process import carries_nothing
from noria.scheduler.scheduler import Scheduler
from noria.scheduler.spec_governor import EXPLORE, size_class

VOCAB = 6
BS = 4


def _engine(num_blocks: int = 64, **spec) -> tuple[Scheduler, FakeWorker]:
    config = EngineConfig(block_size=BS, speculative_config=SpeculativeConfig(
        num_speculative_tokens=spec.pop("k", 3), prompt_lookup_min=1, prompt_lookup_max=2, **spec))
    return Scheduler(config, num_blocks, 1000), FakeWorker(num_blocks, BS, vocab=VOCAB, window=1)


def _drain(s: Scheduler, w: FakeWorker) -> tuple[dict[int, list[int]], list]:
    out: dict[int, list[int]] = {}
    plans = []
    while s.has_work():
        plan = s.schedule()
        plans.append(plan)
        result = w.execute(plan)
        s.update_from_result(result)
        s.observe_step(plan.step_id, 1.0, len(result.token_ids))  # rows cost nothing: drafting pays
        for u in s.take_updates():
            out.setdefault(u.req_id, []).extend(u.new_token_ids)
    assert s.check_blocks() is None and s.kv.num_free_blocks == s.kv.pool.num_blocks
    return out, plans


def _model(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens, VOCAB, 1))
    return tokens[len(prompt):]


def test_drafts_are_kept_and_outputs_are_the_models() -> None:
    s, w = _engine()
    prompts = {1: [1, 2, 3, 1, 2, 3], 2: [4, 5, 4, 5, 4], 3: [2]}
    for rid, p in prompts.items():
        s.add_request(EngineRequest(rid, p, EngineSamplingParams(max_tokens=23, ignore_eos=True), []))
    out, plans = _drain(s, w)
    assert out == {rid: _model(p, 23) for rid, p in prompts.items()}
    assert any(plan.drafts for plan in plans)
    assert 0 < s.stats.spec_accepted_tokens <= s.stats.spec_draft_tokens
    assert len(plans) < 23  # some steps kept several tokens per request
    for plan in plans:  # a draft never reaches past max_tokens (the fake worker checks it too)
        drafted = {d.req_id: len(d.token_ids) for d in plan.drafts}
        assert all(n == 1 + drafted[rid] for rid, n in plan.scheduled if rid in drafted)
        assert all(0 < k <= 3 for k in drafted.values())


def test_no_draft_above_disable_by_batch_size() -> None:
    s, w = _engine(disable_by_batch_size=1)
    for rid in (1, 2):
        s.add_request(EngineRequest(rid, [1, 2, 1, 2], EngineSamplingParams(max_tokens=12, ignore_eos=True), []))
    out, plans = _drain(s, w)
    assert all(len(o) == 12 for o in out.values())
    # Both run until they end together: no step drafts while two run.
    assert not any(plan.drafts for plan in plans) and s.stats.spec_drafts == 0


def test_a_draft_never_preempts() -> None:
    """Two requests whose tokens fill the cache exactly: a draft that needs a block no one has
    free is not planned (the request decodes its one token), and nothing is preempted."""
    s, w = _engine(num_blocks=4, k=4)
    for rid in (1, 2):  # 3 prompt tokens and 6 outputs: 8 tokens computed, 2 blocks each
        s.add_request(EngineRequest(rid, [1, 2, 1], EngineSamplingParams(max_tokens=6, ignore_eos=True), []))
    out, plans = _drain(s, w)
    assert out == {rid: _model([1, 2, 1], 6) for rid in (1, 2)}
    assert s.stats.spec_drafts > 0 and s.stats.num_preemptions == 0
    assert any(not plan.drafts and all(n == 1 for _, n in plan.scheduled) for plan in plans[1:])


def test_constrained_requests_are_drafted_by_the_schedulers_proposers_only() -> None:
    """Their drafts are checked against the grammar when planned (tests/test_spec_decode.py runs
    them); a draft model's or EAGLE-3 head's tokens are known only on the worker, too late for masks."""
    p = EngineSamplingParams(max_tokens=6, ignore_eos=True, structured_output=StructuredOutput(regex="[0-9a-z ]*"))
    for method, drafted in (("ngram", True), ("suffix", True), ("draft_model", False), ("eagle3", False)):
        s, _ = _engine(method=method)
        s.add_request(EngineRequest(1, [1, 2, 1, 2], p, []))
        assert bool(s.requests[1].spec_k) is drafted, method


def test_suffix_drafts_from_the_prompt_and_the_tenants_answers() -> None:
    """A model whose outputs never repeat within a request (it hashes the whole sequence): the
    same prompt asked again by its tenant is drafted from the first answer (each proposal at most
    as long as its match); asked by another tenant, never."""
    config = EngineConfig(block_size=BS, speculative_config=SpeculativeConfig(method="suffix", num_speculative_tokens=6))
    s, w = Scheduler(config, 64, 1000), FakeWorker(64, BS, vocab=1000)
    prompt = [1, 2, 3, 4, 5, 6]
    p = EngineSamplingParams(max_tokens=20, ignore_eos=True)
    answers, accepted = {}, {}
    for rid, tenant in ((1, "a"), (2, "a"), (3, "b")):
        before = s.stats.spec_accepted_tokens
        s.add_request(EngineRequest(rid, prompt, p, [], cache_salt=tenant))
        out, _ = _drain(s, w)
        answers[rid], accepted[rid] = out[rid], s.stats.spec_accepted_tokens - before
    assert answers[1] == answers[2] == answers[3] and len(set(answers[1])) == 20
    assert accepted[1] == accepted[3] == 0 and accepted[2] >= 10, accepted


def test_ahead_each_sent_step_counts_once_for_the_switch_and_tries_come_round() -> None:
    """Async scheduling as scheduler/process.py plans: nothing planned while the next step would
    draft, no plan sent that carries nothing. Where drafting costs more than it brings (a row a
    unit, a draft token five), the class stops drafting and its steps are planned ahead; each sent step
    still counts once in its class, so the switch's tries come round every 4 * EXPLORE steps,
    and the outputs stay the model's."""
    s, w = _engine(num_blocks=256)
    prompts = {1: [1, 2, 3, 1, 2, 3], 2: [4, 5, 4, 5, 4]}
    for rid, p in prompts.items():
        s.add_request(EngineRequest(rid, p, EngineSamplingParams(max_tokens=400, ignore_eos=True), []))
    out: dict[int, list[int]] = {}
    sent: dict[int, int] = {}  # class -> decode steps sent
    drafted_at: list[int] = []
    in_flight = None
    while s.has_work() or in_flight is not None:
        result, ahead = None, in_flight is not None
        if s.has_work() and not (ahead and s.drafts_next()):
            plan = s.schedule(ahead)
            if not (ahead and carries_nothing(plan)):
                assert not (ahead and plan.drafts)
                drafted = {d.req_id for d in plan.drafts}
                decodes = sum(1 for rid, n in plan.scheduled if n == 1 or rid in drafted)
                if decodes and not plan.new_requests:
                    sent[size_class(decodes)] = sent.get(size_class(decodes), 0) + 1
                if drafted:
                    drafted_at.append(plan.step_id)
                result = w.execute(plan)
                cost = 1.0 + sum(n for _, n in plan.scheduled) + 4 * sum(len(d.token_ids) for d in plan.drafts)
                s.observe_step(plan.step_id, cost, len(result.token_ids))
        result, in_flight = in_flight, result
        if result is not None:
            s.update_from_result(result)
        for u in s.take_updates():
            out.setdefault(u.req_id, []).extend(u.new_token_ids)
    assert out == {rid: _model(p, 400) for rid, p in prompts.items()}
    assert s.switch.steps == sent
    # After the first few measured steps, a try every 4 * EXPLORE steps of the class (a step id
    # more: the plan made while the try ran, which carried nothing and was not sent).
    gaps = [b - a for a, b in zip(drafted_at, drafted_at[1:], strict=False) if b - a > 8]
    assert len(gaps) >= 3 and all(gap == 4 * EXPLORE + 1 for gap in gaps[1:]), drafted_at
