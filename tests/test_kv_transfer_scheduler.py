"""Prefill/decode disaggregation in the schedulers, against brute-force workers that model every
KV slot (bench/fake_worker.py): a consumer's greedy output equals a single engine's whatever
was pulled, cached or failed; blocks are freed on both sides on every path (released, expired,
aborted, pull failed, worker lost)."""

from __future__ import annotations

import random

import msgspec
import pytest

from noria.bench.fake_worker import FakeWorker, next_token
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.errors import ErrorCode
from noria.protocol.kv_transfer import KVTransferConfig, KVTransferParams
from noria.protocol.sampling import SamplingParams, engine_params
from noria.scheduler.scheduler import Scheduler

EOS = 999
BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine(role: str, num_blocks: int = 64, **kw) -> tuple[Scheduler, FakeWorker]:
    tc = msgspec.convert({"kv_role": role, **kw}, KVTransferConfig)
    s = Scheduler(EngineConfig(block_size=BS, kv_transfer_config=tc), num_blocks, 256)
    w = FakeWorker(num_blocks, BS, vocab=EOS)
    s.kv_endpoints, s.side_channel = [w.endpoint], ("127.0.0.1", 1)
    return s, w


def request(rid: int, prompt: list[int], max_tokens: int, params: KVTransferParams | None) -> EngineRequest:
    return EngineRequest(rid, prompt, engine_params(SamplingParams(max_tokens=max_tokens)), [EOS],
                         kv_transfer_params=params)


def reference(prompt: list[int], n: int) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(toks, EOS))
        toks.append(out[-1])
    return out


def step(s: Scheduler, w: FakeWorker, outs: dict, done: dict) -> None:
    s.update_from_result(w.execute(s.schedule()))
    for u in s.take_updates():
        assert u.req_id not in done, f"request {u.req_id} got an update after its last"
        outs.setdefault(u.req_id, []).extend(u.new_token_ids)
        if u.finish_reason:
            done[u.req_id] = u
    assert s.check_blocks() is None


def drain(s: Scheduler, w: FakeWorker, outs: dict, done: dict, limit: int = 2000) -> None:
    for _ in range(limit):
        if not s.has_work():
            return
        step(s, w, outs, done)
    raise AssertionError("the scheduler did not finish its work")


def prefill(p: Scheduler, pw: FakeWorker, rid: int, prompt: list[int]) -> KVTransferParams:
    outs: dict = {}
    done: dict = {}
    p.add_request(request(rid, prompt, 1, KVTransferParams(do_remote_decode=True)))
    drain(p, pw, outs, done)
    answer = done[rid].kv_transfer_params
    assert answer is not None and answer.do_remote_prefill
    assert outs[rid] == reference(prompt, 1)
    return answer


def all_free(s: Scheduler) -> bool:
    return s.kv.pool.num_free == s.kv.pool.num_blocks and not s.held


@pytest.mark.parametrize("delay", [0, 1, 3], ids=["same-step", "next-step", "three-steps"])
@pytest.mark.parametrize("seed", range(4))
def test_consumer_output_equals_one_engine_whatever_was_pulled_cached_or_lost(seed, delay):
    rng = random.Random(seed)
    p, pw = engine("kv_producer", num_blocks=96)
    c, cw = engine("kv_consumer", num_blocks=48)
    cw.peers[pw.endpoint] = pw
    cw.pull_delay = delay  # the pulls end while later steps run
    shared = [rng.randrange(EOS) for _ in range(rng.randint(0, 12))]
    prompts = {i: shared + [rng.randrange(EOS) for _ in range(rng.randint(1, 30))] for i in range(24)}
    wanted = {i: rng.randint(1, 12) for i in prompts}
    outs: dict = {}
    done: dict = {}
    lost, aborted = set(), set()
    for i, prompt in prompts.items():
        params = prefill(p, pw, 1000 + i, prompt)
        if rng.random() < 0.2:  # the producer let go (expired, restarted): the pull fails
            pw.holds.pop(params.remote_transfer_id, None)
            lost.add(i)
        c.add_request(request(i, prompt, wanted[i], params))
        for _ in range(rng.randint(0, 3)):
            if c.has_work():
                step(c, cw, outs, done)
        if rng.random() < 0.15:  # a client gone, perhaps mid-pull: its blocks must not be reused early
            victim = rng.choice(list(prompts)[: i + 1])
            if victim not in done:
                c.abort([victim])
                aborted.add(victim)
                if c.has_work():
                    step(c, cw, outs, done)
        p.release_transfers([tid for (_, _, tid) in c.take_releases()])
    drain(c, cw, outs, done)
    p.release_transfers([tid for (_, _, tid) in c.take_releases()])
    for i, prompt in prompts.items():
        if i in aborted:
            assert done[i].finish_reason in ("abort", "length")
            assert outs[i] == reference(prompt, wanted[i])[: len(outs[i])], f"request {i}"
            continue
        assert done[i].finish_reason == "length"
        assert outs[i] == reference(prompt, wanted[i]), f"request {i}"
    assert c.stats.kv_pulls_ok > 0
    assert c.stats.kv_pulls_failed > 0 or not lost - aborted
    assert all_free(c) and all_free(p) and not c.orphans
    assert p.stats.kv_transfers_released == len(prompts)


def test_a_prefix_cached_on_the_consumer_is_not_pulled_again():
    p, pw = engine("kv_producer")
    c, cw = engine("kv_consumer")
    cw.peers[pw.endpoint] = pw
    prompt = list(range(1, 24))  # 23 tokens: the KV of 22, five full blocks and two tokens
    outs: dict = {}
    done: dict = {}
    c.add_request(request(1, prompt, 3, prefill(p, pw, 101, prompt)))
    plan = c.schedule()
    assert len(plan.kv_pulls[0].remote_block_ids) == 6 and not plan.scheduled
    c.update_from_result(cw.execute(plan))
    drain(c, cw, outs, done)
    assert c.stats.kv_pull_tokens == 22
    c.add_request(request(2, prompt, 3, prefill(p, pw, 102, prompt)))
    plan = c.schedule()
    pull = plan.kv_pulls[0]
    assert len(pull.remote_block_ids) == 1 and pull.remote_block_ids == [plan.kv_pulls[0].remote_block_ids[-1]]
    c.update_from_result(cw.execute(plan))
    drain(c, cw, outs, done)
    assert c.stats.kv_pull_tokens == 22 + 2  # only the block the cache lacked
    assert outs[1] == outs[2] == reference(prompt, 3)


def test_held_blocks_expire_and_the_workers_let_go():
    p, pw = engine("kv_producer", kv_connector_extra_config={"abort_request_timeout": 5.0})
    clock = p.clock = Clock()
    params = prefill(p, pw, 1, list(range(10)))
    assert p.held and pw.holds and p.kv.pool.num_free < p.kv.pool.num_blocks
    clock.now = 4.9
    assert p.expire_transfers() == 0
    clock.now = 5.0
    assert p.expire_transfers() == 1
    assert all_free(p) and p.stats.kv_transfers_expired == 1
    assert p.schedule().kv_release == [params.remote_transfer_id]


def test_an_aborted_pull_frees_its_blocks_and_releases_the_producer():
    p, pw = engine("kv_producer")
    c, cw = engine("kv_consumer")
    cw.peers[pw.endpoint] = pw
    params = prefill(p, pw, 1, list(range(30)))
    c.add_request(request(5, list(range(30)), 4, params))
    plan = c.schedule()
    assert plan.kv_pulls and c.kv.pool.num_free < c.kv.pool.num_blocks
    c.abort([5])
    assert c.take_releases() == [("127.0.0.1", 1, params.remote_transfer_id)]
    c.update_from_result(cw.execute(plan))  # the pull ran anyway: nothing comes of it
    assert not c.pulled and all_free(c)
    # aborted before boarding: released too
    params = prefill(p, pw, 2, list(range(30)))
    c.add_request(request(6, list(range(30)), 4, params))
    c.abort([6])
    assert c.take_releases() == [("127.0.0.1", 1, params.remote_transfer_id)]


def test_policy_fail_ends_the_request_with_an_error():
    p, pw = engine("kv_producer")
    c, cw = engine("kv_consumer", kv_load_failure_policy="fail")
    params = prefill(p, pw, 1, list(range(30)))  # cw has no peers: the producer is unreachable
    c.add_request(request(5, list(range(30)), 4, params))
    outs: dict = {}
    done: dict = {}
    drain(c, cw, outs, done)
    assert done[5].finish_reason == "error" and done[5].error_code == ErrorCode.KV_TRANSFER_FAILED
    assert all_free(c) and c.stats.kv_pulls_failed == 1


def test_a_worker_lost_mid_pull_computes_the_prompt_again():
    p, pw = engine("kv_producer")
    c, cw = engine("kv_consumer")
    cw.peers[pw.endpoint] = pw
    prompt = list(range(40))
    c.add_request(request(5, prompt, 6, prefill(p, pw, 1, prompt)))
    assert c.schedule().kv_pulls
    c.reset_after_worker_loss()
    assert c.take_releases() and not c.pulling
    cw = FakeWorker(64, BS, vocab=EOS)  # a new group: nothing of the old cache
    outs: dict = {}
    done: dict = {}
    drain(c, cw, outs, done)
    assert outs[5] == reference(prompt, 6) and all_free(c)


def test_a_preempted_producer_request_holds_the_blocks_it_ends_with():
    p, pw = engine("kv_producer", num_blocks=12)
    outs: dict = {}
    done: dict = {}
    p.add_request(request(1, list(range(20)), 8, KVTransferParams(do_remote_decode=True)))
    p.add_request(request(2, list(range(50, 66)), 8, None))  # 7 + 6 blocks of 12: one is preempted
    drain(p, pw, outs, done)
    assert p.stats.num_preemptions > 0
    params = done[1].kv_transfer_params
    assert params is not None
    assert pw.holds[params.remote_transfer_id] == params.remote_block_ids
    assert outs[1] == reference(list(range(20)), 8)


def test_params_an_engine_cannot_serve_are_ignored_and_n_above_one_refused():
    plain = Scheduler(EngineConfig(block_size=BS), 32, 256)
    w = FakeWorker(32, BS, vocab=EOS)
    outs: dict = {}
    done: dict = {}
    plain.add_request(request(1, [1, 2, 3], 2, KVTransferParams(do_remote_decode=True)))
    drain(plain, w, outs, done)
    assert done[1].kv_transfer_params is None and outs[1] == reference([1, 2, 3], 2)
    c, _ = engine("kv_consumer")
    msg = request(2, [1, 2, 3], 2, KVTransferParams(do_remote_decode=True))
    msg.more_samples = [msg.samples()[0].__class__(3, 1)]
    c.add_request(msg)
    refused = c.take_updates()
    assert {u.req_id for u in refused} == {2, 3} and all(u.error_code == ErrorCode.INVALID_REQUEST for u in refused)


def test_blocks_of_a_request_aborted_mid_pull_wait_for_the_pull_to_end():
    p, pw = engine("kv_producer")
    c, cw = engine("kv_consumer", num_blocks=10)
    cw.peers[pw.endpoint] = pw
    cw.pull_delay = 3  # the worker writes the pulled blocks three steps later
    prompt = list(range(30))
    c.add_request(request(5, prompt, 4, prefill(p, pw, 1, prompt)))
    c.update_from_result(cw.execute(c.schedule()))
    c.abort([5])
    assert list(c.orphans) == [5]  # not free: the pull may still write them
    other = list(range(100, 120))  # needs blocks the aborted request holds
    c.add_request(request(6, other, 4, None))
    outs: dict = {}
    done: dict = {}
    drain(c, cw, outs, done)  # the fake worker fails if a late pull overwrites request 6's KV
    assert outs[6] == reference(other, 4) and all_free(c) and not c.orphans


def test_a_consumer_with_a_producer_list_pulls_from_those_hosts_only():
    p, pw = engine("kv_producer")
    fake_host = pw.endpoint[len("tcp://"):].rsplit(":", 1)[0]
    prompt = list(range(30))
    for producers, pulls in (([fake_host, "127.0.0.1"], 1), (["10.0.0.9"], 0)):
        c, cw = engine("kv_consumer", kv_connector_extra_config={"producers": producers})
        cw.peers[pw.endpoint] = pw
        params = prefill(p, pw, 1, prompt)
        c.add_request(request(5, prompt, 4, params))
        outs: dict = {}
        done: dict = {}
        drain(c, cw, outs, done)
        assert outs[5] == reference(prompt, 4) and all_free(c)
        assert c.stats.kv_pulls_ok == pulls and c.stats.kv_pulls_failed == 0
        # a stranger's params are not even released: that would be a connection to it
        assert c.take_releases() == ([("127.0.0.1", 1, params.remote_transfer_id)] if pulls else [])
        p.release_transfers([params.remote_transfer_id])
