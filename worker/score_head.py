"""The classifying pooling engine's head (protocol/score.py): [num_labels, hidden] float32 rows
that the pooled last-token hidden state is multiplied by (worker/pooling.py).

Read from the checkpoint files themselves rather than from the loaded model: the lm_head a
reranker's rows come from may be packed for the native GEMM (no plain copy kept) or split
over tensor-parallel ranks, and a classifier's `score.weight` has no place in the decoder.
Each rank reads the whole head (a few rows): rank 0, which pools, uses it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from noria.protocol.config import EngineConfig
from noria.protocol.score import ScoreSpec, engine_score
from noria.worker.loader import checkpoint_files


def engine_head(config: EngineConfig, device: torch.device) -> torch.Tensor | None:
    """The head of the engine `config` describes, None for one that does not classify."""
    spec = engine_score(config.model, config.runner, config.hf_overrides, config.tokenizer, config.pooling)
    return None if spec is None else score_head(config.model, spec, device)


def score_head(path: str | Path, spec: ScoreSpec, device: torch.device) -> torch.Tensor:
    files = checkpoint_files(path)
    if spec.from_checkpoint:
        head = _rows(files, ("score.weight", "model.score.weight"), None)
        if head is None:
            raise ValueError(f"{path} is a {spec.architecture} checkpoint without a score.weight tensor")
        if head.shape[0] != spec.num_labels:
            raise ValueError(f"{path}: score.weight has {head.shape[0]} rows but config.json gives "
                             f"{spec.num_labels} labels")
    else:
        # A tied model's lm_head is its embedding.
        head = _rows(files, ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"),
                     list(spec.token_ids))
        if head is None:
            raise ValueError(f"classifier_from_token: {path} has no float lm_head.weight or embed_tokens.weight "
                             "to take the tokens' rows from")
        if spec.two_way:
            head = head[1:2] - head[0:1]
    return head.to(device=device, dtype=torch.float32).contiguous()


def _rows(files: list[Path], names: tuple[str, ...], rows: list[int] | None) -> torch.Tensor | None:
    """The first of `names` found in `files` (only `rows` of it where given), as float32."""
    for name in names:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                if name not in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    continue
                if rows is None:
                    return f.get_tensor(name).float()
                part = f.get_slice(name)
                return torch.cat([part[i : i + 1] for i in rows]).float()
    return None
