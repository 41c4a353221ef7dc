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

import torch

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
    # Old checkpoints store the rotary buffer (recomputed here); a tied model may still ship an lm_head.
    return "rotary_emb.inv_freq" in name or name == "lm_head.weight"
