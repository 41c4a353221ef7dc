"""n > 1 from the frontend's side, in one process: FrontendCore sends a request's
samples in one engine request, a real Scheduler with the brute-force worker runs
each as a sequence of its own, and the engine's updates flow back through the core."""

from __future__ import annotations

import pytest

from noria.bench.fake_worker import FakeWorker, next_token
from noria.frontend.core import FrontendCore
from noria.frontend.processor import InputProcessor
from noria.protocol.client import Delta, Done, Error, Generate
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineOutputs, EngineRequest
from noria.scheduler.scheduler import Scheduler

NUM_BLOCKS = 64
PROMPT = list(range(10, 50))  # 2 full blocks of 16 + a partial one


class InProcessEngine:
    """The two calls FrontendCore makes on its EngineClient, straight into a Scheduler."""

    def __init__(self, max_model_len: int = 1024) -> None:
        self.sched = Scheduler(EngineConfig(enable_prefix_caching=False), NUM_BLOCKS, max_model_len)
        self.worker = FakeWorker(NUM_BLOCKS, 16, vocab=500)
        self.sent: list[EngineRequest] = []
        self.aborted: list[int] = []

    def add(self, req: EngineRequest) -> None:
        self.sent.append(req)
        self.sched.add_request(req)

    def abort(self, req_ids: list[int]) -> None:
        self.aborted.extend(req_ids)
        self.sched.abort(req_ids)

    def step(self, core: FrontendCore) -> None:
        if self.sched.has_work():
            self.sched.update_from_result(self.worker.execute(self.sched.schedule()))
        core.on_outputs(EngineOutputs(self.sched.take_updates()))


@pytest.fixture
def setup(demo_tokenizer):
    engine = InProcessEngine()
    core = FrontendCore(engine, InputProcessor(demo_tokenizer, [501], 700, 1024))  # type: ignore[arg-type]
    return engine, core


def _expected(max_tokens: int) -> list[int]:
    toks = list(PROMPT)
    for _ in range(max_tokens):
        toks.append(next_token(toks, 500))
    return toks[len(PROMPT):]


def _sample_ids(engine: InProcessEngine) -> list[int]:
    return [s.req_id for r in engine.sent for s in r.samples()]


def test_samples_cross_in_one_engine_request_and_run_as_sequences_of_their_own(setup):
    engine, core = setup
    got: list[Delta | Done | Error] = []
    core.submit("a", Generate(request_id="a", prompt_token_ids=PROMPT, n=3, seed=7, max_tokens=5, ignore_eos=True,
                              stop=["never said"]), got.append)
    core.submit("b", Generate(request_id="b", prompt_token_ids=PROMPT, seed=7, max_tokens=5), got.append)
    a, b = engine.sent  # the parameters and the prompt cross once for the three samples
    assert [s.index for s in a.samples()] == [0, 1, 2] and len(set(_sample_ids(engine))) == 4
    assert a.params.seed == 7 and b.params.seed == 7  # sample i draws with seed + i (sample_seed)
    assert a.sample_group is not None and b.sample_group is None
    assert len(engine.sched.requests) == 4
    while core.num_open:
        engine.step(core)
    done = [m for m in got if isinstance(m, Done) and m.request_id == "a"]
    assert len(done) == 1 and done[0].finish_reasons == ["length"] * 3
    for i in range(3):
        ids = [t for m in got if isinstance(m, Delta) and m.request_id == "a" and m.index == i for t in m.token_ids]
        assert ids == _expected(5)
    # With prefix caching off, samples 1 and 2 still reuse sample 0's two full blocks; "b" does not.
    assert engine.sched.stats.computed_prompt_tokens == 40 + 2 * 8 + 40


def test_abort_of_the_client_request_aborts_every_sample_and_frees_its_blocks(setup):
    engine, core = setup
    got: list[Delta | Done | Error] = []
    core.submit("a", Generate(request_id="a", prompt_token_ids=PROMPT, n=4, max_tokens=50, ignore_eos=True),
                got.append)
    for _ in range(3):
        engine.step(core)
    assert engine.sched.kv.num_free_blocks < NUM_BLOCKS
    core.abort("a")
    assert sorted(engine.aborted) == sorted(_sample_ids(engine))
    engine.step(core)
    assert engine.sched.kv.num_free_blocks == NUM_BLOCKS and not engine.sched.requests
    assert isinstance(got[-1], Done) and got[-1].finish_reasons == ["abort"] * 4
    assert sum(isinstance(m, Done | Error) for m in got) == 1


def test_an_engine_error_ends_the_request_once(demo_tokenizer):
    engine = InProcessEngine(max_model_len=32)  # the prompt is too long for the engine, not the frontend
    core = FrontendCore(engine, InputProcessor(demo_tokenizer, [501], 700, 1024))  # type: ignore[arg-type]
    got: list[Delta | Done | Error] = []
    core.submit("a", Generate(request_id="a", prompt_token_ids=PROMPT, n=3), got.append)
    engine.step(core)
    assert [type(m) for m in got] == [Error] and got[0].code == "prompt_too_long"
    assert core.num_open == 0 and not engine.sched.has_work()


def test_a_restarted_scheduler_gets_each_request_once_with_its_open_samples(setup):
    engine, core = setup
    got: list[Delta | Done | Error] = []
    core.submit("a", Generate(request_id="a", prompt_token_ids=PROMPT, n=3, seed=7, max_tokens=6, ignore_eos=True),
                got.append)
    for _ in range(3):
        engine.step(core)
    [first] = engine.sent
    # Sample 1 ends here (as a stop string would end it); the scheduler then restarts empty.
    req, sample = core.by_rid[first.req_id + 1]
    core._finish_sample(req, sample, "stop")
    fresh = InProcessEngine()
    core.engine = fresh  # type: ignore[assignment]
    assert core.resubmit_all() == 2
    [again] = fresh.sent
    assert [(s.req_id, s.index) for s in again.samples()] == [(first.req_id, 0), (first.req_id + 2, 2)]
    assert all(s.output_token_ids == _expected(6)[:len(s.output_token_ids)] and s.output_token_ids
               for s in again.samples())
    assert again.params is first.params and again.sample_group == first.sample_group
    while core.num_open:
        fresh.step(core)
    for i in (0, 2):  # the resumed samples end as if undisturbed
        ids = [t for m in got if isinstance(m, Delta) and m.index == i for t in m.token_ids]
        assert ids == _expected(6)
