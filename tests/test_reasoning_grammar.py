"""The scheduler's side of reasoning with a grammar (vLLM's way): a constrained request with
`reasoning_end_token_id` samples freely, with no mask and its matcher untouched, until it
samples that token; from the next token the grammar holds. A request resubmitted after a
scheduler restart picks up from its outputs either side of the token."""

from __future__ import annotations

import select

from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import StepResult
from noria.protocol.structured import StructuredOutput
from noria.scheduler.request import Status
from noria.scheduler.scheduler import Scheduler

END = 9  # stands for `</think>`
FREE = 5  # a token the grammar ("ab" or "ba") rejects


def _compiled(sched: Scheduler, rid: int) -> None:
    while sched.requests[rid].status == Status.WAITING_GRAMMAR:
        assert select.select([sched.grammars.wake_fd], [], [], 600)[0]  # a bound, not a timing: the wait ends on the compile
        sched.grammars_ready()


def _allowed(plan) -> set[int]:
    words = memoryview(plan.grammar.data).cast("i")
    return {t for t in range(len(words) * 32) if words[t // 32] >> (t % 32) & 1}


def test_the_grammar_starts_after_the_reasoning_end_token(demo_path):
    sched = Scheduler(EngineConfig(model=str(demo_path)), 64, 512)
    params = EngineSamplingParams(max_tokens=16, structured_output=StructuredOutput(choice=["ab", "ba"]),
                                  reasoning_end_token_id=END)
    sched.add_request(EngineRequest(1, [3, 4, 5, 6], params, [2]))
    _compiled(sched, 1)
    tok = sched.grammars._tokenizer
    a, b = tok.tokenize_str("a")[0], tok.tokenize_str("b")[0]
    masks, reasons = [], []
    for sampled in (FREE, FREE, END, a, b):  # reasoning, its end, then the grammar's "ab"
        plan = sched.schedule()
        masks.append(_allowed(plan) if plan.grammar else None)
        sched.update_from_result(StepResult(plan.step_id, [1], [sampled]))
        reasons += [u.finish_reason for u in sched.take_updates()]
    assert masks[:3] == [None, None, None]  # no mask while it reasons: FREE and END were free
    assert a in masks[3] and b in masks[3] and FREE not in masks[3]
    assert masks[4] is not None and b in masks[4] and a not in masks[4]
    assert reasons[-1] == "stop" and reasons[:-1] == [None] * 4 and sched.check_blocks() is None

    # Without the field the same tokens break the grammar at once.
    sched.add_request(EngineRequest(2, [3, 4, 5, 6], EngineSamplingParams(
        max_tokens=16, structured_output=StructuredOutput(choice=["ab", "ba"])), [2]))
    _compiled(sched, 2)
    plan = sched.schedule()
    assert plan.grammar is not None and FREE not in _allowed(plan)


def test_a_resumed_request_stands_where_its_outputs_left_the_reasoning(demo_path):
    sched = Scheduler(EngineConfig(model=str(demo_path)), 64, 512)
    params = EngineSamplingParams(max_tokens=16, structured_output=StructuredOutput(choice=["ab", "ba"]),
                                  reasoning_end_token_id=END)
    sched.add_request(EngineRequest(1, [3, 4, 5, 6], params, [2]))
    _compiled(sched, 1)
    sched.abort([1])
    sched.take_updates()
    tok = sched.grammars._tokenizer
    a, b = tok.tokenize_str("a")[0], tok.tokenize_str("b")[0]
    sched.add_request(EngineRequest(2, [3, 4, 5, 6], params, [2], output_token_ids=[FREE, a, END, b]))
    sched.add_request(EngineRequest(3, [3, 4, 5, 6], params, [2], output_token_ids=[FREE, a, FREE]))
    plan = sched.schedule()
    assert plan.grammar is not None and plan.grammar.req_ids == [2]  # 3 still reasons: no row
    allowed = _allowed(plan)
    assert a in allowed and b not in allowed  # "b" after the end: only "ba" is left
    assert [r for r, _ in plan.scheduled] == [2, 3]
    sched.update_from_result(StepResult(plan.step_id, [2, 3], [a, END]))
    updates = {u.req_id: u.finish_reason for u in sched.take_updates()}
    assert updates == {2: "stop", 3: None}
    plan = sched.schedule()
    assert plan.grammar.req_ids == [3] and FREE not in _allowed(plan)
