"""Linear layers with integer weights (protocol/quant_config.py's schemes) and their kinds.

A `QuantLinear` holds what every scheme reduces to once loaded: int8 values [N, K] (4-bit ones
in [-8, 7]), a float32 scale per output row and group of input features [N, G], and for an
asymmetric scheme an int8 zero point per scale, or for a scheme with minimums (GGUF's Q4_K) a
float32 minimum per scale, subtracted after scaling. The checkpoint's own forms (compressed-tensors'
int32 words of packed values, zero points packed along the output rows, one scale for the
whole tensor, bf16 scales) are converted as each tensor is read, so a fused layer's parts
(q/k/v, gate/up) and a tensor-parallel rank's slice are cut from them like float weights.

The kinds, chosen once at load (`QuantLinear.pack`): the native CPU GEMMs of
worker/gemm_quant_kernels.py, and torch references that compute the same thing (the GPU and
hosts without a C compiler take them): W8A8 quantizes each row of activations to int8 with its
own scale (vLLM's dynamic per-token rule: absmax / 127, rounded to nearest even) and sums the
int8 products exactly in int32; weight-only schemes multiply float activations by
(q - zero) * scale, or q * scale - min.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from noria.protocol.model_spec import ModelSpec
from noria.protocol.quant_config import WeightScheme
from noria.worker.gemm_quant_kernels import quantize_rows
from noria.worker.models.linear import CheckpointTensor, Convert, Linear, RowParallelLinear
from noria.worker.models.parallel import TensorParallel


def unpack_words(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32, undone: values stored as (value + 2^(bits-1)), 32/bits
    per little-endian int32 word along `dim`, element i at bit (i % per_word) * bits; the
    first `count` values along `dim`, as int8."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed weights are {words.dtype}, expected int32 words")
    per_word = 32 // bits
    w = words.transpose(0, 1) if dim == 0 else words
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(w.shape[0], w.shape[1] * per_word)
    if values.shape[1] < count:
        raise ValueError(f"{w.shape[1]} words of {bits}-bit values hold {values.shape[1]}, expected {count}")
    values = (values[:, :count] - (1 << (bits - 1))).to(torch.int8)
    return values.transpose(0, 1).contiguous() if dim == 0 else values.contiguous()


class QuantLinear(nn.Module):
    """x @ W.T + b with W = (q - zero) * scale per group, in one of the kinds below."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: WeightScheme) -> None:
        super().__init__()
        self.scheme, self.in_features, self.out_features = scheme, in_features, out_features
        self.group = scheme.group or in_features
        g = scheme.groups(in_features)
        values = torch.float8_e4m3fn if scheme.kind == "fp8" else torch.int8
        self.qweight = nn.Parameter(torch.empty(out_features, in_features, dtype=values), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, g, dtype=torch.float32), requires_grad=False)
        self.weight_zero = (None if scheme.symmetric else
                            nn.Parameter(torch.empty(out_features, g, dtype=torch.int8), requires_grad=False))
        self.weight_min = (nn.Parameter(torch.empty(out_features, g, dtype=torch.float32), requires_grad=False)
                           if scheme.minimum else None)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # The float weight's shape and dtype, no bytes (code that asks a Linear for them).
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        # The input features in the order the weight's columns hold them (GPTQ's act_order, set
        # as the checkpoint is read), None where they are in the model's order.
        self.input_perm: torch.Tensor | None = None
        self.op: QuantOp = TorchQuantOp(self)

    # The input features the checkpoint's module has (a row-parallel rank holds a slice of them).
    checkpoint_in_features = property(lambda self: self.in_features)

    def checkpoint_tensors(self) -> list[CheckpointTensor]:
        s, k, g = self.scheme, self.checkpoint_in_features, self.group
        module = _LAYOUT_MODULES.get(s.layout) or (_LAYOUT_MODULES["fp8"] if s.kind == "fp8" else None)
        if module is not None:  # the formats that keep their tensors in a layout of their own
            return importlib.import_module(module).checkpoint_tensors(self)
        per_row = 0 if s.group is None else g
        values = (CheckpointTensor("weight_packed", self.qweight, lambda t, n, what: unpack_words(t, s.bits, k, 1))
                  if s.packed else CheckpointTensor("weight", self.qweight, _int8))
        out = [values, CheckpointTensor("weight_scale", self.weight_scale, _scales(k // g), per_row)]
        if s.packed:
            out.append(CheckpointTensor("weight_shape", None, _shape_check(k)))
        if self.weight_zero is not None:
            out.append(CheckpointTensor("weight_zero_point", self.weight_zero, _zeros(s.bits, k // g), per_row))
        if self.weight_min is not None:
            out.append(CheckpointTensor("weight_min", self.weight_min, _scales(k // g), per_row))
        if self.bias is not None:
            out.append(CheckpointTensor("bias", self.bias, None, 0))
        return out

    def pack(self, weights: torch.dtype | None = None) -> None:
        """The kind, once, after loading: the native GEMM's packed copy (the only one kept) where
        it is built for this device, else the torch reference over the loaded tensors."""
        if self.qweight.is_meta:
            return
        from noria.worker.models import quant_kinds

        self.op = quant_kinds.choose(self)
        if self.op.native:
            for name in ("qweight", "weight_scale", "weight_zero", "weight_min"):
                p = getattr(self, name)
                if p is not None:
                    setattr(self, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                     requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.permuted(x), self.bias)

    def permuted(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_perm is None else x.index_select(-1, self.input_perm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.name}, group={self.group}"


class RowParallelQuantLinear(QuantLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 scheme: WeightScheme) -> None:
        super().__init__(in_features, out_features, bias, scheme)
        self.tp = tp

    checkpoint_in_features = property(lambda self: self.in_features * self.tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.permuted(x)
        if self.tp.size == 1:
            return self.op(x, self.bias)
        out = self.tp.all_reduce(self.op(x, None))
        return out if self.bias is None else out + self.bias


# The modules (worker/models/) whose `checkpoint_tensors(layer)` read the layouts that are not
# compressed-tensors' integer ones.
_LAYOUT_MODULES = {"awq": "noria.worker.models.quant_awq_gptq", "gptq": "noria.worker.models.quant_awq_gptq",
                   "gptq_v2": "noria.worker.models.quant_awq_gptq",
                   "fp8": "noria.worker.models.quant_fp8", "online": "noria.worker.models.quant_fp8"}


def _int8(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    if t.dtype != torch.int8:
        raise ValueError(f"checkpoint tensor {what!r} is {t.dtype}, expected int8 values")
    return t


def _scales(groups: int) -> Convert:
    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        if not t.is_floating_point():
            raise ValueError(f"checkpoint tensor {what!r} is {t.dtype}, expected floating-point scales")
        t = t.to(torch.float32)
        if t.numel() == 1:  # one scale for the whole tensor: every row's
            return t.reshape(1, 1).expand(rows, groups)
        return t.reshape(rows, groups) if t.dim() == 1 and groups == 1 and t.numel() == rows else t
    return convert


def _zeros(bits: int, groups: int) -> Convert:
    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        if t.dtype == torch.int32:  # packed along the output rows
            return unpack_words(t, bits, rows, 0)
        if t.dtype != torch.int8:
            raise ValueError(f"checkpoint tensor {what!r} is {t.dtype}, expected int8 or packed int32 zero points")
        return t.reshape(rows, groups) if t.numel() == rows * groups else t
    return convert


def _shape_check(in_features: int) -> Convert:
    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        if t.tolist() != [rows, in_features]:
            raise ValueError(f"checkpoint tensor {what!r} says the weight is {t.tolist()}, expected "
                             f"{[rows, in_features]}")
        return t
    return convert


def scheme_of(spec: ModelSpec, modules: list[str]) -> WeightScheme | None:
    """The scheme of the checkpoint modules ("model.layers.0.self_attn.q_proj", ...) one layer
    computes, or None for float weights."""
    if spec.quantization is None:
        return None
    return spec.quantization.fused_scheme(modules)


class TorchQuantOp:
    """The torch reference of a QuantLinear's scheme, over its loaded tensors."""

    native = False

    def __init__(self, layer: QuantLinear) -> None:
        self.layer = layer
        self.kind = f"torch_{layer.scheme.name.lower()}"

    def dequantized(self) -> torch.Tensor:
        """W in float32 [N, K]."""
        lay = self.layer
        q = lay.qweight.float()
        if lay.weight_zero is not None:
            q = q.view(lay.out_features, -1, lay.group) - lay.weight_zero.float()[..., None]
        w = q.view(lay.out_features, -1, lay.group) * lay.weight_scale[..., None]
        if lay.weight_min is not None:  # GGUF's order: (d * sc) * q - dmin * m
            w = w - lay.weight_min[..., None]
        return w.view(lay.out_features, lay.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lay = self.layer
        xf = x.float()
        if lay.scheme.act_int8:
            qx, sx = quantize_rows(xf)
            acc = torch_int_mm(qx, lay.qweight)
            y = acc.float() * sx[:, None] * lay.weight_scale[:, 0][None, :]
            y = y if bias is None else y + bias.float()
        else:
            y = F.linear(xf, self.dequantized(), None if bias is None else bias.float())
        return y.to(x.dtype)


def torch_int_mm(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """The int32 sums qx [M, K] @ qw [N, K].T: exact on the CPU (torch's int8 GEMM); elsewhere
    in float32, exact while a sum stays under 2^24."""
    if qx.device.type == "cpu":
        return torch._int_mm(qx, qw.t())
    return (qx.float() @ qw.float().t()).round().to(torch.int32)


QuantOp = TorchQuantOp  # the native kinds (worker/models/quant_kinds.py) have the same call


def make_linear(in_features: int, out_features: int, bias: bool,
                scheme: WeightScheme | None) -> Linear | QuantLinear:
    """A column-parallel (or unsplit) linear layer: float, or integer weights in `scheme`."""
    if scheme is None:
        return Linear(in_features, out_features, bias)
    return QuantLinear(in_features, out_features, bias, scheme)


def make_row_parallel(in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                      scheme: WeightScheme | None) -> RowParallelLinear | RowParallelQuantLinear:
    if scheme is None:
        return RowParallelLinear(in_features, out_features, bias, tp)
    return RowParallelQuantLinear(in_features, out_features, bias, tp, scheme)
