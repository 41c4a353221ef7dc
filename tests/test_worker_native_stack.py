"""The decoder stack in one native call (worker/native_stack.py) against the Python path.

Both run the same kernels in the same order, so the hidden states must be equal bit
for bit, not merely close: any slip in the driver (a residual added twice, a buffer
read after it was overwritten, a layer's window or bias dropped) changes bits.
Greedy parity with transformers through the same code is tests/test_worker_parity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from noria.bench.ceiling import _metadata
from noria.protocol.config import EngineConfig
from noria.worker import native_stack
from noria.worker.model_runner import ModelRunner
from tests.tiny_models import make_checkpoint

pytestmark = pytest.mark.skipif(native_stack.load() is None, reason="no C compiler for the native kernels")

# (query lengths, sequence lengths): decode rows only; short prompts as rows, one after a
# cached prefix; decodes mixed with a prompt; a prompt past ROWS_MAX_LEN (SDPA: Python path).
STEPS = {
    "decode": ([1] * 5, [3, 17, 40, 64, 130]),
    "prompts as rows": ([7, 33, 20], [7, 33, 90]),
    "mixed": ([1, 1, 1, 25], [200, 9, 60, 25]),
    "long prompt": ([1, 600], [30, 600]),
}


def _runner(path: Path) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=128,
                                      swap_space=0.001, num_threads=2))
    torch.manual_seed(0)
    runner.kv_cache.device_cache.uniform_(-1, 1)  # contexts the steps attend to
    return runner


def _forward(runner: ModelRunner, step: tuple[list[int], list[int]], native: bool) -> tuple[torch.Tensor, bool]:
    """Hidden states of one step, and whether the native stack ran it."""
    model = runner.model
    ran: list[bool] = []
    real = native_stack.NativeStack.run

    def spy(self: native_stack.NativeStack, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        ran.append(True)
        return real(self, *args)  # type: ignore[arg-type]

    ids, meta = _metadata(runner, *step)
    before = runner.kv_cache.device_cache.clone()
    try:
        native_stack.NativeStack.run = spy  # type: ignore[method-assign]
        if not native:
            model._native_stack = lambda *a: None  # type: ignore[method-assign]
        with torch.inference_mode():
            hidden = model(ids, meta.positions, meta, runner.attention, runner._kv_layers)
    finally:
        native_stack.NativeStack.run = real  # type: ignore[method-assign]
        model.__dict__.pop("_native_stack", None)
    written = runner.kv_cache.device_cache.clone()
    runner.kv_cache.device_cache.copy_(before)  # the other path starts from the same caches
    return torch.cat([hidden.flatten(), written.flatten()]), bool(ran)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # plain; sliding window; q/k/v biases
def test_native_stack_is_bit_identical_to_the_python_path(arch: str, tmp_path: Path) -> None:
    runner = _runner(make_checkpoint(arch, tmp_path / arch, tied=arch == "llama"))
    for name, step in STEPS.items():
        python, _ = _forward(runner, step, native=False)
        native, ran = _forward(runner, step, native=True)
        assert ran == (name != "long prompt"), name
        assert torch.equal(python, native), f"{arch}, {name}: hidden states or written K/V differ"


def test_models_outside_its_kernels_keep_the_python_path(tmp_path: Path) -> None:
    # Qwen3's per-head q/k norm has no place in the driver.
    runner = _runner(make_checkpoint("qwen3", tmp_path / "qwen3"))
    assert not native_stack.NativeStack.applies(runner.model, runner._kv_layers)
    _, ran = _forward(runner, STEPS["decode"], native=True)
    assert not ran


def test_scratch_buffers_grow_and_are_reused(tmp_path: Path) -> None:
    runner = _runner(make_checkpoint("llama", tmp_path / "llama"))
    for step in (STEPS["decode"], STEPS["prompts as rows"], STEPS["decode"]):
        python, _ = _forward(runner, step, native=False)
        native, ran = _forward(runner, step, native=True)
        assert ran and torch.equal(python, native)
    stack = runner.model._stack
    assert stack is not None and stack._capacity >= sum(STEPS["prompts as rows"][0])
