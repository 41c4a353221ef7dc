"""FrontendCore's admission caps, in one process with a real Scheduler: over a cap a request
is refused as `overloaded`, and every way a request ends (done, client abort, vanished
client, engine error, stop string) gives its place back, so a cap never leaks shut."""

from __future__ import annotations

import pytest

from noria.frontend.core import FrontendCore, Limits
from noria.frontend.processor import InputProcessor
from noria.protocol.client import Delta, Done, Error, Generate
from noria.protocol.engine import EngineOutputs, RequestUpdate
from tests.test_frontend_samples import PROMPT, InProcessEngine


@pytest.fixture
def setup(demo_tokenizer):
    engine = InProcessEngine()
    core = FrontendCore(engine, InputProcessor(demo_tokenizer, [501], 700, 1024),  # type: ignore[arg-type]
                        Limits(max_queued=3, max_per_client=2))
    return engine, core


def _submit(core: FrontendCore, client: str, rid: str, got: list, max_tokens: int = 4) -> None:
    msg = Generate(request_id=rid, prompt_token_ids=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.submit((client, rid), msg, got.append, client=client)


def _codes(got: list) -> list[str]:
    return [m.code for m in got if isinstance(m, Error)]


def test_caps_refuse_and_every_ending_gives_the_place_back(setup):
    engine, core = setup
    got: list[Delta | Done | Error] = []
    _submit(core, "a", "1", got)
    _submit(core, "a", "2", got)
    _submit(core, "a", "3", got)  # a third for client a: over its cap of 2
    assert _codes(got) == ["overloaded"] and "connection" in got[-1].message
    _submit(core, "b", "1", got)
    _submit(core, "c", "1", got)  # 3 wait to start: the queue is full
    assert _codes(got) == ["overloaded", "overloaded"] and "overloaded" in got[-1].message
    assert core.num_queued == 3
    # Endings of every kind: a client abort, a vanished client, an engine error, a done.
    core.abort(("a", "1"))
    core.abort_where(lambda key: key[0] == "b")
    req, sample = next(v for v in core.by_rid.values() if v[0].key == ("a", "2"))
    core.on_outputs(EngineOutputs([RequestUpdate(sample.rid, [], finish_reason="error", error_code="internal_error",
                                                 error_message="boom")]))
    assert core.num_queued == 0 and dict(core.per_client) == {}
    for _ in range(50):
        if not engine.sched.has_work():
            break
        engine.step(core)
    assert core.num_open == 0 and core.num_queued == 0 and not core.per_client
    # Nothing leaked shut: the caps admit as many as before.
    got.clear()
    for rid in ("x", "y"):
        _submit(core, "a", rid, got)
    _submit(core, "d", "z", got)
    assert _codes(got) == []
    assert core.num_queued == 3


def test_started_requests_leave_the_queue(setup):
    engine, core = setup
    got: list[Delta | Done | Error] = []
    for c in ("a", "b", "c"):
        _submit(core, c, "1", got, max_tokens=8)
    engine.step(core)  # prefill: each request gets its first token and counts as started
    assert core.num_queued == 0 and core.num_open == 3
    _submit(core, "d", "1", got)
    assert _codes(got) == []
