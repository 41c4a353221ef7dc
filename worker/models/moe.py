"""The sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) over a ragged batch.

Routing follows transformers' modelling code number for number: router logits in the
model dtype, softmax in float32, top-k, renormalised where the family says so (Mixtral
always, the Qwen families per `norm_topk_prob`); the Qwen families cast the routing
weights back to the model dtype before weighting an expert's output, Mixtral keeps them
in float32 (the product is rounded once, when it is added to the output).

Experts run grouped: the (token, choice) pairs are sorted by expert, each active expert
runs one gate/up GEMM and one down GEMM over its rows (the native CPU GEMM through
pre-packed weights where the dense MLP uses it, torch's matmul elsewhere), and the
weighted rows are added back to their tokens with one index_add in expert order, the
order transformers adds them in. Where the experts are packed for the native GEMM and the
layer runs the CPU ops, all of that is one native call (worker/moe_kernels.py), bit for bit
the same numbers. Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x)).

Quantized checkpoints (compressed-tensors, FP8, AWQ, GPTQ, or --quantization fp8) store one
linear module per expert and part: each expert is then a pair of linear layers of its scheme
(worker/models/moe_quant.py), its values kept quantized, and the grouped loop calls each active
expert's kind on its rows; the router stays float, the shared expert is a dense MLP's layers.

Tensor parallelism shards every expert's intermediate dimension (and the shared
expert's): gate/up column-parallel, down row-parallel, so each rank's output is a
partial sum; the routed and shared partial sums are added first and all-reduced once
per block. The router is replicated, so every rank picks the same experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from noria.protocol.model_spec import ModelSpec
from noria.protocol.quant_moe import expert_schemes
from noria.worker import moe_kernels
from noria.worker.models.linear import (
    LinearOp,
    PackedHalfLinear,
    TorchLinear,
    linear_op,
    packed,
)
from noria.worker.models.moe_quant import ExpertOp, QuantExperts, local
from noria.worker.models.ops import CpuOps, Ops
from noria.worker.models.parallel import TensorParallel
from noria.worker.models.quant_linear import make_linear, make_row_parallel, scheme_of
from noria.worker.models.weights import (
    Loader,
    Part,
    Slot,
    WeightMap,
    narrow,
    register_fused,
    register_single,
)


def describe(spec: ModelSpec, tp: TensorParallel) -> str:
    """The start-up line of a sparse model: its layers, routing and how the experts are split."""
    sparse = sum(spec.sparse_layers)
    norm = "renormalised" if spec.norm_topk_prob else "not renormalised"
    shared = f", a shared expert of {spec.shared_expert_intermediate_size}" \
        if spec.shared_expert_intermediate_size else ""
    split = (f"each expert's {spec.moe_intermediate_size} intermediate columns split over {tp.size} ranks "
             f"({spec.moe_intermediate_size // tp.size} per rank, one all_reduce per block), router replicated"
             if tp.size > 1 else "experts whole on one rank")
    return (f"mixture of experts: {sparse} of {spec.num_layers} layers sparse, {spec.num_experts} experts "
            f"of {spec.moe_intermediate_size}, top-{spec.num_experts_per_tok} ({norm}){shared}; {split}")


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _meta(p: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
    """p's shape in the panels' dtype, no bytes."""
    return nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP when the layer is sparse: router, experts, optional shared expert."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel, ops: Ops, layer_index: int = 0) -> None:
        super().__init__()
        e, h, n = spec.num_experts, spec.hidden_size, tp.size
        self.tp = tp
        self.ops = ops
        self.num_experts, self.top_k = e, spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.weights_in_model_dtype = spec.router_weights_in_model_dtype
        self.inter = spec.moe_intermediate_size // n  # this rank's columns of every expert
        self.inter_start = tp.rank * self.inter
        self.router = _param(e, h)
        schemes = expert_schemes(spec, layer_index)
        # Quantized experts: a layer per expert and part (their float stacks below keep only a shape).
        self.quantized = QuantExperts(spec, tp, self.inter, schemes) if schemes != (None, None) else None
        dev = "meta" if self.quantized is not None else None
        # Per expert: [gate rows; up rows] of this rank, as the dense MLP's gate_up_proj.
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * self.inter, h, device=dev), requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(e, h, self.inter, device=dev), requires_grad=False)
        shared = spec.shared_expert_intermediate_size
        self.shared_inter = shared // n
        self.shared_start = tp.rank * self.shared_inter
        s = f"model.layers.{layer_index}.mlp.shared_expert."
        self.shared_gate_up = make_linear(h, 2 * self.shared_inter, False, scheme_of(
            spec, [s + "gate_proj", s + "up_proj"])) if shared else None
        self.shared_down = make_row_parallel(self.shared_inter, h, False, tp, scheme_of(
            spec, [s + "down_proj"])) if shared else None
        self.shared_expert_gate = _param(1, h) if shared else None
        # Each expert's linear kinds (`pack`).
        self.gate_up_ops: list[LinearOp] | list[ExpertOp]
        self.down_ops: list[LinearOp] | list[ExpertOp]
        if self.quantized is not None:
            self.gate_up_ops, self.down_ops = self.quantized.ops()
        else:
            self.gate_up_ops = [TorchLinear(w) for w in self.experts_gate_up]
            self.down_ops = [TorchLinear(w) for w in self.experts_down]
        self.native: moe_kernels.PackedExperts | None = None  # the one-call path's view of the packed experts

    # -- forward ----------------------------------------------------------------

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) as transformers' top-k router computes them."""
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_gate_up is not None and self.shared_down is not None and self.shared_expert_gate is not None:
            shared = local(self.shared_down, self.ops.act_and_mul(local(self.shared_gate_up, x)))
            # sigmoid(gate) is the same on every rank, so gating partial sums gates their total.
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return self.tp.all_reduce(out)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x), grouped by expert ([T, hidden])."""
        t, k = ids.shape
        if self.native is not None and t and k <= moe_kernels.MAX_TOP_K:
            return moe_kernels.experts(x, weights, ids, self.native)
        out = torch.zeros_like(x)
        if t == 0:
            return out
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # expert by expert, tokens in order within one
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync
        tokens = order // k
        picked = x.index_select(0, tokens)
        done = torch.empty_like(picked)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            h = self.gate_up_ops[e](picked[start:start + n], None)
            done[start:start + n] = self.down_ops[e](self.ops.act_and_mul(h), None)
            start += n
        # Mixtral's float32 weights promote the product; it is rounded once, as transformers does.
        weighted = (done * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
        return out.index_add_(0, tokens, weighted)

    def pack(self, weights: torch.dtype | None = None) -> None:
        """The linear kind of every expert, and the one-call path where all are packed and the
        layer runs the CPU ops (the CUDA ops keep the grouped loop on their kernels)."""
        if self.quantized is not None:
            self.quantized.pack(weights)
            self.gate_up_ops, self.down_ops = self.quantized.ops()
        elif self.experts_gate_up.is_meta:
            return  # packed already: the panels are all that is left
        else:
            self.gate_up_ops = [linear_op(w, weights) for w in self.experts_gate_up]
            self.down_ops = [linear_op(w, weights) for w in self.experts_down]
            if all(packed(op) is not None for op in self.gate_up_ops + self.down_ops):
                # As Linear.pack: the panels are the only copy kept (`packed(op).unpack()` gives it back).
                first = self.gate_up_ops[0]
                kept = first.packed.dtype if isinstance(first, PackedHalfLinear) else self.experts_gate_up.dtype
                self.experts_gate_up = _meta(self.experts_gate_up, kept)
                self.experts_down = _meta(self.experts_down, kept)
        for shared in (self.shared_gate_up, self.shared_down):
            if shared is not None:
                shared.pack(weights)
        self.use_ops(self.ops)

    def use_ops(self, ops: Ops) -> None:
        self.ops = ops
        gate_up, down = [packed(op) for op in self.gate_up_ops], [packed(op) for op in self.down_ops]
        self.native = None
        if isinstance(ops, CpuOps) and moe_kernels.load() is not None and all(w is not None for w in gate_up + down):
            self.native = moe_kernels.PackedExperts(gate_up, down)  # type: ignore[arg-type]

    # -- loading ----------------------------------------------------------------

    def register_weights(self, wm: WeightMap, prefix: str, spec: ModelSpec) -> None:
        """Loaders for this block's checkpoint tensors below `prefix` (`layers.N.`): the router,
        every expert per expert under `mlp.` or `block_sparse_moe.` (the family's part names),
        or all at once as transformers 5 holds them ([E, 2I, H] gate_up_proj, [E, H, I] down_proj),
        and Qwen2-MoE's shared expert and its gate."""
        e, n, inter = self.num_experts, self.tp.size, self.inter
        router = wm.slot(prefix + "mlp.router", self.router)
        for block in ("mlp.", "block_sparse_moe."):
            wm.add(prefix + block + "gate.weight", router.loader())
        if self.quantized is not None:
            self.quantized.register_weights(wm, prefix, spec, self.inter_start, n)
        else:
            gate_up = wm.slot(prefix + "mlp.experts_gate_up", self.experts_gate_up,
                              [((i, p), ("all", p)) for i in range(e) for p in (0, 1)])
            down = wm.slot(prefix + "mlp.experts_down", self.experts_down, [(i, "all") for i in range(e)])
            gate, up, dn = spec.expert_parts
            cols, rank_rows = narrow(-1, self.inter_start, inter, n), narrow(0, self.inter_start, inter, n)
            for block in ("mlp.", "block_sparse_moe."):
                b = prefix + block
                for i in range(e):
                    for part, name in ((0, gate), (1, up)):
                        wm.add(f"{b}experts.{i}.{name}.weight",
                               gate_up.loader((i, part), _expert_rows(i, part, inter), rank_rows))
                    wm.add(f"{b}experts.{i}.{dn}.weight", down.loader(i, lambda p, i=i: p[i], cols))
                wm.add(b + "experts.gate_up_proj", self._fused_gate_up(gate_up))
                wm.add(b + "experts.down_proj", down.loader("all", None, cols))
        if self.shared_gate_up is None or self.shared_down is None or self.shared_expert_gate is None:
            return
        s, si, full = prefix + "mlp.shared_expert.", self.shared_inter, spec.shared_expert_intermediate_size
        rank_rows = narrow(0, self.shared_start, si, n)
        register_fused(wm, s, "gate_up_proj", self.shared_gate_up.checkpoint_tensors(),
                       [Part("gate_proj", 0, si, full, rank_rows), Part("up_proj", si, si, full, rank_rows)], False)
        register_single(wm, s + "down_proj", self.shared_down.checkpoint_tensors(), spec.hidden_size,
                        columns=(self.shared_start, si, n))
        wm.add(prefix + "mlp.shared_expert_gate.weight",
               wm.slot(prefix + "mlp.shared_expert_gate", self.shared_expert_gate).loader())

    def _fused_gate_up(self, slot: Slot) -> Loader:
        e, inter = self.num_experts, self.inter

        def load(tensor: torch.Tensor, what: str) -> None:
            if tensor.dim() != 3 or tensor.shape[0] != e:
                raise ValueError(f"checkpoint tensor {what!r} has shape {tuple(tensor.shape)}, expected {e} experts "
                                 "along its first dimension")
            full = tensor.shape[1] // 2  # [E, 2I, H]: every expert's gate rows, then its up rows
            for part in (0, 1):
                src = tensor.narrow(1, part * full, full)
                if self.tp.size > 1:
                    src = src.narrow(1, self.inter_start, inter)
                slot.fill(("all", part), slot.param.data.narrow(1, part * inter, inter), src, what)

        return load


def _expert_rows(expert: int, part: int, inter: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda p: p[expert].narrow(0, part * inter, inter)
