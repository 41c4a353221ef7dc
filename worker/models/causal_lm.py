"""A decoder-only language model over a ragged, flattened batch, built from its ModelSpec.

One class serves every family (protocol/families/): the embedding (scaled by sqrt(hidden)
where the recipe says), the decoder layers (worker/models/decoder.py), the final norm and the
lm_head (soft-capped logits where the recipe says). The layers the native CPU stack runs
(worker/native_stack.py) go through it in one call per run of layers; the others run here.

Tensor parallelism: the embedding is replicated (a lookup costs nothing, a vocab-parallel one
would add an all_reduce per step); the lm_head is vocab-parallel and its logits are gathered
on rank 0 only, which alone samples. On the CPU that halves the largest decode matmul
(vocab x hidden, read from memory every step) for a gather of sampled-rows x vocab floats,
about rows / hidden of the weight's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from noria.protocol.model_spec import ModelSpec
from noria.worker import native_stack
from noria.worker.attention import AttentionBackend, AttentionMetadata
from noria.worker.models.decoder import DecoderLayer, StepContext, register_norm
from noria.worker.models.layers import RMSNorm, RotaryEmbedding
from noria.worker.models.linear import Linear, LinearOp, TorchLinear, linear_op
from noria.worker.models.moe import SparseMoeBlock
from noria.worker.models.ops import Ops, TorchOps
from noria.worker.models.parallel import TensorParallel, rank_shapes
from noria.worker.models.quant_linear import QuantLinear, make_linear, scheme_of
from noria.worker.models.weights import WeightMap, narrow, register_single


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp = tp or TensorParallel()
        self.shapes = shapes = rank_shapes(spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
                                           spec.vocab_size, tp)
        self.embed_tokens = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size), requires_grad=False)
        # transformers multiplies by a tensor of the weights' dtype: sqrt(hidden) rounded to it.
        scale = torch.tensor(spec.hidden_size**0.5, dtype=torch.float32).to(self.embed_tokens.dtype)
        self.register_buffer("embed_scale", scale if spec.embed_scale else None, persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, shapes, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm == "rms_one_plus")
        vocab_rows = shapes.vocab_end - shapes.vocab_start
        self.lm_head = (None if spec.tie_word_embeddings else
                        make_linear(spec.hidden_size, vocab_rows, False, scheme_of(spec, ["lm_head"])))
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim)
        self.local_rotary = RotaryEmbedding(spec.local_rope, spec.head_dim) if spec.local_rope else None
        self.ops: Ops = TorchOps(spec.activation)
        # The lm_head's kind; tied, over this rank's vocabulary rows of the (replicated) embedding.
        self.head: LinearOp = self._head_op(pack=False)
        self._stack_key: int | None = None  # the KV caches _stack was built for
        self._stack: native_stack.NativeStack | None = None
        # A drafting head's inputs, kept by each forward pass in `captured`, in layer order: the
        # residual stream entering these layers (an EAGLE-3 head's, worker/eagle3.py), where index
        # num_layers is the stream entering the final norm (an MTP layer's, worker/mtp.py).
        self.capture: tuple[int, ...] = ()
        self.captured: list[torch.Tensor] = []

    # -- ops and weights --------------------------------------------------------

    def use_ops(self, ops: Ops) -> None:
        """Every layer's ops, chosen once (worker/models/ops.py)."""
        self.ops = ops
        self._stack_key, self._stack = None, None  # coverage depends on them
        for layer in self.layers:
            layer.use_ops(ops)

    def pack_weights(self, weights: torch.dtype | None = None) -> None:
        """Choose every linear layer's kind (the native GEMM's packed copy, in `weights`' dtype
        where given, or F.linear), once, after loading: a packed kind keeps no other copy. The
        embedding table is kept in `weights`' dtype too (a Llama-3.2-1B's is 1 GB in float32),
        its rows widened as they are looked up: the same values the rounded table gives."""
        self._stack_key, self._stack = None, None  # it points at the packed weights
        for module in self.modules():
            if isinstance(module, (Linear, QuantLinear, SparseMoeBlock)):
                module.pack(weights)
        self.head = self._head_op(pack=True, weights=weights)
        if weights is not None and weights != self.embed_tokens.dtype and self.embed_tokens.device.type == "cpu":
            self.embed_tokens = nn.Parameter(self.embed_tokens.to(weights), requires_grad=False)

    def _head_op(self, pack: bool, weights: torch.dtype | None = None) -> LinearOp:
        if self.lm_head is not None:
            if isinstance(self.lm_head, QuantLinear):
                return self.lm_head.op
            return self.lm_head.op if pack else TorchLinear(self.lm_head.weight)
        weight = self.embed_tokens[self.shapes.vocab_start:self.shapes.vocab_end]
        return linear_op(weight, weights) if pack else TorchLinear(weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) into the parameters through their loaders.

        Raises ValueError on unknown names, shape mismatches and missing tensors."""
        self.weight_map().load(weights, self.spec.architecture)

    def weight_map(self) -> WeightMap:
        """Every checkpoint tensor's loader and the parameter slots they fill (an online-quantized
        layer's float weight is made here, to be filled)."""
        wm = WeightMap()
        spec, n = self.spec, self.tp.size
        wm.add("embed_tokens.weight", wm.slot("embed_tokens", self.embed_tokens).loader())
        register_norm(wm, "norm.weight", self.norm)
        if self.lm_head is not None:
            rows = self.shapes.vocab_end - self.shapes.vocab_start
            register_single(wm, "lm_head", self.lm_head.checkpoint_tensors(), spec.vocab_size,
                            rows_rank=narrow(0, self.shapes.vocab_start, rows, n))
        for i, layer in enumerate(self.layers):
            layer.register_weights(wm, f"layers.{i}.", spec, self.shapes, self.tp)
        return wm

    # -- forward ------------------------------------------------------------------

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
        if x.dtype != self.norm.weight.dtype:  # a 16-bit table under wider activations
            x = x.to(self.norm.weight.dtype)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        local_cos, local_sin = self.local_rotary.cos_sin(positions, x.dtype) if self.local_rotary else (cos, sin)
        ctx = StepContext(meta, backend, kv_caches, cos, sin, local_cos, local_sin)
        stack = self._native_stack(kv_caches, x)
        rows = None if stack is None else native_stack.paged_rows(backend, meta)
        segments = stack.segments if stack is not None and rows is not None else [(0, len(self.layers), False)]
        residual = None
        self.captured = []
        for start, end, native in _cut(segments, self.capture):
            if start in self.capture:  # (a layer named twice is kept twice: the same tensor, read only)
                kept = x.clone() if residual is None else x + residual
                self.captured.extend([kept] * self.capture.count(start))
            if native:
                assert stack is not None and rows is not None
                x, residual = stack.run(x, residual, ctx, rows, start, end)
                continue
            for layer in self.layers[start:end]:
                x, residual = layer(x, residual, ctx)
        out, stream = self.ops.add_norm(x, residual, self.norm)
        self.captured.extend([stream] * self.capture.count(len(self.layers)))
        return out

    def _native_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      x: torch.Tensor) -> native_stack.NativeStack | None:
        """The layers the driver runs in one native call per run, where this model and its caches
        allow any (decided once per caches: `native_stack.coverage`)."""
        if not x.shape[0] or not kv_caches:
            return None
        key = kv_caches[0][0].data_ptr()
        if self._stack_key != key:
            self._stack_key = key
            reasons = native_stack.coverage(self, kv_caches)
            self._stack = native_stack.NativeStack(self, kv_caches, reasons) if None in reasons else None
        return self._stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [rows, vocab] on rank 0, soft-capped where the model says; None elsewhere."""
        local = self.head(hidden, None).float()
        if self.tp.size == 1:
            logits = local
        else:
            pad = self.shapes.vocab_shard - local.shape[1]
            parts = self.tp.gather_to_first(F.pad(local, (0, pad)) if pad else local)
            if parts is None:
                return None
            logits = torch.cat(parts, dim=1)[:, : self.spec.vocab_size]
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _cut(segments: list[tuple[int, int, bool]], at: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """`segments` also cut where a captured layer starts."""
    out = []
    for start, end, native in segments:
        for cut in sorted({i for i in at if start < i < end}):
            out.append((start, cut, native))
            start = cut
        out.append((start, end, native))
    return out
