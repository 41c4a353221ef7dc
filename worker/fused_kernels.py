"""Fused elementwise steps for the CPU layers (worker/csrc/fused_f32.c): RMSNorm with
the residual add, rotary with the q/k/v split (and Qwen3's per-head q/k norm before it),
SiLU-and-mul, Gemma's tanh-GeGLU-and-mul, and the greedy argmax. `load()` is None where no
C compiler works or worker/cpu_ops.py puts the fused family on torch; the layers then run
the same steps as torch operators."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from noria.worker.cpu_ops import disabled
from noria.worker.native_build import build

_SRC = Path(__file__).parent / "csrc" / "fused_f32.c"
# -ffp-contract=off: no fused multiply-adds, each operation rounds as torch's own operators do.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_I64, _F32P = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)


@cache
def load() -> ctypes.CDLL | None:
    if disabled("fused"):
        return None
    dll = build(_SRC, _FLAGS)
    if dll is None:
        return None
    dll.add_rms_norm.argtypes = [_F32P, _F32P, _F32P, _F32P, _I64, _I64, ctypes.c_float, ctypes.c_int]
    dll.add_rms_norm.restype = None
    dll.rope_split.argtypes = [_F32P, _I64, _F32P, _F32P, _F32P, _F32P, _F32P, _I64, _I64, _I64, _I64, ctypes.c_int]
    dll.rope_split.restype = None
    dll.rope_split_partial.argtypes = [_F32P, _I64, _F32P, _F32P, _F32P, _F32P, _F32P, _I64, _I64, _I64, _I64, _I64,
                                       ctypes.c_int]
    dll.rope_split_partial.restype = None
    dll.qk_norm_rope_split.argtypes = [_F32P, _I64, _F32P, _F32P, _F32P, _F32P, ctypes.c_float, _F32P, _F32P, _F32P,
                                       _I64, _I64, _I64, _I64, ctypes.c_int]
    dll.qk_norm_rope_split.restype = None
    dll.argmax_rows.argtypes = [_F32P, _I64, _I64, _I64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    dll.argmax_rows.restype = _I64
    dll.silu_mul.argtypes = [_F32P, _I64, _F32P, _I64, _I64, ctypes.c_int]
    dll.silu_mul.restype = None
    dll.gelu_tanh_mul.argtypes = [_F32P, _I64, _F32P, _I64, _I64, ctypes.c_int]
    dll.gelu_tanh_mul.restype = None
    return dll


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def _ptr(t: torch.Tensor) -> ctypes._Pointer:
    return ctypes.cast(t.data_ptr(), _F32P)


def add_rms_norm(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_normalized(h + residual), h + residual) for [T, n] float32 rows.

    `h` must be a tensor the caller owns (a layer's fresh output): the sum is
    written into it and it is returned as the new residual stream."""
    dll = load()
    assert dll is not None and h.is_contiguous() and weight.is_contiguous()
    rows, n = h.shape
    out = torch.empty_like(h)
    res = None
    if residual is not None:
        residual = residual.contiguous()
        res = _ptr(residual)
    dll.add_rms_norm(_ptr(h), res, _ptr(weight), _ptr(out), rows, n, eps, torch.get_num_threads())
    return out, h


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, KVH, D] (contiguous) from a fused qkv [T, (H + 2 KVH) D],
    rotary applied to q and k; cos and sin [T, 1, R/2] contiguous, R = D or, for partial
    rotary, fewer: the first R dims of each head rotate, the rest are copied."""
    dll = load()
    assert dll is not None and qkv.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    t = qkv.shape[0]
    q = torch.empty(t, heads, head_dim, dtype=torch.float32)
    k = torch.empty(t, kv_heads, head_dim, dtype=torch.float32)
    v = torch.empty(t, kv_heads, head_dim, dtype=torch.float32)
    rot = 2 * cos.shape[-1]
    if rot == head_dim:
        dll.rope_split(_ptr(qkv), qkv.stride(0), _ptr(cos), _ptr(sin), _ptr(q), _ptr(k), _ptr(v), t, heads, kv_heads,
                       head_dim, torch.get_num_threads())
    else:
        dll.rope_split_partial(_ptr(qkv), qkv.stride(0), _ptr(cos), _ptr(sin), _ptr(q), _ptr(k), _ptr(v), t, heads,
                               kv_heads, head_dim, rot, torch.get_num_threads())
    return q, k, v


def qk_norm_rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                       head_dim: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rope_split with Qwen3's per-head RMSNorm (weights [D], float32, contiguous) applied to
    each q and k head before the rotary: the norm, the rotary and the split in one pass."""
    dll = load()
    assert dll is not None and qkv.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    t = qkv.shape[0]
    q = torch.empty(t, heads, head_dim, dtype=torch.float32)
    k = torch.empty(t, kv_heads, head_dim, dtype=torch.float32)
    v = torch.empty(t, kv_heads, head_dim, dtype=torch.float32)
    dll.qk_norm_rope_split(_ptr(qkv), qkv.stride(0), _ptr(cos), _ptr(sin), _ptr(q_weight), _ptr(k_weight), eps,
                           _ptr(q), _ptr(k), _ptr(v), t, heads, kv_heads, head_dim, torch.get_num_threads())
    return q, k, v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up [T, 2n] float32 (gate, then up): one pass instead of
    three operators, each an allocation and, from ~32k elements, an OpenMP region."""
    dll = load()
    assert dll is not None and gate_up.stride(-1) == 1
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n, dtype=torch.float32)
    dll.silu_mul(_ptr(gate_up), gate_up.stride(0), _ptr(out), t, n, torch.get_num_threads())
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up (Gemma's GeGLU) for gate_up [T, 2n] float32
    (gate, then up), within a few float32 ulps of the exact value (fused_f32.c says how).
    The native decoder stack calls the same kernel: Gemma's Python layers match it bit for bit."""
    dll = load()
    assert dll is not None and gate_up.stride(-1) == 1
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n, dtype=torch.float32)
    dll.gelu_tanh_mul(_ptr(gate_up), gate_up.stride(0), _ptr(out), t, n, torch.get_num_threads())
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for [B, V] float32 (the same answer, ties to the first
    index). torch's compare-and-select does not vectorise: on a Zen 3 core at 32 x 32000,
    torch takes ~2.7 ms, this ~0.3 ms (one pass, four compare chains per lane, rows over
    the threads)."""
    if not usable(logits) or logits.dim() != 2 or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    dll = load()
    assert dll is not None
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    bad = dll.argmax_rows(_ptr(logits), logits.stride(0), rows, n,
                          ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_int64)), torch.get_num_threads())
    if bad:  # rows with a NaN: torch's answer (the NaN's index)
        rows_bad = (out < 0).nonzero()[:, 0]
        out[rows_bad] = logits[rows_bad].argmax(dim=-1)
    return out
