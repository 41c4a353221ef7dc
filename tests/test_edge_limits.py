"""Hostile input at the edge: a real `noria serve` (bridge + frontend) gets what an attacker
sends and must answer each with one clear error for that request only, quickly, and keep
serving everyone: integers past 64 bits, JSON nested 10,000 deep, bytes that are not UTF-8,
oversized chat messages and word lists, a repetition penalty that vanishes in float32, a
`priority` the server does not honour, a `max_tokens` past the context, and aborts that
overtake their `generate` on a websocket."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import msgspec
import pytest
import websockets

from noria import AsyncClient, SamplingParams
from noria.frontend.processor import InputLimits, InputProcessor, json_size
from noria.protocol.client import Delta, Generate
from noria.protocol.errors import NoriaError, ParamError
from noria.protocol.sampling import check_sampling
from tests.procs import engine_idle, serve_http, wait_metrics

MAX_MODEL_LEN = 256
INT_FIELDS = ("priority", "top_k", "max_tokens", "min_tokens", "n", "seed", "logprobs")
HUGE = (2**64, -(2**64))


@pytest.fixture(scope="module")
def served(demo_path):
    with serve_http("--num-kv-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN)) as s:
        yield s


def _post(served, path: str, body: bytes | dict) -> tuple[int, str, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(served.http + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get_content_type(), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get_content_type(), json.loads(e.read())


def _bad_request(served, path: str, body: bytes | dict) -> dict:
    """A 400 in OpenAI's error shape, as JSON; its `error` object."""
    status, ctype, out = _post(served, path, body)
    assert (status, ctype) == (400, "application/json"), (status, out)
    assert set(out["error"]) == {"message", "type", "param", "code"}
    return out["error"]


def _completion(**kw) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, "temperature": 0.0, **kw}


def _chat(messages: list, **kw) -> dict:
    return {"messages": messages, "max_tokens": 2, "temperature": 0.0, **kw}


def _serves(served) -> None:
    status, _, out = _post(served, "/v1/completions", _completion())
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("field", INT_FIELDS)
def test_huge_integers_are_a_400_naming_the_field(served, field, value):
    err = _bad_request(served, "/v1/completions", _completion(**{field: value}))
    assert err["param"] == field and err["code"] in ("invalid_message", "invalid_request"), err
    err = _bad_request(served, "/v1/chat/completions", _chat([{"role": "user", "content": "hi"}], **{field: value}))
    assert err["param"] == field, err
    _serves(served)


def test_huge_integers_inside_prompts_and_messages_are_a_400(served):
    err = _bad_request(served, "/v1/completions", _completion(prompt=[1, 2**64]))
    assert err["code"] == "invalid_request" and "encoded" in err["message"]
    err = _bad_request(served, "/v1/chat/completions", _chat([{"role": "user", "content": "hi", "x": -(2**64)}]))
    assert err["code"] == "invalid_request"
    _serves(served)


@pytest.mark.parametrize("body", [b"[" * 10_000 + b"]" * 10_000, b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                                  b'{"prompt": "\xff\xfe", "max_tokens": 2}', b"{not json"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_undecodable_bodies_are_a_400_json(served, path, body):
    err = _bad_request(served, path, body)
    assert err["code"] == "invalid_message" and "Traceback" not in err["message"]
    _serves(served)


def test_oversized_chat_and_word_lists_are_a_400_naming_the_field(served):
    user = {"role": "user", "content": "hi"}
    cases = [
        # The prompt-size guard counts every field, not only `content`.
        (_chat([{"role": "r" * 100_000, "content": "x"}]), "messages"),
        (_chat([user | {"name": "n" * 100_000}]), "messages"),
        (_chat([{"role": "user", "content": [{"type": "text", "text": "t" * 100_000}]}]), "messages"),
        (_chat([{"role": "user", "content": ""}] * 5000), "messages"),
        (_chat([user], bad_words=["w"] * 2000), "bad_words"),
        (_chat([user], bad_words=["w" * 70_000]), "bad_words"),
        (_chat([user], stop=["s"] * 300), "stop"),
        (_chat([user], logit_bias={str(i): 1.0 for i in range(2000)}), "logit_bias"),
        (_chat([user], allowed_token_ids=list(range(700)) * 2), "allowed_token_ids"),
    ]
    for body, field in cases:
        err = _bad_request(served, "/v1/chat/completions", body)
        assert err["param"] == field, (field, err)
    err = _bad_request(served, "/v1/completions", _completion(prompt=["a"] * 5, n=64))
    assert err["param"] == "n" and "320" in err["message"]
    _serves(served)


def test_a_vanishing_repetition_penalty_is_a_400(served):
    for value in (1e-300, 0.0, 1e300):
        err = _bad_request(served, "/v1/completions", _completion(repetition_penalty=value))
        assert err["param"] == "repetition_penalty", err
    status, _, out = _post(served, "/v1/completions", _completion(repetition_penalty=0.5))
    assert status == 200


def test_max_tokens_past_the_context_is_a_400_with_the_numbers(served):
    err = _bad_request(served, "/v1/completions", _completion(prompt=[1, 2, 3], max_tokens=1_000_000_000))
    assert err["param"] == "max_tokens"
    assert f"max_tokens (1000000000) + prompt tokens (3) > max_model_len ({MAX_MODEL_LEN})" in err["message"]
    # What fits exactly is served.
    status, _, out = _post(served, "/v1/completions", _completion(prompt=[1, 2, 3], max_tokens=MAX_MODEL_LEN - 3,
                                                                    ignore_eos=True))
    assert status == 200 and out["usage"]["completion_tokens"] == MAX_MODEL_LEN - 3


def test_priority_needs_the_priority_policy(served):
    err = _bad_request(served, "/v1/completions", _completion(priority=1))
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    status, _, _ = _post(served, "/v1/completions", _completion(priority=0))
    assert status == 200


def _ws_url(served) -> str:
    return served.http.replace("http://", "ws://") + "/v1/stream"


def _generate(rid: str, **kw) -> str:
    return json.dumps({"type": "generate", "request_id": rid, "prompt": "Hello", "max_tokens": 2,
                       "temperature": 0.0, **kw})


async def _final(ws, rid: str) -> dict:
    while True:
        m = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 60))
        if m.get("request_id") == rid and m["type"] in ("done", "error"):
            return m


def test_bad_websocket_messages_get_an_error_and_the_socket_keeps_serving(served):
    bad: list[tuple[str | bytes, str | None, str | None]] = [  # (message, its request id, the field to be named)
        ("[" * 10_000 + "]" * 10_000, None, None),
        ('{"type": "generate", "request_id": "d", "prompt": ' + "[" * 10_000 + "]" * 10_000 + "}", None, None),
        (b'{"type": "generate", "request_id": "u", "prompt": "\xff\xfe"}', None, None),
    ]
    for field in INT_FIELDS:
        for i, value in enumerate(HUGE):
            bad.append((_generate(f"{field}{i}", **{field: value}), f"{field}{i}", field))
    bad.append((_generate("role", messages=[{"role": "r" * 100_000, "content": "x"}], prompt=None), "role", "messages"))
    bad.append((_generate("pen", repetition_penalty=1e-300), "pen", "repetition_penalty"))
    bad.append((_generate("prio", priority=7), "prio", "priority"))
    bad.append((_generate("len", max_tokens=10**9), "len", "max_tokens"))

    async def main() -> list[tuple[dict, dict]]:
        out = []
        async with websockets.connect(_ws_url(served), max_size=None) as ws:
            for k, (msg, _, _) in enumerate(bad):
                await ws.send(msg)
                err = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 60))
                # The same socket serves the next request to the end.
                await ws.send(_generate(f"ok{k}"))
                out.append((err, await _final(ws, f"ok{k}")))
        return out

    for (msg, rid, field), (err, ok) in zip(bad, asyncio.run(main()), strict=True):
        assert err["type"] == "error" and err["request_id"] == rid, (msg[:80], err)
        assert err["code"] in ("invalid_message", "invalid_request", "prompt_too_long"), err
        if field is not None and not (field == "seed" and err["code"] == "invalid_request"):
            assert err.get("param") == field, err
        assert ok["type"] == "done" and ok["finish_reason"] == "length"


def test_websocket_aborts_that_overtake_their_generate_still_abort(served):
    """Each abort is sent right after its generate, before the bridge has forwarded it."""
    pairs = 20

    async def main() -> dict[str, dict]:
        async with websockets.connect(_ws_url(served)) as ws:
            for i in range(pairs):
                await ws.send(_generate(f"a{i}", max_tokens=None, ignore_eos=True))
                await ws.send(json.dumps({"type": "abort", "request_id": f"a{i}"}))
            finals: dict[str, dict] = {}
            while len(finals) < pairs:
                m = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 120))
                if m["type"] in ("done", "error"):
                    assert m["request_id"] not in finals, "two final messages"
                    finals[m["request_id"]] = m
            return finals

    finals = asyncio.run(main())
    assert sorted(finals) == sorted(f"a{i}" for i in range(pairs))
    for m in finals.values():
        assert (m["type"], m.get("finish_reason")) == ("done", "abort"), m
        assert m["usage"]["completion_tokens"] < MAX_MODEL_LEN // 2
    assert engine_idle(wait_metrics(served.http, engine_idle))


def test_zmq_errors_name_their_field(served):
    async def main() -> list[NoriaError]:
        errors = []
        async with AsyncClient(served.address) as c:
            for kw, params in (({"priority": 3}, None), ({}, SamplingParams(max_tokens=10**6)),
                               ({}, SamplingParams(stop=["x"] * 300)), ({}, SamplingParams(top_k=2**64))):
                with pytest.raises(NoriaError) as e:
                    await c.generate("Hello", params, **kw)
                errors.append(e.value)
            # and the connection goes on serving
            out = await c.generate("Hello", SamplingParams(max_tokens=2))
            assert out.outputs[0].finish_reason == "length"
        return errors

    errors = asyncio.run(main())
    assert [(e.code, e.param) for e in errors[:3]] == [("invalid_request", "priority"), ("invalid_request", "max_tokens"),
                                                      ("invalid_request", "stop")]
    assert errors[3].code == "invalid_request"  # cannot even be encoded: refused before it is sent


@pytest.fixture(scope="module")
def by_priority(demo_path):
    # A long context: the first request must still run while the two others queue behind it.
    with serve_http("--num-kv-blocks", "160", "--max-model-len", "2048", "--max-num-seqs", "1",
                    "--scheduling-policy", "priority") as s:
        yield s


def test_priority_is_honoured_under_the_priority_policy(by_priority):
    """One sequence at a time: while a first request runs, a low-priority (5) and then a
    high-priority (-5) request wait; once the first is aborted the later, higher one goes first."""

    async def main() -> list[str]:
        order: list[str] = []
        async with AsyncClient(by_priority.address) as c:
            async def run(rid: str, priority: int) -> None:
                async for out in c.stream("Hello", SamplingParams(max_tokens=4, ignore_eos=True), request_id=rid,
                                          priority=priority):
                    if isinstance(out, Delta) and out.token_ids and rid not in order:
                        order.append(rid)

            long = c.stream("Go on", SamplingParams(max_tokens=None, ignore_eos=True), request_id="first")
            await long.__anext__()  # it runs: the others must wait behind it
            low = asyncio.create_task(run("low", 5))
            high = asyncio.create_task(run("high", -5))
            for _ in range(1200):
                stats = await c.stats()
                if stats.stats.num_waiting == 2:
                    break
                await asyncio.sleep(0.05)  # polling the engine's published state
            assert stats.stats.num_waiting == 2 and stats.stats.num_running == 1, stats
            await c.abort("first")
            async for _ in long:
                pass
            await asyncio.gather(low, high)
        return order

    assert asyncio.run(main()) == ["high", "low"]


def test_input_limits_unit(demo_tokenizer):
    """The frontend's checks on their own: each limit names its field, and the prompt
    size counts every string of every message (roles, names, tool calls, content parts)."""
    proc = InputProcessor(demo_tokenizer, [501], 700, 64, InputLimits(max_prompt_chars=100, max_messages=3,
                                                                      max_stop_strings=2, max_bad_words=2,
                                                                      max_word_chars=10, max_logit_bias=2))

    def field_of(**kw) -> str | None:
        msg = Generate(request_id="r", **({"prompt": "hi"} | kw))
        try:
            proc.process(msg)
        except ParamError as e:
            return e.param
        return None

    assert field_of() is None
    assert field_of(prompt="x" * 101) == "prompt"
    assert field_of(prompt=None, messages=[{"role": "user", "content": "hi"}] * 4) == "messages"
    assert field_of(prompt=None, messages=[{"role": "u" * 120, "content": ""}]) == "messages"
    tool = {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "a" * 120}}]}
    assert field_of(prompt=None, messages=[tool]) == "messages"
    assert field_of(stop=["a", "b", "c"]) == "stop"
    assert field_of(stop=["a" * 11]) == "stop"
    assert field_of(bad_words=["a", "b", "c"]) == "bad_words"
    assert field_of(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}) == "logit_bias"
    assert field_of(allowed_token_ids=[1] * 701) == "allowed_token_ids"
    assert field_of(max_tokens=63) == "max_tokens"  # "hi" is more than one token
    assert field_of(priority=1) == "priority"
    assert InputProcessor(demo_tokenizer, [501], 700, 64, scheduling_policy="priority").check_priority(1) is None
    with pytest.raises(ParamError):
        InputProcessor(demo_tokenizer, [501], 700, 64, scheduling_policy="priority").check_priority(2**40)

    deep: list = []
    for _ in range(50_000):  # no recursion: nesting this deep must not raise
        deep = [deep]
    assert json_size(deep, 10**9) == 50_000
    assert json_size([{"ab": "cde"}, 7], 10**9) == 2 + 1 + 2 + 3 + 1
    assert json_size(["x" * 50] * 10**6, 100) > 100


def test_sampling_ranges_unit():
    for bad in ({"repetition_penalty": 1e-300}, {"repetition_penalty": 101.0}, {"top_k": 2**63},
                {"max_tokens": 2**63}, {"min_tokens": -1}, {"seed": 2**64}, {"stop_token_ids": [2**63]}):
        with pytest.raises(ParamError) as e:
            check_sampling(SamplingParams(**bad))
        assert e.value.param == next(iter(bad))
    check_sampling(SamplingParams(repetition_penalty=0.01, seed=2**64 - 1, top_k=2**63 - 1))
    # Past 64 bits a field fails where the message is decoded, naming itself.
    dec = msgspec.json.Decoder(Generate)
    for field in ("priority", "top_k", "max_tokens", "min_tokens", "n"):
        with pytest.raises(msgspec.ValidationError, match=field):
            dec.decode(json.dumps({"type": "generate", "request_id": "r", "prompt": "x", field: 2**64}))
