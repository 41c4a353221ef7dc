"""W4A16 GEMM (csrc/gemm_w4a16.cu): y = x @ dequant(W).T (+ bias) for 4-bit weights with float32
group scales and optional int8 zero points, W[n][k] = (q - z) * s with q in [-8, 7].

QuantLinear's tensors (int8 values [N, K], scales [N, G], zero points [N, G]) are converted
once at load by `pack_w4a16` into the kernel's layout (documented at the top of the .cu file:
16 x 16 tiles, one 32-bit word of eight nibbles per lane, Marlin's pair interleave);
`unpack_w4a16` undoes it (tests and checks). float16 / bfloat16 activations run on tensor
cores, float32 ones on CUDA cores; like kernels.ops, CUDA tensors run through CuPy on torch's
current stream and CPU tensors under the emulator unless a backend is given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from noria.kernels import instances
from noria.kernels.arg_checks import dtype_name
from noria.kernels.backends import KernelBackend, default_backend

TILE_N = 16  # columns per packed tile (one warp)
BLOCK_K = 64  # input features per 16-byte word load of a lane
WARPS = 4
BLOCK_N = TILE_N * WARPS  # columns per CTA
THREADS = WARPS * 32
TC_ROWS = 16  # rows per mma row tile
SIMT_ROWS = 8  # rows per CTA of the float32 kernel (kW4SimtRows)
REDUCE_THREADS = 256
# Split-K: a launch with fewer CTAs than SMs (decode: a few output tiles, a long K) cuts K into
# parts, up to MAX_SPLITS, until about CTAS_PER_SM x SMs CTAs run; the reduce kernel merges them.
CTAS_PER_SM = 4
MAX_SPLITS = 16


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PackedW4A16:
    """A 4-bit weight in the kernel's layout. words: int32 [N16 / 16, K64 / 64, 32, 4] (N16, K64:
    N and K rounded up to 16 and 64); scales: float32 [G, N16]; zeros: int8 [G, N16] or None.
    group: input features per scale (K for one scale per output row)."""

    words: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    n: int
    k: int
    group: int

    @property
    def n16(self) -> int:
        return self.words.shape[0] * TILE_N

    @property
    def k_blocks(self) -> int:
        return self.words.shape[1]

    @property
    def groups(self) -> int:
        return self.scales.shape[0]

    @property
    def device(self) -> torch.device:
        return self.words.device

    def to(self, device: torch.device | str) -> PackedW4A16:
        return replace(self, words=self.words.to(device), scales=self.scales.to(device),
                       zeros=None if self.zeros is None else self.zeros.to(device))


# Where a lane's nibbles come from. The packed words' index order is [tile, k block, g, t, step],
# each word's eight values [j, h, e]: column n0 + 8j + g, input feature k0 + 2t + 8h + e, stored
# at bit 4 (2j + h) + 16 e (the Marlin pair interleave: the two values of one mma B register
# 16 bits apart).
_SHIFTS = torch.tensor([4 * (2 * j + h) + 16 * e for j in range(2) for h in range(2) for e in range(2)],
                       dtype=torch.int64)


def pack_w4a16(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> PackedW4A16:
    """QuantLinear's int8 values q [N, K] (in [-8, 7]), float32 scales [N, K / group] and int8
    zero points [N, K / group] (or None: symmetric) in the kernel's layout, on q's device.
    group == K is one scale per output row; otherwise it must be a multiple of 16 that divides K."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"q must be int8 [N, K], got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if n == 0 or k == 0:
        raise ValueError("an empty weight has nothing to pack")
    if group != k and (group % 16 or k % group):
        raise ValueError(f"group {group} must be K ({k}) or a multiple of 16 dividing it")
    g = k // group
    if tuple(scale.shape) != (n, g):
        raise ValueError(f"scale must be [{n}, {g}], got {tuple(scale.shape)}")
    if zero is not None and (tuple(zero.shape) != (n, g) or zero.dtype != torch.int8):
        raise ValueError(f"zero must be int8 [{n}, {g}], got {zero.dtype} {tuple(zero.shape)}")
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("4-bit values must lie in [-8, 7]")
    n16, k64 = _ceil(n, TILE_N) * TILE_N, _ceil(k, BLOCK_K) * BLOCK_K
    u = torch.full((n16, k64), 8, dtype=torch.int64, device=q.device)  # padding: q = 0
    u[:n, :k] = q.to(torch.int64) + 8
    # [tile, j, g, block, step, h, t, e] -> [tile, block, g, t, step, (j, h, e)]
    u = u.view(n16 // 16, 2, 8, k64 // 64, 4, 2, 4, 2).permute(0, 3, 2, 6, 4, 1, 5, 7)
    words = (u.reshape(n16 // 16, k64 // 64, 32, 4, 8) << _SHIFTS.to(q.device)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    scales = torch.zeros(g, n16, dtype=torch.float32, device=q.device)
    scales[:, :n] = scale.to(torch.float32).t()
    zeros = None
    if zero is not None:
        zeros = torch.zeros(g, n16, dtype=torch.int8, device=q.device)
        zeros[:, :n] = zero.t()
    return PackedW4A16(words.contiguous(), scales, zeros, n, k, group)


def unpack_w4a16(w: PackedW4A16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [N, K] int8, scale [N, G] float32, zero [N, G] int8 or None): pack_w4a16's inputs."""
    words = w.words.to(torch.int64) & 0xFFFFFFFF
    tiles, blocks = words.shape[:2]
    u = (words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF  # [tile, block, g, t, step, (j, h, e)]
    u = u.view(tiles, blocks, 8, 4, 4, 2, 2, 2).permute(0, 5, 2, 1, 4, 6, 3, 7)
    q = (u.reshape(tiles * 16, blocks * 64) - 8).to(torch.int8)[: w.n, : w.k].contiguous()
    zero = None if w.zeros is None else w.zeros[:, : w.n].t().contiguous()
    return q, w.scales[:, : w.n].t().contiguous(), zero


def dequantize(w: PackedW4A16) -> torch.Tensor:
    """W as float32 [N, K] (torch, for checks and the GPU session's comparison)."""
    q, scale, zero = unpack_w4a16(w)
    v = q.float().view(w.n, -1, w.group)
    if zero is not None:
        v = v - zero.float()[..., None]
    return (v * scale[..., None]).view(w.n, w.k)


@dataclass(frozen=True)
class W4A16Plan:
    name: str  # the main kernel's name expression
    grid: tuple[int, int, int]
    splits: int
    blocks_per_split: int  # K / 64 word blocks per split


def plan_w4a16(m: int, n: int, k: int, dtype: str, sm_count: int, split: int | None = None) -> W4A16Plan:
    """The launch of one GEMM: tensor cores with one 16-row tile per CTA for M <= 16 (decode)
    or four (prefill), the CUDA-core kernel for float32; `split` K parts (None: enough CTAs to
    fill the GPU where one wave would not: see CTAS_PER_SM)."""
    if dtype in instances.TENSOR_CORE_DTYPES:
        m_tiles = instances.W4A16_M_TILES[0] if m <= TC_ROWS else instances.W4A16_M_TILES[-1]
        name, rows = instances.gemm_w4a16_tc_name(dtype, m_tiles), TC_ROWS * m_tiles
    else:
        name, rows = instances.gemm_w4a16_simt_name(dtype), SIMT_ROWS
    k_blocks = _ceil(k, BLOCK_K)
    ctas = _ceil(n, BLOCK_N) * _ceil(m, rows)
    if split is None:
        split = 1 if ctas >= sm_count else min(MAX_SPLITS, _ceil(CTAS_PER_SM * sm_count, ctas))
    if split < 1:
        raise ValueError(f"split must be at least 1, got {split}")
    per = _ceil(k_blocks, min(split, k_blocks))
    splits = _ceil(k_blocks, per)  # no empty split
    return W4A16Plan(name, (_ceil(n, BLOCK_N), _ceil(m, rows), splits), splits, per)


def _check(x: torch.Tensor, w: PackedW4A16, bias: torch.Tensor | None, out: torch.Tensor | None,
           m: int) -> None:
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {w.k}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")
    if w.words.dtype != torch.int32 or not w.words.is_contiguous() or w.words.shape[2:] != (32, 4):
        raise ValueError("packed words must be a contiguous int32 [N16 / 16, K64 / 64, 32, 4] tensor")
    if w.scales.dtype != torch.float32 or tuple(w.scales.shape) != (w.groups, w.n16) or not w.scales.is_contiguous():
        raise ValueError("scales must be a contiguous float32 [G, N16] tensor")
    if w.zeros is not None and (w.zeros.dtype != torch.int8 or w.zeros.shape != w.scales.shape
                                or not w.zeros.is_contiguous()):
        raise ValueError("zero points must be a contiguous int8 tensor shaped as the scales")
    if w.groups * w.group != w.k:
        raise ValueError(f"{w.groups} groups of {w.group} do not cover K = {w.k}")
    if bias is not None and (bias.shape != (w.n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{w.n}] tensor of x's dtype")
    if out is not None and (out.shape != (m, w.n) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{m}, {w.n}] tensor of x's dtype")


def gemm_w4a16(
    x: torch.Tensor,
    w: PackedW4A16,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    split: int | None = None,
    backend: KernelBackend | None = None,
) -> torch.Tensor:
    """x [..., K] (float32 / float16 / bfloat16, features contiguous, row stride free) @
    dequant(w).T + bias -> [..., N] in x's dtype; `out` ([M, N], M the rows of x) if given."""
    dtype = dtype_name(x)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    m = x2.shape[0]
    _check(x2, w, bias, out, m)
    if x2.stride(1) != 1 and w.k > 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], w.n)
    be = backend if backend is not None else default_backend(x.device)
    plan = plan_w4a16(m, w.n, w.k, dtype, be.sm_count, split)
    spec = instances.gemm_w4a16_module(dtype)
    partial = be.scratch((plan.splits, m, w.n), x.device) if plan.splits > 1 else None
    # Pointers a launch does not read (no zero points, no bias, one split) get a real tensor.
    args = (
        be.ptr(x2),
        be.ptr(w.words),
        be.ptr(w.scales),
        be.ptr(w.zeros if w.zeros is not None else w.scales),
        be.ptr(bias if bias is not None else out),
        be.ptr(out),
        be.ptr(partial if partial is not None else w.scales),
        np.int64(x2.stride(0)),
        np.int32(m),
        np.int32(w.n),
        np.int32(w.k),
        np.int32(w.n16),
        np.int32(w.group),
        np.int32(w.k_blocks),
        np.int32(plan.blocks_per_split),
        np.int32(w.zeros is not None),
        np.int32(bias is not None),
    )
    with be.launch_context(x.device):
        be.kernel(spec, plan.name)(plan.grid, (THREADS,), args)
        if partial is not None:
            reduce = be.kernel(spec, instances.gemm_w4a16_reduce_name(dtype))
            reduce(
                (_ceil(m * w.n, REDUCE_THREADS),),
                (REDUCE_THREADS,),
                (be.ptr(partial), be.ptr(bias if bias is not None else out), be.ptr(out), np.int32(m),
                 np.int32(w.n), np.int32(plan.splits), np.int32(bias is not None)),
            )
    return out.view(*x.shape[:-1], w.n)
