"""The frontend's one-of-a-kind builders, without processes: `generate` messages
from SamplingParams (LLM, client, OpenAI bridge), RequestOutputs from deltas,
and the engine-output pump shared by the ZMQ server and the offline LLM."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from noria.frontend.bridge.openai_requests import chat_generate, completion_generates
from noria.frontend.bridge.openai_schema import ChatRequest, CompletionRequest
from noria.frontend.inputs import make_generate
from noria.frontend.outputs import CompletionOutput, OutputBuilder, RequestOutput
from noria.frontend.pump import pump_engine
from noria.protocol.client import Delta, Done, Error, Generate, Logprob, Usage
from noria.protocol.engine import EngineDead, EngineOutputs, RequestUpdate
from noria.protocol.sampling import SamplingParams

PARAMS = SamplingParams(n=2, max_tokens=7, temperature=0.5, top_k=3, seed=9, stop=["x"], logprobs=1)


def _wire(msg: Generate) -> dict:
    """What a client in another language sees: the msgpack map."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg))


@pytest.mark.parametrize(
    "prompt, messages, expect",
    [
        ("Hello", None, {"prompt": "Hello", "prompt_token_ids": None, "messages": None}),
        ((5, 6, 7), None, {"prompt": None, "prompt_token_ids": [5, 6, 7], "messages": None}),
        (None, [{"role": "user", "content": "Hi"}], {"prompt": None, "prompt_token_ids": None,
                                                    "messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_make_generate_lays_every_sampling_field_flat(prompt, messages, expect):
    m = _wire(make_generate("r1", prompt, PARAMS, messages=messages, priority=2))
    assert m["type"] == "generate" and m["request_id"] == "r1" and m["priority"] == 2
    # Fields at their defaults are left out of the map (omit_defaults), i.e. read as nil.
    assert {k: m.get(k) for k in expect} == expect
    sampling = msgspec.to_builtins(PARAMS)
    assert sampling["n"] == 2 and {k: m[k] for k in sampling} == sampling
    assert m.get("add_generation_prompt", True) is True


def test_make_generate_defaults_match_a_bare_generate():
    assert make_generate("r", "p") == Generate(request_id="r", prompt="p")


def test_the_openai_bridge_builds_the_same_generates():
    ids = (f"u{i}" for i in itertools.count())
    req = msgspec.json.decode(b'{"prompt": ["a", "b"], "n": 2, "max_tokens": 4, "seed": 3, "priority": 1}',
                              type=CompletionRequest)
    outs = completion_generates(req, lambda: next(ids))
    assert [(g.request_id, g.prompt, g.n, g.max_tokens, g.seed, g.priority) for g in outs] == [
        ("u0", "a", 2, 4, 3, 1), ("u1", "b", 2, 4, 3, 1)]
    req = msgspec.json.decode(b'{"prompt": [[1, 2], [3]]}', type=CompletionRequest)
    assert [g.prompt_token_ids for g in completion_generates(req, lambda: next(ids))] == [[1, 2], [3]]
    chat = msgspec.json.decode(
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],'
        b' "add_generation_prompt": false, "max_completion_tokens": 5}', type=ChatRequest)
    g = chat_generate(chat, lambda: "c0")
    assert g.messages == [{"role": "user", "content": "Hi"}] and g.add_generation_prompt is False
    assert g.max_tokens == 5 and g.prompt is None and g.prompt_token_ids is None


def _lp(t: int) -> Logprob:
    return Logprob(token_id=t, logprob=-float(t))


def test_output_builder_assembles_interleaved_samples():
    b = OutputBuilder("r", "the prompt", 2)
    b.add(Delta(request_id="r", text="He", token_ids=[1], index=0, logprobs=[_lp(1)]))
    b.add(Delta(request_id="r", text="Wo", token_ids=[4, 5], index=1))
    b.add(Delta(request_id="r", text="", token_ids=[2], index=0, logprobs=[_lp(2)]))
    b(Delta(request_id="r", text="llo", token_ids=[3], index=0, logprobs=[_lp(3)]))  # callable: a core sink
    assert b.final is None
    b.add(Done(request_id="r", finish_reason="stop", finish_reasons=["stop", "length"], prompt_token_ids=[9, 8],
               usage=Usage(prompt_tokens=2, completion_tokens=5, cached_tokens=16)))
    assert b.output() == RequestOutput(
        request_id="r", prompt="the prompt", prompt_token_ids=[9, 8], num_cached_tokens=16,
        outputs=[
            CompletionOutput(index=0, text="Hello", token_ids=[1, 2, 3], finish_reason="stop",
                             logprobs=[_lp(1), _lp(2), _lp(3)]),
            CompletionOutput(index=1, text="Wo", token_ids=[4, 5], finish_reason="length", logprobs=None),
        ],
    )


def test_output_builder_keeps_an_error_and_has_no_output_for_it():
    b = OutputBuilder("r", None, 1)
    b.add(Error(request_id="r", code="engine_dead", message="gone"))
    assert isinstance(b.final, Error)
    with pytest.raises(AssertionError):
        b.output()


class _FakeEngine:
    def __init__(self, batches: list[list[object]], dead: str | None = None) -> None:
        self.batches, self._dead = batches, dead
        self.waits: list[int] = []

    def recv(self, timeout_ms: int) -> list[object]:
        self.waits.append(timeout_ms)
        return self.batches.pop(0) if self.batches else []

    def dead(self) -> str | None:
        return self._dead


class _FakeCore:
    def __init__(self, engine: _FakeEngine) -> None:
        self.engine = engine
        self.applied: list[EngineOutputs] = []
        self.failed: list[str] = []

    def on_outputs(self, out: EngineOutputs) -> None:
        self.applied.append(out)

    def fail_all(self, reason: str) -> None:
        self.failed.append(reason)


def test_pump_applies_outputs_until_the_engine_says_it_died():
    outs = [EngineOutputs([RequestUpdate(0, [5])]), EngineOutputs([RequestUpdate(0, [6], "stop")])]
    core = _FakeCore(_FakeEngine([[outs[0]], [outs[1], EngineDead("worker 0 exited"), outs[0]]]))
    assert pump_engine(core, 250) is None  # type: ignore[arg-type]
    assert pump_engine(core, 0) == "worker 0 exited"  # type: ignore[arg-type]
    assert core.applied == outs and core.failed == ["engine died: worker 0 exited"]
    assert core.engine.waits == [250, 0]


def test_an_idle_pump_looks_at_the_processes():
    alive = _FakeCore(_FakeEngine([]))
    assert pump_engine(alive, 0) is None and alive.failed == []  # type: ignore[arg-type]
    gone = _FakeCore(_FakeEngine([], dead="scheduler exited with code -9"))
    assert pump_engine(gone, 0) == "scheduler exited with code -9"  # type: ignore[arg-type]
    assert gone.failed == ["engine died: scheduler exited with code -9"]
    busy_but_dead = _FakeCore(_FakeEngine([[EngineOutputs([])]], dead="late"))
    assert pump_engine(busy_but_dead, 0) is None  # type: ignore[arg-type]  # messages came: alive enough
