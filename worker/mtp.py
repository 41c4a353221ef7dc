"""MTP speculation on the worker (`{"method": "mtp", "num_speculative_tokens": k}`): the served
checkpoint's own multi-token-prediction layer drafts for it (worker/head_drafter.py says how a
head over the target's hidden states is run), in MiMo's layout, as vLLM reads it:

    x   = input_proj(cat[hidden_layernorm(h), token_layernorm(embed(t))])   (h first: MiMo's order)
    out = final_layernorm(x + the layer's attention and MLP, a Qwen2 decoder layer)

at position q, with h the target's residual stream at q as it enters the final norm (vLLM's MiMo
model hands that on and norms only in its logits) and t the token at q + 1;
the embedding of the token at position 0 is zeroed, as vLLM does. `out` goes through the
target's own lm_head for the proposal and is the next pass's h: one layer (`mtp_layers.0`) drafts
every one of the k tokens. Its weights are `model.mtp_layers.0.*` of the checkpoint, which the
target's loading leaves alone; its KV cache is one layer's, in the target's block ids.

Like every drafter it runs on the first tensor-parallel rank alone, which under tensor
parallelism holds a slice of the target's lm_head: there the layer keeps a whole lm_head of its
own (the checkpoint's, or the replicated embedding table where the two are tied).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from noria.protocol.config import EngineConfig
from noria.protocol.model_spec import ModelSpec
from noria.worker.attention import AttentionBackend, AttentionMetadata
from noria.worker.attention_select import attention_layers, select_attention_backend
from noria.worker.head_drafter import HeadDrafter
from noria.worker.kv_cache import KVLayout
from noria.worker.kv_fp8 import apply_scales
from noria.worker.loader import built_on, checkpoint_files
from noria.worker.models.causal_lm import CausalLM
from noria.worker.models.decoder import DecoderLayer, StepContext, register_norm
from noria.worker.models.layers import RMSNorm, RotaryEmbedding
from noria.worker.models.linear import Linear, LinearOp, linear_op
from noria.worker.models.ops import Ops, TorchOps, choose_ops
from noria.worker.models.parallel import TensorParallel, rank_shapes
from noria.worker.models.weights import WeightMap, register_single

log = logging.getLogger("noria.worker")

PREFIX = "mtp_layers.0."  # the checkpoint's first MTP layer, under `model.`


class MtpHead(nn.Module):
    def __init__(self, spec: ModelSpec, target: CausalLM) -> None:
        super().__init__()
        tp, h, eps = TensorParallel(), spec.hidden_size, spec.rms_norm_eps
        self.spec = spec
        # The target's embedding table and lm_head, looked up when used (a tuple: as an attribute
        # the target would become a submodule of this head, packed and counted twice).
        self._target = (target,)
        self.shapes = rank_shapes(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size, tp)
        self.token_layernorm, self.hidden_layernorm, self.final_layernorm = RMSNorm(h, eps), RMSNorm(h, eps), \
            RMSNorm(h, eps)
        self.input_proj = Linear(2 * h, h, False)
        self.block = DecoderLayer(spec, 0, self.shapes, tp)
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim)
        self.ops: Ops = TorchOps(spec.activation)
        # Where the target's lm_head is split over ranks, a whole one of its own (`own_head`, set by
        # `pack`): the checkpoint's (`lm_head`, loaded here) or the tied embedding table's.
        self.sharded = target.tp.size > 1
        self.lm_head = Linear(h, spec.vocab_size, False) if self.sharded and not spec.tie_word_embeddings else None
        self.own_head: LinearOp | None = None

    def load(self, folder: str | Path) -> None:
        """Its weights: the checkpoint's `model.mtp_layers.0.*` (and `lm_head.weight` where it keeps
        a copy), read by name; ValueError on a shape that does not fit, or one missing."""
        wm = WeightMap()
        for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            register_norm(wm, f"{PREFIX}{name}.weight", getattr(self, name))
        register_single(wm, f"{PREFIX}input_proj", self.input_proj.checkpoint_tensors(), self.spec.hidden_size)
        self.block.register_weights(wm, PREFIX, self.spec, self.shapes, TensorParallel())
        if self.lm_head is not None:
            register_single(wm, "lm_head", self.lm_head.checkpoint_tensors(), self.spec.vocab_size)
        wm.load(_read(folder, with_head=self.lm_head is not None), f"the MTP layer of {folder}")

    def pack(self, weights: torch.dtype | None) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(weights)
        if self.lm_head is not None:
            self.own_head = self.lm_head.op
        elif self.sharded:
            self.own_head = linear_op(self._target[0].embed_tokens.to(self.token_layernorm.weight.dtype), weights)

    def use_ops(self, ops: Ops) -> None:
        self.ops = ops
        self.block.use_ops(ops)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The layer over tokens `input_ids` beside `hidden` [T, hidden]: its normed output (the
        next pass's hidden state, and what the lm_head reads)."""
        ops = self.ops
        emb = F.embedding(input_ids, self._target[0].embed_tokens).to(hidden.dtype)
        emb = emb.masked_fill((meta.positions == 0)[:, None], 0.0)
        cos, sin = self.rotary.cos_sin(meta.positions, hidden.dtype)
        ctx = StepContext(meta, backend, [cache], cos, sin, cos, sin)
        x = self.input_proj(torch.cat([ops.norm(hidden, self.hidden_layernorm),
                                       ops.norm(emb, self.token_layernorm)], dim=-1))
        out, residual = self.block(x, None, ctx)
        return ops.add_norm(out, residual, self.final_layernorm)[0]

    def propose(self, hidden: torch.Tensor) -> list[int]:
        # (A soft-cap, tanh, keeps the argmax: the target's own head is the only one that applies it.)
        head = self.own_head
        logits = head(hidden, None) if head is not None else self._target[0].compute_logits(hidden)
        assert logits is not None
        return logits.argmax(dim=-1).tolist()


class MtpDrafter(HeadDrafter):
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 weight_dtype: torch.dtype | None, kv_dtype: torch.dtype, target: CausalLM) -> None:
        spec = target.spec
        self.path = config.model
        with built_on(device, dtype):
            self.head = MtpHead(spec, target)
        self.head.load(self.path)
        self.head.pack(weight_dtype)
        apply_scales([self.head.block.self_attn], kv_dtype)
        bs = config.block_size
        choice = select_attention_backend(device, attention_layers(self.head), dtype, bs,
                                          choice=config.attention_backend, kv_dtype=kv_dtype)
        self.head.use_ops(choose_ops(spec.activation, device, dtype, choice.backend, bs))
        super().__init__(KVLayout(1, bs, spec.num_kv_heads, spec.head_dim, kv_dtype), choice.backend, device)
        self.target = target
        target.capture = (spec.num_layers,)  # the stream entering its final norm
        log.info("MTP layer of %s drafts for it (one of %d), %d KV bytes per block beside the target's",
                 self.path, spec.mtp_layers, self.layout.bytes_per_block)

    def fuse(self, features: list[torch.Tensor]) -> torch.Tensor:
        return features[0]


def _read(folder: str | Path, with_head: bool) -> list[tuple[str, torch.Tensor]]:
    out = []
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.removeprefix("model.").startswith(PREFIX) or with_head and name == "lm_head.weight":
                    out.append((name, f.get_tensor(name)))
    return out
