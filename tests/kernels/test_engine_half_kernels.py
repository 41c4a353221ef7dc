"""The whole engine (real processes, the demo model) in float16 and bfloat16 on the CUDA
kernels run by the CPU emulator (`NORIA_EMULATED_KERNELS=1`): the tensor-core prefill kernel
for chunks and prefix-cache hits, the tensor-core decode kernel, and steps that mix both.
Greedy output must equal the torch backend's in the same dtype."""

from __future__ import annotations

import pytest

from noria import LLM
from noria.worker import cpu_ops
from noria.worker.attention_select import EMULATED_KERNELS_ENV
from tests.test_engine_scheduling import KERNELS_LINE, _workload


def _generate(dtype: str) -> list[list[int]]:
    prompts, params = _workload()
    # Chunks of 24 tokens beside running decodes, and the shared 40-token system prompt as a
    # prefix-cache hit after the first request.
    with LLM("demo", dtype=dtype, num_kv_blocks=256, enable_prefix_caching=True,
             enable_chunked_prefill=True, max_num_batched_tokens=24) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_engine_on_kernels_matches_torch(
    demo_path: object, dtype: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv(EMULATED_KERNELS_ENV, raising=False)
    # The reference computes in the dtype, on torch's operators, as a GPU does: without the native
    # GEMMs a CPU worker does not keep bf16 as weights-only (worker/device.py, cpu_precision).
    monkeypatch.setenv(cpu_ops.FAMILY_ENV["gemm"], "1")
    expected = _generate(dtype)
    monkeypatch.delenv(cpu_ops.FAMILY_ENV["gemm"])
    monkeypatch.setenv(EMULATED_KERNELS_ENV, "1")
    capfd.readouterr()
    got = _generate(dtype)
    assert KERNELS_LINE in capfd.readouterr().err
    assert got == expected
