"""The model families noria implements: one module per family, each with a `FAMILY`.

Found by listing this package, so adding a family is adding a file. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from noria.protocol.recipe import Family


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            if family.architecture in found:
                raise ImportError(f"two families claim {family.architecture}")
            found[family.architecture] = family
    return found


FAMILIES: dict[str, Family] = _discover()
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)


def find_family(cfg: Mapping[str, Any]) -> Family | None:
    """The family of a config.json: its first supported `architectures` entry, or, for a config
    without that list, its `model_type`; None when noria does not implement it."""
    archs = cfg.get("architectures") or []
    if archs:
        # A sequence-classification checkpoint is its family's decoder under a score head
        # (protocol/score.py), as transformers builds `LlamaForSequenceClassification`.
        archs = [a.removesuffix("ForSequenceClassification") + "ForCausalLM"
                 if isinstance(a, str) and a.endswith("ForSequenceClassification") else a for a in archs]
        return next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    model_type = cfg.get("model_type")
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)
