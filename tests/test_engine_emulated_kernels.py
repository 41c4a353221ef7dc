"""The engine's scheduling scenarios with the worker's attention and block copies on the CUDA
kernels, run by the CPU emulator (NORIA_EMULATED_KERNELS=1 in the worker process): swap
preemption, recompute preemption, prefix caching and chunked prefill must give the tokens
of the torch backend. Small: the demo model (head size 32, 2 layers), few short requests."""

from __future__ import annotations

import random

import pytest

from noria import LLM, SamplingParams
from noria.worker.attention_select import EMULATED_KERNELS_ENV


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    system = [rng.randrange(5, 700) for _ in range(40)]
    prompts = [system + [rng.randrange(5, 700) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randint(8, 20), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def baseline(demo_path: object) -> list[list[int]]:
    prompts, params = _workload()
    with LLM("demo", num_kv_blocks=256, enable_prefix_caching=False) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        ({"num_kv_blocks": 10, "preemption_mode": "swap", "swap_space": 0.01}, "num_swap_ins"),
        ({"num_kv_blocks": 10, "preemption_mode": "recompute"}, "num_preemptions"),
        ({"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 24},
         "prefix_cache_hits"),
    ],
    ids=["swap", "recompute", "prefix-chunked"],
)
def test_scheduling_on_emulated_kernels(baseline: list[list[int]], flags: dict, expect: str,
                                        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(EMULATED_KERNELS_ENV, "1")  # inherited by the worker process
    prompts, params = _workload()
    capfd.readouterr()
    with LLM("demo", **flags) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    # The worker's start-up line (its stderr is this process's): every layer ran on kernels.
    assert "attention: kernels for all 2 layers" in capfd.readouterr().err
    assert outs == baseline
    assert stats.blocks_consistent
    assert getattr(stats, expect) > 0, stats
