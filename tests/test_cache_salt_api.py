"""`cache_salt` on a live `noria serve`: over raw ZMQ (msgpack maps), `noria.Client`, the
websocket and OpenAI HTTP (the official `openai` package, `extra_body`). Requests with
different salts, or a salt and none, never reuse each other's prompt blocks (usage's
cached tokens stay 0); the same salt hits; a bad salt is refused naming the field."""

from __future__ import annotations

import asyncio
import itertools
import random

import msgspec
import openai
import pytest
import websockets
import zmq

from noria import Client, SamplingParams
from tests.procs import serve_http

BLOCK = 16  # the default --block-size
_ids = itertools.count()


@pytest.fixture(scope="module")
def served(demo_path):
    with serve_http("--num-kv-blocks", "256", "--max-model-len", "512") as s:
        yield s


def _prompt(seed: int, n: int = 100) -> list[int]:
    """Token ids no other test sends: nothing of them is cached before the test."""
    rng = random.Random(seed)
    return [rng.randrange(300, 700) for _ in range(n)]


def _hit(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK  # every whole block before the last prompt token


class Raw:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def final(self, **fields) -> dict:
        rid = f"salt-{next(_ids)}"
        self.sock.send(msgspec.msgpack.encode({"type": "generate", "request_id": rid, "max_tokens": 2, **fields}))
        while True:
            assert self.sock.poll(30_000), "no answer from the server"
            m = msgspec.msgpack.decode(self.sock.recv())
            if m.get("request_id") == rid and m["type"] in ("done", "error"):
                return m

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def raw(served):
    r = Raw(served.address)
    yield r
    r.close()


def test_zmq_salts_share_blocks_only_with_the_same_salt(raw):
    prompt = _prompt(1)
    cached = []
    for salt in ["t1", "t2", None, "t1", None, "T1"]:
        done = raw.final(prompt_token_ids=prompt, **({} if salt is None else {"cache_salt": salt}))
        assert done["type"] == "done", done
        cached.append(done["usage"]["cached_tokens"])
    assert cached == [0, 0, 0, _hit(100), _hit(100), 0]


def test_zmq_a_salted_request_with_samples_caches_its_prompt(raw):
    done = raw.final(prompt_token_ids=_prompt(2), cache_salt="n3", n=3, ignore_eos=True)
    assert done["type"] == "done" and len(done["finish_reasons"]) == 3
    # Sample 0 computed the prompt; a later request with the salt reuses what it left.
    assert raw.final(prompt_token_ids=_prompt(2), cache_salt="n3")["usage"]["cached_tokens"] == _hit(100)


@pytest.mark.parametrize("salt, code", [("", "invalid_request"), ("s" * 257, "invalid_request"),
                                        (5, "invalid_message"), (["a"], "invalid_message")])
def test_zmq_bad_salts_are_refused(raw, salt, code):
    err = raw.final(prompt_token_ids=[1, 2, 3], cache_salt=salt)
    assert err["type"] == "error" and err["code"] == code and "cache_salt" in err["message"]
    if code == "invalid_request":
        assert err["param"] == "cache_salt"


def test_zmq_longest_salt_is_taken(raw):
    assert raw.final(prompt_token_ids=[1, 2, 3], cache_salt="s" * 256)["type"] == "done"


def test_client_library_passes_the_salt(served):
    prompt = _prompt(3)
    with Client(served.address) as c:
        got = [c.generate(prompt, SamplingParams(max_tokens=2), cache_salt=salt).num_cached_tokens
               for salt in ["c1", "c2", "c1"]]
        got.append(c.generate(prompt, SamplingParams(max_tokens=2)).num_cached_tokens)
    assert got == [0, 0, _hit(100), 0]


def test_websocket_salts(served):
    url = served.http.replace("http://", "ws://") + "/v1/stream"
    prompt = _prompt(4)

    async def main() -> list[int]:
        out = []
        async with websockets.connect(url) as ws:
            for i, salt in enumerate(["w1", "w2", "w1"]):
                await ws.send(msgspec.json.encode({"type": "generate", "request_id": f"w{i}", "max_tokens": 2,
                                                   "prompt_token_ids": prompt, "cache_salt": salt}).decode())
                while True:
                    m = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 60))
                    if m["type"] in ("done", "error"):
                        assert m["type"] == "done", m
                        out.append(m["usage"]["cached_tokens"])
                        break
            await ws.send(msgspec.json.encode({"type": "generate", "request_id": "bad", "prompt": "x",
                                               "cache_salt": ""}).decode())
            m = msgspec.json.decode(await asyncio.wait_for(ws.recv(), 60))
            assert m["type"] == "error" and m["code"] == "invalid_request" and "cache_salt" in m["message"]
        return out

    assert asyncio.run(main()) == [0, 0, _hit(100)]


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


TEXT = "Salted prompts keep one tenant's prefix cache away from another's, block by block. " * 4


def test_http_completions_and_chat_salts(oai):
    def completion(salt):
        u = oai.completions.create(model="demo", prompt=TEXT, max_tokens=2, extra_body={"cache_salt": salt}).usage
        return u.prompt_tokens, u.prompt_tokens_details.cached_tokens

    def chat(salt):
        u = oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": TEXT}], max_tokens=2,
                                        extra_body={"cache_salt": salt}).usage
        return u.prompt_tokens, u.prompt_tokens_details.cached_tokens

    for call in (completion, chat):
        runs = [call(salt) for salt in ["h1", "h2", "h1"]]
        n = runs[0][0]
        assert n > 3 * BLOCK and [c for _, c in runs] == [0, 0, _hit(n)], call.__name__


@pytest.mark.parametrize("salt", ["", "s" * 257, 5])
def test_http_bad_salts_are_400_naming_the_field(oai, salt):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={"cache_salt": salt})
    assert e.value.body["param"] == "cache_salt"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    extra_body={"cache_salt": salt})
    assert e.value.body["param"] == "cache_salt"
