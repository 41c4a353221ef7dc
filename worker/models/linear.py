"""The linear layer: parameters, and the kind of matmul that computes x @ W.T + b, chosen once at load.

A kind is an op with one call, `op(x, bias)`: torch's F.linear, or the native CPU GEMM over a
pre-packed copy of W (worker/gemm_kernels.py). Quantized weights and LoRA are further kinds
behind the same call; the native decoder stack reads a packed kind's panels.

Tensor parallelism (Megatron): a column-parallel layer holds its rank's output rows and needs
nothing more; a row-parallel one holds its rank's input columns, so its outputs are partial
sums, all-reduced, and its bias is added once after the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from noria.worker import gemm_bf16_kernels, gemm_kernels
from noria.worker.gemm_bf16_kernels import PackedHalfWeight
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.models.parallel import TensorParallel


class TorchLinear:
    kind = "torch"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


class PackedLinear:
    """The native GEMM: against oneDNN's packed weights (torch's private mkldnn ops, which noria
    does not use) it is 1.05-1.7x faster per call at 1-512 rows on the "small" model's shapes,
    and it keeps no state per row count."""

    kind = "packed"

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = PackedWeight(weight)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemm_kernels.gemm(x, self.packed, bias)


class PackedHalfLinear:
    """The native GEMM over a bf16 or f16 copy of W (worker/gemm_bf16_kernels.py): float32 in and
    out, half the weight bytes per call; in the widening layouts each output is PackedLinear's
    over the rounded W."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
        self.packed = PackedHalfWeight(weight, gemm_bf16_kernels.layout(dtype))
        self.kind = "packed_f16" if dtype == torch.float16 else "packed_bf16"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemm_bf16_kernels.gemm_bf16(x, self.packed, bias)


LinearOp = TorchLinear | PackedLinear | PackedHalfLinear


def linear_op(weight: torch.Tensor, weights: torch.dtype | None = None) -> LinearOp:
    """The kind for a float32 weight on the CPU while worker/cpu_ops.py has the gemm family native:
    packed in 16 bits where `weights` asks for bfloat16 or float16 weights, else packed as it
    is; torch elsewhere."""
    if weights in (torch.bfloat16, torch.float16) and gemm_bf16_kernels.usable(weight):
        return PackedHalfLinear(weight, weights)
    return PackedLinear(weight) if gemm_kernels.usable(weight) else TorchLinear(weight)


def packed(op: LinearOp) -> PackedWeight | PackedHalfWeight | None:
    return op.packed if isinstance(op, (PackedLinear, PackedHalfLinear)) else None


def panels(op: object) -> int | None:
    """What the native decoder stack's GEMM reads for a layer: a packed kind's panels, a quantized
    kind's descriptor (worker/models/quant_kinds.py), else None."""
    w = packed(op)  # type: ignore[arg-type]
    return w.data.data_ptr() if w is not None else getattr(op, "desc_ptr", None)


# (a checkpoint tensor, the output rows of the module it belongs to, its name) -> the tensor as
# the layer holds those rows (quantized layers unpack and widen what checkpoints store).
Convert = Callable[[torch.Tensor, int, str], torch.Tensor]


@dataclass
class CheckpointTensor:
    """One tensor a checkpoint stores per linear module, and where it goes (worker/models/weights.py
    cuts a fused layer's parts and a tensor-parallel rank's slice out of it)."""

    suffix: str  # after the module's name: "weight", "bias", "weight_packed", "weight_scale", ...
    param: torch.Tensor | None  # None: checked as it is read, not kept (weight_shape)
    convert: Convert | None = None
    # Input features per column of `param`, for a row-parallel rank's slice: 1 for weights, the
    # group for group scales, 0 for what is not cut by columns (biases, one scale per row).
    per_column: int = 1


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.op: LinearOp = TorchLinear(self.weight)

    def pack(self, weights: torch.dtype | None = None) -> None:
        """Choose the kind for the loaded weight (`weights`: the dtype the weights are kept in,
        None for the parameter's own), once. A packed kind's panels are the only copy kept:
        the parameter keeps its shape and dtype on the meta device, no bytes (a second copy of
        every linear weight was 40 % of a small model's worker; `packed(op).unpack()` gives it back)."""
        if self.weight.is_meta:
            return  # packed already (a MoE block packs its shared expert, and the model every Linear)
        self.op = linear_op(self.weight, weights)
        if isinstance(self.op, (PackedLinear, PackedHalfLinear)):
            kept = self.op.packed.dtype if isinstance(self.op, PackedHalfLinear) else self.weight.dtype
            self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=kept, device="meta"), requires_grad=False)

    def checkpoint_tensors(self) -> list[CheckpointTensor]:
        return [CheckpointTensor("weight", self.weight),
                *([CheckpointTensor("bias", self.bias, None, 0)] if self.bias is not None else [])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.bias)


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.op(x, self.bias)  # the single-rank op order, bit for bit
        out = self.tp.all_reduce(self.op(x, None))
        return out if self.bias is None else out + self.bias
