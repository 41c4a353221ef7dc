"""Load a Hugging Face checkpoint folder: config via AutoConfig, weights from safetensors."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from noria.worker.models import moe
from noria.worker.models.gemma import GemmaForCausalLM
from noria.worker.models.llama import LlamaForCausalLM
from noria.worker.models.parallel import TensorParallel
from noria.worker.models.spec import ModelSpec, model_spec

log = logging.getLogger("noria.worker")

# The Llama implementation serves every family but Gemma; the spec carries the differences.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Mixture of experts: the same decoder with worker/models/moe.py's block as a sparse layer's MLP.
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    # Gemma 2 / 3: Llama's attention, MLP and loading under Gemma's norms, GeGLU and soft-caps.
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def load_hf_config(path: str | Path) -> Any:
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot read the config of {str(folder)!r}: {e}") from e


def load_spec(path: str | Path, max_model_len: int | None = None) -> ModelSpec:
    """`max_model_len`: the engine's context length where one is set (longrope picks its factors by it)."""
    return model_spec(load_hf_config(path), max_model_len)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names missing shards: {absent}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {str(folder)!r} (PyTorch .bin checkpoints are not supported)"
        )
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(path: str | Path, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
               tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """Build the model for `spec` (this rank's shard of it under `tp`) directly on
    `device` in `dtype` and fill it from `path`."""
    cls = MODEL_CLASSES[spec.architecture]
    tp = tp or TensorParallel()
    if spec.num_experts and tp.first:
        log.info("%s", moe.describe(spec, tp))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(spec, tp)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(iter_weights(checkpoint_files(path)))
    model.pack_weights()
    return model.eval()
