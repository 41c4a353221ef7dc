"""`echo` with token-id prompts on /v1/completions, through a live `noria serve --dtype float32`
and the official `openai` client: the echoed text is the ids decoded as vLLM spells them
(special tokens included), and with `logprobs` the prompt's tokens come first in the legacy
layout (`tokens`, `token_logprobs` with a null first entry, `top_logprobs`, `text_offset`),
each value checked against transformers' float32 logits. Batched prompts (a list of id
lists), `max_tokens: 0` (score only) and streaming are covered."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.procs import serve_http
from tests.sampling_reference import forward_logits, prompt_logprobs
from tests.tiny_models import load_reference

ATOL = 1e-3  # float32 on both sides, sums in another order: see tests/test_prompt_logprobs.py
TEXTS = ["Once upon a time there was a little girl", "The quick brown fox"]


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
def prompts(demo_tokenizer) -> list[list[int]]:
    """Token ids with the BOS the tokenizer adds: a special token that the echo spells too."""
    ids = [demo_tokenizer(t)["input_ids"] for t in TEXTS]
    assert all(p[0] == demo_tokenizer.bos_token_id for p in ids)
    return ids


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    """vLLM's text_offset: each token starts where the texts of those before it end."""
    out, at = [], start
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def _ids_of(tokens) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_batched_token_prompts_echo_their_text_and_logprobs(oai, ref, demo_tokenizer, prompts):
    k = 2
    kw = dict(model="demo", prompt=prompts, max_tokens=1, temperature=0, logprobs=k, echo=True)
    out = oai.completions.create(**kw, extra_body={"ignore_eos": True})
    # The same, every token spelled by its id: the top maps are checked by id (a top token
    # may hold part of a character, which its text cannot show).
    by_id = oai.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1]
    for choice, id_choice, ids in zip(out.choices, by_id.choices, prompts, strict=True):
        echo = demo_tokenizer.decode(ids)  # vLLM decodes a token prompt for echo, specials kept
        assert echo.startswith(demo_tokenizer.bos_token)
        lp, lpi = choice.logprobs, id_choice.logprobs
        n = len(ids)
        assert choice.text.startswith(echo) and len(lp.tokens) == n + 1
        assert lp.tokens[:n] == [demo_tokenizer.decode([t]) for t in ids]
        assert _ids_of(lpi.tokens[:n]) == ids
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lpi.top_logprobs[0] is None
        expect = prompt_logprobs(ref, ids)  # row i scores prompt token i + 1
        for i in range(1, n):
            row = expect[i - 1]
            assert lp.token_logprobs[i] == pytest.approx(float(row[ids[i]]), abs=ATOL), f"token {i}"
            # The k most likely tokens there, and the prompt's own token beside them.
            top = row.topk(k)
            want = {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)}
            want.setdefault(ids[i], float(row[ids[i]]))
            got = dict(zip(_ids_of(lpi.top_logprobs[i]), lpi.top_logprobs[i].values(), strict=True))
            assert got.keys() == want.keys(), f"token {i}"
            assert [got[t] for t in want] == pytest.approx(list(want.values()), abs=ATOL)
            assert set(lp.top_logprobs[i].values()) == set(lpi.top_logprobs[i].values())
        # The drawn token follows: greedy, scored at the last prompt position; its offset is
        # where the echo ends.
        last = torch.log_softmax(forward_logits(ref, ids)[-1], dim=-1)
        assert _ids_of(lpi.tokens[n:]) == [int(last.argmax())]
        assert lp.token_logprobs[n] == pytest.approx(float(last.max()), abs=ATOL)
        assert lp.text_offset == [*_offsets(lp.tokens[:n]), len(echo)]


def test_max_tokens_0_returns_the_scored_prompt_alone(oai, ref, demo_tokenizer, prompts):
    out = oai.completions.create(model="demo", prompt=prompts, max_tokens=0, logprobs=0, echo=True)
    for choice, ids in zip(out.choices, prompts, strict=True):
        lp = choice.logprobs
        assert choice.text == demo_tokenizer.decode(ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
        assert lp.token_logprobs[0] is None
        expect = prompt_logprobs(ref, ids)
        assert lp.token_logprobs[1:] == pytest.approx([float(expect[i - 1][ids[i]]) for i in range(1, len(ids))],
                                                      abs=ATOL)
        # logprobs 0: each map holds the prompt token alone.
        assert [list(m) for m in lp.top_logprobs[1:]] == [[demo_tokenizer.decode([t])] for t in ids[1:]]


def test_one_token_prompt_echo_without_logprobs(oai, demo_tokenizer, prompts):
    ids = prompts[1]
    out = oai.completions.create(model="demo", prompt=ids, max_tokens=3, temperature=0, echo=True,
                                 extra_body={"ignore_eos": True})
    plain = oai.completions.create(model="demo", prompt=ids, max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert out.choices[0].text == demo_tokenizer.decode(ids) + plain.choices[0].text
    assert out.choices[0].logprobs is None


def test_streamed_token_prompts_echo_first_in_every_choice(oai, demo_tokenizer, prompts):
    kw = dict(model="demo", prompt=prompts, max_tokens=4, n=2, temperature=0, extra_body={"ignore_eos": True})
    whole = oai.completions.create(echo=True, **kw)
    chunks = list(oai.completions.create(echo=True, stream=True, **kw))
    texts: dict[int, str] = {}
    first: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            first.setdefault(ch.index, ch.text)
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert sorted(texts) == [0, 1, 2, 3]
    for i in range(4):
        echo = demo_tokenizer.decode(prompts[i // 2])
        assert first[i].startswith(echo)
        assert texts[i] == whole.choices[i].text and texts[i].startswith(echo) and len(texts[i]) > len(echo)


def test_streaming_echo_with_logprobs_is_still_refused(oai, prompts):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="demo", prompt=prompts, max_tokens=1, logprobs=1, echo=True, stream=True)
    assert e.value.body["param"] == "echo"
