"""Checkpoint tensors into a model's parameters, each through a loader that knows its place.

As vLLM's weight_loader: every module says, for each checkpoint tensor name it owns, which
parameter takes it, which shard of a fused parameter (q, k or v of qkv_proj; gate or up;
one expert's part, or all experts at once), and which slice of it this tensor-parallel rank
holds. A `Slot` is one parameter with the shards it needs; loading fills them and reports
anything left empty. The same mechanism takes the hub's per-expert tensors, the fused
experts transformers 5 keeps in memory, and Phi-3's fused q/k/v and gate/up.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import torch

from noria.worker.models.linear import CheckpointTensor

# A checkpoint tensor's loader: (the tensor, its name for messages).
Loader = Callable[[torch.Tensor, str], None]


class Slot:
    """A parameter and the shards it needs filled: each need is a set of alternative keys (an
    expert's gate rows come per expert or with every expert's at once)."""

    def __init__(self, name: str, param: torch.Tensor, needs: Iterable[Iterable[Hashable]] = (("all",),)) -> None:
        self.name, self.param = name, param
        self.needs = [frozenset(n) for n in needs]
        self.filled: set[Hashable] = set()

    def fill(self, key: Hashable, dest: torch.Tensor, src: torch.Tensor, what: str) -> None:
        if dest.shape != src.shape:
            raise ValueError(f"checkpoint tensor {what!r} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(src)
        self.filled.add(key)

    def loader(self, key: Hashable = "all", view: Callable[[torch.Tensor], torch.Tensor] | None = None,
               rank: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Loader:
        """Copy a tensor (`rank`: this rank's slice of it) into `view` of the parameter, filling `key`."""
        def load(tensor: torch.Tensor, what: str) -> None:
            dest = self.param.data if view is None else view(self.param.data)
            self.fill(key, dest, tensor if rank is None else rank(tensor), what)

        return load

    def missing(self) -> bool:
        return any(not need & self.filled for need in self.needs)


def split_rows(sizes: Sequence[int], loaders: Sequence[Loader]) -> Loader:
    """A tensor of stacked parts (Phi-3's qkv_proj, gate_up_proj) cut into its parts' loaders."""
    def load(tensor: torch.Tensor, what: str) -> None:
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint tensor {what!r} has {tensor.shape[0]} rows, expected {sum(sizes)} "
                             f"({' + '.join(map(str, sizes))})")
        for part, load_part in zip(tensor.split(list(sizes)), loaders, strict=True):
            load_part(part, what)

    return load


def narrow(dim: int, start: int, size: int, ranks: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """This rank's slice along `dim` (None with one rank: the whole tensor)."""
    if ranks == 1:
        return None
    return lambda t: t.narrow(dim if dim >= 0 else t.dim() + dim, start, size)


def rows(start: int, size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda p: p.narrow(0, start, size)


class WeightMap:
    """A model's loaders by checkpoint tensor name (`model.` prefix removed) and its slots."""

    def __init__(self) -> None:
        self.loaders: dict[str, Loader] = {}
        self.slots: list[Slot] = []

    def add(self, name: str, loader: Loader) -> None:
        self.loaders[name] = loader

    def slot(self, name: str, param: torch.Tensor, needs: Iterable[Iterable[Hashable]] = (("all",),)) -> Slot:
        s = Slot(name, param, needs)
        self.slots.append(s)
        return s

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], model_name: str) -> None:
        """Raises ValueError on a tensor the model has no place for, a shape that does not fit, or
        a parameter the checkpoint leaves unfilled."""
        for name, tensor in weights:
            key = name.removeprefix("model.")
            loader = self.loaders.get(key)
            if loader is not None:
                loader(tensor, name)
            elif not _ignored(key):
                raise ValueError(f"checkpoint tensor {name!r} has no place in {model_name}; "
                                 "is the config consistent with the weights?")
        missing = [s.name for s in self.slots if s.missing()]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def _ignored(name: str) -> bool:
    # Old checkpoints store the rotary buffer (recomputed here); a tied model may still ship an lm_head;
    # a sequence-classification checkpoint's head is the pooling runner's (worker/score_head.py); MTP
    # layers (MiMo) are the mtp drafter's (worker/mtp.py).
    return "rotary_emb.inv_freq" in name or name in ("lm_head.weight", "score.weight") or name.startswith("mtp_layers.")


class Part(NamedTuple):
    """One checkpoint module's rows of a fused layer (q of qkv_proj, gate of gate_up_proj)."""

    module: str  # its name in the checkpoint, after the prefix ("q_proj")
    start: int  # its first row in the layer (this rank's rows)
    size: int  # its rows in the layer
    full: int  # its rows in the checkpoint (all ranks')
    rank: Callable[[torch.Tensor], torch.Tensor] | None  # this rank's rows of the checkpoint tensor


def register_fused(wm: WeightMap, prefix: str, fused: str, tensors: Sequence[CheckpointTensor],
                   parts: Sequence[Part], fused_checkpoint: bool) -> None:
    """A column-parallel layer whose parts the checkpoint stores as separate modules (or, with
    `fused_checkpoint`, already stacked under the layer's own name, as Phi-3 does): every tensor
    the layer keeps per module (weight, bias, scales, zero points) goes into its parts' rows."""
    for t in tensors:
        if t.param is None:  # checked, not kept
            names = [(fused, sum(p.full for p in parts))] if fused_checkpoint else [(p.module, p.full) for p in parts]
            for name, full in names:
                wm.add(f"{prefix}{name}.{t.suffix}", _converted(t, full, lambda tensor, what: None))
            continue
        slot = wm.slot(f"{prefix}{fused}.{t.suffix}", t.param, [(p.module,) for p in parts])
        loaders = [slot.loader(p.module, rows(p.start, p.size), p.rank) for p in parts]
        if fused_checkpoint:
            full = [p.full for p in parts]
            wm.add(f"{prefix}{fused}.{t.suffix}", _converted(t, sum(full), split_rows(full, loaders)))
        else:
            for p, load in zip(parts, loaders, strict=True):
                wm.add(f"{prefix}{p.module}.{t.suffix}", _converted(t, p.full, load))


def register_single(wm: WeightMap, name: str, tensors: Sequence[CheckpointTensor], full_rows: int,
                    rows_rank: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    columns: tuple[int, int, int] | None = None) -> None:
    """A layer that is one checkpoint module `name`: this rank's rows of it (`rows_rank`: a
    vocab-parallel lm_head), or its input columns (start, size, ranks) for a row-parallel one,
    each tensor cut where its columns are input features or groups of them."""
    for t in tensors:
        if t.param is None:
            wm.add(f"{name}.{t.suffix}", _converted(t, full_rows, lambda tensor, what: None))
            continue
        if columns is None:
            rank = rows_rank
        else:  # a bias (added once, after the sum) and one scale per row are replicated
            rank = None if t.per_column == 0 else _columns(t, name, *columns)
        wm.add(f"{name}.{t.suffix}", _converted(t, full_rows, wm.slot(f"{name}.{t.suffix}", t.param)
                                                .loader("all", None, rank)))


def _columns(t: CheckpointTensor, name: str, start: int, size: int,
             ranks: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if start % t.per_column or size % t.per_column:
        raise ValueError(f"{name}.{t.suffix}: a rank's {size} input features from {start} do not split its "
                         f"groups of {t.per_column}; use a tensor-parallel size that does")
    return narrow(1, start // t.per_column, size // t.per_column, ranks)


def _converted(t: CheckpointTensor, full_rows: int, load: Loader) -> Loader:
    if t.convert is None:
        return load
    convert = t.convert
    return lambda tensor, what: load(convert(tensor, full_rows, what), what)
