"""bench/stack_kernels.py: the timed kernel pointers hand every call through unchanged,
name each call after its kernel, and are restored afterwards."""

from __future__ import annotations

import pytest
import torch

from noria.bench.ceiling import _metadata
from noria.bench.stack_kernels import KernelTimes, profile, report, timed_kernels
from noria.frontend.startup import make_config
from noria.worker import native_stack
from noria.worker.model_runner import ModelRunner
from noria.worker.native_stack import model_dims


def _fields() -> dict[str, int]:
    loaded = native_stack.load()
    assert loaded is not None, "the native stack should build here"
    return {name: getattr(loaded[1], name) for name, _ in loaded[1]._fields_}


@torch.inference_mode()
def test_timed_kernels_pass_calls_through_and_count_them(demo_path):
    runner = ModelRunner(make_config(str(demo_path), num_kv_blocks=64, num_threads=2))
    model = runner.model
    runner.kv_cache.device_cache.uniform_(-1, 1)
    seq_lens = [9, 30, 17]
    layers = len(model.layers)

    def forward() -> torch.Tensor:
        ids, meta = _metadata(runner, [1] * len(seq_lens), seq_lens)
        return model(ids, meta.positions, meta, runner.attention, runner._kv_layers).clone()

    plain = forward()
    before = _fields()
    times = KernelTimes(model_dims(model))
    with timed_kernels(times):
        assert _fields() != before  # the stack now calls the timing callbacks
        timed = forward()
    assert _fields() == before
    assert torch.equal(plain, timed)
    assert times.calls == {"qkv": layers, "o": layers, "gate_up": layers, "down": layers,
                           "norm": 2 * layers, "rope": layers, "silu": layers, "attn": layers}
    assert all(s > 0 for s in times.seconds.values())
    hidden, heads, kv_heads, head_dim, inter = model_dims(model)
    assert times.flops["gate_up"] == 2.0 * len(seq_lens) * 2 * inter * hidden * layers
    assert times.flops["down"] == 2.0 * len(seq_lens) * hidden * inter * layers
    assert times.kv_bytes == 2.0 * sum(seq_lens) * kv_heads * head_dim * 4 * layers

    with pytest.raises(RuntimeError, match="boom"), timed_kernels(KernelTimes(model_dims(model))):
        raise RuntimeError("boom")
    assert _fields() == before  # restored on the way out of an error too


def test_profile_reports_every_kernel(demo_path):
    steps = [([1] * 3, [12, 20, 7], 3, 0.0), ([1] * 3, [13, 21, 8], 3, 0.0), ([1] * 2, [14, 22], 2, 0.0)]
    times, totals = profile(str(demo_path), steps, threads=2, num_kv_blocks=64)
    assert times.calls["attn"] == 2 * _layers(demo_path)  # the first of the 3 steps warms up, uncounted
    assert totals["model"] >= sum(times.seconds.values()) and totals["logits"] > 0
    text = report(times, totals, 2)
    for name in ("qkv", "o", "gate_up", "down", "norm", "rope", "silu", "attn", "logits", "model + logits"):
        assert f"| {name}" in text or f"**{name}" in text, name
    assert "GFLOP/s" in text and "GB/s of K/V" in text


def _layers(path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).num_hidden_layers
