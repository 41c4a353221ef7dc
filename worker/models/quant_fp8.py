"""FP8 linear layers (protocol/quant_fp8.py's schemes): their checkpoint tensors and their kinds.

A QuantLinear of kind fp8 holds float8_e4m3fn values [N, K] and float32 scales [N, G]: G = 1 for
per-tensor and per-channel scales (a per-tensor scale repeated on every row, so q/k/v or gate/up
parts with scales of their own fuse into one layer), G = K / 128 for 128 x 128 blocks, each
block's scale repeated over its 128 rows (a fused layer's parts and a tensor-parallel rank's rows
are then cut from the expanded rows like any per-row tensor, and a row-parallel rank's columns by
whole groups). A static `input_scale` (one per checkpoint module) is kept per row the same way
and reduced to its maximum at load (vLLM's rule for fused parts: one scale for the one input).

Online fp8 (--quantization fp8): the layer holds the checkpoint's float weight while loading
(each part and rank slice cut as a float layer's), and `quantize_online` turns it into e4m3
values with one scale per output row, max |w| / 448, at pack time; the float copy goes then.

The kinds, chosen once at load (`choose`):
- CPU: the native GEMM of worker/gemm_fp8_kernels.py (e4m3 widened in registers: to bf16 for
  vdpbf16ps on activations rounded to bf16 where built with AVX512_BF16, its "dot" layout, else to
  float32 on float32 activations), else the torch reference (TorchQuantOp: F.linear over the
  dequantized weight, float activations, as transformers' dequantized reference).
- CUDA, compute capability 8.9 and later, where the checkpoint quantizes activations:
  `ScaledMmFp8`, torch._scaled_mm on the tensor cores with the activations rounded to e4m3,
  per token (dynamic: scale max |x| / 448) or by the static input_scale; block-scaled layers
  round per token and group of 128 and run in one call of cuBLASLt's block recipe
  (`BlockScaledMmFp8`, sm_90) where a check at load agrees with the reference, else one
  row-wise scaled GEMM per group, summed in float32. Elsewhere on CUDA (older GPUs, weight-only
  checkpoints, shapes cuBLAS refuses) the torch reference.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from noria.worker.models.linear import CheckpointTensor, Convert
from noria.worker.models.quant_linear import QuantLinear, TorchQuantOp

log = logging.getLogger("noria.worker")

FP8_MAX = 448.0  # the largest finite e4m3fn


def checkpoint_tensors(layer: QuantLinear) -> list[CheckpointTensor]:
    s, k = layer.scheme, layer.checkpoint_in_features
    bias = [CheckpointTensor("bias", layer.bias, None, 0)] if layer.bias is not None else []
    if s.layout == "online":
        # The float weight this rank holds, until pack time (QuantLinear keeps its shape on meta).
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=layer.weight.dtype,
                                                device=layer.qweight.device), requires_grad=False)
        return [CheckpointTensor("weight", layer.weight), *bias]
    scale_name = "weight_scale_inv" if s.layout == "fp8" and s.group is not None else "weight_scale"
    out = [CheckpointTensor("weight", layer.qweight, _values),
           CheckpointTensor(scale_name, layer.weight_scale, _scales(s.group, k), s.group or 0)]
    if s.fp8_act == "static":
        layer.input_scale = nn.Parameter(torch.empty(layer.out_features, 1, device=layer.qweight.device),
                                         requires_grad=False)
        out.append(CheckpointTensor("input_scale", layer.input_scale, _one_scale, 0))
    return out + bias


def _values(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    if t.dtype != torch.float8_e4m3fn:
        raise ValueError(f"checkpoint tensor {what!r} is {t.dtype}, expected float8_e4m3fn values")
    return t


def _float(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"checkpoint tensor {what!r} is {t.dtype}, expected floating-point scales")
    return t.to(torch.float32)


def _scales(block: int | None, in_features: int) -> Convert:
    def convert(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        t = _float(t, what)
        if block is not None:  # one scale per block of rows and columns: repeated over the block's rows
            want = (-(-rows // block), -(-in_features // block))
            if tuple(t.shape) != want:
                raise ValueError(f"checkpoint tensor {what!r} has shape {tuple(t.shape)}, expected {want} "
                                 f"(one scale per {block} x {block} block of a [{rows}, {in_features}] weight)")
            return t.repeat_interleave(block, dim=0)[:rows]
        if t.numel() == 1:  # per tensor: every row's
            return t.reshape(1, 1).expand(rows, 1)
        if t.numel() == rows and t.dim() <= 2 and t.shape[0] == rows:
            return t.reshape(rows, 1)
        raise ValueError(f"checkpoint tensor {what!r} has shape {tuple(t.shape)}, expected one scale or one per "
                         f"output row ({rows})")
    return convert


def _one_scale(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    t = _float(t, what)
    if t.numel() != 1:
        raise ValueError(f"checkpoint tensor {what!r} has shape {tuple(t.shape)}, expected one activation scale")
    return t.reshape(1, 1).expand(rows, 1)


def quantize_rows_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric e4m3: s = max |w| / 448 (1 for a row of zeros), q = w / s rounded to the
    nearest e4m3 (ties to even), clamped to +-448. Returns (q [N, K], s float32 [N, 1])."""
    w = w.to(torch.float32)
    s = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def quantize_online(layer: QuantLinear) -> None:
    """The loaded float weight of an online layer into its e4m3 values and row scales."""
    q, s = quantize_rows_fp8(layer.weight.data)
    layer.qweight.data.copy_(q)
    layer.weight_scale.data.copy_(s)
    layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device="meta"),
                                requires_grad=False)


class NativeFp8:
    """The native CPU GEMM over the packed e4m3 weights (the only copy kept). The native decoder
    stack calls the same kernel through the packed weight's descriptor (`desc_ptr`)."""

    native = True
    kind = "native_fp8"

    def __init__(self, layer: QuantLinear) -> None:
        from noria.worker import gemm_fp8_kernels

        self.packed = gemm_fp8_kernels.PackedFp8Weight(layer.qweight.data, layer.weight_scale.data, layer.group)
        self._gemm = gemm_fp8_kernels.gemm_fp8

    @property
    def desc_ptr(self) -> int | None:
        return self.packed.desc_ptr

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # float32 activations (a CPU model's, but under the kernel emulator's 16-bit ones)
        return self._gemm(x if x.dtype == torch.float32 else x.float(), self.packed, bias).to(x.dtype)


def quantize_acts(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] to e4m3 with a float32 scale per row [M, 1]: the static `scale` (one
    for every row), else dynamic per token, s = max |x| / 448 (1 for a row of zeros); q = x / s
    rounded to the nearest e4m3, clamped to +-448."""
    xf = x.to(torch.float32)
    if scale is None:
        s = xf.abs().amax(dim=1, keepdim=True) / FP8_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)
    else:
        s = scale.reshape(1, 1).expand(xf.shape[0], 1).contiguous()
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


class ScaledMmFp8:
    """torch._scaled_mm: e4m3 activations (dynamic per token, or the static input_scale) times the
    e4m3 weights, row-wise scales on both sides; a block-scaled layer per group of 128 input
    features (its activations rounded per token and group), the groups' float32 results summed
    in order. Holds the layer's tensors, no copy."""

    native = False
    kind = "scaled_mm_fp8"

    def __init__(self, layer: QuantLinear, out_dtype: torch.dtype | None = None) -> None:
        self.qweight, self.group, self.groups = layer.qweight.data, layer.group, layer.weight_scale.shape[1]
        # One row of scales per group, [1, N] as _scaled_mm's row-wise recipe takes them.
        self.scales = [layer.weight_scale.data[:, g].reshape(1, -1).contiguous() for g in range(self.groups)]
        static = getattr(layer, "input_scale", None) if layer.scheme.fp8_act == "static" else None
        self.input_scale = None if static is None else static.data.amax().reshape(1, 1).float()
        # The CPU's _scaled_mm gives float32; cuBLAS's row-wise recipe is asked for float32, which the
        # load-time probe (`choose`) replaces with bfloat16 where the build refuses it.
        self.out_dtype = out_dtype or torch.float32

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = None
        for g in range(self.groups):
            xg = x if self.groups == 1 else x[:, g * self.group:(g + 1) * self.group]
            qx, sx = quantize_acts(xg, self.input_scale)
            wg = self.qweight if self.groups == 1 else self.qweight[:, g * self.group:(g + 1) * self.group]
            part = torch._scaled_mm(qx, wg.t(), scale_a=sx, scale_b=self.scales[g], out_dtype=self.out_dtype)
            y = part.float() if y is None else y + part.float()
        assert y is not None
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


class BlockScaledMmFp8:
    """A 128 x 128 block-scaled layer in one torch._scaled_mm: activations rounded to e4m3 per token
    and group of 128 (BlockWise1x128), the weight's own block scales (BlockWise128x128), cuBLASLt's
    DeepSeek recipe (torch 2.9 and later on sm_90 with cuBLASLt 12.9+; torch 2.11 cu130 has it).
    The layouts torch checks: scale_a [M, K/128] with strides (1, M), M padded to a multiple of 4
    for cuBLASLt's 16-byte alignment; scale_b [K/128, N/128] whose transpose is contiguous; an
    explicit 16-bit out_dtype. Used only where the load-time check (`_probed`) agreed with the
    reference; elsewhere ScaledMmFp8's loop of one row-wise GEMM per group."""

    native = False
    kind = "scaled_mm_fp8_block"

    def __init__(self, layer: QuantLinear, out_dtype: torch.dtype = torch.bfloat16) -> None:
        self.qweight, self.group, self.out_dtype = layer.qweight.data, layer.group, out_dtype
        self.block_scales = layer.weight_scale.data[::layer.group].contiguous()  # [N/128, K/128]

    @staticmethod
    def fits(layer: QuantLinear) -> bool:
        """Square 128 blocks whose scales repeat over whole 128-row blocks of this layer (a fused
        layer's parts each a multiple of 128 rows), K a multiple of 128."""
        s, w = layer.scheme, layer.weight_scale.data
        if s.group != 128 or layer.in_features % 128 or s.fp8_act != "dynamic" or w.is_meta:
            return False
        return bool(torch.equal(w, w[::128].repeat_interleave(128, dim=0)[: w.shape[0]]))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, k = x.shape
        xf = x.to(torch.float32).reshape(m, k // self.group, self.group)
        s = xf.abs().amax(dim=2) / FP8_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)
        qx = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(m, k)
        pad = -m % 4
        if pad:
            qx = torch.cat([qx, qx.new_zeros(pad, k)])
            s = torch.cat([s, s.new_ones(pad, s.shape[1])])
        scale_a = s.t().contiguous().t()  # [M, K/128], strides (1, M)
        y = torch._scaled_mm(qx, self.qweight.t(), scale_a=scale_a, scale_b=self.block_scales.t(),
                             out_dtype=self.out_dtype)[:m].float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


def _scaled_mm_fits(layer: QuantLinear) -> bool:
    """cuBLAS's FP8 GEMMs: compute capability 8.9+, leading dimensions multiples of 16."""
    dev = layer.qweight.device
    return (dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
            and layer.in_features % 16 == 0 and layer.out_features % 16 == 0 and layer.group % 16 == 0)


def _probed(layer: QuantLinear) -> BlockScaledMmFp8 | ScaledMmFp8 | None:
    """The scaled_mm kind this torch and GPU compute, checked once on a few rows (an odd count:
    the block path's padding too) against the reference: for a block-scaled layer the one-call
    block recipe first, then the loop; float32 output first, then bfloat16. None where none does."""
    x = torch.randn(13, layer.in_features, device=layer.qweight.device, dtype=torch.bfloat16)
    want = TorchQuantOp(layer)(x.float(), None)
    ops: list[BlockScaledMmFp8 | ScaledMmFp8] = []
    if layer.group < layer.in_features and BlockScaledMmFp8.fits(layer):
        ops.append(BlockScaledMmFp8(layer))
    ops += [ScaledMmFp8(layer, dtype) for dtype in (torch.float32, torch.bfloat16)]
    for op in ops:
        try:
            got = op(x.float(), None)
        except (RuntimeError, ValueError, NotImplementedError) as e:  # torch says "not here" in all three
            log.debug("%s with %s output: %s", op.kind, op.out_dtype, e)
            continue
        if torch.allclose(got, want, rtol=0.1, atol=0.1 * float(want.abs().max()) + 1e-3):
            return op
        log.debug("%s with %s output disagrees with the reference", op.kind, op.out_dtype)
    return None


def choose(layer: QuantLinear) -> NativeFp8 | BlockScaledMmFp8 | ScaledMmFp8 | TorchQuantOp:
    if layer.scheme.layout == "online" and not layer.weight.is_meta:
        quantize_online(layer)
    dev = layer.qweight.device
    if dev.type == "cpu":
        from noria.worker import gemm_fp8_kernels

        return NativeFp8(layer) if gemm_fp8_kernels.usable() else TorchQuantOp(layer)
    if layer.scheme.fp8_act and _scaled_mm_fits(layer):
        op = _probed(layer)
        if op is not None:
            return op
    return TorchQuantOp(layer)
