"""An EAGLE-3 head's checkpoint (`--speculative-config '{"method": "eagle3", "model": ...}'`),
read torch-free: the frontend checks it before anything starts, the worker builds the head
from it (worker/eagle3.py).

The layout is the one SpecForge and the EAGLE authors publish: a config.json whose one decoder
layer is a Llama layer (`num_hidden_layers` 1, `draft_vocab_size` for its own lm_head), and
weights `fc` (the target's three hidden states, concatenated, to the head's width),
`midlayer.*` (that layer; `layers.0.*` in some exports; its q/k/v read twice the width: the
normed token embedding beside the normed hidden state, and a `hidden_norm` for the latter),
`norm`, `lm_head` (the draft vocabulary's rows), `d2t` (each draft token's offset to its
target id) and optionally `embed_tokens` (else the target's table). The target's hidden states
are the residual stream entering three of its layers: config.json's
`eagle_config.eagle_aux_hidden_state_layer_ids`, else (2, L // 2, L - 3) of its L layers,
as vLLM and the EAGLE authors take them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.protocol.model_spec import ModelSpec, model_spec, read_config

PREFIXES = ("midlayer.", "layers.0.")  # the layer's names in the published exports


@dataclass(frozen=True)
class Eagle3Spec:
    layer: ModelSpec  # the head's layer (and norms, rope) as a one-layer Llama's
    target_hidden: int  # the width of each target hidden state `fc` reads
    draft_vocab: int  # lm_head's rows; d2t maps them to the target's ids
    aux_layers: tuple[int, ...]  # the target layers whose entering residual stream it reads


def read_eagle3(folder: str | Path, target: ModelSpec, weights: bool = False) -> Eagle3Spec:
    """The head in `folder`, checked against the target it drafts for (`weights`: and that its
    weights are there); ValueError says in one sentence what does not fit (FileNotFoundError
    without a config.json)."""
    raw = read_config(folder)
    what = f"--speculative-config EAGLE-3 head {folder}"
    if weights and not weight_files(folder):
        raise ValueError(f"{what} holds no weights (*.safetensors or pytorch_model.bin)")
    if raw.get("speculators_model_type") or raw.get("transformer_layer_config"):
        raise ValueError(f"{what} is in the speculators library's format; noria reads heads as SpecForge "
                         "and the EAGLE authors save them")
    archs = [a for a in raw.get("architectures") or () if isinstance(a, str)]
    if archs and not any(a.startswith("LlamaForCausalLM") for a in archs):
        raise ValueError(f"{what} is a {archs[0]}; noria reads Llama-layer heads (LlamaForCausalLMEagle3)")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{what} has {raw['num_hidden_layers']} layers; noria runs one-layer heads")
    layer = model_spec(_as_llama(raw))
    vocab = layer.vocab_size
    if vocab != target.vocab_size:
        raise ValueError(f"{what} has {vocab} tokens, the target {target.vocab_size}: a head needs the "
                         "target's tokenizer")
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ValueError(f"{what} has draft_vocab_size {draft_vocab}, outside 1..{vocab}")
    target_hidden = int(raw.get("target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(f"{what} reads hidden states of width {target_hidden}, the target's are "
                         f"{target.hidden_size}: it was trained for another model")
    eagle = raw.get("eagle_config") or {}
    n = target.num_layers
    aux = tuple(int(i) for i in eagle.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3))
    if len(aux) != 3 or not all(0 <= i < n for i in aux):
        raise ValueError(f"{what} reads the target's layers {list(aux)}: three of its {n} layers are needed "
                         "(eagle_config.eagle_aux_hidden_state_layer_ids)")
    return Eagle3Spec(layer, target_hidden, draft_vocab, tuple(sorted(aux)))


def weight_files(folder: str | Path) -> list[Path]:
    """The head's weight files: its safetensors, else the EAGLE authors' pytorch_model.bin."""
    folder = Path(folder)
    return sorted(folder.glob("*.safetensors")) or [p for p in [folder / "pytorch_model.bin"] if p.is_file()]


def _as_llama(raw: dict[str, Any]) -> dict[str, Any]:
    cfg = {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1}
    cfg.pop("quantization_config", None)
    return cfg
