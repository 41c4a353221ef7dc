"""The offline LLM on the demo model: order, continuous batching, sampling, stats, shutdown."""

from __future__ import annotations

import random

import pytest

from noria import LLM, NoriaError, SamplingParams
from tests.procs import alive


@pytest.fixture(scope="module")
def llm(demo_path):
    with LLM("demo", num_kv_blocks=64, max_num_seqs=8, seed=0) as engine:
        yield engine


def test_outputs_in_prompt_order_with_mixed_prompts(llm):
    prompts = ["Hello", [0, 44, 559, 16], "Once upon a time there was"]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (3, 5, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7]
    assert outs[1].prompt_token_ids == [0, 44, 559, 16]
    assert outs[0].prompt == "Hello" and outs[0].prompt_token_ids == llm.tokenizer("Hello")["input_ids"]
    for o in outs:
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_more_requests_than_the_cache_holds_all_finish_correctly(llm):
    # 64 blocks x 16 tokens; 40 requests of ~120 tokens each cannot all be resident.
    prompts = [f"Request number {i} says hello" for i in range(40)]
    p = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, p, use_tqdm=False)
    alone = llm.generate(prompts[:3], p, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 100 for o in outs)
    assert [o.outputs[0].token_ids for o in outs[:3]] == [o.outputs[0].token_ids for o in alone]
    stats = llm.stats()
    assert stats.blocks_consistent and stats.num_free_blocks == stats.num_kv_blocks


def test_seeded_sampling_reproduces(llm):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    a = llm.generate(["Hello"] * 3, p, use_tqdm=False)
    b = llm.generate(["Hello", "unrelated other prompt"], p, use_tqdm=False)
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == a[2].outputs[0].token_ids == b[0].outputs[0].token_ids
    c = llm.generate(["Hello"], SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True), use_tqdm=False)
    assert c[0].outputs[0].token_ids != a[0].outputs[0].token_ids


def test_n_samples_and_stop_strings(llm):
    out = llm.generate(["Hello"], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 8 for c in out.outputs)
    full = llm.generate(["Hello"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    cut = llm.generate(["Hello"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]


def test_sample_i_of_a_seeded_request_is_the_request_seeded_with_seed_plus_i(llm):
    many = llm.generate(["Hello"], SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    alone = [SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i, ignore_eos=True) for i in range(3)]
    outs = llm.generate(["Hello"] * 3, alone, use_tqdm=False)
    assert [c.token_ids for c in many] == [o.outputs[0].token_ids for o in outs]
    assert len({tuple(c.token_ids) for c in many}) == 3


def test_bad_request_raises_and_engine_survives(llm):
    with pytest.raises(NoriaError, match="top_p"):
        llm.generate(["x"], SamplingParams(top_p=2.0), use_tqdm=False)
    assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def _long_prompt(seed: int, length: int = 100) -> list[int]:
    """Token ids no other test uses, so that nothing is cached before the test sends them."""
    rng = random.Random(seed)
    return [rng.randrange(300, 700) for _ in range(length)]


def test_prefix_cache_hits_are_reported(llm):
    prompt = _long_prompt(1)
    block = llm.config.block_size
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], p, use_tqdm=False)[0]
    hits_before = llm.stats().prefix_cache_hits
    second = llm.generate([prompt], p, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # Every full block before the last prompt token (whose logits are needed): 6 x 16 of 100.
    assert second.num_cached_tokens == (len(prompt) - 1) // block * block == 96
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.stats().prefix_cache_hits - hits_before == second.num_cached_tokens
    # A prompt sharing only its first 40 tokens reuses the two whole blocks among them.
    forked = llm.generate([prompt[:40] + _long_prompt(2, 60)], p, use_tqdm=False)[0]
    assert forked.num_cached_tokens == 2 * block


def test_no_prefix_caching_reports_no_cached_tokens(demo_path):
    prompt = _long_prompt(3)
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM("demo", num_kv_blocks=32, enable_prefix_caching=False) as engine:
        outs = [engine.generate([prompt], p, use_tqdm=False)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_leaving_with_stops_every_process(demo_path):
    with LLM("demo", num_kv_blocks=16) as engine:
        pids = [p.pid for p in engine.core.engine.procs.procs.values()]
        assert all(alive(p) for p in pids)
    assert not any(alive(p) for p in pids)


def test_unknown_engine_flag_is_an_error():
    with pytest.raises(TypeError, match="no_such_flag"):
        LLM("demo", no_such_flag=1)
