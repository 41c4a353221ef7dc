"""Checkpoints derived from a benchmark model for `noria bench spec`'s draft-model rows, made once
beside it in the cache.

- `head_checkpoint(model, L)`: the model's embedding, first L layers, final norm and lm_head: a
  draft of the same family at L / num_layers of the layers' cost.
- `inert_checkpoint(model, L)`: the model with every layer from L on made to add nothing to
  the residual stream (its attention and MLP output projections zero). It still computes every
  layer at full cost, but its greedy tokens are those of its first L layers, so
  `head_checkpoint(model, L)` drafts it with every proposal right: the upper bound of a draft
  that size. (Random weights give a real head of a real model next to no agreement; trained
  models fall between the two.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from noria.bench.workloads import write_checkpoint

_OUTPUTS = (".self_attn.o_proj.", ".mlp.down_proj.")


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def _derive(model: Path, name: str, layers: int, keep: bool) -> Path:
    from safetensors.torch import save_file

    from noria.worker.loader import checkpoint_files, iter_weights

    path = model.with_name(f"{model.name}-{name}{layers}")
    if (path / "complete").exists():
        return path
    config = json.loads((model / "config.json").read_text())
    if not 0 < layers < config["num_hidden_layers"]:
        raise SystemExit(f"{model.name} has {config['num_hidden_layers']} layers: {name}{layers} needs fewer")

    def save(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        weights = {}
        for key, value in iter_weights(checkpoint_files(model)):
            index = _layer(key)
            if index is not None and index >= layers:
                if not keep:
                    continue
                if any(part in key for part in _OUTPUTS):
                    value = value.new_zeros(value.shape)
            weights[key] = value.contiguous()
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        if not keep:
            config["num_hidden_layers"] = layers
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for extra in ("generation_config.json",):
            if (model / extra).exists():
                shutil.copy(model / extra, tmp / extra)

    return write_checkpoint(path, save, model)


def head_checkpoint(model: Path, layers: int) -> Path:
    return _derive(model, "head", layers, keep=False)


def inert_checkpoint(model: Path, layers: int) -> Path:
    return _derive(model, "inert", layers, keep=True)
