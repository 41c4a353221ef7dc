"""--generation-config: the checkpoint's generation_config.json gives the sampling defaults of
requests that leave them unset; a request's own value, even vLLM's default, wins.

The end-to-end tests use a copy of the demo checkpoint whose generation_config.json says
temperature 0: a request that names no temperature must then come back greedy (equal to
the same request with temperature 0), and one that says temperature 1.0 with a seed must
come back sampled (equal to the same seeded request on an engine with vLLM's defaults, and
not greedy).
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest

from noria.frontend.generation_config import GenerationConfigError, describe, generation_defaults
from noria.frontend.inputs import make_generate
from noria.protocol.client import GENERATION_DEFAULT_FIELDS, Generate
from noria.protocol.sampling import SamplingParams
from tests.procs import serve_http

PROMPT = "the quick brown fox"
SEEDED = {"temperature": 1.0, "seed": 3}
NEW_TOKENS = 9  # the test checkpoint's max_new_tokens: neither 16 (vLLM's default) nor a length asked for


def _with_generation_config(src: Path, dst: Path, **values: Any) -> Path:
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, **values}))
    return dst


@pytest.fixture(scope="module")
def greedy_model(demo_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_generation_config(demo_path, tmp_path_factory.mktemp("gen") / "m", temperature=0.0, top_k=50,
                                   max_new_tokens=NEW_TOKENS)


# ---- reading the file ----


def test_defaults_by_mode(tmp_path: Path) -> None:
    path = tmp_path
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
         "min_p": None, "do_sample": True}))
    assert generation_defaults(str(path), "auto") == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                      "repetition_penalty": 1.05}
    assert generation_defaults(str(path), "vllm") == {} and generation_defaults(str(path), "none") == {}
    assert generation_defaults(str(tmp_path / "absent"), "auto") == {}
    line = describe(generation_defaults(str(path), "auto"), "auto")
    assert line.startswith("sampling defaults for requests that do not set them: temperature=0.7, top_p=0.8, "
                           "top_k=20, min_p=0.0, repetition_penalty=1.05;")
    assert "generation_config.json" in line
    assert "--generation-config vllm" in describe({}, "vllm") and "temperature=1.0" in describe({}, "vllm")
    (path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(GenerationConfigError, match=r"top_p.*--generation-config vllm ignores the file"):
        generation_defaults(str(path), "auto")
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match="cannot be read as JSON"):
        generation_defaults(str(path), "auto")


def test_max_new_tokens_is_the_default_max_tokens(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 300, "max_length": 4096}))
    assert generation_defaults(str(tmp_path), "auto") == {"max_tokens": 300}
    assert generation_defaults(str(tmp_path), "vllm") == {}
    assert "max_tokens=300" in describe({"max_tokens": 300}, "auto")
    assert "max_tokens" not in describe({}, "auto")  # vLLM's 16 is not a default worth a word
    for bad in (0, -5, True, "many"):
        (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": bad}))
        with pytest.raises(GenerationConfigError, match="max_tokens|max_new_tokens"):
            generation_defaults(str(tmp_path), "auto")


def test_default_max_tokens_fills_an_absent_or_nil_one_within_the_model_length(demo_tokenizer) -> None:
    from noria.frontend.processor import InputProcessor
    from noria.protocol.errors import ParamError

    max_model_len = 64
    proc = InputProcessor(demo_tokenizer, [1], len(demo_tokenizer), max_model_len,
                          sampling_defaults={"max_tokens": 20, "temperature": 0.0})
    short = "hello"
    long_prompt = " ".join(["word"] * 200)
    ids = demo_tokenizer.encode(long_prompt)
    long_ids = ids[: max_model_len - 5]  # room for 5 tokens only

    def max_tokens(**fields: Any) -> int | None:
        return proc.process(Generate(request_id="r", **fields))[1].max_tokens

    assert max_tokens(prompt=short) == 20  # left out
    assert max_tokens(prompt=short, max_tokens=None) == 20  # nil, as vLLM's OpenAI server reads a null
    assert max_tokens(prompt=short, max_tokens=3) == 3 and max_tokens(prompt=short, max_tokens=40) == 40
    assert max_tokens(prompt_token_ids=long_ids) == 5 == max_tokens(prompt_token_ids=long_ids, max_tokens=None)
    with pytest.raises(ParamError, match="max_tokens"):  # a length the request chose is not cut
        max_tokens(prompt_token_ids=long_ids, max_tokens=6)
    plain = InputProcessor(demo_tokenizer, [1], len(demo_tokenizer), max_model_len)
    assert plain.process(Generate(request_id="r", prompt=short))[1].max_tokens == 16  # vLLM's default
    assert plain.process(Generate(request_id="r", prompt=short, max_tokens=None))[1].max_tokens is None


# ---- the wire: unset is not the default value ----


def test_unset_and_set_to_the_default_differ_on_the_wire() -> None:
    dec = msgspec.msgpack.Decoder(Generate)
    bare = dec.decode(msgspec.msgpack.encode({"type": "generate", "request_id": "r", "prompt": "x"}))
    told = dec.decode(msgspec.msgpack.encode({"type": "generate", "request_id": "r", "prompt": "x",
                                              "temperature": 1.0, "top_k": 0, "repetition_penalty": 1.0}))
    defaults = {"temperature": 0.0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2}
    assert bare.sampling_params(defaults) == SamplingParams(**defaults)
    assert bare.sampling_params() == SamplingParams()  # no defaults: vLLM's
    got = told.sampling_params(defaults)
    assert (got.temperature, got.top_k, got.repetition_penalty, got.top_p) == (1.0, 0, 1.0, 0.5)
    # JSON (the websocket) decodes the same way.
    ws = msgspec.json.decode(b'{"type": "generate", "request_id": "r", "prompt": "x", "top_p": 1}', type=Generate)
    assert ws.sampling_params(defaults).top_p == 1.0 and ws.sampling_params(defaults).temperature == 0.0
    # The client library: no params leaves the five out of the map; a SamplingParams names them all.
    unset = msgspec.msgpack.decode(msgspec.msgpack.encode(make_generate("a", "x")))
    assert not set(GENERATION_DEFAULT_FIELDS) & set(unset)
    given = msgspec.msgpack.decode(msgspec.msgpack.encode(make_generate("a", "x", SamplingParams())))
    assert {k: given[k] for k in GENERATION_DEFAULT_FIELDS} == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def test_openai_body_fields_left_out_stay_unset() -> None:
    from noria.frontend.bridge.openai_requests import chat_generate, completion_generates
    from noria.frontend.bridge.openai_schema import ChatRequest, CompletionRequest

    ids = iter(str(i) for i in range(10))
    req = msgspec.json.decode(b'{"model": "m", "prompt": ["a", "b"], "top_p": 0.9}', type=CompletionRequest)
    for msg in completion_generates(req, lambda: next(ids)):
        sent = msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
        assert sent["top_p"] == 0.9 and not {"temperature", "top_k", "min_p", "repetition_penalty"} & set(sent)
    chat = msgspec.json.decode(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}',
                               type=ChatRequest)
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(chat_generate(chat, lambda: next(ids))))
    assert sent["temperature"] == 1.0 and "top_p" not in sent


# ---- end to end ----


def _http_completion(http: str, **body: Any) -> str:
    with urllib.request.urlopen(f"{http}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    data = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 12, **body}).encode()
    req = urllib.request.Request(f"{http}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _http_chat_length(http: str, **body: Any) -> int:
    """completion_tokens of a greedy chat completion with `body`'s fields, EOS ignored."""
    with urllib.request.urlopen(f"{http}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    data = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True,
                       **body}).encode()
    req = urllib.request.Request(f"{http}/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def _ws_tokens(http: str, **fields: Any) -> list[int]:
    """A websocket `generate` with only `fields` besides the prompt: its token ids."""
    import asyncio

    import websockets

    async def main() -> list[int]:
        async with websockets.connect(http.replace("http://", "ws://") + "/v1/stream") as ws:
            await ws.send(json.dumps({"type": "generate", "request_id": "w", "prompt": PROMPT, "max_tokens": 12,
                                      **fields}))
            ids: list[int] = []
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 120))
                if m["type"] != "delta":
                    assert m["type"] == "done", m
                    return ids
                ids += m["token_ids"]

    return asyncio.run(main())


def test_llm_defaults_from_generation_config(greedy_model: Path) -> None:
    from noria.frontend.llm import LLM

    with LLM(str(greedy_model), num_kv_blocks=32, swap_space=0.001, max_model_len=128) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=50, max_tokens=NEW_TOKENS)
        unset = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
        greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        sampled = llm.generate(PROMPT, SamplingParams(**SEEDED), use_tqdm=False)[0].outputs[0]
    # max_new_tokens, not vLLM's 16 that the explicit SamplingParams above asks for.
    assert len(greedy.token_ids) == 16 and unset.token_ids == greedy.token_ids[:NEW_TOKENS]
    assert sampled.token_ids != greedy.token_ids  # the request's temperature 1.0 was honoured
    with LLM(str(greedy_model), generation_config="vllm", num_kv_blocks=32, swap_space=0.001,
             max_model_len=128) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        # vLLM's defaults: temperature 1.0 when unset, so the seeded draw is the one above.
        reference = llm.generate(PROMPT, SamplingParams(seed=3), use_tqdm=False)[0].outputs[0]
    assert reference.token_ids == sampled.token_ids


def test_served_defaults_over_http_websocket_and_zmq(greedy_model: Path, tmp_path: Path) -> None:
    from noria.frontend.client import Client

    log = tmp_path / "serve.log"
    with open(log, "w") as err, serve_http("--model", str(greedy_model), "--num-kv-blocks", "32",
                                           "--max-model-len", "128", "--swap-space", "0.001", stderr=err) as s:
        unset_http = _http_completion(s.http)
        greedy_http = _http_completion(s.http, temperature=0)
        sampled_http = _http_completion(s.http, **SEEDED)
        unset_ws, greedy_ws, sampled_ws = (_ws_tokens(s.http), _ws_tokens(s.http, temperature=0),
                                           _ws_tokens(s.http, **SEEDED))
        chat_lengths = [_http_chat_length(s.http, **body) for body in ({}, {"max_tokens": None}, {"max_tokens": 3})]
        with Client(s.address) as c:
            unset_zmq = c.generate(PROMPT).outputs[0]
            greedy_zmq = c.generate(PROMPT, SamplingParams(temperature=0.0, ignore_eos=True)).outputs[0]
            sampled_zmq = c.generate(PROMPT, SamplingParams(max_tokens=12, **SEEDED)).outputs[0]
    assert unset_http == greedy_http and unset_zmq.token_ids == greedy_zmq.token_ids[:NEW_TOKENS]
    assert len(greedy_zmq.token_ids) == 16 and chat_lengths == [NEW_TOKENS, NEW_TOKENS, 3]
    assert sampled_http != greedy_http and sampled_http == sampled_zmq.text
    assert unset_ws == greedy_ws and sampled_ws == sampled_zmq.token_ids != greedy_ws
    text = log.read_text()
    assert text.count("sampling defaults for requests that do not set them: temperature=0.0, top_p=1.0, "
                      f"top_k=50, min_p=0.0, repetition_penalty=1.0, max_tokens={NEW_TOKENS} ") == 1, text
