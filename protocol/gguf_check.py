"""The checkpoint pre-check of a GGUF file's folder view (protocol/checkpoint.py), torch-free.

It reads the file's header only (protocol/gguf_file.py): the file whole (every tensor's bytes
inside it), every tensor one the model has a place for, of a type noria loads, shaped as the
spec says, and every tensor the spec needs present. A linear module's type was checked when the
spec was read (protocol/gguf_quant.py); other tensors (the embedding table, norms, biases) are
dequantized to float at load, which the gguf package does for more types than the GEMMs compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from noria.protocol import gguf_file
from noria.protocol.checkpoint import CheckpointError
from noria.protocol.gguf_quant import SUPPORTED_TYPES

DEQUANTIZED_TYPES = SUPPORTED_TYPES


def check_gguf(path: str, architecture: str, expected: dict[str, tuple[int, ...] | None], required: set[str],
               generic: Callable[[str], str]) -> None:
    """Raise CheckpointError (one sentence, naming the tensor) for the first problem found.
    `expected`: shapes by name without "model." (or generic, `generic(name)`); `required`: names."""
    reader: Any = gguf_file.open_gguf(path)
    arch = gguf_file.architecture(reader, path)
    present: set[str] = set()
    for t in reader.tensors:
        name = gguf_file.hf_name(t.name, arch)
        if name is None:
            if t.name in gguf_file.IGNORED:
                continue
            raise CheckpointError(f"{path}: GGUF tensor {t.name} has no place in a {architecture}")
        kind = t.tensor_type.name
        if kind not in DEQUANTIZED_TYPES:
            raise CheckpointError(f"{path}: GGUF tensor {t.name} is of type {kind}, which noria does not load "
                                  f"(supported: {', '.join(SUPPORTED_TYPES)})")
        key = name.removeprefix("model.")
        want = expected[key] if key in expected else expected.get(generic(name))
        got = gguf_file.shape(t)
        if want is not None and got != want:
            raise CheckpointError(f"{path}: GGUF tensor {t.name} has shape {got} but the file's metadata implies "
                                  f"{want}")
        present.add(key)
    missing = sorted(required - present)
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} tensor(s) its metadata requires (first: {missing[0]})")
