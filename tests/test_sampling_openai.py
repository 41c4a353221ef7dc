"""The sampling surface through a live `noria serve --dtype float32`: the ZMQ wire (raw
msgpack maps and `noria.Client`) and the OpenAI API (the official `openai` package),
checked against transformers' float32 logits; and the OpenAI fields that noria cannot
honour, refused with a 400 naming them, next to the fields it may safely ignore."""

from __future__ import annotations

import itertools

import msgspec
import openai
import pytest
import zmq

from noria import Client, SamplingParams
from noria.frontend.bad_words import bad_words_token_ids
from tests.procs import serve_http
from tests.sampling_reference import (
    bias_edit,
    check_prompt_logprobs,
    forward_logits,
    greedy_with,
    prompt_logprobs,
)
from tests.tiny_models import load_reference

ATOL = 1e-3  # float32 on both sides, sums in another order: see tests/test_prompt_logprobs.py
TEXT = "Once upon a time there was a little girl who lived"
_ids = itertools.count()


@pytest.fixture(scope="module")
def served(demo_path):
    with serve_http("--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "512") as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def ref(demo_path):
    return load_reference(demo_path)


@pytest.fixture(scope="module")
def prompt_ids(demo_tokenizer):
    return demo_tokenizer(TEXT)["input_ids"]


def _lifted_bias(ref, prompt: list[int]) -> dict[int, float]:
    """A bias that makes the runner-up win the first step and keeps the winner out."""
    top2 = forward_logits(ref, prompt)[-1].topk(2)
    return {int(top2.indices[1]): float(top2.values[0] - top2.values[1]) + 0.5, int(top2.indices[0]): -100.0}


def _ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


# ---- ZMQ -------------------------------------------------------------------


def test_raw_generate_map_with_every_new_field(served, ref, prompt_ids):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(served.address)
    try:
        bias = _lifted_bias(ref, prompt_ids)
        rid = f"r{next(_ids)}"
        sock.send(msgspec.msgpack.encode({
            "type": "generate", "request_id": rid, "prompt_token_ids": prompt_ids, "max_tokens": 6,
            "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": 2, "logit_bias": bias,
        }))
        msgs = []
        while not msgs or msgs[-1]["type"] not in ("done", "error"):
            assert sock.poll(60_000), "no answer"
            msgs.append(msgspec.msgpack.decode(sock.recv()))
    finally:
        sock.close()
    assert msgs[-1]["type"] == "done", msgs[-1]
    deltas = [m for m in msgs if m["type"] == "delta"]
    assert deltas[0]["prompt_logprobs"][0] is None and all(d["prompt_logprobs"] is None for d in deltas[1:])
    entries = deltas[0]["prompt_logprobs"]
    assert set(entries[1]) == {"token_id", "logprob", "top_token_ids", "top_logprobs", "token", "bytes", "top_tokens",
                               "top_bytes"}
    decoded = [None] + [msgspec.convert(e, _Entry) for e in entries[1:]]
    check_prompt_logprobs(decoded, prompt_ids, prompt_logprobs(ref, prompt_ids), 2, ATOL)
    tokens = [t for d in deltas for t in d["token_ids"]]
    assert tokens == greedy_with(ref, prompt_ids, 6, bias_edit(bias))


class _Entry(msgspec.Struct):
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def test_client_allowed_ids_and_bad_words(served, prompt_ids, demo_tokenizer):
    greedy = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    with Client(served.address) as c:
        out = c.generate(prompt_ids, SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True,
                                                    allowed_token_ids=[300, 301, 302]))
        plain = c.generate(prompt_ids, SamplingParams(**greedy)).outputs[0].token_ids
        # A word of the greedy output that is a single token in one of its spellings.
        words = {demo_tokenizer.decode([t]).strip() for t in plain} - {""}
        word = next(w for w in sorted(words)
                    if any(len(ids) == 1 and ids[0] in plain for ids in bad_words_token_ids(demo_tokenizer, [w], 10**6)))
        banned = {ids[0] for ids in bad_words_token_ids(demo_tokenizer, [word], 10**6) if len(ids) == 1}
        got = c.generate(prompt_ids, SamplingParams(**greedy, bad_words=[word])).outputs[0].token_ids
    assert set(out.outputs[0].token_ids) <= {300, 301, 302}
    assert got != plain and not banned & set(got)


# ---- OpenAI ------------------------------------------------------------------


def test_completions_logit_bias_equals_the_biased_argmax(oai, ref, prompt_ids):
    bias = _lifted_bias(ref, prompt_ids)
    out = oai.completions.create(model="demo", prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=0,
                                 logit_bias={str(t): v for t, v in bias.items()},
                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert _ids_of(out.choices[0].logprobs.tokens) == greedy_with(ref, prompt_ids, 8, bias_edit(bias))


def test_chat_logit_bias_and_allowed_token_ids(oai):
    kw = dict(model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=5, logprobs=True)
    out = oai.chat.completions.create(**kw, temperature=0, logit_bias={"300": 100},
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert _ids_of([t.token for t in out.choices[0].logprobs.content]) == [300] * 5
    out = oai.chat.completions.create(**kw, temperature=1.0, seed=1,
                                      extra_body={"ignore_eos": True, "allowed_token_ids": [7, 8],
                                                  "return_tokens_as_token_ids": True})
    assert set(_ids_of([t.token for t in out.choices[0].logprobs.content])) <= {7, 8}


def test_echo_with_logprobs_returns_the_prompts_logprobs(oai, ref, demo_tokenizer):
    out = oai.completions.create(model="demo", prompt=TEXT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = out.choices[0]
    ids = demo_tokenizer(TEXT)["input_ids"]
    lp = choice.logprobs
    assert choice.text.startswith(TEXT) and len(choice.text) > len(TEXT)
    assert len(lp.tokens) == len(ids) + 3 and _ids_of(lp.tokens[: len(ids)]) == ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expect = prompt_logprobs(ref, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(expect[i - 1][ids[i]])) <= ATOL
        top = {int(t.removeprefix("token_id:")): v for t, v in lp.top_logprobs[i].items()}
        assert ids[i] in top and 2 <= len(top) <= 3
    # max_tokens 0: the prompt alone, as a scorer asks for it.
    only = oai.completions.create(model="demo", prompt=TEXT, max_tokens=0, logprobs=0, echo=True).choices[0]
    assert only.text == TEXT and only.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=ATOL)
    assert len(only.logprobs.tokens) == len(ids)


def test_echo_streams_the_prompt_first(oai):
    chunks = list(oai.completions.create(model="demo", prompt=["ab", "cd"], max_tokens=4, echo=True, stream=True, seed=1))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts[0].startswith("ab") and texts[1].startswith("cd")


@pytest.mark.parametrize("kw, param", [
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"5": -100.5}), "logit_bias"),
    (dict(logit_bias={"five": 1}), "logit_bias"),
    (dict(logit_bias={"100000": 1}), "logit_bias"),  # out of the vocabulary: the engine's error names it
    (dict(best_of=3), "best_of"),
    (dict(suffix="tail"), "suffix"),
    (dict(echo=True, logprobs=1, stream=True), "echo"),
    (dict(extra_body={"tools": [{"type": "function", "function": {"name": "f"}}]}), "tools"),
    (dict(extra_body={"tool_choice": "required"}), "tool_choice"),
    (dict(extra_body={"functions": [{"name": "f"}]}), "functions"),
    (dict(extra_body={"function_call": "auto"}), "function_call"),
    (dict(extra_body={"use_beam_search": True}), "use_beam_search"),
    (dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
    (dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
    (dict(extra_body={"bad_words": [" "]}), "bad_words"),
])
def test_completions_refuse_what_they_cannot_honour(oai, kw, param):
    args = {"model": "demo", "prompt": "x", "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(**args)
    assert e.value.body["param"] == param, e.value.body
    assert param in e.value.body["message"]


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, None),  # an empty map asks for nothing
    ({"echo": True}, "echo"),
    ({"logit_bias": {"1": 1000}}, "logit_bias"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_chat_refuses_what_it_cannot_honour(oai, extra, param):
    args = dict(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body=extra)
    if param is None:
        assert oai.chat.completions.create(**args).choices[0].message.content is not None
        return
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**args)
    assert e.value.body["param"] == param, e.value.body


def test_fields_that_change_nothing_are_ignored(oai):
    out = oai.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=2, user="u1", metadata={"k": "v"},
        store=False, parallel_tool_calls=False, service_tier="auto", tools=[] or openai.NOT_GIVEN,
        extra_body={"tool_choice": "none", "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
                    "some_future_field": 1},
    )
    assert out.choices[0].finish_reason in ("stop", "length")
