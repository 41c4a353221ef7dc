"""Load a Hugging Face checkpoint folder: its spec (protocol/model_spec.py), weights from safetensors
(or, for a GGUF file's folder view, from the file: worker/gguf_weights.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from noria.protocol.model_spec import ModelSpec, read_spec
from noria.worker.models import moe
from noria.worker.models.causal_lm import CausalLM
from noria.worker.models.ops import choose_ops
from noria.worker.models.parallel import TensorParallel

log = logging.getLogger("noria.worker")


def load_spec(path: str | Path, max_model_len: int | None = None) -> ModelSpec:
    """`max_model_len`: the engine's context length where one is set (longrope picks its factors by it)."""
    return read_spec(path, max_model_len)


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


def checkpoint_float32_bytes(path: str | Path) -> int | None:
    """The checkpoint's tensors' size in float32, from the safetensors headers alone (8 bytes of
    length, then JSON), before anything is loaded (`--dtype auto` asks); None where they cannot be
    read (loading says why)."""
    count = 0
    try:
        for file in checkpoint_files(path):
            with open(file, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for name, entry in header.items():
                if name != "__metadata__":
                    n = 1
                    for dim in entry["shape"]:
                        n *= dim
                    count += n
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return 4 * count


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


@contextmanager
def built_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Modules made inside have their parameters on `device` in `dtype`, allocated once there."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def load_model(path: str | Path, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
               tp: TensorParallel | None = None, weights: torch.dtype | None = None,
               load_format: str = "auto", seed: int = 0) -> CausalLM:
    """Build the model for `spec` (this rank's shard of it under `tp`) directly on `device` in
    `dtype`, fill it from `path` (load_format "dummy": with random weights seeded by `seed`,
    worker/dummy_weights.py), keep its linear weights in `weights`' dtype where a kernel
    takes it (None: `dtype`), and give it the ops of its device and dtype (the worker gives it
    the CUDA ops once its attention backend is chosen: `CausalLM.use_ops`)."""
    tp = tp or TensorParallel()
    if spec.num_experts and tp.first:
        log.info("%s", moe.describe(spec, tp))
    with built_on(device, dtype):
        model = CausalLM(spec, tp)
    if load_format == "dummy":
        from noria.worker.dummy_weights import fill_dummy

        fill_dummy(model, seed)
    elif spec.quantization is not None and spec.quantization.method == "gguf":
        from noria.worker.gguf_weights import iter_gguf_weights

        model.load_weights(iter_gguf_weights(path, spec))
    else:
        model.load_weights(iter_weights(checkpoint_files(path)))
    model.pack_weights(weights)
    model.use_ops(choose_ops(spec.activation, device, dtype))
    return model.eval()
