"""Default sampling parameters from a checkpoint's generation_config.json (--generation-config).

Model makers ship their recommended sampling in generation_config.json (Qwen2.5: temperature
0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). As in vLLM, `auto` (the default) makes
those the values of a request that does not set them; `vllm` and `none` ignore the file and
keep vLLM's defaults (SamplingParams'). `max_new_tokens` is the default `max_tokens` (vLLM reads
it so too): the frontend gives it to a request that leaves `max_tokens` out or nil, cut to the
room its prompt leaves in the model (frontend/processor.py). A request field that is set, even to vLLM's default
value, always wins: the wire tells "unset" from "set" (protocol/client.py, `Generate`), an
OpenAI request's omitted field is unset, and `LLM.generate` / `Client.generate` with no
params leave every field unset (an explicit `SamplingParams` sets them all, as in vLLM).

The file is read here once for both of its uses: the sampling knobs under `auto`, and the EOS
ids whatever the mode (frontend/processor.py, `eos_token_ids`), as vLLM does.
"""

from __future__ import annotations

import json
import os
from typing import Any

from noria.protocol.client import GENERATION_DEFAULT_FIELDS
from noria.protocol.errors import ParamError
from noria.protocol.sampling import SamplingParams, check_sampling

# The generation_config.json keys read, each named as its SamplingParams field, and the one
# that is not: transformers' max_new_tokens is max_tokens.
FIELDS = GENERATION_DEFAULT_FIELDS
MAX_NEW_TOKENS = "max_new_tokens"


class GenerationConfigError(ValueError):
    """generation_config.json holds a default no request could use; one sentence."""


def read_generation_config(model_path: str) -> dict[str, Any]:
    """The checkpoint's generation_config.json ({} without one); GenerationConfigError when it
    cannot be read as a JSON object."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise GenerationConfigError(f"{path} cannot be read as JSON ({e}); --generation-config vllm ignores it") \
            from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path} does not hold a JSON object")
    return raw


def generation_defaults(model_path: str, mode: str = "auto") -> dict[str, Any]:
    """The sampling defaults `mode` puts in effect: the file's values for FIELDS under `auto`
    (where the file exists), none otherwise. Raises GenerationConfigError for an unreadable
    file or a value a request could not carry."""
    if mode != "auto":
        return {}
    path = os.path.join(model_path, "generation_config.json")
    raw = read_generation_config(model_path)
    defaults = {k: raw[k] for k in FIELDS if raw.get(k) is not None}
    if raw.get(MAX_NEW_TOKENS) is not None:
        if isinstance(raw[MAX_NEW_TOKENS], bool):
            raise GenerationConfigError(f"{path}: max_new_tokens must be a positive integer; "
                                        "--generation-config vllm ignores the file")
        defaults["max_tokens"] = raw[MAX_NEW_TOKENS]
    try:
        check_sampling(SamplingParams(**defaults))
    except (ParamError, TypeError) as e:
        raise GenerationConfigError(f"{path}: {e}; --generation-config vllm ignores the file") from None
    return defaults


def describe(defaults: dict[str, Any], mode: str) -> str:
    """The start-up line naming the sampling defaults in effect and where they come from."""
    base = SamplingParams()
    values = ", ".join(f"{k}={defaults.get(k, getattr(base, k))}" for k in FIELDS)
    if "max_tokens" in defaults:
        values += f", max_tokens={defaults['max_tokens']} (when a request leaves it out or nil)"
    if defaults:
        source = (f"{', '.join(defaults)} from the checkpoint's generation_config.json "
                  "(--generation-config vllm: vLLM's defaults)")
    elif mode == "auto":
        source = "vLLM's defaults: the checkpoint's generation_config.json sets none of them"
    else:
        source = f"vLLM's defaults (--generation-config {mode})"
    return f"sampling defaults for requests that do not set them: {values}; {source}"
