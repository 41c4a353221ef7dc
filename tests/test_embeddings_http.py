"""POST /v1/embeddings and the `embed` ZMQ message against a live `noria serve --runner pooling`
(a random Qwen3 checkpoint, last-token pooling, Qwen3-Embedding style): the official `openai`
client's `embeddings.create` against transformers' `AutoModel`, every input form, base64 against
float, `dimensions`, usage, errors (too long, bad input, dimensions, the wrong runner both
ways), `Client.embed`, and every block free afterwards."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request

import msgspec
import numpy as np
import openai
import pytest
import torch
import websockets

from noria import AsyncClient, Client, SamplingParams
from noria.protocol.errors import NoriaError
from tests.procs import serve_http
from tests.test_embeddings import TOL, assert_close, reference, with_tokenizer
from tests.tiny_models import make_checkpoint
from tests.workers import wait_stats

NUM_BLOCKS = 32
MAX_LEN = 128


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, demo_path):
    # The demo tokenizer's vocabulary, so that any text's ids fit the model.
    vocab = json.loads((demo_path / "config.json").read_text())["vocab_size"]
    path = tmp_path_factory.mktemp("emb") / "qwen3"
    return with_tokenizer(make_checkpoint("qwen3", path, vocab_size=vocab), demo_path)


@pytest.fixture(scope="module")
def served(ckpt):
    # A step budget of 32 tokens: longer inputs are chunked over several steps.
    with serve_http("--model", str(ckpt), "--runner", "pooling", "--dtype", "float32", "--num-kv-blocks",
                    str(NUM_BLOCKS), "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", "32") as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, msgspec.json.decode(r.read())
    except urllib.error.HTTPError as e:
        return e.code, msgspec.json.decode(e.read())


TEXTS = ["Hello there", "An embedding of a longer sentence, long enough to take more than one step of "
         "thirty-two tokens through the engine's chunked prefill, and then a little more.", "x"]


def test_openai_client_matches_transformers(served, oai, ckpt, tokenizer):
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(len(i) for i in ids) > 32
    want = reference(ckpt, ids, "last")
    res = oai.embeddings.create(model=str(ckpt), input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in res.data] == [0, 1, 2] and res.object == "list" and res.model == str(ckpt)
    assert_close([d.embedding for d in res.data], want)
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(len(i) for i in ids)
    floats = oai.embeddings.create(model=str(ckpt), input=TEXTS[1], encoding_format="float")
    assert_close([floats.data[0].embedding], want[1:2])
    by_ids = oai.embeddings.create(model=str(ckpt), input=ids, encoding_format="float")
    assert_close([d.embedding for d in by_ids.data], want)
    one = oai.embeddings.create(model=str(ckpt), input=ids[0], encoding_format="float", user="someone")
    assert_close([one.data[0].embedding], want[:1])
    assert one.usage.prompt_tokens == len(ids[0])


def test_many_inputs_base64_and_dimensions(served):
    url = f"{served.http}/v1/embeddings"
    inputs = [f"input number {i} " * (1 + i % 7) for i in range(40)]
    status, flt = _post(url, {"input": inputs, "encoding_format": "float"})
    assert status == 200 and len(flt["data"]) == 40
    status, b64 = _post(url, {"input": inputs, "encoding_format": "base64"})
    assert status == 200 and [d["index"] for d in b64["data"]] == list(range(40))
    for f, b in zip(flt["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        full = np.asarray(f["embedding"], dtype=np.float64)
        assert decoded.shape == (64,) and abs(np.linalg.norm(full) - 1) < 1e-5
        np.testing.assert_allclose(decoded, full, atol=TOL)
    assert b64["usage"] == flt["usage"] and flt["usage"]["prompt_tokens"] > 40
    # The same input always gives the same float32 values on one request path: base64 is their bytes.
    status, a = _post(url, {"input": "same text", "encoding_format": "float"})
    status, b = _post(url, {"input": "same text", "encoding_format": "base64"})
    assert np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4").tolist() == a["data"][0]["embedding"]
    status, cut = _post(url, {"input": "same text", "dimensions": 16})
    assert status == 200 and len(cut["data"][0]["embedding"]) == 16
    head = np.asarray(a["data"][0]["embedding"][:16])
    np.testing.assert_allclose(cut["data"][0]["embedding"], head / np.linalg.norm(head), atol=1e-6)


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": "x", "dimensions": 65}, "dimensions", "invalid_request"),
    ({"input": "x", "dimensions": 0}, "dimensions", "invalid_request"),
    ({"input": [5] * (MAX_LEN + 1)}, "input", "prompt_too_long"),
    ({"input": []}, "input", "invalid_request"),
    ({"input": ["a", 3]}, "input", "invalid_request"),
    ({"input": [[1, 2], []]}, "input", "invalid_request"),
    ({"input": [10**6]}, "input", "invalid_request"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "invalid_message"),
])
def test_bad_requests_are_400_naming_the_field(served, body, param, code):
    status, out = _post(f"{served.http}/v1/embeddings", body)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["code"] == code


def test_input_of_max_model_len_fits(served):
    status, out = _post(f"{served.http}/v1/embeddings", {"input": [5] * MAX_LEN})
    assert status == 200 and out["usage"]["prompt_tokens"] == MAX_LEN


def test_generation_on_a_pooling_server_is_refused(served, oai, ckpt):
    for call in (lambda: oai.completions.create(model=str(ckpt), prompt="hi", max_tokens=2),
                 lambda: oai.chat.completions.create(model=str(ckpt), messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert "pooling runner" in e.value.message
    with Client(served.address, timeout=60) as c, pytest.raises(NoriaError) as err:
        c.generate("hi", SamplingParams(max_tokens=2))
    assert err.value.code == "invalid_request" and "pooling runner" in err.value.message

    async def ws() -> dict:
        async with websockets.connect(served.http.replace("http", "ws") + "/v1/stream") as sock:
            await sock.send(json.dumps({"type": "generate", "request_id": "r1", "prompt": "hi", "max_tokens": 2}))
            return json.loads(await sock.recv())

    event = asyncio.run(ws())
    assert event["type"] == "error" and event["request_id"] == "r1" and "pooling runner" in event["message"]
    with urllib.request.urlopen(f"{served.http}/health", timeout=30) as r:
        assert r.status == 200
    assert [m.id for m in oai.models.list().data] == [str(ckpt)]


def test_zmq_clients_embed(served, oai, ckpt):
    want = oai.embeddings.create(model=str(ckpt), input=TEXTS, encoding_format="float")
    with Client(served.address, timeout=60) as c:
        got = c.embed(TEXTS)
        assert len(c.embed("one")) == 1
        with pytest.raises(NoriaError) as e:
            c.embed(["fine", [5] * (MAX_LEN + 1)])
        assert e.value.code == "prompt_too_long"

    async def run() -> list[list[float]]:
        async with AsyncClient(served.address, timeout=60) as ac:
            return await ac.embed(TEXTS, dimensions=8)

    short = asyncio.run(run())
    for g, s, w in zip(got, short, want.data, strict=True):
        np.testing.assert_allclose(g, w.embedding, atol=TOL)
        head = torch.tensor(w.embedding[:8])
        np.testing.assert_allclose(s, (head / head.norm()).tolist(), atol=1e-5)


def test_aborted_embeds_end_once(served):
    """Embeds aborted right behind their `embed` end with exactly one final message each (the
    embedding, or a `done` with finish_reason "abort" if the abort came first); none is lost."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(served.address)
    try:
        ids = [f"e{i}" for i in range(24)]
        for i, rid in enumerate(ids):
            sock.send(msgspec.msgpack.encode({"type": "embed", "request_id": rid, "prompt_token_ids": [7 + i] * 100}))
            if i % 2:
                sock.send(msgspec.msgpack.encode({"type": "abort", "request_id": rid}))
        finals: dict[str, list[dict]] = {}
        while sum(len(v) for v in finals.values()) < len(ids):
            assert sock.poll(60_000), f"no final message for {sorted(set(ids) - set(finals))}"
            msg = msgspec.msgpack.decode(sock.recv())
            finals.setdefault(msg["request_id"], []).append(msg)
        assert sorted(finals) == sorted(ids)
        for rid, msgs in finals.items():
            (msg,) = msgs
            aborted = int(rid[1:]) % 2
            assert msg["type"] == "embedding" or (aborted and msg["type"] == "done" and msg["finish_reason"] == "abort")
        # An embed's final message comes before anything the server sends after it on this socket.
        sock.send(msgspec.msgpack.encode({"type": "hello"}))
        assert sock.poll(60_000)
        assert msgspec.msgpack.decode(sock.recv())["type"] == "ready"
    finally:
        sock.close()
        ctx.term()


def test_every_block_free_afterwards(served):
    # Runs after the others (file order): every request above ended, so none may hold a block.
    st = wait_stats(served.address, lambda s: s.stats.num_running == s.stats.num_waiting == 0
                    and s.stats.num_free_blocks == NUM_BLOCKS, "every KV block free")
    assert st.stats.blocks_consistent and st.stats.num_kv_blocks == NUM_BLOCKS


def test_embeddings_on_a_generate_server_is_refused(demo_path):
    with serve_http("--num-kv-blocks", "16") as s:
        status, out = _post(f"{s.http}/v1/embeddings", {"input": "hello"})
        assert status == 400 and "generate runner" in out["error"]["message"]
        with Client(s.address, timeout=60) as c, pytest.raises(NoriaError) as e:
            c.embed("hello")
        assert e.value.code == "invalid_request" and "--runner pooling" in e.value.message
