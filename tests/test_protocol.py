"""Round trips for every message, and the language-neutral shape of client messages."""

from __future__ import annotations

import msgspec
import pytest

from noria.protocol.client import (
    Abort,
    ClientToServer,
    Delta,
    Done,
    Error,
    Generate,
    GetStats,
    Hello,
    Logprob,
    Ready,
    SchedulerStats,
    ServerToClient,
    Stats,
    Usage,
)
from noria.protocol.codec import Codec
from noria.protocol.config import EngineAddresses, EngineConfig
from noria.protocol.engine import (
    EngineAbort,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    EngineSample,
    EngineShutdown,
    FrontendToScheduler,
    RequestUpdate,
    SchedulerToFrontend,
    StatsQuery,
)
from noria.protocol.errors import ParamError
from noria.protocol.model_identity import ModelIdentity, WeightFile
from noria.protocol.sampling import (
    EngineSamplingParams,
    SamplingParams,
    check_sampling,
    engine_params,
    sample_seed,
)
from noria.protocol.step import CachedRequestData, NewRequestData, StepPlan, StepResult
from noria.protocol.worker_link import (
    Disband,
    Heartbeat,
    Refused,
    Register,
    SchedulerToWorker,
    Welcome,
    WorkerFailed,
    WorkerReady,
    WorkerShutdown,
    WorkerToScheduler,
)

LP = Logprob(token_id=3, logprob=-0.5, top_token_ids=[3, 4], top_logprobs=[-0.5, -1.5])
PARAMS = SamplingParams(n=2, max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["x"], logprobs=2)
ENGINE_PARAMS = engine_params(PARAMS, [[5, 6], [7]])

CLIENT_MSGS = [
    Generate(request_id="r1", prompt="hi", max_tokens=5, temperature=0.0, stop=["\n"]),
    Generate(request_id="r2", messages=[{"role": "user", "content": "hi"}], n=3, seed=1),
    Generate(request_id="r3", prompt_token_ids=[1, 2, 3], priority=-1),
    Abort(request_id="r1"),
    Hello(),
    GetStats(),
]
SERVER_MSGS = [
    Delta(request_id="r1", text="é", token_ids=[1, 2], logprobs=[LP]),
    Done(request_id="r1", finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=2)),
    Done(request_id="r2", finish_reason="length", usage=Usage(prompt_tokens=40, completion_tokens=2, cached_tokens=32)),
    Error(request_id=None, code="invalid_message", message="bad"),
    Ready(protocol_version=1, model="demo", max_model_len=2048, vocab_size=706),
    Stats(stats=SchedulerStats(num_running=3, kv_cache_usage=0.5), num_open_requests=2),
]


@pytest.mark.parametrize("msg", CLIENT_MSGS, ids=lambda m: type(m).__name__)
def test_client_messages_are_maps_with_type(msg):
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
    assert isinstance(raw, dict) and raw["type"] == type(msg).__struct_config__.tag
    assert Codec(ClientToServer).decode(msgspec.msgpack.encode(msg)) == msg


@pytest.mark.parametrize("msg", SERVER_MSGS, ids=lambda m: type(m).__name__)
def test_server_messages_round_trip(msg):
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
    assert isinstance(raw, dict) and "type" in raw
    assert Codec(ServerToClient).decode(msgspec.msgpack.encode(msg)) == msg


def test_usage_cached_tokens_is_optional_both_ways():
    # A `done` from a server that predates `cached_tokens` reads as 0 ...
    old = {"type": "done", "request_id": "r", "finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    done = Codec(ServerToClient).decode(msgspec.msgpack.encode(old))
    assert isinstance(done, Done) and done.usage == Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0)

    # ... and a reader that predates it ignores it.
    class OldUsage(msgspec.Struct, kw_only=True):
        prompt_tokens: int
        completion_tokens: int

    new = msgspec.msgpack.encode(Usage(prompt_tokens=40, completion_tokens=2, cached_tokens=32))
    assert msgspec.msgpack.decode(new) == {"prompt_tokens": 40, "completion_tokens": 2, "cached_tokens": 32}
    assert msgspec.msgpack.decode(new, type=OldUsage) == OldUsage(prompt_tokens=40, completion_tokens=2)


def test_a_foreign_client_map_decodes():
    # What a client in another language builds by hand.
    raw = {"type": "generate", "request_id": "x", "prompt": "hello", "max_tokens": 3, "top_k": 2}
    msg = Codec(ClientToServer).decode(msgspec.msgpack.encode(raw))
    assert isinstance(msg, Generate) and msg.max_tokens == 3 and msg.top_k == 2
    assert msg.sampling_params() == SamplingParams(max_tokens=3, top_k=2)


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"type": "launch", "request_id": "x"}, "launch"),
        ({"type": "generate", "request_id": 5, "prompt": "a"}, "request_id"),
        ({"type": "generate", "request_id": "x", "max_tokens": "many"}, "max_tokens"),
        ({"request_id": "x"}, "type"),
    ],
)
def test_bad_client_messages_name_the_problem(raw, words):
    with pytest.raises(msgspec.ValidationError, match=words):
        Codec(ClientToServer).decode(msgspec.msgpack.encode(raw))


IDENTITY = ModelIdentity("ab" * 32, [WeightFile("model.safetensors", 1234, "cd" * 32)])

INTERNAL = [
    (FrontendToScheduler, EngineRequest(1, [1, 2], ENGINE_PARAMS, [0], 2)),
    (FrontendToScheduler, EngineRequest(1, [1, 2], ENGINE_PARAMS, [0], 0, 1, [9], 0, [EngineSample(2, 1, [8])])),
    (FrontendToScheduler, EngineAbort([1, 2])),
    (FrontendToScheduler, EngineShutdown()),
    (FrontendToScheduler, StatsQuery()),
    (SchedulerToFrontend, EngineOutputs([RequestUpdate(1, [5], "stop", [LP])], SchedulerStats(num_running=2))),
    (SchedulerToFrontend, EngineReady(10, 16, 2048, 706)),
    (SchedulerToFrontend, EngineDead("boom")),
    (SchedulerToWorker, StepPlan(3, [(1, 5)], [NewRequestData(1, [1, 2], [0], 0, 0, 2, [0], 1)],
                                 [CachedRequestData(2, [4])], [7], [(3, 0)], [(0, 3)], epoch=4, params=[ENGINE_PARAMS])),
    (SchedulerToWorker, WorkerShutdown()),
    (SchedulerToWorker, Welcome(2, EngineConfig(model="/m", tensor_parallel_size=2), IDENTITY, 1.0, 5.0,
                                "tcp://10.0.0.2:29500")),
    (SchedulerToWorker, Refused("protocol version 9 != 1")),
    (SchedulerToWorker, Heartbeat(2)),
    (SchedulerToWorker, Disband(2, "rank 1 lost")),
    (WorkerToScheduler, StepResult(3, [1], [9], [LP], epoch=2)),
    (WorkerToScheduler, Register(1, 0, "cpu", "host-a", 123, 2**30, IDENTITY, "10.0.0.2:29500")),
    (WorkerToScheduler, Register(1, 1, "cuda", "host-b", 7, 0, None)),
    (WorkerToScheduler, WorkerReady(2, 0, 10, 4, 706, 2048)),
    (WorkerToScheduler, WorkerFailed(2, 0, "oom")),
    (WorkerToScheduler, Heartbeat(2)),
]


@pytest.mark.parametrize("union, msg", INTERNAL, ids=lambda x: type(x).__name__)
def test_internal_messages_round_trip(union, msg):
    c = Codec(union)
    assert c.decode(c.encode(msg)) == msg


def test_config_round_trips_as_json():
    cfg = EngineConfig(model="/m", num_kv_blocks=24, preemption_mode="swap")
    addrs = EngineAddresses(requests="ipc://a", outputs="ipc://b", workers="tcp://10.0.0.1:7000")
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=EngineConfig) == cfg
    assert msgspec.json.decode(msgspec.json.encode(addrs), type=EngineAddresses) == addrs


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"n": "3"}, "n"),  # a Python caller's wrong type is caught too
    ],
)
def test_sampling_validation_names_the_field(kw, param):
    with pytest.raises(ParamError) as e:
        check_sampling(SamplingParams(**kw))
    assert e.value.param == param and param in e.value.message
    assert e.value.code == "invalid_request" and isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "kw",
    [  # the edges of vLLM's ranges are valid
        {"temperature": 0}, {"top_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"min_p": 1.0}, {"n": 64},
        {"logprobs": 0}, {"logprobs": 20}, {"presence_penalty": -2}, {"frequency_penalty": 2},
        {"max_tokens": None, "min_tokens": 5}, {"min_tokens": 3, "max_tokens": 3}, {"seed": 2**64 - 1},
        {"seed": -(2**63)}, {"stop": "x"},
    ],
)
def test_valid_sampling_params_pass(kw):
    check_sampling(SamplingParams(**kw))


def test_stop_token_ids_are_checked_against_the_vocabulary():
    check_sampling(PARAMS, vocab_size=100)
    check_sampling(SamplingParams(stop_token_ids=[99]), vocab_size=100)
    with pytest.raises(ParamError) as e:
        check_sampling(SamplingParams(stop_token_ids=[100]), vocab_size=100)
    assert e.value.param == "stop_token_ids"


def test_checked_types_name_real_fields():
    assert set(SamplingParams.CHECKED) <= set(SamplingParams.__struct_fields__)
    # The wire type stays loose: an out-of-range value decodes (and is rejected later, with its request id).
    g = msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "generate", "request_id": "r", "n": 0}), type=Generate)
    assert g.n == 0


def test_engine_params_carry_token_ids_only_once_each():
    p = SamplingParams(n=4, seed=2**64 - 2, stop=["zebra crossing"], bad_words=["giraffe"], stop_token_ids=[9, 3, 9],
                       allowed_token_ids=[5, 5, 1], skip_special_tokens=False)
    e = engine_params(p, [[7, 8], [7, 8], [4]])
    wire = msgspec.msgpack.encode(EngineRequest(0, [1], e, [2], more_samples=[EngineSample(i, i) for i in range(1, 4)]))
    assert b"zebra" not in wire and b"giraffe" not in wire  # text stays in the frontend
    assert e.stop_token_ids == [3, 9] and e.allowed_token_ids == [1, 5] and e.bad_words_token_ids == [[7, 8], [4]]
    # Beyond SamplingParams' own fields only token ids the frontend derived: the bad words' and the
    # reasoning parser's end-of-thinking token (the grammar waits for it).
    derived = {"bad_words_token_ids", "reasoning_end_token_id"}
    assert set(EngineSamplingParams.__struct_fields__) <= set(SamplingParams.__struct_fields__) | derived
    # Sample i's seed is the request's + i, wrapping at 2**64 (vLLM's rule, 64 bits in torch).
    assert [sample_seed(e.seed, i) for i in range(4)] == [2**64 - 2, 2**64 - 1, 0, 1]
    assert sample_seed(None, 3) is None
