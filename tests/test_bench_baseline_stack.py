"""bench/baseline_stack.py: bench/attention.py's baseline forward runs in the native stack
too (before, a baseline backend always fell back to the Python path), the working tree's
can be held to the Python path, and everything is put back afterwards."""

from __future__ import annotations

import types

import pytest
import torch

from noria.bench import baseline_stack
from noria.bench.attention import load_baseline, metadata
from noria.bench.baseline_stack import PYTHON, STACK, common_path, forward_path
from noria.frontend.startup import make_config
from noria.worker import attention as current
from noria.worker import native_stack
from noria.worker.model_runner import ModelRunner


def _state() -> tuple[object, int]:
    loaded = native_stack.load()
    assert loaded is not None
    return native_stack.paged_rows, loaded[1].attn


@torch.inference_mode()
def test_the_baseline_runs_in_the_stack_and_both_paths_agree(demo_path, monkeypatch):
    baseline = load_baseline("HEAD")
    assert common_path(baseline) == STACK
    runner = ModelRunner(make_config(str(demo_path), num_kv_blocks=64, num_threads=2))
    runner.kv_cache.device_cache.uniform_(-1, 1)
    runs = {"n": 0}
    real_run = native_stack.NativeStack.run

    def counted(self, *args):
        runs["n"] += 1
        return real_run(self, *args)

    monkeypatch.setattr(native_stack.NativeStack, "run", counted)

    def forward(mod: types.ModuleType, backend) -> tuple[torch.Tensor, int]:
        meta = metadata(mod, 64, runner.block_size, [1, 1, 1], [9, 30, 17], seed=1)
        backend.prepare(meta)
        ids = torch.full((3,), 5, dtype=torch.long)
        before = runs["n"]
        out = runner.model(ids, meta.positions, meta, backend, runner._kv_layers).clone()
        return out, runs["n"] - before

    mine = forward(current, current.TorchAttentionBackend())
    theirs = baseline.TorchAttentionBackend()
    assert forward(baseline, theirs)[1] == 0  # left alone, a baseline backend misses the stack
    state = _state()
    with forward_path(STACK, baseline):
        assert _state()[0] is not state[0]
        in_stack = forward(baseline, theirs)
    with forward_path(PYTHON, None):
        python = forward(current, current.TorchAttentionBackend())
    assert _state() == state
    assert mine[1] == 1 and in_stack[1] == 1 and python[1] == 0
    assert torch.equal(mine[0], in_stack[0])  # the same code at HEAD: the same bits
    assert torch.equal(python[0], mine[0])  # the stack calls the Python path's kernels, in its order

    with pytest.raises(RuntimeError, match="boom"), forward_path(STACK, baseline):
        raise RuntimeError("boom")
    assert _state() == state


def test_a_baseline_kernel_of_another_signature_keeps_both_sides_on_python(monkeypatch):
    other = types.SimpleNamespace(argtypes=[object])
    old = types.SimpleNamespace(
        cpu_kernels=types.SimpleNamespace(load=lambda: types.SimpleNamespace(paged_decode_f32=other)),
        TorchAttentionBackend=type("Old", (), {}))
    assert common_path(old) == PYTHON  # type: ignore[arg-type]
    same = types.SimpleNamespace(
        cpu_kernels=baseline_stack.cpu_kernels,
        TorchAttentionBackend=type("NoRows", (), {}))  # no paged_rows: the stack cannot ask it
    assert common_path(same) == PYTHON  # type: ignore[arg-type]
