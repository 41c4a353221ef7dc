"""One decoder layer, built from the model's spec (its family's recipe resolved for the checkpoint).

Every family is this layer with different entries: q/k/v and o_proj biases (Qwen2), a
per-head q/k RMSNorm (Qwen3, Gemma 3), Gemma's (1 + w) norms around attention and MLP
("sandwich" norms), the gated MLP's activation, a sliding window or a rope of the sliding
layers' own, soft-capped scores, and a mixture-of-experts MLP (worker/models/moe.py) on the
sparse layers. q/k/v and gate/up are fused into one matmul each at load time.

Tensor parallelism (Megatron): q/k/v and gate/up are column-parallel (each rank holds its
heads / columns), o_proj and down_proj row-parallel (the matching input slice, then one
all_reduce each); norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from noria.protocol.model_spec import ModelSpec
from noria.protocol.quant_config import WeightScheme
from noria.worker.attention import AttentionBackend, AttentionMetadata, LayerAttention
from noria.worker.kv_fp8 import CheckpointScales, register_scales
from noria.worker.models.layers import RMSNorm
from noria.worker.models.moe import SparseMoeBlock
from noria.worker.models.ops import AttendFn, Ops, TorchOps
from noria.worker.models.parallel import RankShapes, TensorParallel
from noria.worker.models.quant_linear import make_linear, make_row_parallel, scheme_of
from noria.worker.models.rope import rotary_dim
from noria.worker.models.weights import Part, WeightMap, narrow, register_fused, register_single


@dataclass
class StepContext:
    """What every layer needs for one forward pass besides its input."""

    meta: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    cos: torch.Tensor
    sin: torch.Tensor
    local_cos: torch.Tensor  # the rope of the sliding layers that have their own (else cos / sin)
    local_sin: torch.Tensor


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, shapes: RankShapes, tp: TensorParallel) -> None:
        super().__init__()
        h, kvh, d = shapes.num_heads, shapes.num_kv_heads, spec.head_dim
        self.layer_index = layer_index
        self.q_size, self.kv_size = h * d, kvh * d
        p = f"model.layers.{layer_index}.self_attn."
        qkv = ["qkv_proj"] if spec.fused_checkpoint else ["q_proj", "k_proj", "v_proj"]
        self.qkv_proj = make_linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias,
                                    scheme_of(spec, [p + m for m in qkv]))
        self.o_proj = make_row_parallel(self.q_size, spec.hidden_size, spec.o_bias, tp, scheme_of(spec, [p + "o_proj"]))
        one_plus = spec.norm == "rms_one_plus"
        self.q_norm = RMSNorm(d, spec.rms_norm_eps, one_plus) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps, one_plus) if spec.qk_norm else None
        window = spec.sliding_windows[layer_index]
        self.attn = LayerAttention(h, kvh, d, spec.scale, window, spec.attn_softcap)
        # The checkpoint's fp8 KV cache scales, if any (an fp8 cache puts them on self.attn).
        self.kv_scales = CheckpointScales()
        # The sliding layers of a model with a local rope rotate with it (Gemma 3).
        self.local_rope = window is not None and spec.local_rope is not None
        self.rotary_dim = rotary_dim(spec.local_rope if self.local_rope and spec.local_rope else spec.rope, d)
        self.attend: AttendFn = TorchOps(spec.activation).attention(self)

    def register_weights(self, wm: WeightMap, prefix: str, spec: ModelSpec, shapes: RankShapes,
                         tp: TensorParallel) -> None:
        """q, k and v into their rows of qkv_proj (this rank's heads of each), o_proj's input columns
        of this rank; a checkpoint with q/k/v stored as one qkv_proj (Phi-3) is cut first."""
        d, n, p = spec.head_dim, tp.size, prefix + "self_attn."
        full = (spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d)
        parts = [Part("q_proj", 0, self.q_size, full[0], narrow(0, shapes.head_start * d, self.q_size, n)),
                 Part("k_proj", self.q_size, self.kv_size, full[1],
                      narrow(0, shapes.kv_head_start * d, self.kv_size, n)),
                 Part("v_proj", self.q_size + self.kv_size, self.kv_size, full[2],
                      narrow(0, shapes.kv_head_start * d, self.kv_size, n))]
        register_fused(wm, p, "qkv_proj", self.qkv_proj.checkpoint_tensors(), parts, spec.fused_checkpoint)
        register_single(wm, p + "o_proj", self.o_proj.checkpoint_tensors(), spec.hidden_size,
                        columns=(shapes.head_start * d, self.q_size, n))
        for name, norm in (("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            if norm is not None:
                register_norm(wm, f"{p}{name}.weight", norm)
        register_scales(wm, p, self.kv_scales)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        cos, sin = (ctx.local_cos, ctx.local_sin) if self.local_rope else (ctx.cos, ctx.sin)
        out = self.attend(self.qkv_proj(x), ctx, cos, sin)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), gate and up one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TensorParallel, ops: Ops,
                 schemes: tuple[WeightScheme | None, WeightScheme | None] = (None, None)) -> None:
        """`schemes`: gate/up's and down's quantization (None: float weights)."""
        super().__init__()
        self.gate_up_proj = make_linear(hidden, 2 * intermediate, bias, schemes[0])
        self.down_proj = make_row_parallel(intermediate, hidden, bias, tp, schemes[1])
        self.ops = ops

    def register_weights(self, wm: WeightMap, prefix: str, spec: ModelSpec, shapes: RankShapes,
                         tp: TensorParallel) -> None:
        """gate and up into their rows of gate_up_proj (this rank's columns of each), down_proj's
        input columns of this rank; Phi-3's stored gate_up_proj is cut first."""
        inter, start, n, p = shapes.intermediate_size, shapes.inter_start, tp.size, prefix + "mlp."
        rank, full = narrow(0, start, inter, n), spec.intermediate_size
        parts = [Part("gate_proj", 0, inter, full, rank), Part("up_proj", inter, inter, full, rank)]
        register_fused(wm, p, "gate_up_proj", self.gate_up_proj.checkpoint_tensors(), parts, spec.fused_checkpoint)
        register_single(wm, p + "down_proj", self.down_proj.checkpoint_tensors(), spec.hidden_size,
                        columns=(start, inter, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, shapes: RankShapes, tp: TensorParallel) -> None:
        super().__init__()
        ops = TorchOps(spec.activation)
        self.ops: Ops = ops
        self.self_attn = Attention(spec, layer_index, shapes, tp)
        self.mlp: MLP | SparseMoeBlock = (SparseMoeBlock(spec, tp, ops, layer_index) if spec.is_sparse(layer_index)
                                          else MLP(spec.hidden_size, shapes.intermediate_size, spec.mlp_bias, tp, ops,
                                                   mlp_schemes(spec, layer_index)))
        h, eps, one_plus = spec.hidden_size, spec.rms_norm_eps, spec.norm == "rms_one_plus"
        self.input_layernorm = RMSNorm(h, eps, one_plus)
        self.post_attention_layernorm = RMSNorm(h, eps, one_plus)
        # Gemma: post_attention_layernorm normalizes the attention's output, pre_feedforward the
        # stream into the MLP, post_feedforward the MLP's output.
        self.pre_feedforward_layernorm = RMSNorm(h, eps, one_plus) if spec.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(h, eps, one_plus) if spec.sandwich_norms else None

    def use_ops(self, ops: Ops) -> None:
        self.ops = ops
        self.self_attn.attend = ops.attention(self.self_attn)
        if isinstance(self.mlp, SparseMoeBlock):
            self.mlp.use_ops(ops)
        else:
            self.mlp.ops = ops

    def register_weights(self, wm: WeightMap, prefix: str, spec: ModelSpec, shapes: RankShapes,
                         tp: TensorParallel) -> None:
        self.self_attn.register_weights(wm, prefix, spec, shapes, tp)
        if isinstance(self.mlp, SparseMoeBlock):
            self.mlp.register_weights(wm, prefix, spec)
        else:
            self.mlp.register_weights(wm, prefix, spec, shapes, tp)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            norm = getattr(self, name)
            if norm is not None:
                register_norm(wm, f"{prefix}{name}.weight", norm)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm of the stream into the MLP."""
        return self.pre_feedforward_layernorm or self.post_attention_layernorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): the add of a layer's output to
        the stream is fused into the next norm, as in vLLM. `x` is the previous layer's output
        (or the embedding, with no residual)."""
        ops = self.ops
        normed, residual = ops.add_norm(x, residual, self.input_layernorm)
        h = self.self_attn(normed, ctx)
        if self.post_feedforward_layernorm is not None:
            h = ops.norm(h, self.post_attention_layernorm)
        normed, residual = ops.add_norm(h, residual, self.mlp_norm)
        out = self.mlp(normed)
        if self.post_feedforward_layernorm is not None:
            out = ops.norm(out, self.post_feedforward_layernorm)
        return out, residual


def mlp_schemes(spec: ModelSpec, layer_index: int) -> tuple[WeightScheme | None, WeightScheme | None]:
    p = f"model.layers.{layer_index}.mlp."
    gate_up = ["gate_up_proj"] if spec.fused_checkpoint else ["gate_proj", "up_proj"]
    return scheme_of(spec, [p + m for m in gate_up]), scheme_of(spec, [p + "down_proj"])


def register_norm(wm: WeightMap, name: str, norm: RMSNorm) -> None:
    """A replicated norm weight; a (1 + w) norm keeps 1 + w in float32 (transformers' `1.0 + w.float()`)."""
    slot = wm.slot(name, norm.weight)
    wm.add(name, slot.loader("all", None, (lambda t: 1.0 + t.float()) if norm.one_plus else None))
