"""Scheduler features through the whole engine (real processes, the demo model)."""

from __future__ import annotations

import random

import pytest

from noria import LLM, SamplingParams
from noria.protocol.client import Delta, Generate

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    system = [rng.randrange(5, 700) for _ in range(40)]
    prompts = [system + [rng.randrange(5, 700) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(10, 50), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def baseline(demo_path):
    prompts, params = _workload()
    with LLM("demo", num_kv_blocks=256, enable_prefix_caching=False) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "flags, expect",
    [
        ({}, "prefix_hits"),
        ({"num_kv_blocks": 12, "preemption_mode": "recompute"}, "preemptions"),
        ({"num_kv_blocks": 12, "preemption_mode": "swap", "swap_space": 0.01}, "swaps"),
        ({"enable_prefix_caching": True, "num_kv_blocks": 256}, "prefix_hits"),
        ({"enable_chunked_prefill": True, "max_num_batched_tokens": 24}, "chunks"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "enable_prefix_caching": False}, None),
    ],
    ids=["default", "recompute", "swap", "prefix-cache", "chunked", "unchunked"],
)
def test_greedy_output_is_identical_across_scheduling(baseline, flags, expect):
    prompts, params = _workload()
    with LLM("demo", **flags) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert outs == baseline
    assert stats.blocks_consistent and stats.num_free_blocks == stats.num_kv_blocks
    if expect == "preemptions":
        assert stats.num_preemptions > 0
    if expect == "swaps":
        assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    if expect == "prefix_hits":
        assert stats.prefix_cache_hits > 0
    if expect == "chunks":
        assert stats.num_steps > max(p.max_tokens for p in params) + 10


def test_shared_system_prompt_computes_far_fewer_prefill_tokens(demo_path):
    rng = random.Random(3)
    system = [rng.randrange(5, 700) for _ in range(512)]
    prompts = [system + [rng.randrange(5, 700) for _ in range(8)] for _ in range(16)]
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    computed = {}
    for caching in (True, False):
        with LLM("demo", num_kv_blocks=512, enable_prefix_caching=caching) as llm:
            llm.generate(prompts[:1], p, use_tqdm=False)  # the system prompt is now cached
            llm.generate(prompts[1:], p, use_tqdm=False)
            s = llm.stats()
        computed[caching] = s.computed_prompt_tokens
        if caching:
            assert s.prefix_cache_hits >= 15 * 512
    assert computed[False] == 16 * 520
    assert computed[True] <= 520 + 15 * 24


def test_n_samples_share_prompt_blocks_and_reproduce(demo_path):
    prompt = list(range(5, 325))  # 320 tokens = 20 blocks
    p = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    # 4 unshared copies would need ~84 blocks; shared they need 28 of these 32.
    with LLM("demo", num_kv_blocks=32, enable_prefix_caching=False) as llm:
        a = llm.generate([prompt], p, use_tqdm=False)[0]
        b = llm.generate([prompt], p, use_tqdm=False)[0]
        stats = llm.stats()
    assert stats.num_preemptions == 0
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 4


def test_abort_mid_stream_frees_blocks_within_a_step(demo_path):
    with LLM("demo", num_kv_blocks=64) as llm:
        core = llm.core
        got: list[object] = []
        core.submit("s", Generate(request_id="s", prompt="go on", max_tokens=500, ignore_eos=True), got.append)
        while sum(isinstance(m, Delta) for m in got) < 3:
            llm._pump(100)
        core.abort("s")
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_kv_blocks and stats.num_running == 0
        assert got[-1].finish_reason == "abort"
