"""An EAGLE-3 head (protocol/eagle3.py reads its checkpoint) as a module: `fc` fuses three of
the target's hidden states into one, and one Llama layer whose q/k/v read the normed token
embedding beside the normed hidden state runs over the head's own paged KV cache; its output
before the final norm is the hidden state its next pass reads, after it its draft-vocabulary
logits, which `d2t` maps to the target's ids. worker/eagle3.py runs it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from noria.protocol.eagle3 import PREFIXES, Eagle3Spec, weight_files
from noria.worker.attention import AttentionBackend, AttentionMetadata
from noria.worker.loader import iter_weights
from noria.worker.models.decoder import MLP, Attention, StepContext, register_norm
from noria.worker.models.layers import RMSNorm, RotaryEmbedding
from noria.worker.models.linear import Linear
from noria.worker.models.ops import Ops, TorchOps
from noria.worker.models.parallel import TensorParallel, rank_shapes
from noria.worker.models.weights import WeightMap, register_single


class Eagle3Head(nn.Module):
    def __init__(self, spec: Eagle3Spec, target_embed: torch.Tensor) -> None:
        super().__init__()
        layer, tp = spec.layer, TensorParallel()
        h = layer.hidden_size
        self.shapes = shapes = rank_shapes(layer.num_heads, layer.num_kv_heads, layer.intermediate_size,
                                           layer.vocab_size, tp)
        self.spec = spec
        self.embed_tokens = target_embed  # replaced by the head's own where its checkpoint has one
        self.fc = Linear(len(spec.aux_layers) * spec.target_hidden, h)
        self.self_attn = Attention(layer, 0, shapes, tp)
        # q/k/v read the embedding and the hidden state side by side.
        self.self_attn.qkv_proj = Linear(2 * h, self.self_attn.q_size + 2 * self.self_attn.kv_size, layer.qkv_bias)
        ops = TorchOps(layer.activation)
        self.mlp = MLP(h, shapes.intermediate_size, layer.mlp_bias, tp, ops)
        eps = layer.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.lm_head = Linear(h, spec.draft_vocab)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab, dtype=torch.long))
        self.rotary = RotaryEmbedding(layer.rope, layer.head_dim)
        self.ops: Ops = ops

    def load(self, folder: str | Path) -> None:
        """Its weights from `folder`, under either export's names; ValueError on a tensor it has
        no place for, a shape that does not fit, or one missing."""
        tensors = dict(_read(folder))
        layer, tp, shapes = self.spec.layer, TensorParallel(), self.shapes
        wm = WeightMap()
        if "embed_tokens.weight" in tensors:
            self.embed_tokens = nn.Parameter(torch.empty(layer.vocab_size, layer.hidden_size), requires_grad=False)
            wm.add("embed_tokens.weight", wm.slot("embed_tokens", self.embed_tokens).loader())
        elif self.embed_tokens.shape[1] != layer.hidden_size:
            raise ValueError(f"EAGLE-3 head {folder} has no embed_tokens and is {layer.hidden_size} wide, the "
                             f"target's table {self.embed_tokens.shape[1]}")
        register_single(wm, "fc", self.fc.checkpoint_tensors(), self.fc.weight.shape[0])
        self.self_attn.register_weights(wm, "midlayer.", layer, shapes, tp)
        self.mlp.register_weights(wm, "midlayer.", layer, shapes, tp)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            register_norm(wm, f"midlayer.{name}.weight", getattr(self, name))
        register_norm(wm, "norm.weight", self.norm)
        register_single(wm, "lm_head", self.lm_head.checkpoint_tensors(), self.spec.draft_vocab)
        if self.spec.draft_vocab < layer.vocab_size or "d2t" in tensors:
            wm.add("d2t", wm.slot("d2t", self.d2t).loader())
        wm.add("t2d", lambda tensor, what: None)  # the target's tokens the draft vocabulary holds: not needed
        wm.load(tensors.items(), f"the EAGLE-3 head {folder}")

    def pack(self, weights: torch.dtype | None) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(weights)

    def use_ops(self, ops: Ops) -> None:
        self.ops, self.mlp.ops = ops, ops
        self.self_attn.attend = ops.attention(self.self_attn)

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's hidden states [T, hidden] each, in layer order, fused to the head's width."""
        x = torch.cat(aux, dim=-1)
        if x.shape[1] != self.fc.weight.shape[1]:  # (the native GEMM would read past the rows)
            raise ValueError(f"EAGLE-3 head: {len(aux)} hidden states kept, {len(self.spec.aux_layers)} read")
        return self.fc(x)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The layer over tokens `input_ids` beside `hidden` [T, hidden]: its output before the
        final norm (the next pass's hidden state)."""
        ops = self.ops
        emb = F.embedding(input_ids, self.embed_tokens).to(hidden.dtype)
        cos, sin = self.rotary.cos_sin(meta.positions, hidden.dtype)
        ctx = StepContext(meta, backend, [cache], cos, sin, cos, sin)
        x = torch.cat([ops.norm(emb, self.input_layernorm), ops.norm(hidden, self.hidden_norm)], dim=-1)
        normed, residual = ops.add_norm(self.self_attn(x, ctx), hidden, self.post_attention_layernorm)
        return self.mlp(normed) + residual

    def propose(self, hidden: torch.Tensor) -> list[int]:
        """The greedy next token (a target id) after each row of the layer's output."""
        logits = self.lm_head(self.ops.norm(hidden, self.norm))
        best = logits.argmax(dim=-1)
        return (best + self.d2t[best]).tolist()


def _read(folder: str | Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, named as the SpecForge export names them (`model.` dropped by the
    weight map)."""
    files = weight_files(folder)
    if files and files[0].suffix == ".bin":
        items = list(torch.load(files[0], map_location="cpu", weights_only=True).items())
    else:
        items = list(iter_weights(files))
    out = []
    for name, tensor in items:
        key = name.removeprefix("model.")
        for prefix in PREFIXES[1:]:
            if key.startswith(prefix):
                key = PREFIXES[0] + key.removeprefix(prefix)
        out.append((key, tensor))
    return out
