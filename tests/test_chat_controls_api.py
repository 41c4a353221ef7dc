"""Against a live `noria serve --chat-template FILE --trust-request-chat-template`: the chat
template controls over HTTP (the `openai` client) and ZMQ, logprob token texts and bytes
(chat and completions, whole and streamed; the tokens join to the text, partial UTF-8
tokens included), and POST /tokenize, /detokenize and their ZMQ messages, each compared
with the tokenizer itself."""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request

import msgspec
import openai
import pytest
import zmq

from noria.frontend.client import Client
from noria.protocol.errors import NoriaError
from tests.procs import serve_http

# The demo's template with a Qwen3-style switch: enable_thinking false adds an empty think block.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "Where does the river run?"}]
# Forces an output of multi-byte characters: the demo's byte-level BPE spells 東, 🙂 and ✓ with
# tokens that hold parts of characters.
MULTIBYTE = "東京 🙂 café ✓"
_ids = itertools.count()


@pytest.fixture(scope="module")
def served(demo_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    with serve_http("--max-model-len", "512", "--num-kv-blocks", "64", "--chat-template", str(path),
                    "--trust-request-chat-template") as s:
        yield s


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(served):
    with Client(served.address, timeout=120) as c:
        yield c


def _render(tok, messages, **kw) -> list[int]:
    """transformers' own rendering of the server's template, tokenized as the server does."""
    text = tok.apply_chat_template(messages, chat_template=kw.pop("chat_template", TEMPLATE), tokenize=False, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _unbytes(text: str) -> bytes:
    if text.startswith("bytes:"):
        return bytes(int(h, 16) for h in text[len("bytes:"):].split("\\x")[1:])
    return text.encode()


def _chat(oai, **kw):
    return oai.chat.completions.create(model="demo", messages=kw.pop("messages", CHAT), **kw)


# ---- chat template controls -------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_servers_template(oai, client, demo_tokenizer):
    off = _render(demo_tokenizer, CHAT, add_generation_prompt=True, enable_thinking=False)
    plain = _render(demo_tokenizer, CHAT, add_generation_prompt=True)
    assert len(off) > len(plain)
    got = _chat(oai, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got.usage.prompt_tokens == len(off)
    assert _chat(oai, max_tokens=1).usage.prompt_tokens == len(plain)
    # The ids themselves, over ZMQ.
    from noria import SamplingParams

    out = client.chat(CHAT, SamplingParams(max_tokens=1), chat_template_kwargs={"enable_thinking": False})
    assert out.prompt_token_ids == off


def test_a_request_template_and_continue_final_message(oai, client, demo_tokenizer):
    own = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}ASSISTANT:"
    got = _chat(oai, max_tokens=1, extra_body={"chat_template": own})
    assert got.usage.prompt_tokens == len(_render(demo_tokenizer, CHAT, chat_template=own))

    partial = [*CHAT, {"role": "assistant", "content": "It runs to the"}]
    ref = _render(demo_tokenizer, partial, continue_final_message=True)
    got = _chat(oai, messages=partial, max_tokens=1,
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert got.usage.prompt_tokens == len(ref)
    from noria import SamplingParams

    out = client.chat(partial, SamplingParams(max_tokens=1), continue_final_message=True, add_generation_prompt=False)
    assert out.prompt_token_ids == ref
    with pytest.raises(openai.BadRequestError) as info:
        _chat(oai, messages=partial, max_tokens=1, extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"


def test_a_template_that_fails_is_a_400_for_that_request_only(oai):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(oai, max_tokens=1, extra_body={"chat_template": "{{ raise_exception('no system prompt here') }}"})
    assert info.value.body["param"] == "chat_template" and "no system prompt here" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(oai, max_tokens=1, extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert info.value.body["param"] == "chat_template_kwargs"
    assert _chat(oai, max_tokens=2).choices[0].finish_reason in ("stop", "length")  # still serving


# ---- logprob token texts and bytes ----------------------------------------------------------


def _check_joins(content, text: str) -> None:
    assert b"".join(bytes(t.bytes) for t in content) == text.encode()
    assert b"".join(_unbytes(t.token) for t in content) == text.encode()
    assert any(t.token.startswith("bytes:") for t in content)  # a token holds part of a character
    # Whole-character tokens are their text as it is.
    assert all(t.token == bytes(t.bytes).decode() for t in content if not t.token.startswith("bytes:"))


def test_chat_logprobs_join_to_the_text_partial_characters_too(oai, demo_tokenizer):
    kw = dict(max_tokens=20, temperature=0, logprobs=True, top_logprobs=2, extra_body={"guided_choice": [MULTIBYTE]})
    whole = _chat(oai, **kw)
    text = whole.choices[0].message.content
    assert text == MULTIBYTE
    content = whole.choices[0].logprobs.content
    _check_joins(content, text)
    for t in content:
        assert len(t.top_logprobs) == 2 and all(x.bytes is not None for x in t.top_logprobs)
        assert all(_unbytes(x.token) == bytes(x.bytes) for x in t.top_logprobs)

    streamed = [c for c in _chat(oai, stream=True, **kw) if c.choices and c.choices[0].logprobs]
    content_s = [t for c in streamed for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes, t.logprob) for t in content_s] == [(t.token, t.bytes, t.logprob) for t in content]

    # vLLM's return_tokens_as_token_ids: the same tokens by id, and their bytes are the tokenizer's.
    as_ids = _chat(oai, **{**kw, "extra_body": {**kw["extra_body"], "return_tokens_as_token_ids": True}})
    ids = [int(t.token.removeprefix("token_id:")) for t in as_ids.choices[0].logprobs.content]
    assert demo_tokenizer.decode(ids) == MULTIBYTE
    assert [t.bytes for t in as_ids.choices[0].logprobs.content] == [t.bytes for t in content]
    pieces = demo_tokenizer.convert_ids_to_tokens(ids)
    assert [len(t.bytes) for t in content] == [len(p) for p in pieces]  # byte-level: one character per byte


def test_logprobs_under_a_grammar_are_the_models_over_what_it_allows(served, demo_path, demo_tokenizer):
    """vLLM's logprobs: log_softmax of the logits the sampler gets, before penalties, bias and
    temperature; a grammar's mask is applied before that (vLLM's model runner masks the logits
    it hands its sampler), so the allowed tokens share all the mass and the rest are -inf,
    which JSON spells -9999.0 as vLLM does. Reference: transformers on the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = demo_tokenizer.encode("Where does the river run?")
    model = AutoModelForCausalLM.from_pretrained(str(demo_path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    y, n = demo_tokenizer.convert_tokens_to_ids(["y", "n"])  # the only tokens ["y", "n"] allows first
    mass = torch.logsumexp(logits[[y, n]], 0)
    expect = {f"token_id:{t}": (logits[t] - mass).item() for t in (y, n)}
    body = {"model": "demo", "prompt": prompt, "max_tokens": 1, "logprobs": 5, "guided_choice": ["y", "n"],
            "return_tokens_as_token_ids": True}
    edits = {"temperature": 1.7, "seed": 5, "presence_penalty": 2.0, "frequency_penalty": 1.0,
             "repetition_penalty": 1.8, "logit_bias": {str(y): 4.0, str(n): -3.0}, "min_p": 0.2}
    tops = []
    for extra in ({"temperature": 0}, edits):
        status, out = _post(f"{served.http}/v1/completions", {**body, **extra})
        assert status == 200, out
        lp = out["choices"][0]["logprobs"]
        token, top = lp["tokens"][0], lp["top_logprobs"][0]
        assert token in expect and lp["token_logprobs"][0] == pytest.approx(expect[token], abs=1e-4)
        allowed = {t: v for t, v in top.items() if v > -9999.0}
        assert allowed == pytest.approx(expect, abs=1e-4)
        assert sum(2.718281828459045 ** v for v in allowed.values()) == pytest.approx(1.0, abs=1e-4)
        assert len(top) == 5 and [v for v in top.values() if v <= -9999.0] == [-9999.0] * 3  # numbers, not null
        tops.append(allowed)
    assert tops[0] == tops[1]  # penalties, bias, min_p and temperature change the draw, not the logprobs


def test_top_logprobs_range(oai):
    zero = _chat(oai, max_tokens=2, logprobs=True, top_logprobs=0)
    assert all(t.top_logprobs == [] for t in zero.choices[0].logprobs.content)
    twenty = _chat(oai, max_tokens=1, logprobs=True, top_logprobs=20)
    assert len(twenty.choices[0].logprobs.content[0].top_logprobs) == 20
    with pytest.raises(openai.BadRequestError) as info:
        _chat(oai, max_tokens=1, logprobs=True, top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"


def test_completion_logprobs_keyed_by_token_text(oai, demo_tokenizer):
    prompt = "Unicode: 東京 🙂"
    out = oai.completions.create(model="demo", prompt=prompt, max_tokens=4, logprobs=2, echo=True, temperature=0,
                                 extra_body={"ignore_eos": True, "skip_special_tokens": False})
    choice = out.choices[0]
    lp = choice.logprobs
    ids = demo_tokenizer(prompt)["input_ids"]
    head, tail = lp.tokens[: len(ids)], lp.tokens[len(ids):]
    assert head[0] == "<|begin_of_text|>" and lp.token_logprobs[0] is None
    assert b"".join(_unbytes(t) for t in head[1:]) == prompt.encode()
    assert any(t.startswith("bytes:") for t in head)
    # The completion's tokens join to its text; each top map holds the sampled token's text.
    assert b"".join(_unbytes(t) for t in tail).decode("utf-8", "replace") == choice.text[len(prompt):]
    for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
        assert tok in top
    # Offsets place each token in the returned text (the BOS takes no room).
    assert lp.text_offset[:2] == [0, 0] and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[len(ids)] == len(prompt)
    for tok, off in zip(lp.tokens, lp.text_offset, strict=True):
        if not tok.startswith("bytes:") and tok != "<|begin_of_text|>":
            assert choice.text[off:off + len(tok)] == tok


def test_zmq_deltas_carry_token_texts(served, demo_tokenizer):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(served.address)
    rid = f"z{next(_ids)}"
    try:
        sock.send(msgspec.msgpack.encode({"type": "generate", "request_id": rid, "messages": CHAT, "max_tokens": 12,
                                          "temperature": 0, "logprobs": 1, "prompt_logprobs": 1,
                                          "structured_output": {"choice": [MULTIBYTE]}}))
        msgs = []
        while not msgs or msgs[-1]["type"] not in ("done", "error"):
            assert sock.poll(60_000), "no answer"
            msgs.append(msgspec.msgpack.decode(sock.recv()))
    finally:
        sock.close()
    assert msgs[-1]["type"] == "done", msgs[-1]
    deltas = [m for m in msgs if m["type"] == "delta"]
    lps = [lp for d in deltas for lp in d["logprobs"]]
    assert set(lps[0]) == {"token_id", "logprob", "top_token_ids", "top_logprobs", "token", "bytes", "top_tokens",
                           "top_bytes"}
    assert b"".join(bytes(lp["bytes"]) for lp in lps) == "".join(d["text"] for d in deltas).encode()
    for lp in lps:
        assert bytes(lp["bytes"]).decode("utf-8", "replace") == demo_tokenizer.decode([lp["token_id"]])
    prompt_ids = msgs[-1]["prompt_token_ids"]
    assert deltas[0]["prompt_tokens"][0] == "<|begin_of_text|>" and len(deltas[0]["prompt_tokens"]) == len(prompt_ids)
    assert [e["token"] for e in deltas[0]["prompt_logprobs"][1:]] == deltas[0]["prompt_tokens"][1:]
    assert all("prompt_tokens" not in d for d in deltas[1:])


# ---- /tokenize and /detokenize ------------------------------------------------------------


def test_tokenize_endpoint_counts_as_the_tokenizer(served, demo_tokenizer):
    text = "The river runs, 東京 🙂"
    status, body = _post(f"{served.http}/tokenize", {"model": "demo", "prompt": text})
    ids = demo_tokenizer(text)["input_ids"]
    assert status == 200 and body == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    status, body = _post(f"{served.http}/tokenize", {"prompt": text, "add_special_tokens": False,
                                                     "return_token_strs": True})
    assert body["tokens"] == ids[1:] and body["token_strs"] == demo_tokenizer.convert_ids_to_tokens(ids[1:])

    status, body = _post(f"{served.http}/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and body["tokens"] == _render(demo_tokenizer, CHAT, add_generation_prompt=True,
                                                       enable_thinking=False)
    status, body = _post(f"{served.http}/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert body["tokens"] == _render(demo_tokenizer, CHAT, add_generation_prompt=False)


def test_tokenize_and_detokenize_errors_name_the_field(served):
    for body, param in (({"prompt": "a", "messages": CHAT}, "prompt"), ({}, "messages"),
                        ({"messages": CHAT, "chat_template": "{% if %}"}, "chat_template"),
                        ({"prompt": 5}, "prompt")):
        status, answer = _post(f"{served.http}/tokenize", body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    for bad in (-1, 10**9):
        status, answer = _post(f"{served.http}/detokenize", {"tokens": [5, bad]})
        assert status == 400 and answer["error"]["param"] == "tokens", answer
    status, answer = _post(f"{served.http}/tokenize", {"model": "other", "prompt": "a"})
    assert status == 404


def test_detokenize_endpoint_round_trips(served, demo_tokenizer):
    text = "Привет, 東京 🙂 café"
    ids = demo_tokenizer(text)["input_ids"]
    status, body = _post(f"{served.http}/detokenize", {"model": "demo", "tokens": ids})
    assert status == 200 and body == {"prompt": demo_tokenizer.decode(ids)}
    assert body["prompt"].endswith(text)


def test_tokenize_over_zmq(served, client, demo_tokenizer):
    out = client.tokenize("the river", return_token_strs=True)
    assert out.tokens == demo_tokenizer("the river")["input_ids"] and out.count == len(out.tokens)
    assert out.token_strs == demo_tokenizer.convert_ids_to_tokens(out.tokens)
    chat = client.tokenize(messages=CHAT, chat_template_kwargs={"enable_thinking": False})
    assert chat.tokens == _render(demo_tokenizer, CHAT, add_generation_prompt=True, enable_thinking=False)
    assert client.detokenize(out.tokens) == demo_tokenizer.decode(out.tokens)
    with pytest.raises(NoriaError) as info:
        client.detokenize([1, -3])
    assert info.value.param == "tokens"

    # The raw maps, as any zmq + msgpack client sends them.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(served.address)
    try:
        sock.send(msgspec.msgpack.encode({"type": "tokenize", "request_id": "t1", "prompt": "the river"}))
        sock.send(msgspec.msgpack.encode({"type": "detokenize", "request_id": "t2", "tokens": out.tokens}))
        sock.send(msgspec.msgpack.encode({"type": "detokenize", "request_id": "t3", "tokens": [10**6]}))
        got = {}
        while len(got) < 3:
            assert sock.poll(60_000), "no answer"
            m = msgspec.msgpack.decode(sock.recv())
            got[m["request_id"]] = m
    finally:
        sock.close()
    assert got["t1"] == {"type": "tokenized", "request_id": "t1", "count": len(out.tokens), "max_model_len": 512,
                         "tokens": out.tokens, "token_strs": None}
    assert got["t2"] == {"type": "detokenized", "request_id": "t2", "prompt": demo_tokenizer.decode(out.tokens)}
    assert got["t3"]["type"] == "error" and got["t3"]["param"] == "tokens"


def test_offline_llm_chat_takes_the_template_controls(demo_tokenizer):
    from noria import LLM, SamplingParams

    own = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if flavour %}[{{ flavour }}]{% endif %}"
    partial = [*CHAT, {"role": "assistant", "content": "To the"}]
    with LLM("demo", max_model_len=256, num_kv_blocks=32) as llm:
        # The caller's own template needs no trust flag: it is this process's code.
        out = llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=own,
                       chat_template_kwargs={"flavour": "salt"})[0]
        assert out.prompt_token_ids == _render(demo_tokenizer, CHAT, chat_template=own, flavour="salt")
        out = llm.chat(partial, SamplingParams(max_tokens=1), use_tqdm=False, add_generation_prompt=False,
                       continue_final_message=True)[0]
        assert out.prompt_token_ids == demo_tokenizer(demo_tokenizer.apply_chat_template(
            partial, tokenize=False, continue_final_message=True), add_special_tokens=False)["input_ids"]
        # As vLLM's LLM.chat: tools reach the template with no tool-call parser configured.
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        with_tools = own + "{% for t in tools %}({{ t['function']['name'] }}){% endfor %}"
        out = llm.chat(CHAT, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=with_tools, tools=tools)[0]
        assert out.prompt_token_ids == _render(demo_tokenizer, CHAT, chat_template=with_tools, tools=tools)
        assert out.outputs[0].finish_reason == "length"
        # A constraining choice still constrains.
        out = llm.chat(CHAT, SamplingParams(max_tokens=200), use_tqdm=False, chat_template=with_tools, tools=tools,
                       tool_choice="required")[0].outputs[0]
        assert out.finish_reason == "tool_calls" and [c.function.name for c in out.tool_calls] == ["lookup"]


def test_the_servers_token_ids_flag_is_the_default_a_request_may_override(demo_path, demo_tokenizer):
    with serve_http("--max-model-len", "256", "--num-kv-blocks", "32", "--return-tokens-as-token-ids") as s, \
            openai.OpenAI(base_url=f"{s.http}/v1", api_key="none", max_retries=0, timeout=120) as oai:
        kw = dict(max_tokens=8, temperature=0, logprobs=True, top_logprobs=1, extra_body={"guided_choice": [MULTIBYTE]})
        by_id = _chat(oai, **kw).choices[0].logprobs.content
        ids = [int(t.token.removeprefix("token_id:")) for t in by_id]
        assert demo_tokenizer.decode(ids) == MULTIBYTE
        assert all(x.token.startswith("token_id:") for t in by_id for x in t.top_logprobs)
        by_text = _chat(oai, **{**kw, "extra_body": {**kw["extra_body"], "return_tokens_as_token_ids": False}})
        _check_joins(by_text.choices[0].logprobs.content, MULTIBYTE)
        out = oai.completions.create(model="demo", prompt="the river", max_tokens=2, logprobs=1, temperature=0)
        assert all(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)
