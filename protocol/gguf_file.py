"""A GGUF file, opened torch-free: its header checked, its tensors named as transformers names them.

Every process that meets a GGUF file goes through here: the frontend building the file's folder
view (frontend/gguf_view.py), the checkpoint pre-check (protocol/checkpoint.py) and the worker's
loader (worker/gguf_weights.py). The gguf package's reader maps the file and builds a view of
every tensor's bytes; a truncated file would fail there with a reshape error, so each tensor's
extent is checked first and the error names the tensor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from noria.protocol.checkpoint import CheckpointError

# GGUF architectures noria loads: the llama.cpp name, and the tensors' naming scheme below.
# Mistral models are converted by llama.cpp under "llama" (transformers reads them as Mistral
# when the file's name says so).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
_GEMMA = ("gemma2", "gemma3")
# Tensors that are no weight of the model: rope_freqs holds Llama 3's rope factors, which the
# folder view turns into its config's rope scaling, or refuses (protocol/gguf_config.py).
IGNORED = ("rope_freqs.weight",)
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
# The norm around the MLP: Llama's after attention; Gemma's three (post-attention, pre- and post-MLP).
_NORMS = {"ffn_norm": "post_attention_layernorm"}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(CheckpointError):
    """A GGUF file noria cannot load; the message is one sentence naming the file and what is wrong."""


def open_gguf(path: str | Path) -> Any:
    """The gguf package's reader over the memory-mapped file; GGUFError where the file is not a
    whole GGUF file (bad magic or version, a header cut short, a tensor past the end)."""
    from gguf import GGUFReader

    class _Checked(GGUFReader):  # type: ignore[misc]
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            _check_extents(path, len(self.data), start_offs, fields)
            super()._build_tensors(start_offs, fields)

    try:
        return _Checked(str(path))
    except GGUFError:
        raise
    except (OSError, ValueError, IndexError, KeyError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file ({e or type(e).__name__}); is it truncated?") from None


def _check_extents(path: str | Path, size: int, start: int, fields: list[Any]) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        try:
            kind = GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has GGML type id {int(raw_type[0])}, which the gguf package "
                            "does not know") from None
        block, type_size = GGML_QUANT_SIZES[kind]
        if len(dims) and int(dims[0]) % block:
            # Each row is whole blocks; the reader would cut rows (their scales) at the wrong bytes.
            raise GGUFError(f"{path}: tensor {name} has rows of {int(dims[0])} values, not a multiple of "
                            f"{kind.name}'s block of {block}")
        n = int(np.prod(dims.astype(np.int64)))
        end = start + int(offset[0]) + n * type_size // block
        if end > size:
            raise GGUFError(f"{path} is truncated: tensor {name} ends at byte {end} but the file has {size}")


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value as Python (the reader's parts, read as gguf 0.10 has them)."""
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None or not f.data or f.types[0] == GGUFValueType.ARRAY:
        return default
    part = f.parts[f.data[0]]
    return bytes(part).decode("utf-8") if f.types[0] == GGUFValueType.STRING else part.tolist()[0]


def architecture(reader: Any, path: str | Path) -> str:
    """The file's llama.cpp architecture, GGUFError where noria does not load it from GGUF."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path} holds a model of GGUF architecture {arch!r}, which noria does not load "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    return str(arch)


def hf_name(name: str, arch: str) -> str | None:
    """The transformers name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"),
    None for one noria has no place for."""
    top, _, suffix = name.rpartition(".")
    if top in _TOP:
        return f"{_TOP[top]}.{suffix}"
    m = _BLK.fullmatch(name)
    if m is None:
        return None
    layer, part, suffix = m.groups()
    norms = _GEMMA_NORMS if arch in _GEMMA else _NORMS
    hf = _BLOCK.get(part) or norms.get(part)
    return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"


def permuted_rows(name: str, arch: str) -> bool:
    """llama.cpp permutes the rows of Llama's q and k (rotary halves interleaved for its rope);
    transformers' loader undoes it for the llama architecture, and so does the worker."""
    return arch == "llama" and (".attn_q." in name or ".attn_k." in name)


def norm_minus_one(name: str, arch: str) -> bool:
    """llama.cpp stores Gemma's (1 + w) norm weights with the 1 added; transformers' loader
    subtracts it (and the model adds it back), and so does the worker."""
    return arch in _GEMMA and "norm.weight" in name


def shape(tensor: Any) -> tuple[int, ...]:
    """A tensor's shape as transformers has it (GGUF lists dimensions fastest first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))
