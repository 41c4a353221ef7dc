"""Gemma 2 and Gemma 3 (text) over a ragged, flattened batch.

The Llama decoder's pieces with Gemma's differences (transformers' modeling_gemma2 /
modeling_gemma3 are the reference for every number):

* embeddings scaled by sqrt(hidden), the factor rounded to the compute dtype first;
* RMSNorm scales by (1 + w), computed in float32 and cast back once: the norm weights are
  kept in float32 holding 1 + w (added at load), so in a float32 model the Llama norm's
  kernels compute exactly Gemma's norm;
* a norm after attention and after the MLP as well as before each (four per layer),
  the residual added after the post-norms;
* GeGLU (gelu_pytorch_tanh) instead of SwiGLU;
* attention scaled by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps attention logits
  (LayerAttention.logits_soft_cap, read by every attention path) and both soft-cap the
  final logits; sliding-window and global layers alternate (`ModelSpec.sliding_windows`);
* Gemma 3: (1 + w) RMSNorm on q and k per head, and the sliding layers rotate with a
  rope of their own (rope_local_base_freq), the global ones with the model's rope
  (possibly scaled).

Tensor parallelism, fused q/k/v and gate/up weights, loading and the tied lm_head are the
Llama family's (worker/models/llama.py), and so is the native CPU decoder stack
(worker/native_stack.py), which runs these layers too: in float32 on the CPU the Python
layers call the kernels it calls (the fused norm for the post-norms, GeGLU-and-mul, the
soft-capped paged attention), so the two agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from noria.worker import fused_kernels, native_stack
from noria.worker.attention import AttentionBackend, AttentionMetadata, LayerAttention
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.models.layers import RMSNorm, RotaryEmbedding, linear
from noria.worker.models.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    StepContext,
    _param,
    _row_parallel,
)
from noria.worker.models.parallel import RankShapes, TensorParallel, rank_shapes
from noria.worker.models.spec import GemmaSpec, ModelSpec


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w) in float32, cast back to x's dtype once. `weight` holds 1 + w in
    float32 whatever the model's dtype (`GemmaForCausalLM.load_weights` adds the 1)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight = nn.Parameter(torch.empty(size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_kernels.usable(x) and x.dim() == 2 and x.is_contiguous():
            # The kernel the native decoder stack calls for the post-attention and post-MLP
            # norms: the two paths agree bit for bit (torch's differs in the order of the sum).
            return fused_kernels.add_rms_norm(x, None, self.weight, self.eps)[0]
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def _gemma(spec: ModelSpec) -> GemmaSpec:
    if spec.gemma is None:
        raise ValueError(f"{spec.architecture} is not a Gemma model")
    return spec.gemma


class GemmaAttention(Attention):
    def __init__(self, spec: ModelSpec, layer_index: int, shapes: RankShapes, tp: TensorParallel) -> None:
        super().__init__(spec, layer_index, shapes, tp)
        g, d = _gemma(spec), spec.head_dim
        self.attn = LayerAttention(shapes.num_heads, shapes.num_kv_heads, d, g.query_pre_attn_scalar**-0.5,
                                   spec.sliding_windows[layer_index], g.attn_logit_softcap)
        if spec.qk_norm:
            self.q_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(d, spec.rms_norm_eps)


class GemmaMLP(MLP):
    def __init__(self, spec: ModelSpec, shapes: RankShapes, tp: TensorParallel) -> None:
        super().__init__(spec, shapes, tp)
        self.approximate = _gemma(spec).gelu_approximate

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj, self.gate_up_bias, self.gate_up_packed)
        if self.approximate == "tanh" and gate_up.dim() == 2 and gate_up.stride(-1) == 1 \
                and fused_kernels.usable(gate_up):
            act = fused_kernels.gelu_tanh_mul(gate_up)  # the native decoder stack's kernel
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate=self.approximate) * up
        return _row_parallel(act, self.down_proj, self.down_bias, self.down_packed, self.tp)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, shapes: RankShapes, tp: TensorParallel) -> None:
        super().__init__()
        self.sliding = spec.sliding_windows[layer_index] is not None
        self.self_attn = GemmaAttention(spec, layer_index, shapes, tp)
        self.mlp = GemmaMLP(spec, shapes, tp)
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's post-MLP-normed output, the residual stream before it), as in the
        Llama layers: each add to the stream is fused into the next pre-norm."""
        normed, residual = self.input_layernorm.add_forward(x, residual, ctx.fused)
        h = self.post_attention_layernorm(self.self_attn(normed, ctx))
        normed, residual = self.pre_feedforward_layernorm.add_forward(h, residual, ctx.fused)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text only)."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        nn.Module.__init__(self)  # the Llama layers are not built: Gemma's take their place
        self.spec = spec
        self.gemma = _gemma(spec)
        self.tp = tp = tp or TensorParallel()
        self.shapes = shapes = rank_shapes(spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
                                           spec.vocab_size, tp)
        self.embed_tokens = _param(spec.vocab_size, spec.hidden_size)
        # transformers multiplies by a tensor of the weights' dtype: sqrt(hidden) rounded to it.
        self.register_buffer("embed_scale", torch.tensor(spec.hidden_size**0.5, dtype=torch.float32)
                             .to(self.embed_tokens.dtype), persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(spec, i, shapes, tp) for i in range(spec.num_layers))
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        vocab_rows = shapes.vocab_end - shapes.vocab_start
        self.lm_head = None if spec.tie_word_embeddings else _param(vocab_rows, spec.hidden_size)
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim)
        local = self.gemma.local_rope
        self.local_rotary = RotaryEmbedding(local, spec.head_dim) if local is not None else None
        self.lm_head_packed: PackedWeight | None = None
        self._stack_key: int | None = None
        self._stack = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a ragged batch of T tokens."""
        x = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        ctx = StepContext(meta, backend, kv_caches, *self.rotary.cos_sin(positions, x.dtype))
        local = ctx
        if self.local_rotary is not None and any(layer.sliding for layer in self.layers):
            local = StepContext(meta, backend, kv_caches, *self.local_rotary.cos_sin(positions, x.dtype))
        stack = self._native_stack(kv_caches, x)
        rows = None if stack is None else native_stack.paged_rows(backend, meta)
        residual = None
        if stack is not None and rows is not None:
            # The driver's runs of layers (each sliding layer on the local rope's cos / sin),
            # and in between the layers it declines.
            for start, end, native in stack.segments:
                if native:
                    x, residual = stack.run(x, residual, ctx.cos, ctx.sin, meta, rows, start, end,
                                            (local.cos, local.sin))
                    continue
                for layer in self.layers[start:end]:
                    x, residual = layer(x, residual, local if layer.sliding else ctx)
            return self.norm.add_forward(x, residual, ctx.fused)[0]
        for layer in self.layers:
            x, residual = layer(x, residual, local if layer.sliding else ctx)
        return self.norm.add_forward(x, residual, ctx.fused)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [rows, vocab] on rank 0, soft-capped where the model says; None elsewhere."""
        logits = super().compute_logits(hidden)
        cap = self.gemma.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The Llama family's loading, then 1 added to every norm weight (in float32, as
        transformers' `1.0 + weight.float()`)."""
        super().load_weights(weights)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, GemmaRMSNorm):
                    module.weight += 1.0
