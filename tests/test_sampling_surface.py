"""logit_bias, allowed_token_ids and bad_words: their validation, the worker's batched
edits against masks written out per row, and the offline LLM on the demo model against
transformers' float32 logits with the same edit applied, token by token."""

from __future__ import annotations

import random

import pytest
import torch

from noria import LLM, NoriaError, SamplingParams
from noria.frontend.bad_words import bad_words_token_ids
from noria.protocol.errors import ParamError
from noria.protocol.sampling import EngineSamplingParams, check_sampling
from noria.worker.logits_processors import apply_processors, make_processors
from noria.worker.sampler import Sampler, SamplingState
from tests.sampling_reference import (
    allowed_edit,
    bad_words_edit,
    banned_by_bad_words,
    bias_edit,
    forward_logits,
    greedy_with,
)
from tests.tiny_models import load_reference

PROMPT = "Once upon a time there was a little girl who lived"
CPU = torch.device("cpu")


# ---- validation -----------------------------------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"logit_bias": {3: -101.0}}, "logit_bias"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {1000: 1.0}}, "logit_bias"),  # outside a vocabulary of 1000
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 1000]}, "allowed_token_ids"),
    ({"bad_words": ["ok", "  "]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_out_of_range_values_name_their_field(fields, param):
    with pytest.raises(ParamError) as e:
        check_sampling(SamplingParams(**fields), vocab_size=1000)
    assert e.value.param == param


def test_edges_of_the_ranges_pass():
    check_sampling(SamplingParams(logit_bias={0: -100.0, 999: 100.0}, allowed_token_ids=[999],
                                  bad_words=["x"], prompt_logprobs=20), vocab_size=1000)


def test_bad_words_tokenize_with_and_without_a_leading_space(demo_tokenizer):
    vocab = len(demo_tokenizer)
    for word in ["little", "time", "girl who", " lived", "the", "girl"]:
        got = bad_words_token_ids(demo_tokenizer, [word], vocab)
        plain = demo_tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = demo_tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        expect = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert got == expect, word
    # The demo tokenizer spells "the" and " the" as two tokens, "girl" and " girl" with the same
    # four-token length: both spellings are banned. " little" is shorter than "little": only one.
    assert len(bad_words_token_ids(demo_tokenizer, ["the"], vocab)) == 2
    assert len(bad_words_token_ids(demo_tokenizer, ["girl"], vocab)) == 2
    assert len(bad_words_token_ids(demo_tokenizer, ["little"], vocab)) == 1


# ---- the worker's batched edits against per-row masks ----------------------


def _random_params(rng: random.Random, vocab: int) -> EngineSamplingParams:
    kw: dict = {}
    if rng.random() < 0.6:
        kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(1, 6))}
    if rng.random() < 0.4:
        kw["allowed_token_ids"] = rng.sample(range(vocab), rng.randint(1, 12))
    if rng.random() < 0.6:
        kw["bad_words_token_ids"] = [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(4)]
    return EngineSamplingParams(**kw)


def _expected(logits: torch.Tensor, p: EngineSamplingParams, outputs: list[int]) -> torch.Tensor:
    row = logits.clone()
    if p.allowed_token_ids:
        row = allowed_edit(p.allowed_token_ids)(row, outputs)
    row = bad_words_edit(p.bad_words_token_ids or [])(row, outputs)
    return bias_edit(p.logit_bias or {})(row, outputs)


def test_batched_edits_equal_each_rows_own_mask():
    rng = random.Random(7)
    vocab = 50
    for _ in range(40):
        params = [_random_params(rng, vocab) for _ in range(5)]
        outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 4))] for _ in params]
        procs = [make_processors(p, o, vocab, CPU) for p, o in zip(params, outputs, strict=True)]
        # Outputs that arrive later count too: feed a few through `record`.
        for p, o, pr in zip(params, outputs, procs, strict=True):
            for t in [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]:
                o.append(t)
                if pr is not None:
                    pr.record(t)
            assert (pr is None) == (not (p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids))
        logits = torch.randn(len(params), vocab)
        expected = torch.stack([_expected(logits[i], params[i], outputs[i]) for i in range(len(params))])
        apply_processors(logits, procs)
        assert torch.equal(logits, expected)


def test_a_banned_or_disallowed_token_is_never_sampled_whatever_its_bias():
    vocab = 40
    params = EngineSamplingParams(temperature=1.0, seed=3, allowed_token_ids=[5, 6, 7],
                                  logit_bias={1: 100.0, 5: 100.0}, bad_words_token_ids=[[5]])
    state = SamplingState(params, [1, 2], 2, [], vocab, CPU)
    sampler = Sampler(vocab, CPU)
    for _ in range(30):
        tokens, _ = sampler.sample(torch.randn(1, vocab), [state])
        assert tokens[0] in (6, 7)


# ---- the engine against transformers ----------------------------------------


@pytest.fixture(scope="module")
def llm(demo_path):
    with LLM("demo", dtype="float32", num_kv_blocks=64, seed=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def ref(demo_path):
    return load_reference(demo_path)


def _greedy(llm: LLM, ids: list[int], n: int, **kw) -> list[int]:
    out = llm.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw), use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_logit_bias_greedy_equals_the_biased_argmax(llm, ref):
    prompt = llm.tokenizer(PROMPT)["input_ids"]
    first = forward_logits(ref, prompt)[-1]
    top2 = first.topk(2)
    # Lift the runner-up just past the winner, and sink another token that would win later.
    bias = {int(top2.indices[1]): float(top2.values[0] - top2.values[1]) + 0.5, int(top2.indices[0]): -100.0}
    plain = _greedy(llm, prompt, 12)
    got = _greedy(llm, prompt, 12, logit_bias=bias)
    assert got == greedy_with(ref, prompt, 12, bias_edit(bias))
    assert got[0] == int(top2.indices[1]) and got != plain


def test_allowed_token_ids_greedy_and_sampled(llm, ref):
    prompt = llm.tokenizer(PROMPT)["input_ids"]
    plain = _greedy(llm, prompt, 10)
    rng = random.Random(1)
    allowed = rng.sample([t for t in range(3, len(llm.tokenizer)) if t not in plain], 25)
    got = _greedy(llm, prompt, 10, allowed_token_ids=allowed)
    assert got == greedy_with(ref, prompt, 10, allowed_edit(allowed))
    sampled = llm.generate([prompt] * 4, SamplingParams(max_tokens=30, temperature=1.5, seed=5, n=2, ignore_eos=True,
                                                       allowed_token_ids=allowed[:3]), use_tqdm=False)
    seen = {t for o in sampled for c in o.outputs for t in c.token_ids}
    assert seen <= set(allowed[:3]) and len(seen) > 1


def _reference_words(tok, word: str) -> list[list[int]]:
    """vLLM's rule spelled out here, independently of noria's frontend: the word as is, and
    with a leading space when that is another first token and as many tokens."""
    words = [tok.encode(word, add_special_tokens=False)]
    spaced = tok.encode(" " + word, add_special_tokens=False)
    if spaced[0] != words[0][0] and len(spaced) == len(words[0]):
        words.append(spaced)
    return words


def _occurs(ids: list[int], tokens: list[int]) -> bool:
    return any(tokens[i:i + len(ids)] == ids for i in range(len(tokens)))


def test_bad_words_greedy_equals_the_reference_ban(llm, ref):
    tok = llm.tokenizer
    prompt = tok(PROMPT)["input_ids"]
    plain = _greedy(llm, prompt, 24)
    # A word of the greedy text that its ban would change (a multi-token one where there is).
    candidates = [w for w in tok.decode(plain).split() if any(_occurs(ids, plain) for ids in _reference_words(tok, w))]
    assert candidates, tok.decode(plain)
    word = max(candidates, key=lambda w: max(len(ids) for ids in _reference_words(tok, w)))
    words = _reference_words(tok, word)
    got = _greedy(llm, prompt, 24, bad_words=[word])
    assert got == greedy_with(ref, prompt, 24, bad_words_edit(words))
    assert got != plain
    for i in range(len(got)):
        assert got[i] not in banned_by_bad_words(words, got[:i]), f"token {i}"


def test_bad_word_ids_outside_the_vocabulary_or_blank_are_refused(llm):
    with pytest.raises(NoriaError) as e:
        llm.generate(["hi"], SamplingParams(bad_words=["\t"]), use_tqdm=False)
    assert "bad_words" in str(e.value)
    with pytest.raises(NoriaError) as e:
        llm.generate(["hi"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert "logit_bias" in str(e.value)
