"""Checks of layers that round their activations: to int8 (W8A8 per token, 4- and 8-bit weights
per group), or to bf16 (FP8 weights on the "dot" layout of worker/csrc/gemm_fp8.c).

Chained through a model, such rounding cannot be compared with a reference to float32 rounding:
a value the reference computes 1e-7 away from a rounding tie may round the other way, and the
step it then differs by flows on. So a model is checked in two parts: every quantized layer on
the very inputs it saw in a forward pass, against its dequantized weights times those inputs
rounded by the rule written here apart from the kernels (float32 rounding), and the whole
model's logits against a reference that rounds the same way, off by less than the rounding
itself moves them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from noria.bench.ceiling import _metadata
from noria.protocol.config import EngineConfig
from noria.worker.model_runner import ModelRunner
from noria.worker.models.quant_linear import QuantLinear


def prompt_logits(path: Path, prompt: list[int], num_kv_blocks: int = 128) -> tuple[torch.Tensor, ModelRunner]:
    """Every position's logits of one prompt, run as one prefill by a float32 CPU ModelRunner of
    the checkpoint (which is returned too)."""
    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks,
                                      swap_space=0.001, num_threads=2))
    _, meta = _metadata(runner, [len(prompt)], [len(prompt)])
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt), meta.positions, meta, runner.attention, runner._kv_layers)
        return runner.model.compute_logits(hidden), runner


def fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded as an int8 kernel rounds it: absmax / 127 per token (group 0) or per group of
    features of a token, to the nearest even, within [-127, 127]; back in float."""
    shape = x.shape
    x = x.reshape(*shape[:-1], -1, group) if group else x.unsqueeze(-2)
    s = x.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    return ((x / s).round().clamp(-127, 127) * s).reshape(shape)


def dequantized(layer: QuantLinear) -> torch.Tensor:
    """A native kind's weight, float32 [N, K], from its packed copy."""
    packed = layer.op.packed
    if hasattr(packed, "dequantize"):
        return packed.dequantize()
    q, scale = packed.unpack()
    return q.float() * scale[:, None]


def act_group(layer: QuantLinear) -> int:
    """0 (per token) for W8A8; the weights' group for W4A8 and W8A8g."""
    return 0 if layer.op.kind == "packed_w8a8" else layer.group


def rounds_activations(layer: QuantLinear) -> bool:
    """The layer's kernel rounds its inputs (to int8, or to bf16 for the fp8 dot layout)."""
    if layer.op.kind == "native_fp8":
        from noria.worker import gemm_fp8_kernels

        return gemm_fp8_kernels.layout() == "dot"
    return layer.op.kind in ("packed_w8a8", "packed_w4a8", "packed_w8a8g")


def rounded(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """x as `layer`'s kernel rounds it, back in float."""
    if layer.op.kind == "native_fp8":
        return x.to(torch.bfloat16).to(x.dtype)
    return fake_quant(x, act_group(layer))


def check_layers_on_their_inputs(runner: ModelRunner, prompt: list[int]) -> int:
    """Every layer of `runner`'s model that rounds its activations, on the inputs a forward of
    `prompt` gives it: its output against the float64 product of its dequantized weight and the
    rounded inputs. Returns how many layers were checked."""
    model, seen = runner.model, {}
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and rounds_activations(m)]
    ops = {m: m.op for m in layers}
    real_head = model.head

    def spy(m: QuantLinear) -> Any:
        def call(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            seen[m] = x.clone()
            return ops[m](x, bias)
        return call

    for m in layers:
        m.op = spy(m)
    if model.lm_head in ops:
        model.head = model.lm_head.op
    try:
        _, meta = _metadata(runner, [len(prompt)], [len(prompt)])
        model._native_stack = lambda *a: None  # the Python path calls each layer's op
        with torch.inference_mode():
            model.compute_logits(model(torch.tensor(prompt), meta.positions, meta, runner.attention,
                                       runner._kv_layers))
    finally:
        model.__dict__.pop("_native_stack", None)
        model.head = real_head
        for m, op in ops.items():
            m.op = op
    for m in layers:
        x = seen[m]
        want = rounded(m, x).double() @ dequantized(m).double().T
        if m.bias is not None:
            want += m.bias.double()
        got = m.op(x, m.bias).double()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * (1 + want.abs().max().item()))
    return len(layers)


def check_logits(got: torch.Tensor, hooked: torch.Tensor, plain: torch.Tensor) -> None:
    """noria's logits against a reference that rounds the same inputs (`hooked`) and one that does
    not (`plain`): off from the first by less than the rounding moves the second."""
    assert (got - hooked).abs().mean() < (hooked - plain).abs().mean()
