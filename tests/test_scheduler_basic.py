"""The step loop against a brute-force worker: admission, decode, stop, errors, block reuse."""

from __future__ import annotations

import random

from noria.bench.fake_worker import FakeWorker, next_token
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.sampling import SamplingParams, engine_params
from noria.scheduler.scheduler import Scheduler

EOS = 999


def make(num_blocks: int = 64, block_size: int = 4, max_len: int = 256, **kw) -> tuple[Scheduler, FakeWorker]:
    cfg = EngineConfig(block_size=block_size, **kw)
    return Scheduler(cfg, num_blocks, max_len), FakeWorker(num_blocks, block_size, vocab=EOS)


def req(rid: int, prompt: list[int], priority: int = 0, **params) -> EngineRequest:
    return EngineRequest(rid, prompt, engine_params(SamplingParams(**params)), [EOS], priority)


def run(s: Scheduler, w: FakeWorker, max_steps: int = 10_000) -> dict[int, tuple[list[int], str]]:
    """Run to completion; returns req_id -> (output tokens, finish reason)."""
    outs: dict[int, list[int]] = {}
    done: dict[int, tuple[list[int], str]] = {}
    for _ in range(max_steps):
        for u in s.take_updates():
            assert u.req_id not in done, f"req {u.req_id} got an update after finishing"
            outs.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.finish_reason:
                done[u.req_id] = (outs.pop(u.req_id), u.finish_reason)
        if not s.has_work():
            break
        s.update_from_result(w.execute(s.schedule()))
    assert s.check_blocks() is None
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    return done


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    out = []
    while len(out) < max_tokens:
        t = next_token(toks, EOS)
        toks.append(t)
        out.append(t)
    return out


def test_outputs_match_brute_force_and_every_request_ends_once():
    s, w = make()
    rng = random.Random(0)
    prompts = {i: [rng.randrange(EOS) for _ in range(rng.randint(1, 40))] for i in range(20)}
    for i, p in prompts.items():
        s.add_request(req(i, p, max_tokens=rng.randint(1, 30)))
    done = run(s, w)
    assert sorted(done) == list(prompts)
    for i, (toks, reason) in done.items():
        assert reason == "length"
        assert toks == reference(prompts[i], len(toks))


def test_request_admitted_while_others_run_and_freed_blocks_reused():
    s, w = make(num_blocks=8, block_size=4)
    s.add_request(req(0, [1, 2, 3], max_tokens=4))  # needs 2 blocks
    s.add_request(req(1, list(range(10, 30)), max_tokens=40))  # long runner
    plan = s.schedule()
    assert {r for r, _ in plan.scheduled} == {0, 1}
    s.update_from_result(w.execute(plan))
    first_blocks = set(s.requests[0].block_ids)
    # Step until request 0 finishes while 1 keeps running.
    while 0 in s.requests:
        s.update_from_result(w.execute(s.schedule()))
    assert 1 in s.requests and s.requests[1].status.name == "RUNNING"
    s.add_request(req(2, [7, 7, 7, 7, 7], max_tokens=3))
    plan = s.schedule()
    assert (2, 5) in plan.scheduled and any(r == 1 for r, _ in plan.scheduled)
    assert first_blocks & set(s.requests[2].block_ids), "a finished request's blocks were not reused"
    s.update_from_result(w.execute(plan))
    run(s, w)


def test_stop_conditions():
    s, w = make()
    # Force tokens: EOS before min_tokens is ignored, then stop token ends it.
    s.add_request(req(0, [5, 6], max_tokens=50, min_tokens=2, stop_token_ids=[42]))
    s.add_request(req(1, [5, 6], max_tokens=50, ignore_eos=True))
    s.add_request(req(2, [5, 6], max_tokens=50))
    w.forced = {0: [EOS, 3, 42, 8], 1: [EOS, EOS, 1] + [2] * 47, 2: [4, EOS, 9]}
    done = run(s, w)
    assert done[0] == ([EOS, 3, 42], "stop")
    assert done[1][1] == "length" and len(done[1][0]) == 50
    assert done[2] == ([4, EOS], "stop")


def test_max_model_len_caps_output():
    s, w = make(max_len=20)
    s.add_request(req(0, list(range(15)), max_tokens=None))
    done = run(s, w)
    assert done[0][1] == "length" and len(done[0][0]) == 5


def test_bad_requests_get_errors_and_others_continue():
    s, w = make(max_len=20)
    s.add_request(req(0, [], max_tokens=3))
    s.add_request(req(1, list(range(20)), max_tokens=3))
    s.add_request(req(2, [1, 2], max_tokens=3))
    done = run(s, w)
    assert done[0] == ([], "error") and done[1] == ([], "error")
    assert done[2][1] == "length" and len(done[2][0]) == 3


def test_errors_name_the_problem():
    s, _ = make(max_len=20)
    s.add_request(req(0, [], max_tokens=3))
    s.add_request(req(1, list(range(20)), max_tokens=3))
    ups = {u.req_id: u for u in s.take_updates()}
    assert ups[0].error_code == "invalid_request" and "empty" in ups[0].error_message
    assert ups[1].error_code == "prompt_too_long" and "20 tokens" in ups[1].error_message


def test_abort_frees_blocks_immediately():
    s, w = make()
    s.add_request(req(0, list(range(30)), max_tokens=100))
    s.add_request(req(1, list(range(5)), max_tokens=100))
    for _ in range(3):
        s.update_from_result(w.execute(s.schedule()))
    used = s.kv.pool.num_blocks - s.kv.pool.num_free
    assert used > 0
    s.abort([0])
    assert [u.finish_reason for u in s.take_updates() if u.req_id == 0][-1] == "abort"
    assert s.kv.pool.num_blocks - s.kv.pool.num_free < used
    assert s.check_blocks() is None
    plan = s.schedule()
    assert 0 in plan.finished_req_ids and all(r != 0 for r, _ in plan.scheduled)
    s.update_from_result(w.execute(plan))
    s.abort([1])
    run(s, w)


def test_max_num_seqs_caps_the_batch():
    s, w = make(max_num_seqs=3)
    for i in range(6):
        s.add_request(req(i, [i + 1] * 3, max_tokens=5))
    plan = s.schedule()
    assert len(plan.scheduled) == 3
    s.update_from_result(w.execute(plan))
    run(s, w)
