"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over a ragged, flattened batch.

Differences inside the family are data in `ModelSpec`: q/k/v and o_proj biases
(Qwen2), per-head q/k RMSNorm (Qwen3), explicit head_dim, sliding windows
(Mistral), rope scaling (Llama 3.1) and tied embeddings.
q/k/v and gate/up are fused into one matmul each at load time.

Tensor parallelism (Megatron): q/k/v and gate/up are column-parallel (each rank
holds its heads / columns), o_proj and down_proj row-parallel (the matching input
slice, then one all_reduce each); norms and the embedding are replicated (a
lookup costs nothing, a vocab-parallel one would add an all_reduce per step);
the lm_head is vocab-parallel and its logits are gathered on rank 0 only, which
alone samples. On the CPU that halves the largest decode matmul (vocab x hidden,
read from memory every step) for a gather of sampled-rows x vocab floats, about
rows / hidden of the weight's bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from noria.worker import fused_kernels, native_stack
from noria.worker.attention import AttentionBackend, AttentionMetadata, LayerAttention
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    linear,
    pack_linear_weight,
    silu_and_mul,
)
from noria.worker.models.moe import SparseMoeBlock
from noria.worker.models.moe import owns as moe_owns
from noria.worker.models.parallel import RankShapes, TensorParallel, rank_shapes
from noria.worker.models.spec import ModelSpec


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class StepContext:
    """What every layer needs for one forward pass besides its input."""

    def __init__(
        self,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        self.meta = meta
        self.backend = backend
        self.kv_caches = kv_caches
        self.cos = cos
        self.sin = sin
        # The backend when it also runs the fused elementwise kernels (the CUDA kernels' backend,
        # on a GPU or emulated), else None: the layers keep their torch / CPU-native steps.
        self.fused: Any = backend if callable(getattr(backend, "rotary_attention", None)) else None


def _row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: PackedWeight | None, tp: TensorParallel) -> torch.Tensor:
    """x holds this rank's slice of the input features: partial sums, all-reduced;
    the bias is added once, after the sum."""
    if tp.size == 1:
        return linear(x, weight, bias, packed)  # the single-rank op order, bit for bit
    out = tp.all_reduce(linear(x, weight, None, packed))
    return out if bias is None else out + bias


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, shapes: RankShapes, tp: TensorParallel) -> None:
        super().__init__()
        h, kvh, d = shapes.num_heads, shapes.num_kv_heads, spec.head_dim
        self.layer_index = layer_index
        self.tp = tp
        self.q_size, self.kv_size = h * d, kvh * d
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, spec.hidden_size)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if spec.qkv_bias else None
        self.o_proj = _param(spec.hidden_size, self.q_size)
        self.o_bias = _param(spec.hidden_size) if spec.o_bias else None
        self.q_norm = RMSNorm(d, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps) if spec.qk_norm else None
        self.attn = LayerAttention(h, kvh, d, d**-0.5, spec.sliding_windows[layer_index])
        self.qkv_packed: PackedWeight | None = None
        self.o_packed: PackedWeight | None = None

    def pack_weights(self) -> None:
        self.qkv_packed = pack_linear_weight(self.qkv_proj)
        self.o_packed = pack_linear_weight(self.o_proj)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        a = self.attn
        qkv = linear(x, self.qkv_proj, self.qkv_bias, self.qkv_packed)
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        if self.q_norm is None and ctx.fused is not None and qkv.stride(-1) == 1:
            # One kernel: rotary on q and k in qkv, k and v into the cache; then attention.
            out = ctx.fused.rotary_attention(a, qkv, ctx.cos, ctx.sin, k_cache, v_cache, ctx.meta)
            if out is not None:
                return _row_parallel(out.reshape(t, self.q_size), self.o_proj, self.o_bias, self.o_packed, self.tp)
        if self.q_norm is None and fused_kernels.usable(qkv):
            # One pass: rotary on q and k (bit for bit apply_rope) and contiguous q, k, v.
            q, k, v = fused_kernels.rope_split(qkv, ctx.cos, ctx.sin, a.num_heads, a.num_kv_heads, a.head_dim)
        elif self.q_norm is not None and self.k_norm is not None and fused_kernels.usable(qkv) \
                and self.q_norm.weight.dtype == torch.float32 and self.q_norm.eps == self.k_norm.eps \
                and 2 * ctx.cos.shape[-1] == a.head_dim:  # the kernel rotates whole heads
            # The same pass with the per-head q/k norm first: the kernel the native stack calls.
            q, k, v = fused_kernels.qk_norm_rope_split(qkv, ctx.cos, ctx.sin, a.num_heads, a.num_kv_heads,
                                                       a.head_dim, self.q_norm.weight, self.k_norm.weight,
                                                       self.q_norm.eps)
        else:
            q, k, v = self._split_rope(qkv, ctx)
        out = ctx.backend.forward(a, q, k, v, k_cache, v_cache, ctx.meta)
        return _row_parallel(out.reshape(t, self.q_size), self.o_proj, self.o_bias, self.o_packed, self.tp)

    def _split_rope(self, qkv: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, a = qkv.shape[0], self.attn
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, a.num_heads, a.head_dim)
        k = k.view(t, a.num_kv_heads, a.head_dim)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin), v.contiguous()


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, shapes: RankShapes, tp: TensorParallel) -> None:
        super().__init__()
        inter = shapes.intermediate_size
        self.tp = tp
        self.gate_up_proj = _param(2 * inter, spec.hidden_size)
        self.gate_up_bias = _param(2 * inter) if spec.mlp_bias else None
        self.down_proj = _param(spec.hidden_size, inter)
        self.down_bias = _param(spec.hidden_size) if spec.mlp_bias else None
        self.gate_up_packed: PackedWeight | None = None
        self.down_packed: PackedWeight | None = None

    def pack_weights(self) -> None:
        self.gate_up_packed = pack_linear_weight(self.gate_up_proj)
        self.down_packed = pack_linear_weight(self.down_proj)

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj, self.gate_up_bias, self.gate_up_packed)
        return _row_parallel(silu_and_mul(gate_up, fused), self.down_proj, self.down_bias, self.down_packed, self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, shapes: RankShapes, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_index, shapes, tp)
        # A sparse layer's MLP is the mixture-of-experts block (Mixtral, Qwen2/3-MoE).
        sparse = bool(spec.sparse_layers) and spec.sparse_layers[layer_index]
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(spec, tp) if sparse else MLP(spec, shapes, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the add of
        a layer's output to the stream is fused into the next norm, as in vLLM.
        `x` is the previous layer's output (or the embedding, with no residual)."""
        normed, residual = self.input_layernorm.add_forward(x, residual, ctx.fused)
        h = self.self_attn(normed, ctx)
        normed, residual = self.post_attention_layernorm.add_forward(h, residual, ctx.fused)
        return self.mlp(normed, ctx.fused), residual


# Checkpoint name suffix -> (our fused parameter, which slice of it).
_FUSED = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_bias", 2),
    "self_attn.o_proj.weight": ("self_attn.o_proj", None),
    "self_attn.o_proj.bias": ("self_attn.o_bias", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj", 1),
    "mlp.gate_proj.bias": ("mlp.gate_up_bias", 0),
    "mlp.up_proj.bias": ("mlp.gate_up_bias", 1),
    "mlp.down_proj.weight": ("mlp.down_proj", None),
    "mlp.down_proj.bias": ("mlp.down_bias", None),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp = tp or TensorParallel()
        self.shapes = shapes = rank_shapes(spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
                                           spec.vocab_size, tp)
        self.embed_tokens = _param(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, shapes, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        vocab_rows = shapes.vocab_end - shapes.vocab_start
        self.lm_head = None if spec.tie_word_embeddings else _param(vocab_rows, spec.hidden_size)
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim)
        self.lm_head_packed: PackedWeight | None = None
        self._stack_key: int | None = None  # the KV caches _stack was built for
        self._stack: native_stack.NativeStack | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a ragged batch of T tokens."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        stack = self._native_stack(kv_caches, x)
        rows = None if stack is None else native_stack.paged_rows(backend, meta)
        ctx = StepContext(meta, backend, kv_caches, cos, sin)
        residual = None
        if stack is not None and rows is not None:
            # The driver's runs of layers, and in between the layers it declines.
            for start, end, native in stack.segments:
                if native:
                    x, residual = stack.run(x, residual, cos, sin, meta, rows, start, end)
                    continue
                for layer in self.layers[start:end]:
                    x, residual = layer(x, residual, ctx)
            return self.norm.add_forward(x, residual, ctx.fused)[0]
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm.add_forward(x, residual, ctx.fused)[0]

    def _native_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      x: torch.Tensor) -> native_stack.NativeStack | None:
        """The layers the driver runs in one native call per run, where this model and its caches
        allow any (decided once per caches: `native_stack.coverage`)."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.shape[0]:
            return None
        key = kv_caches[0][0].data_ptr() if kv_caches else None
        if self._stack_key != key:
            self._stack_key = key
            reasons = native_stack.coverage(self, kv_caches) if key is not None else [None]
            self._stack = (native_stack.NativeStack(self, kv_caches, reasons)
                           if key is not None and None in reasons else None)
        return self._stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [rows, vocab] on rank 0; None on the other ranks."""
        local = linear(hidden, self._lm_head_weight(), None, self.lm_head_packed).float()
        if self.tp.size == 1:
            return local
        pad = self.shapes.vocab_shard - local.shape[1]
        parts = self.tp.gather_to_first(F.pad(local, (0, pad)) if pad else local)
        return None if parts is None else torch.cat(parts, dim=1)[:, : self.spec.vocab_size]

    def _lm_head_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head
        # Tied: this rank's vocabulary rows of the (replicated) embedding.
        return self.embed_tokens[self.shapes.vocab_start : self.shapes.vocab_end]

    def pack_weights(self) -> None:
        """Pre-block the matmul weights for the CPU; call again after changing them."""
        self._stack_key, self._stack = None, None  # it points at the packed weights
        for layer in self.layers:
            layer.self_attn.pack_weights()
            layer.mlp.pack_weights()
        self.lm_head_packed = pack_linear_weight(self._lm_head_weight())

    # -- weight loading -------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) into the fused parameters.

        Raises ValueError on unknown names, shape mismatches and missing tensors.
        """
        params = dict(self.named_parameters())
        filled: set[tuple[str, int | None]] = set()
        for name, tensor in self._split_fused(weights):
            moe = self._moe_block(name)
            if moe is not None:
                moe[0].load(moe[1], tensor)
                continue
            target = self._target(name)
            if target is None:
                continue
            pname, shard = target
            if pname not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.spec.architecture} "
                                 f"(maps to {pname!r}); is the config consistent with the weights?")
            dest = self._shard_view(params[pname], pname, shard)
            tensor = self._rank_slice(tensor, pname, shard)
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled.add((pname, shard))
        counts = Counter(p for p, _ in filled)
        sparse = [(f"layers.{i}.mlp.", layer.mlp) for i, layer in enumerate(self.layers)
                  if isinstance(layer.mlp, SparseMoeBlock)]
        missing = [p for p in params if counts[p] < self._num_shards(p)
                   and not p.startswith(tuple(prefix for prefix, _ in sparse))]
        missing += [prefix + m for prefix, block in sparse for m in block.missing()]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`: cut them into
        the per-projection tensors the other families store, so that one mapping (and its
        tensor-parallel slicing) serves every family."""
        d, s = self.spec.head_dim, self.spec
        q, kv = s.num_heads * d, s.num_kv_heads * d
        splits = (("self_attn.qkv_proj.", ("q_proj.", "k_proj.", "v_proj."), (q, kv, kv)),
                  ("mlp.gate_up_proj.", ("gate_proj.", "up_proj."), (s.intermediate_size, s.intermediate_size)))
        for name, tensor in weights:
            for fused, parts, sizes in splits:
                head, sep, tail = name.rpartition(fused)
                if sep and tail in ("weight", "bias"):
                    if tensor.shape[0] != sum(sizes):
                        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                                         f"{sum(sizes)} ({' + '.join(map(str, sizes))})")
                    prefix = head + fused.split(".")[0] + "."
                    yield from ((prefix + part + tail, chunk)
                                for part, chunk in zip(parts, tensor.split(sizes), strict=True))
                    break
            else:
                yield name, tensor

    def _moe_block(self, name: str) -> tuple[SparseMoeBlock, str] | None:
        """The sparse block a checkpoint tensor belongs to, with the tensor's name below `layers.N.`."""
        rest = name.removeprefix("model.")
        if not rest.startswith("layers.") or rest.count(".") < 2:
            return None
        _, index, rest = rest.split(".", 2)
        if not index.isdigit() or int(index) >= len(self.layers):
            return None
        mlp = self.layers[int(index)].mlp
        return (mlp, rest) if isinstance(mlp, SparseMoeBlock) and moe_owns(rest) else None

    def _target(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb.inv_freq" in name:
            return None  # old checkpoints store this buffer; it is recomputed
        if name == "lm_head.weight":
            return None if self.lm_head is None else ("lm_head", None)
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        if name == "norm.weight":
            return "norm.weight", None
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            if rest in _FUSED:
                pname, shard = _FUSED[rest]
                return f"layers.{index}.{pname}", shard
            return f"layers.{index}.{rest}", None  # norms map one to one
        raise ValueError(f"unexpected checkpoint tensor {name!r} for {self.spec.architecture}")

    def _shard_view(self, param: torch.Tensor, pname: str, shard: int | None) -> torch.Tensor:
        if shard is None:
            return param.data
        d, s = self.spec.head_dim, self.shapes
        if pname.endswith(("qkv_proj", "qkv_bias")):
            q, kv = s.num_heads * d, s.num_kv_heads * d
            start, size = ((0, q), (q, kv), (q + kv, kv))[shard]
        else:
            size = s.intermediate_size
            start = shard * size
        return param.data.narrow(0, start, size)

    def _rank_slice(self, tensor: torch.Tensor, pname: str, shard: int | None) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor (the whole of it with one rank)."""
        if self.tp.size == 1:
            return tensor
        d, s = self.spec.head_dim, self.shapes
        if pname.endswith(("qkv_proj", "qkv_bias")):
            if shard == 0:
                return tensor.narrow(0, s.head_start * d, s.num_heads * d)
            return tensor.narrow(0, s.kv_head_start * d, s.num_kv_heads * d)
        if pname.endswith(("gate_up_proj", "gate_up_bias")):
            return tensor.narrow(0, s.inter_start, s.intermediate_size)
        if pname.endswith("self_attn.o_proj"):
            return tensor.narrow(1, s.head_start * d, s.num_heads * d)
        if pname.endswith("mlp.down_proj"):
            return tensor.narrow(1, s.inter_start, s.intermediate_size)
        if pname == "lm_head":
            return tensor.narrow(0, s.vocab_start, s.vocab_end - s.vocab_start)
        return tensor  # replicated: embedding, norms, o/down biases (added after the sum)

    @staticmethod
    def _num_shards(pname: str) -> int:
        if pname.endswith(("qkv_proj", "qkv_bias")):
            return 3
        if pname.endswith(("gate_up_proj", "gate_up_bias")):
            return 2
        return 1
