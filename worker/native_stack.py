"""A model's decoder layers in one native call per step (worker/csrc/decoder_f32.c).

The C driver calls the same kernels as the modules' Python path, in the same
order, on the same inputs, so its output is bit for bit theirs; what it removes
is the Python between them (wrappers, ctypes conversions, a tensor per result).
It applies where every layer runs on those kernels: float32 on the CPU, one
rank, packed native GEMM weights, no per-head q/k norm, and a step whose
attention is one call of the paged kernel per layer (decode rows, or short
prompts as rows: `TorchAttentionBackend.paged_rows`). Anything else keeps the
Python path. worker/cpu_ops.py decides whether it is on (NORIA_DISABLE_CPU_STACK=1: off).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from noria.worker import cpu_kernels, fused_kernels, gemm_kernels
from noria.worker.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from noria.worker.cpu_ops import disabled
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.native_build import build

if TYPE_CHECKING:
    from noria.worker.models.llama import LlamaForCausalLM

_SRC = Path(__file__).parent / "csrc" / "decoder_f32.c"
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [("gemm", _P), ("norm", _P), ("rope", _P), ("silu", _P), ("attn", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
                                        "down_bias", "input_norm", "post_norm", "k_cache", "v_cache")]
    _fields_ += [("window", _I64)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _I64), ("max_blocks", _I64)]
    _fields_ += [(name, _P) for name in ("cos", "sin", "tables", "lens", "slots", "normed", "qkv", "q", "k", "v",
                                         "attn", "gate_up", "act")]
    _fields_ += [("num_threads", ctypes.c_int)]


@cache
def load() -> tuple[ctypes.CDLL, _Kernels] | None:
    if disabled("stack"):
        return None
    gemm, fused, attn = gemm_kernels.load(), fused_kernels.load(), cpu_kernels.load()
    dll = build(_SRC, ["-O2", "-shared", "-fPIC"])
    if dll is None or gemm is None or fused is None or attn is None:
        return None
    dll.decoder_stack.argtypes = [_P, _P, _I64, _P, _P, _P, _P]
    dll.decoder_stack.restype = ctypes.c_int

    def addr(fn: ctypes._CFuncPtr) -> int:
        return ctypes.cast(fn, _P).value or 0

    kernels = _Kernels(addr(gemm.gemm_f32), addr(fused.add_rms_norm), addr(fused.rope_split),
                       addr(fused.silu_mul), addr(attn.paged_decode_f32))
    return dll, kernels


class NativeStack:
    """One model's layers as the C driver sees them, for one set of KV caches."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        first = model.layers[0]
        self.dims = model_dims(model)
        self.shape = _Shape(*self.dims, kv_caches[0][0].shape[1], first.input_layernorm.eps,
                            first.self_attn.attn.scale)
        self._capacity, self._buffers = 0, []
        # Biases the driver reads: contiguous copies, kept alive here.
        self._keep: list[torch.Tensor] = []
        self.layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            at, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = kv_caches[i]
            self.layers[i] = _Layer(
                _packed(at.qkv_packed), self._bias(at.qkv_bias), _packed(at.o_packed), self._bias(at.o_bias),
                _packed(mlp.gate_up_packed), self._bias(mlp.gate_up_bias), _packed(mlp.down_packed),
                self._bias(mlp.down_bias), layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                at.attn.sliding_window or 0)

    def _scratch(self, tokens: int) -> list[torch.Tensor]:
        """Flat buffers for `tokens` rows (normed, qkv, q, k, v, attn, gate_up, act, other), kept
        across steps: a fresh tensor per result, as the Python path makes, costs page faults
        from a few hundred rows up (each allocation that size is a fresh mapping)."""
        if tokens > self._capacity:
            self._capacity = max(tokens, 2 * self._capacity)
            hidden, heads, kv_heads, head_dim, inter = self.dims
            widths = (hidden, (heads + 2 * kv_heads) * head_dim, heads * head_dim, kv_heads * head_dim,
                      kv_heads * head_dim, heads * head_dim, 2 * inter, inter, hidden)
            self._buffers = [torch.empty(self._capacity * w, dtype=torch.float32) for w in widths]
        return self._buffers

    def _bias(self, b: torch.Tensor | None) -> int | None:
        if b is None:
            return None
        b = b.detach().contiguous()
        self._keep.append(b)
        return b.data_ptr()

    @staticmethod
    def applies(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether every layer of `model` runs on the native kernels (fixed for its lifetime)."""
        if model.tp.size != 1 or load() is None or not model.layers:
            return False
        for i, layer in enumerate(model.layers):
            at, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = kv_caches[i]
            packed = (at.qkv_packed, at.o_packed, mlp.gate_up_packed, mlp.down_packed)
            if at.q_norm is not None or not all(isinstance(p, PackedWeight) for p in packed):
                return False
            if not (k_cache.dtype == v_cache.dtype == torch.float32 and v_cache.is_contiguous()
                    and cpu_kernels.fits(at.attn.num_heads, at.attn.head_dim, k_cache)):
                return False
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(w.dtype == torch.float32 and w.is_contiguous() for w in norms):
                return False
        return True

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            rows: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, residual stream) for the embedded tokens x [T, hidden]; x is overwritten."""
        loaded = load()
        assert loaded is not None
        dll, kernels = loaded
        hidden, heads, kv_heads, head_dim, inter = self.dims
        t = x.shape[0]
        tables, lens = (r.contiguous() for r in rows)
        slots = meta.slot_mapping.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        buf = self._scratch(t)
        step = _Step(t, tables.shape[1], cos.data_ptr(), sin.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                     slots.data_ptr(), *(b.data_ptr() for b in buf[:-1]), torch.get_num_threads())
        other = buf[-1][: t * hidden].view(t, hidden)
        status = dll.decoder_stack(ctypes.byref(kernels), self.layers, len(self.layers), ctypes.byref(self.shape),
                                   ctypes.byref(step), x.data_ptr(), other.data_ptr())
        if status != 0:
            raise MemoryError("decoder_stack: no memory for the attention kernel's task list")
        return x, other


def model_dims(model: LlamaForCausalLM) -> tuple[int, int, int, int, int]:
    """(hidden, heads, KV heads, head size, intermediate) of the model's decoder layers."""
    first = model.layers[0]
    a = first.self_attn.attn
    return model.spec.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, first.mlp.gate_up_proj.shape[0] // 2


def _packed(p: object) -> int | None:
    return p.data.data_ptr() if isinstance(p, PackedWeight) else None


def paged_rows(backend: AttentionBackend, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not isinstance(backend, TorchAttentionBackend):
        return None
    return backend.paged_rows(meta)
