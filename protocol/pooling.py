"""How a pooling engine (`--runner pooling`) turns a prompt's hidden states into one embedding.

Read from the checkpoint folder without torch, so that the frontend, the scheduler and the
workers agree: `--pooling` when given, else the sentence-transformers files a checkpoint
ships (`modules.json` naming a Pooling module, whose `config.json` says which mode), else
the last token, as vLLM does for decoder checkpoints. The embedding is L2-normalized unless
the checkpoint's `modules.json` lists no Normalize module (sentence-transformers would not
normalize it either).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

Runner = Literal["generate", "pooling"]
PoolingType = Literal["last", "mean", "cls"]

# sentence-transformers' Pooling config keys, in the order they are looked at.
_ST_MODES: tuple[tuple[str, PoolingType], ...] = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
)
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


class PoolingSpec(msgspec.Struct, frozen=True):
    mode: PoolingType
    normalize: bool = True

    @property
    def every_position(self) -> bool:
        """The embedding reads the hidden state of positions before the last (mean, cls): the
        whole prompt must be computed by this request, in order, with no prefix-cache hit."""
        return self.mode != "last"


def pooling_spec(model_path: str | Path, choice: PoolingType | None = None) -> PoolingSpec:
    """The pooling of the checkpoint at `model_path` (`choice`: the --pooling flag, None for the
    checkpoint's own). Raises ValueError for sentence-transformers files it cannot follow."""
    folder = Path(model_path)
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return PoolingSpec(choice or "last")
    normalize = any(isinstance(m, dict) and str(m.get("type", "")).endswith(".Normalize") for m in modules)
    if choice is not None:
        return PoolingSpec(choice, normalize)
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return PoolingSpec("last", normalize)
    where = folder / str(pooling.get("path") or "1_Pooling") / "config.json"
    config = _read_json(where)
    if not isinstance(config, dict):
        return PoolingSpec("last", normalize)
    for key, mode in _ST_MODES:
        if config.get(key):
            return PoolingSpec(mode, normalize)
    asked = [k for k in _ST_UNSUPPORTED if config.get(k)]
    if asked:
        raise ValueError(f"{where} asks for {asked[0].removeprefix('pooling_mode_')} pooling, which noria does not "
                         "do; pass --pooling {last,mean,cls}")
    return PoolingSpec("last", normalize)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def engine_pooling(model_path: str | Path, runner: Runner, choice: PoolingType | None) -> PoolingSpec | None:
    """The pooling an engine runs, None for a generating one."""
    return pooling_spec(model_path, choice) if runner == "pooling" else None
