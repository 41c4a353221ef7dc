"""Targeted scheduler behaviours, against the brute-force worker."""

from __future__ import annotations

import pytest

from noria.bench.fake_worker import FakeWorker
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest, EngineSample
from noria.protocol.sampling import SamplingParams, engine_params
from noria.scheduler.scheduler import Scheduler
from tests.test_scheduler_basic import EOS, reference, run


def make(num_blocks: int, block_size: int = 16, cpu_blocks: int = 0, **kw) -> tuple[Scheduler, FakeWorker]:
    s = Scheduler(EngineConfig(block_size=block_size, **kw), num_blocks, 100_000, cpu_blocks)
    return s, FakeWorker(num_blocks, block_size, vocab=EOS, num_cpu_blocks=cpu_blocks)


def req(rid, prompt, priority=0, **p):
    return EngineRequest(rid, prompt, engine_params(SamplingParams(**p)), [EOS], priority)


def step(s, w):
    plan = s.schedule()
    s.update_from_result(w.execute(plan))
    return plan


def test_long_prompt_is_chunked_and_never_stalls_decoders():
    s, w = make(1024, max_num_batched_tokens=512, max_num_seqs=64)
    for i in range(32):
        s.add_request(req(i, [i + 1] * 20, max_tokens=1000, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.requests.values()):
        step(s, w)
    s.add_request(req(100, list(range(4000)), max_tokens=5))
    chunks = []
    while s.requests[100].num_output_tokens == 0:
        plan = step(s, w)
        sched = dict(plan.scheduled)
        assert all(sched.get(i) == 1 for i in range(32)), "a decoder was stalled by the long prompt"
        chunks.append(sched.get(100, 0))
        assert sum(sched.values()) <= 512
    assert sum(chunks) == 4000 and len(chunks) >= 8 and max(chunks) == 512 - 32


def test_without_chunking_a_prompt_runs_whole():
    s, w = make(512, max_num_batched_tokens=2048, enable_chunked_prefill=False)
    s.add_request(req(0, list(range(1500)), max_tokens=2))
    plan = step(s, w)
    assert plan.scheduled == [(0, 1500)]
    s.add_request(req(1, list(range(3000)), max_tokens=2))
    assert [u.error_code for u in s.take_updates() if u.req_id == 1] == ["prompt_too_long"]


@pytest.mark.parametrize("caching", [True, False])
def test_shared_system_prompt_hits_the_prefix_cache(caching):
    s, w = make(512, enable_prefix_caching=caching)
    system = list(range(100, 612))  # 512 tokens = 32 full blocks
    for i in range(8):
        s.add_request(req(i, system + [i, i + 1, i + 2], max_tokens=4))
        done = run(s, w)
        assert done[i][0] == reference(system + [i, i + 1, i + 2], 4)
    st = s.snapshot_stats()
    if caching:
        assert st.prefix_cache_hits == 7 * 512
        assert st.computed_prompt_tokens == 8 * 515 - 7 * 512
    else:
        assert st.prefix_cache_hits == 0 and st.computed_prompt_tokens == 8 * 515


def test_last_prompt_token_is_always_computed():
    s, w = make(64, enable_prefix_caching=True)
    prompt = list(range(32))  # exactly two full blocks
    s.add_request(req(0, prompt, max_tokens=1))
    run(s, w)
    s.add_request(req(1, prompt, max_tokens=1))
    plan = s.schedule()
    assert plan.new_requests[0].num_computed_tokens == 16 and plan.scheduled == [(1, 16)]


def samples(first_rid, prompt, n, **p):
    """The engine requests the frontend sends for one client request with n samples: one."""
    more = [EngineSample(first_rid + i, i) for i in range(1, n)]
    return [EngineRequest(first_rid, prompt, engine_params(SamplingParams(**p)), [EOS], 0, first_rid,
                          more_samples=more)]


@pytest.mark.parametrize("caching", [True, False])
def test_samples_of_one_request_share_their_full_prompt_blocks(caching):
    s, w = make(64, enable_prefix_caching=caching)
    prompt = list(range(40))  # 2 full blocks + a partial one
    for r in samples(0, prompt, 4, max_tokens=3):
        s.add_request(r)
    plan = step(s, w)
    # Sample 0 computes the prompt; the others hit its full blocks in the same step.
    assert plan.scheduled == [(0, 40), (1, 8), (2, 8), (3, 8)]
    tables = [s.requests[i].block_ids for i in range(4)]
    assert all(t[:2] == tables[0][:2] for t in tables), "full prompt blocks are not shared"
    assert len({t[2] for t in tables}) == 4, "each sample needs its own last block"
    assert s.kv.pool.num_blocks - s.kv.pool.num_free == 2 + 4  # versus 12 without sharing
    done = run(s, w)
    assert all(done[i][0] == reference(prompt, 3) for i in range(4))
    # A request of its own shares the prompt only where prefix caching is on.
    s.add_request(req(10, prompt, max_tokens=1))
    assert step(s, w).scheduled == [(10, 8 if caching else 40)]


def test_samples_that_board_later_still_share_the_prompt():
    s, w = make(64, enable_prefix_caching=False, max_num_seqs=2)
    prompt = list(range(40))
    for r in samples(0, prompt, 5, max_tokens=6):
        s.add_request(r)
    widest = 0
    outs: dict[int, list[int]] = {}
    while s.has_work():
        widest = max(widest, len(step(s, w).scheduled))
        for u in s.take_updates():
            outs.setdefault(u.req_id, []).extend(u.new_token_ids)
    assert widest == 2
    # Samples 2..4 board after 0 and 1 have finished and still find the freed blocks.
    assert s.stats.computed_prompt_tokens == 40 + 4 * 8
    assert outs == {i: reference(prompt, 6) for i in range(5)}
    assert s.check_blocks() is None and s.kv.pool.num_free == 64


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_samples_survive_preemption(mode):
    s, w = make(10, block_size=4, cpu_blocks=16, preemption_mode=mode, enable_prefix_caching=False)
    prompt = [7] * 10
    for r in samples(0, prompt, 4, max_tokens=14):
        s.add_request(r)
    done = run(s, w)
    assert s.stats.num_preemptions > 0
    if mode == "swap":
        assert s.stats.num_swap_outs > 0
    assert {i: done[i] for i in range(4)} == {i: (reference(prompt, 14), "length") for i in range(4)}
    assert len(s.kv.cpu_free) == s.kv.num_cpu_blocks


def test_samples_cross_as_one_engine_request_and_their_params_go_once_per_plan():
    s, w = make(64)
    [msg] = samples(5, [1, 2, 3], 3, max_tokens=2, seed=9, prompt_logprobs=1)
    s.add_request(msg)
    s.add_request(req(9, [4, 5], max_tokens=2))
    assert sorted(s.requests) == [5, 6, 7, 9]
    assert s.requests[5].params is s.requests[7].params  # shared, not copied per sample
    plan = s.schedule()
    news = {n.req_id: n for n in plan.new_requests}
    assert len(plan.params) == 2
    assert {n.params for rid, n in news.items() if rid != 9} == {0}, "one entry for the three samples"
    assert [news[r].sample_index for r in (5, 6, 7, 9)] == [0, 1, 2, 0]
    assert plan.params[news[9].params].seed is None and plan.params[0].seed == 9
    # Only sample 0 computes the prompt's logprobs, so the others may hit its blocks.
    assert [s.requests[r].needs_prompt_logits for r in (5, 6, 7)] == [True, False, False]
    s.update_from_result(w.execute(plan))
    assert s.schedule().params == [], "a plan without new requests carries no params"


def test_priority_runs_first_and_preempts_the_lowest_latest():
    s, w = make(10, block_size=4, max_num_seqs=2, scheduling_policy="priority")
    s.add_request(req(0, [1] * 4, priority=1, max_tokens=30))
    s.add_request(req(1, [2] * 4, priority=0, max_tokens=30))
    s.add_request(req(2, [3] * 4, priority=2, max_tokens=30))
    plan = step(s, w)
    assert sorted(r for r, _ in plan.scheduled) == [0, 1]  # priority 2 waits
    for _ in range(20):
        step(s, w)
    # 10 blocks are too few for two sequences of 34 tokens: the priority-1 request goes.
    assert s.stats.num_preemptions > 0
    assert s.requests[1].num_preemptions == 0
    done = run(s, w)
    for i, p in enumerate(([1] * 4, [2] * 4, [3] * 4)):
        assert done[i][0] == reference(p, 30)


def test_fcfs_ignores_priority():
    """The default policy boards in arrival order whatever priority a request carries."""
    s, w = make(64, block_size=4, max_num_seqs=2)
    s.add_request(req(0, [1] * 4, priority=5, max_tokens=3))
    s.add_request(req(1, [2] * 4, priority=0, max_tokens=3))
    s.add_request(req(2, [3] * 4, priority=-5, max_tokens=3))
    plan = step(s, w)
    assert sorted(r for r, _ in plan.scheduled) == [0, 1]  # under "priority", 2 and 1 would run


def test_swap_out_and_back_in_preserves_outputs():
    s, w = make(12, block_size=4, cpu_blocks=32, preemption_mode="swap", max_num_seqs=4)
    prompts = [[i + 1] * 6 for i in range(4)]
    for i, p in enumerate(prompts):
        s.add_request(req(i, p, max_tokens=20))
    swaps_out = swaps_in = 0
    outs = {}
    for _ in range(500):
        if not s.has_work():
            break
        plan = step(s, w)
        swaps_out += len(plan.swap_out)
        swaps_in += len(plan.swap_in)
        for u in s.take_updates():
            outs.setdefault(u.req_id, []).extend(u.new_token_ids)
    assert swaps_out > 0 and swaps_in == swaps_out
    assert s.stats.num_swap_outs > 0 and s.stats.num_swap_ins == s.stats.num_swap_outs
    assert all(outs[i] == reference(p, 20) for i, p in enumerate(prompts))
    assert s.check_blocks() is None and len(s.kv.cpu_free) == 32


def test_swap_falls_back_to_recompute_when_the_swap_area_is_full():
    s, w = make(12, block_size=4, cpu_blocks=1, preemption_mode="swap", max_num_seqs=4)
    for i in range(4):
        s.add_request(req(i, [i + 1] * 6, max_tokens=20))
    done = run(s, w)
    assert s.stats.num_preemptions > s.stats.num_swap_outs
    assert all(done[i][0] == reference([i + 1] * 6, 20) for i in range(4))


def test_abort_of_swapped_and_waiting_requests_frees_everything():
    s, w = make(12, block_size=4, cpu_blocks=32, preemption_mode="swap", max_num_seqs=8)
    for i in range(6):
        s.add_request(req(i, [i + 1] * 6, max_tokens=40))
    while not s.swapped:
        step(s, w)
    s.abort([r.req_id for r in s.swapped] + [rid for _, rid in s.waiting])
    run(s, w)
    assert len(s.kv.cpu_free) == 32


def test_requests_with_large_params_start_over_several_plans(monkeypatch):
    import noria.scheduler.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PLAN_PARAMS_BYTES", 2000)
    s, w = make(64)
    big = list(range(1000, 1600))  # ~1.8 kB encoded: two do not fit the budget, one always does
    for rid in range(3):
        s.add_request(req(rid, [1, 2, 3], max_tokens=2, allowed_token_ids=big + [EOS + rid]))
    s.add_request(req(3, [4, 5], max_tokens=2))  # small: waits its turn behind them (FCFS)
    started = [sorted(n.req_id for n in step(s, w).new_requests) for _ in range(3)]
    assert started == [[0], [1], [2, 3]]
    run(s, w)
    assert not s.requests and s.check_blocks() is None
