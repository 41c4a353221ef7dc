"""prompt_logprobs through the offline LLM against a transformers forward pass.

Both sides run float32 on the CPU. noria computes the prompt in chunks over paged KV
(and again after a preemption) and transformers in one dense pass, so the sums run in
another order: the logprobs agree to about 1e-5. ATOL (1e-3) leaves room for that
while an entry of the wrong position or the wrong token is off by whole units.

The engine runs with a small KV cache and token budget so that prompts are chunked and
requests preempted (by recompute, and by swap once their prompt logprobs are out), and
with prefix caching on: a request that wants prompt logprobs takes no prefix-cache hits
(a cached block has no logits), while requests that do not still do.
"""

from __future__ import annotations

import random

import pytest

from noria import LLM, SamplingParams
from tests.sampling_reference import check_prompt_logprobs, prompt_logprobs
from tests.tiny_models import load_reference, reference_greedy

ATOL = 1e-3
MAX_NEW = 24


@pytest.fixture(scope="module")
def ref(demo_path):
    return load_reference(demo_path)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 40, 63, 90, 75, 33]
    return [[0] + [rng.randrange(5, 700) for _ in range(n - 1)] for n in lengths]


@pytest.mark.parametrize("flags, preempted_by", [
    ({"preemption_mode": "recompute"}, "recompute"),
    ({"preemption_mode": "swap", "swap_space": 0.01}, "swap"),
])
def test_prompt_logprobs_match_transformers_through_chunks_and_preemption(demo_path, ref, flags, preempted_by):
    prompts = _prompts(1)
    ks = [i % 3 * 2 for i in range(len(prompts))]  # top 0, 2 or 4 alternatives
    with LLM("demo", dtype="float32", num_kv_blocks=12, max_num_batched_tokens=24, seed=0, **flags) as llm:
        # The long prompt is cached first: the request that wants its logprobs must not take the hit.
        warm = llm.generate([prompts[7]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=k) for k in ks]
        params[3] = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)  # no prompt logprobs
        outs = llm.generate(prompts, params, use_tqdm=False)
        # The batch may have evicted the long prompt's blocks (which request ends last is the host's
        # timing); one request without prompt logprobs caches them again for the next to hit.
        llm.generate([prompts[7]], SamplingParams(max_tokens=1), use_tqdm=False)
        again = llm.generate([prompts[7]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        stats = llm.stats()
    assert warm.prompt_logprobs is None and outs[3].prompt_logprobs is None
    for i, (p, k, out) in enumerate(zip(prompts, ks, outs, strict=True)):
        if i != 3:
            check_prompt_logprobs(out.prompt_logprobs, p, prompt_logprobs(ref, p), k, ATOL)
        assert out.outputs[0].token_ids == reference_greedy(ref, p, MAX_NEW), f"prompt {i}"
    assert outs[7].num_cached_tokens == 0
    assert again.num_cached_tokens > 0, "requests without prompt logprobs still hit the prefix cache"
    assert stats.blocks_consistent and stats.num_free_blocks == stats.num_kv_blocks
    assert stats.num_preemptions > 0
    if preempted_by == "swap":
        assert stats.num_swap_outs > 0


@pytest.fixture(scope="module")
def llm(demo_path):
    with LLM("demo", dtype="float32", num_kv_blocks=64, seed=0) as engine:
        yield engine


def test_n_samples_share_one_prompt_logprobs(llm, ref):
    prompt = llm.tokenizer("Once upon a time there was a little girl who lived")["input_ids"]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    check_prompt_logprobs(out.prompt_logprobs, prompt, prompt_logprobs(ref, prompt), 3, ATOL)
    assert len(out.outputs) == 3 and all(c.logprobs is None for c in out.outputs)


def test_text_prompt_and_sampled_logprobs_together(llm, ref):
    text = "The quick brown fox jumps over the lazy dog"
    out = llm.generate([text], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    check_prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids, prompt_logprobs(ref, out.prompt_token_ids), 1, ATOL)
    assert len(out.outputs[0].logprobs) == 3


def test_a_one_token_prompt_has_one_none_entry(llm):
    out = llm.generate([[0]], SamplingParams(max_tokens=2, prompt_logprobs=5), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_tensor_parallel_ranks_score_the_prompt_together(tmp_path, demo_path):
    # Every rank takes part in each logits gather, also for the prompt positions: a rank that
    # skipped one would hang the group or misalign the next.
    from tests.test_engine_parity import _with_tokenizer
    from tests.tiny_models import make_checkpoint

    ckpt = _with_tokenizer(make_checkpoint("llama", tmp_path / "llama", num_key_value_heads=4), demo_path)
    model = load_reference(ckpt)
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 37, 20, 61)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=i % 2 * 3) for i in range(4)]
    with LLM(str(ckpt), dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, outs, strict=True):
        check_prompt_logprobs(out.prompt_logprobs, p, prompt_logprobs(model, p), sp.prompt_logprobs, ATOL)
        assert out.outputs[0].token_ids == reference_greedy(model, p, 4)
