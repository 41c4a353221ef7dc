"""What identifies a checkpoint, computed without torch: the scheduler compares every
registering worker's model with its own and refuses one that differs.

The identity is the sha256 of config.json and, for each *.safetensors file, its size and the
sha256 of its JSON header (which names every tensor's dtype, shape and byte offsets). Two
copies of one checkpoint on two hosts agree; a different model, a re-quantised copy or a
truncated download does not. Reading headers only keeps it instant on multi-GB checkpoints. A GGUF
file's folder view is identified by the file's size and header in the same way.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import msgspec

from noria.protocol.model_spec import ModelSpec, read_spec


class WeightFile(msgspec.Struct, array_like=True, gc=False):
    name: str
    size: int
    header_sha256: str


class ModelIdentity(msgspec.Struct, array_like=True, gc=False):
    config_sha256: str
    weights: list[WeightFile]


class ModelFacts(msgspec.Struct, frozen=True):
    """What the scheduler needs from config.json before any worker has loaded the model."""

    vocab_size: int
    max_position_embeddings: int
    # The longest context the model serves (`max_model_len`'s default and bound): vLLM's rule,
    # max_position_embeddings scaled by the rope factor of linear and dynamic scaling, and for
    # yarn original_max_position_embeddings times the factor; llama3 and longrope configs
    # already name the extended length.
    max_model_len: int


def _header_sha256(path: Path) -> str:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > path.stat().st_size:
            raise ValueError(f"{path} is not a safetensors file (header longer than the file)")
        return hashlib.sha256(f.read(length)).hexdigest()


def _gguf_weights(config: Path) -> WeightFile | None:
    """A GGUF file's folder view (frontend/gguf_view.py): the file's size and the sha256 of its
    header (metadata and tensor table, up to the tensors' data); None for any other folder."""
    try:
        quant = json.loads(config.read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "gguf":
        return None
    from noria.protocol.gguf_file import open_gguf

    path = Path(quant["gguf_file"])
    offset = open_gguf(path).data_offset
    with path.open("rb") as f:
        return WeightFile(path.name, path.stat().st_size, hashlib.sha256(f.read(offset)).hexdigest())


def model_identity(folder: str | Path, with_weights: bool = True) -> ModelIdentity:
    """The identity of the checkpoint folder; FileNotFoundError names what is missing. `with_weights`
    False (--load-format dummy): config.json alone, as the weights are made from it."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist")
    if not with_weights:
        return ModelIdentity(hashlib.sha256(config.read_bytes()).hexdigest(), [])
    files = sorted(folder.glob("*.safetensors"))
    gguf = None if files else _gguf_weights(config)
    if not files and gguf is None:
        raise FileNotFoundError(f"{folder} holds no *.safetensors file")
    weights = [WeightFile(p.name, p.stat().st_size, _header_sha256(p)) for p in files] if files else [gguf]
    return ModelIdentity(hashlib.sha256(config.read_bytes()).hexdigest(), weights)


def identity_difference(engine: ModelIdentity, worker: ModelIdentity) -> str | None:
    """The first way the worker's model differs from the engine's, in words; None if equal."""
    if engine.config_sha256 != worker.config_sha256:
        return (f"config.json differs (sha256 {worker.config_sha256[:12]}… on the worker, "
                f"{engine.config_sha256[:12]}… on the scheduler)")
    if not engine.weights:  # --load-format dummy: every worker makes the weights from config.json
        return None
    mine = {w.name: w for w in engine.weights}
    theirs = {w.name: w for w in worker.weights}
    for name in sorted(mine.keys() | theirs.keys()):
        a, b = mine.get(name), theirs.get(name)
        if b is None:
            return f"{name} is missing on the worker"
        if a is None:
            return f"{name} is on the worker but not in the engine's checkpoint"
        if a.size != b.size:
            return f"{name}: size {b.size} on the worker != {a.size} on the scheduler"
        if a.header_sha256 != b.header_sha256:
            return f"{name}: its tensor header differs (names, dtypes, shapes or offsets)"
    return None


def model_facts(folder: str | Path) -> ModelFacts:
    """The facts of the checkpoint in `folder` (FileNotFoundError without a config.json)."""
    return spec_facts(read_spec(folder))


def spec_facts(spec: ModelSpec) -> ModelFacts:
    return ModelFacts(spec.vocab_size, spec.max_position_embeddings, spec.context_length)


def context_error(max_model_len: int, facts: ModelFacts) -> str:
    """The one sentence for a --max-model-len longer than the model serves."""
    if facts.max_model_len == facts.max_position_embeddings:
        return f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {facts.max_model_len}"
    return (f"max_model_len {max_model_len} exceeds the model's context length {facts.max_model_len} "
            f"(max_position_embeddings {facts.max_position_embeddings} scaled by its rope_scaling factor)")
