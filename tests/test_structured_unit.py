"""Structured output in pieces: the StructuredOutput checks, the scheduler's grammar
manager (async compile, cache, errors, the packed bitmask against a per-token
reference), the scheduler's plans (a request waits for its grammar; only the step
in which it samples carries its mask) and the worker's masking against a plain
Python reference."""

from __future__ import annotations

import random
import select
import threading

import msgspec
import pytest
import torch

from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.errors import ParamError
from noria.protocol.sampling import EngineSamplingParams, SamplingParams, check_sampling
from noria.protocol.step import GrammarBitmask, StepPlan, StepResult
from noria.protocol.structured import StructuredOutput, check_structured, spec_text
from noria.scheduler.request import Status
from noria.scheduler.scheduler import Scheduler
from noria.scheduler.structured_output import StructuredOutputManager, advance
from noria.worker.grammar_mask import apply_grammar_bitmask


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("so, words", [
    (StructuredOutput(), "exactly one"),
    (StructuredOutput(regex="a", grammar="start: x"), "exactly one"),
    (StructuredOutput(choice=[]), "non-empty"),
    (StructuredOutput(choice=["a", ""]), "non-empty"),
    (StructuredOutput(json="{oops"), "not valid JSON"),
    (StructuredOutput(json="[1]"), "JSON schema"),
    # What msgpack can carry and JSON cannot: the scheduler writes the schema as JSON text.
    (StructuredOutput(json={"type": "string", "title": b"\xff"}), "bytes value is not JSON"),
    (StructuredOutput(json={"properties": {1: {}, "a": {}}}), "key is a int"),
    (StructuredOutput(json={"maximum": float("nan")}), "nan is not a JSON number"),
    (StructuredOutput(json={"items": [{"minimum": float("-inf")}]}), "-inf is not a JSON number"),
    (StructuredOutput(json='{"a":' * 300 + "1" + "}" * 300), "nests more than 256"),
    (StructuredOutput(json="[" * 5000 + "]" * 5000), "not valid JSON"),
    (StructuredOutput(json=_nested(300)), "nests more than 256"),
])
def test_malformed_constraints_are_param_errors(so, words):
    with pytest.raises(ParamError, match=words) as e:
        check_sampling(SamplingParams(structured_output=so))
    assert e.value.param == "structured_output"


def test_equal_schemas_share_one_key_and_params_survive_the_wire():
    assert spec_text(StructuredOutput(json={"b": 1, "a": 2})) == spec_text(StructuredOutput(json='{"a":2, "b":1}'))
    check_structured(StructuredOutput(json_object=True))
    p = SamplingParams(structured_output=StructuredOutput(choice=["x", "y"]))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


# Waits end on the state (a compiled grammar, an opened gate); the bounds only keep a broken
# test from hanging, so they are far past what a loaded 2-core machine needs.
STATE_WAIT_S = 600.0


def _ready(mgr: StructuredOutputManager, timeout: float = STATE_WAIT_S) -> list:
    assert select.select([mgr.wake_fd], [], [], timeout)[0], "no grammar compiled in time"
    return mgr.take_ready()


def _gate(mgr: StructuredOutputManager) -> threading.Event:
    """Hold every compile until the event is set, so that a test sees requests wait."""
    gate, compile_ = threading.Event(), mgr._compile
    mgr._compile = lambda so, eos: (gate.wait(STATE_WAIT_S), compile_(so, eos))[1]
    return gate


def test_a_compile_that_ends_before_anyone_polls_still_wakes_the_loop(demo_path):
    # The wake-up pipe exists before the first compile, so a grammar that compiles before
    # the loop first asks for the descriptor still leaves it readable.
    # The gate keeps the compile from ending inside `submit` (which would hand the matcher
    # over at once, with no wake-up needed).
    mgr = StructuredOutputManager(str(demo_path))
    gate = _gate(mgr)
    assert mgr.submit(1, StructuredOutput(regex=r"[0-9]x"), [2]) is None
    gate.set()
    # The done-callback runs on the pool thread after the result is set; joining the pool
    # waits for it to have written (or, on the old code, not written) the wake-up.
    mgr._pool.shutdown(wait=True)
    assert select.select([mgr.wake_fd], [], [], 0)[0]
    (rid, m, err), = mgr.take_ready()
    assert (rid, err) == (1, None) and m is not None
    mgr.close()


def _allowed_reference(matcher, vocab: int) -> set[int]:
    # Token by token, on copies: which tokens the matcher would accept next.
    return {t for t in range(vocab) if matcher.deep_copy().try_consume_tokens([t]) == 1}


def test_manager_compiles_off_thread_caches_and_reports_errors(demo_path):
    mgr = StructuredOutputManager(str(demo_path))
    so = StructuredOutput(regex=r"[0-9]{2}x")
    fd = mgr.wake_fd
    gate = _gate(mgr)
    assert mgr.submit(1, so, [2]) is None  # not compiled yet: the request must wait
    assert not select.select([fd], [], [], 0.2)[0]
    gate.set()
    (rid, m1, err), = _ready(mgr)
    assert (rid, err) == (1, None) and m1 is not None
    m2 = mgr.submit(2, StructuredOutput(regex=r"[0-9]{2}x"), [2])  # cached: at once, a copy of its own
    assert m2 is not None and m2 is not m1 and not select.select([fd], [], [], 0)[0]
    assert mgr.submit(3, StructuredOutput(regex="(x"), [2]) is None
    (rid, m3, err), = _ready(mgr)
    assert rid == 3 and m3 is None and "unclosed group" in err
    assert mgr.submit(4, StructuredOutput(regex="(x"), [2]) is None  # a cached failure fails again
    assert _ready(mgr)[0][0] == 4

    vocab = mgr._tokenizer.vocab_size
    tok = mgr._tokenizer
    assert advance(m2, tok.tokenize_str("4")[0]) is None
    rows = [(7, m1), (8, m2)]
    mask = mgr.fill_bitmask(rows)
    assert mask.req_ids == [7, 8]
    words = torch.frombuffer(bytearray(mask.data), dtype=torch.int32).view(2, -1)
    for r, (_, m) in enumerate(rows):
        got = {t for t in range(vocab) if (int(words[r, t // 32]) >> (t % 32)) & 1}
        assert got == _allowed_reference(m, vocab) and got
    for t in tok.tokenize_str("2x"):
        last = advance(m2, t)
    assert last == "stop"
    mgr.close()


def _request(rid: int, n_prompt: int, so: StructuredOutput | None) -> EngineRequest:
    return EngineRequest(rid, list(range(3, 3 + n_prompt)), EngineSamplingParams(max_tokens=8, structured_output=so), [2])


def test_scheduler_refuses_a_schema_it_cannot_write_and_serves_on(demo_path):
    """A constraint that reaches the scheduler unchecked and is no JSON (a frontend bug, or
    a client of the engine link) fails its request alone: the scheduler's loop, and every
    other request, go on."""
    config = EngineConfig(model=str(demo_path), max_num_batched_tokens=64)
    sched = Scheduler(config, 64, 512)
    for rid, schema in ((1, {"title": b"\x00"}), (2, {"properties": {1: {}, "a": {}}})):
        sched.add_request(_request(rid, 4, StructuredOutput(json=schema)))
    sched.add_request(_request(3, 4, None))
    updates = {u.req_id: u for u in sched.take_updates()}
    assert {r: (u.finish_reason, u.error_code) for r, u in updates.items()} == {
        1: ("error", "invalid_grammar"), 2: ("error", "invalid_grammar")}
    assert set(sched.requests) == {3}
    plan = sched.schedule()
    assert [r for r, _ in plan.scheduled] == [3]


def test_scheduler_waits_for_the_grammar_and_masks_only_sampling_steps(demo_path):
    config = EngineConfig(model=str(demo_path), max_num_batched_tokens=16, enable_chunked_prefill=True)
    sched = Scheduler(config, 64, 512)
    so = StructuredOutput(choice=["ab", "ba"])
    gate = _gate(sched.grammars)
    sched.add_request(_request(1, 40, so))  # three chunks of prefill
    sched.add_request(_request(2, 4, None))
    sched.add_request(_request(3, 4, StructuredOutput(regex="q+")))
    sched.abort([3])  # aborted while compiling: never scheduled
    assert sched.requests[1].status == Status.WAITING_GRAMMAR
    plan = sched.schedule()
    assert [r for r, _ in plan.scheduled] == [2] and plan.grammar is None
    gate.set()
    while sched.requests[1].status == Status.WAITING_GRAMMAR:  # the wake-up may be request 3's
        assert select.select([sched.grammars.wake_fd], [], [], STATE_WAIT_S)[0]
        sched.grammars_ready()
    sched.update_from_result(StepResult(plan.step_id, [2], [5]))
    tok = sched.grammars._tokenizer
    a, b = tok.tokenize_str("a")[0], tok.tokenize_str("b")[0]
    masks, reasons = [], []
    for _ in range(4):
        plan = sched.schedule()
        samplers = [r for r, _ in plan.scheduled
                    if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens]
        masks.append(plan.grammar.req_ids if plan.grammar else [])
        sampled = [a if len(masks) == 3 else b if r == 1 else 5 for r in samplers]
        sched.update_from_result(StepResult(plan.step_id, samplers, sampled))
        reasons += [u.finish_reason for u in sched.take_updates() if u.req_id == 1]
    # Prefill chunks of 15, 16, 9 tokens: the third samples "a", the next "b", and "ab" is complete.
    assert masks == [[], [], [1], [1]]
    assert reasons[-1] == "stop" and 1 not in sched.requests
    assert 3 not in sched.requests


def test_worker_mask_matches_a_python_reference():
    rng = random.Random(0)
    vocab, rows = 75, [3, 0]  # a vocabulary that is not a multiple of 32
    logits = torch.randn(4, vocab)
    expect = logits.clone()
    words = [[rng.getrandbits(32) for _ in range(3)] for _ in rows]
    for r, ws in zip(rows, words, strict=True):
        for t in range(vocab):
            if not (ws[t // 32] >> (t % 32)) & 1:
                expect[r, t] = float("-inf")
    data = b"".join(w.to_bytes(4, "little") for ws in words for w in ws)
    apply_grammar_bitmask(logits, GrammarBitmask([13, 10], data), [10, 11, 12, 13])
    assert torch.equal(logits, expect)
    with pytest.raises(ValueError, match="samples no token"):
        apply_grammar_bitmask(logits, GrammarBitmask([99], data[:12]), [10])
    assert StepPlan(1, []).grammar is None
    # The accelerator's unpacking (torch shifts) gives the same mask as the CPU's (numpy).
    from noria.worker.grammar_mask import _unpack_numpy, _unpack_torch

    assert torch.equal(_unpack_torch(data, 2, vocab, torch.device("cpu")), _unpack_numpy(data, 2, vocab))
    assert torch.equal(_unpack_numpy(data, 2, vocab), expect[[3, 0]] == float("-inf"))


def test_a_resumed_request_goes_on_from_its_outputs_in_the_grammar(demo_path):
    """After a scheduler restart the frontend resubmits a constrained request with the
    tokens it already delivered: the new matcher must stand after them, and outputs the
    grammar cannot have produced end the request with an error, never a wrong mask."""
    sched = Scheduler(EngineConfig(model=str(demo_path)), 64, 512)
    so = StructuredOutput(choice=["ab", "ba"])
    sched.add_request(_request(1, 4, so))  # compiles the grammar (cached from here on)
    while sched.requests[1].status == Status.WAITING_GRAMMAR:
        assert select.select([sched.grammars.wake_fd], [], [], STATE_WAIT_S)[0]
        sched.grammars_ready()
    sched.abort([1])
    tok = sched.grammars._tokenizer
    a, b = tok.tokenize_str("a")[0], tok.tokenize_str("b")[0]
    params = EngineSamplingParams(max_tokens=8, structured_output=so)
    sched.add_request(EngineRequest(2, [3, 4, 5, 6], params, [2], output_token_ids=[a]))
    sched.add_request(EngineRequest(3, [3, 4, 5, 6], params, [2], output_token_ids=[a, a]))
    (broken,) = [u for u in sched.take_updates() if u.req_id == 3]
    assert broken.error_code == "internal_error" and "break its grammar" in broken.error_message
    plan = sched.schedule()
    assert [r for r, _ in plan.scheduled] == [2] and plan.grammar.req_ids == [2]
    words = memoryview(plan.grammar.data).cast("i")
    allowed = {t for t in range(len(words) * 32) if words[t // 32] >> (t % 32) & 1}
    assert b in allowed and a not in allowed  # "a" is behind it: only "ab" is left
    sched.update_from_result(StepResult(plan.step_id, [2], [b]))
    (done,) = sched.take_updates()
    assert done.finish_reason == "stop" and sched.check_blocks() is None
