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
order transformers adds them in. Where the experts are packed for the native GEMM, all of
that is one native call (worker/moe_kernels.py), bit for bit the same numbers. Qwen2-MoE adds a shared expert scaled by
sigmoid(shared_expert_gate(x)).

Tensor parallelism shards every expert's intermediate dimension (and the shared
expert's): gate/up column-parallel, down row-parallel, so each rank's output is a
partial sum; the routed and shared partial sums are added first and all-reduced once
per block. The router is replicated, so every rank picks the same experts.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from noria.worker import moe_kernels
from noria.worker.gemm_kernels import PackedWeight
from noria.worker.models.layers import linear, pack_linear_weight, silu_and_mul
from noria.worker.models.parallel import TensorParallel
from noria.worker.models.spec import ModelSpec

# Checkpoint names below `layers.N.`: the hub's per-expert tensors (Mixtral's
# block_sparse_moe w1 = gate, w3 = up, w2 = down; the Qwen families' gate/up/down_proj)
# and the fused [E, 2I, H] / [E, H, I] tensors transformers 5 keeps in memory.
_PER_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_FUSED_EXPERTS = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"(?:mlp|block_sparse_moe)\.gate\.weight")
_SHARED = re.compile(r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight")
_SHARED_GATE = "mlp.shared_expert_gate.weight"
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}  # 0 gate, 1 up, 2 down


def expert_sizes(spec: ModelSpec) -> tuple[tuple[str, int], ...]:
    """The intermediate sizes tensor parallelism splits besides the dense MLP's, named as in config.json."""
    if not spec.num_experts:
        return ()
    sizes = [("moe_intermediate_size", spec.moe_intermediate_size)]
    if spec.shared_expert_intermediate_size:
        sizes.append(("shared_expert_intermediate_size", spec.shared_expert_intermediate_size))
    return tuple(sizes)


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


def owns(name: str) -> bool:
    """Whether a checkpoint name below `layers.N.` belongs to a sparse block."""
    return name.startswith(("mlp.", "block_sparse_moe."))


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP when the layer is sparse: router, experts, optional shared expert."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__()
        e, h, n = spec.num_experts, spec.hidden_size, tp.size
        self.tp = tp
        self.num_experts, self.top_k = e, spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.weights_in_model_dtype = spec.router_weights_in_model_dtype
        self.inter = spec.moe_intermediate_size // n  # this rank's columns of every expert
        self.inter_start = tp.rank * self.inter
        self.router = _param(e, h)
        # Per expert: [gate rows; up rows] of this rank, as the dense MLP's gate_up_proj.
        self.experts_gate_up = _param(e, 2 * self.inter, h)
        self.experts_down = _param(e, h, self.inter)
        shared = spec.shared_expert_intermediate_size
        self.shared_inter = shared // n
        self.shared_start = tp.rank * self.shared_inter
        self.shared_gate_up = _param(2 * self.shared_inter, h) if shared else None
        self.shared_down = _param(h, self.shared_inter) if shared else None
        self.shared_expert_gate = _param(1, h) if shared else None
        self.gate_up_packed: list[PackedWeight | None] = [None] * e
        self.down_packed: list[PackedWeight | None] = [None] * e
        self.shared_gate_up_packed: PackedWeight | None = None
        self.shared_down_packed: PackedWeight | None = None
        self.native: moe_kernels.PackedExperts | None = None  # the one-call path's view of the packed experts
        self._filled: set[tuple[str, Any]] = set()

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

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids, fused)
        if self.shared_gate_up is not None and self.shared_down is not None and self.shared_expert_gate is not None:
            h = silu_and_mul(linear(x, self.shared_gate_up, None, self.shared_gate_up_packed), fused)
            shared = linear(h, self.shared_down, None, self.shared_down_packed)
            # sigmoid(gate) is the same on every rank, so gating partial sums gates their total.
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return self.tp.all_reduce(out)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fused: Any = None) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x), grouped by expert ([T, hidden])."""
        t, k = ids.shape
        if self.native is not None and fused is None and t and moe_kernels.usable(x, ids):
            return moe_kernels.experts(x, weights, ids, self.native)
        out = torch.zeros_like(x)
        if t == 0:
            return out
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # expert by expert, tokens in order within one
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync
        tokens = order // k
        rows = x.index_select(0, tokens)
        done = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            h = linear(rows[start:start + n], self.experts_gate_up[e], None, self.gate_up_packed[e])
            done[start:start + n] = linear(silu_and_mul(h, fused), self.experts_down[e], None, self.down_packed[e])
            start += n
        # Mixtral's float32 weights promote the product; it is rounded once, as transformers does.
        weighted = (done * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
        return out.index_add_(0, tokens, weighted)

    def pack_weights(self) -> None:
        self.gate_up_packed = [pack_linear_weight(w) for w in self.experts_gate_up]
        self.down_packed = [pack_linear_weight(w) for w in self.experts_down]
        gate_up, down = self.gate_up_packed, self.down_packed
        if moe_kernels.load() is not None and all(w is not None for w in gate_up + down):
            self.native = moe_kernels.PackedExperts(gate_up, down)  # type: ignore[arg-type]
        if self.shared_gate_up is not None and self.shared_down is not None:
            self.shared_gate_up_packed = pack_linear_weight(self.shared_gate_up)
            self.shared_down_packed = pack_linear_weight(self.shared_down)

    # -- loading ----------------------------------------------------------------

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (its name below `layers.N.`) into this rank's share.

        Raises ValueError on a name this block has no place for or a shape that does not fit."""
        if _ROUTER.fullmatch(name):
            self._copy(name, self.router.data, tensor, ("router", None))
        elif m := _PER_EXPERT.fullmatch(name):
            e, part = int(m.group(1)), _PART[m.group(2)]
            if e >= self.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} names expert {e} of {self.num_experts}")
            if part == 2:
                self._copy(name, self.experts_down.data[e], self._cols(tensor, self.inter_start, self.inter),
                           ("down", e))
            else:
                dest = self.experts_gate_up.data[e].narrow(0, part * self.inter, self.inter)
                self._copy(name, dest, self._rows(tensor, self.inter_start, self.inter), ("gate_up", (e, part)))
        elif m := _FUSED_EXPERTS.fullmatch(name):
            self._load_fused(name, m.group(1), tensor)
        elif m := _SHARED.fullmatch(name):
            part = _PART[m.group(1)]
            if self.shared_gate_up is None or self.shared_down is None:
                raise ValueError(f"checkpoint tensor {name!r} is a shared expert, which the config does not have")
            if part == 2:
                self._copy(name, self.shared_down.data, self._cols(tensor, self.shared_start, self.shared_inter),
                           ("shared_down", None))
            else:
                dest = self.shared_gate_up.data.narrow(0, part * self.shared_inter, self.shared_inter)
                self._copy(name, dest, self._rows(tensor, self.shared_start, self.shared_inter),
                           ("shared_gate_up", part))
        elif name == _SHARED_GATE:
            if self.shared_expert_gate is None:
                raise ValueError(f"checkpoint tensor {name!r} is a shared expert, which the config does not have")
            self._copy(name, self.shared_expert_gate.data, tensor, ("shared_expert_gate", None))
        else:
            raise ValueError(f"unexpected checkpoint tensor {name!r} in a mixture-of-experts layer")

    def _load_fused(self, name: str, kind: str, tensor: torch.Tensor) -> None:
        e = self.num_experts
        if tensor.dim() != 3 or tensor.shape[0] != e:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {e} experts "
                             "along its first dimension")
        if kind == "down_proj":
            self._copy(name, self.experts_down.data, self._cols(tensor, self.inter_start, self.inter), ("down", "all"))
            return
        full = tensor.shape[1] // 2  # [E, 2I, H]: every expert's gate rows, then its up rows
        for part in (0, 1):
            src = tensor.narrow(1, part * full, full)
            if self.tp.size > 1:
                src = src.narrow(1, self.inter_start, self.inter)
            dest = self.experts_gate_up.data.narrow(1, part * self.inter, self.inter)
            self._copy(name, dest, src, ("gate_up", ("all", part)))

    def _rows(self, tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
        return tensor if self.tp.size == 1 else tensor.narrow(0, start, size)

    def _cols(self, tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
        return tensor if self.tp.size == 1 else tensor.narrow(tensor.dim() - 1, start, size)

    def _copy(self, name: str, dest: torch.Tensor, src: torch.Tensor, key: tuple[str, Any]) -> None:
        if dest.shape != src.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(src)
        self._filled.add(key)

    def missing(self) -> list[str]:
        """Names of this block's parameters the checkpoint has not filled (whole or per expert)."""
        f, e = self._filled, self.num_experts
        out = []
        if ("router", None) not in f:
            out.append("router")
        gate_up = all(("gate_up", (i, p)) in f or ("gate_up", ("all", p)) in f for i in range(e) for p in (0, 1))
        if not gate_up:
            out.append("experts_gate_up")
        if not (("down", "all") in f or all(("down", i) in f for i in range(e))):
            out.append("experts_down")
        if self.shared_gate_up is not None:
            need = [("shared_gate_up", 0), ("shared_gate_up", 1), ("shared_down", None), ("shared_expert_gate", None)]
            out += sorted({k[0] for k in need if k not in f})
        return out
