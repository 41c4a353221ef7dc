"""Scheduler features through the whole engine (real processes, the demo model).

Each scheduling scenario runs on both attention paths of the worker: the torch backend, and
the CUDA kernels run by the CPU emulator (`NORIA_EMULATED_KERNELS=1`, inherited by the worker
process), where attention, the KV writes and the swap copies (one `copy_blocks` launch per
step, `KVCache.block_copier`) go through the same .cu sources a GPU runs. Greedy output must
equal the torch backend's without preemption, prefix caching or chunking.

Small on purpose (CI time): 6 prompts of 41-70 tokens, 8-20 new tokens each.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from noria import LLM, SamplingParams
from noria.protocol.client import Delta, Generate
from noria.worker.attention_select import EMULATED_KERNELS_ENV

BACKENDS = ["torch", "emulated-kernels"]
# What the worker logs at start-up when every layer runs on the kernels (its stderr is ours).
KERNELS_LINE = "attention: kernels for all 2 layers"


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    system = [rng.randrange(5, 700) for _ in range(40)]
    prompts = [system + [rng.randrange(5, 700) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randint(8, 20), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> Iterator[str]:
    """The worker's attention path; on the emulated kernels, checks after the test that the
    worker really ran every layer on them."""
    if request.param == "emulated-kernels":
        monkeypatch.setenv(EMULATED_KERNELS_ENV, "1")
    else:
        monkeypatch.delenv(EMULATED_KERNELS_ENV, raising=False)
    capfd.readouterr()
    yield request.param
    err = capfd.readouterr().err
    # On a GPU host the worker's default device is the GPU, so both runs use its kernels.
    on_kernels = request.param == "emulated-kernels" or torch.cuda.is_available()
    assert (KERNELS_LINE in err) == on_kernels, err[-2000:]


@pytest.fixture(scope="module")
def baseline(demo_path: object) -> list[list[int]]:
    prompts, params = _workload()
    with LLM("demo", num_kv_blocks=256, enable_prefix_caching=False) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "flags, expect",
    [
        ({}, "prefix_hits"),
        ({"num_kv_blocks": 10, "preemption_mode": "recompute"}, "preemptions"),
        ({"num_kv_blocks": 10, "preemption_mode": "swap", "swap_space": 0.01}, "swaps"),
        ({"enable_prefix_caching": True, "num_kv_blocks": 256}, "prefix_hits"),
        ({"enable_chunked_prefill": True, "max_num_batched_tokens": 24, "enable_prefix_caching": False}, "chunks"),
        ({"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 24,
          "num_kv_blocks": 12, "preemption_mode": "swap", "swap_space": 0.01}, "swaps"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "enable_prefix_caching": False}, None),
    ],
    ids=["default", "recompute", "swap", "prefix-cache", "chunked", "prefix-chunked-swap", "unchunked"],
)
def test_greedy_output_is_identical_across_scheduling(baseline, backend, flags, expect):
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
        # Every prompt (41-70 tokens) is longer than the 24-token budget, so it is prefilled
        # in chunks; the prompt that completes last does so no earlier than step
        # ceil(prompt tokens / 24) and then decodes the rest of its tokens one step each
        # (22 steps here; unchunked, the same requests take 1 + the longest output = 18).
        least = -(-sum(map(len, prompts)) // 24) + min(p.max_tokens for p in params) - 1
        assert stats.computed_prompt_tokens == sum(map(len, prompts))
        assert stats.num_steps >= least, stats


def test_shared_system_prompt_computes_far_fewer_prefill_tokens(demo_path):
    # Torch backend only: prefix hits on the kernels are covered by the scenarios above.
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


def test_n_samples_share_prompt_blocks_and_reproduce(demo_path, backend):
    prompt = list(range(5, 165))  # 160 tokens = 10 blocks
    p = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    # 4 unshared copies would need ~44 blocks; shared they need about 18 of these 20.
    with LLM("demo", num_kv_blocks=20, enable_prefix_caching=False) as llm:
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
