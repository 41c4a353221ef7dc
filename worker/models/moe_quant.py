"""A sparse block's experts as linear layers of their own, where the checkpoint quantizes them.

Quantized MoE checkpoints store one linear module per expert and part (protocol/quant_moe.py),
so each expert here is a dense MLP's pair of layers: gate/up one column-parallel layer (its
parts fused into one as a dense MLP's are), down one row-parallel layer, each a QuantLinear of
the layer's scheme (or a float Linear where the checkpoint keeps that part float). Their
values stay quantized: each expert's tensors are converted as they are read, as a dense
layer's are, and packed for its kind (worker/models/quant_kinds.py); nothing dequantizes all
the experts at load. The block's grouped loop (worker/models/moe.py) calls each active
expert's kind on its routed rows; under tensor parallelism down's output is a partial sum the
block all-reduces once, so these calls skip the layers' own all_reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from noria.protocol.model_spec import ModelSpec
from noria.protocol.quant_moe import ExpertSchemes
from noria.worker.models.linear import Linear
from noria.worker.models.parallel import TensorParallel
from noria.worker.models.quant_linear import QuantLinear, make_linear, make_row_parallel
from noria.worker.models.weights import (
    Loader,
    Part,
    WeightMap,
    narrow,
    register_fused,
    register_single,
)


def local(layer: Linear | QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """x through `layer`'s kind, without a bias or the row-parallel all_reduce (this rank's
    partial sum, reduced once per block); GPTQ's activation order permutes the input first."""
    if isinstance(layer, QuantLinear):
        x = layer.permuted(x)
    return layer.op(x, None)


class ExpertOp:
    """One expert part in the block's grouped loop: the layer's kind as chosen at pack time."""

    def __init__(self, layer: Linear | QuantLinear) -> None:
        self.layer = layer

    @property
    def kind(self) -> str:
        return self.layer.op.kind

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return local(self.layer, x)


class QuantExperts(nn.Module):
    """Every expert's gate/up and down layers of one sparse layer, this rank's columns of each."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel, inter: int, schemes: ExpertSchemes) -> None:
        super().__init__()
        e, h = spec.num_experts, spec.hidden_size
        self.schemes = schemes
        self.gate_up = nn.ModuleList(make_linear(h, 2 * inter, False, schemes[0]) for _ in range(e))
        self.down = nn.ModuleList(make_row_parallel(inter, h, False, tp, schemes[1]) for _ in range(e))

    def pack(self, weights: torch.dtype | None) -> None:
        for layer in [*self.gate_up, *self.down]:
            layer.pack(weights)

    def ops(self) -> tuple[list[ExpertOp], list[ExpertOp]]:
        return [ExpertOp(m) for m in self.gate_up], [ExpertOp(m) for m in self.down]

    def register_weights(self, wm: WeightMap, prefix: str, spec: ModelSpec, start: int, ranks: int) -> None:
        """Each expert's modules under `mlp.experts.E.` or Mixtral's `block_sparse_moe.experts.E.`
        (the same loaders under both names): gate and up into their rows of the expert's gate/up
        layer (this rank's columns of each), down's input columns of this rank, every tensor its
        format stores per module (values, scales, zero points, g_idx) cut as a dense MLP's are."""
        gate, up, dn = spec.expert_parts
        full, inter = spec.moe_intermediate_size, self.gate_up[0].out_features // 2
        rank = narrow(0, start, inter, ranks)
        per_expert: list[dict[str, Loader]] = []
        for i, (gate_up, down) in enumerate(zip(self.gate_up, self.down, strict=True)):
            sub, p = WeightMap(), f"{prefix}mlp.experts.{i}."
            parts = [Part(gate, 0, inter, full, rank), Part(up, inter, inter, full, rank)]
            register_fused(sub, p, "gate_up_proj", gate_up.checkpoint_tensors(), parts, False)
            register_single(sub, p + dn, down.checkpoint_tensors(), spec.hidden_size, columns=(start, inter, ranks))
            wm.slots += sub.slots
            for name, load in sub.loaders.items():
                wm.add(name, load)
                wm.add(name.replace(f"{prefix}mlp.", f"{prefix}block_sparse_moe.", 1), load)
            per_expert.append({name.removeprefix(p): load for name, load in sub.loaders.items()})
        if all(s is not None and s.layout == "online" for s in self.schemes):
            # A float checkpoint quantized at load may hold its experts as transformers 5 does:
            # [E, 2I, H] gate_up_proj (each expert's gate rows, then its up rows), [E, H, I] down_proj.
            for b in ("mlp.", "block_sparse_moe."):
                wm.add(f"{prefix}{b}experts.gate_up_proj", _split(per_expert, (f"{gate}.weight", f"{up}.weight")))
                wm.add(f"{prefix}{b}experts.down_proj", _split(per_expert, (f"{dn}.weight",)))


def _split(per_expert: list[dict[str, Loader]], names: Sequence[str]) -> Loader:
    """A fused [E, rows, cols] tensor into each expert's loaders of `names`, its rows cut evenly."""
    def load(tensor: torch.Tensor, what: str) -> None:
        if tensor.dim() != 3 or tensor.shape[0] != len(per_expert) or tensor.shape[1] % len(names):
            raise ValueError(f"checkpoint tensor {what!r} has shape {tuple(tensor.shape)}, expected "
                             f"{len(per_expert)} experts along its first dimension")
        for loaders, expert in zip(per_expert, tensor, strict=True):
            for name, part in zip(names, expert.chunk(len(names)), strict=True):
                loaders[name](part, what)

    return load
