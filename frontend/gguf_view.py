"""A GGUF file as a checkpoint folder: `--model file.gguf` is turned, once, into a cached folder
"view" of the file, so the spec, the checkpoint pre-check, the scheduler and the frontend read it
as they read any checkpoint folder, and only the worker's loader opens the file's tensors.

The view holds what transformers itself derives from the file's metadata (config.json through
`AutoConfig.from_pretrained(..., gguf_file=)`, the tokenizer and its chat template through
`AutoTokenizer.from_pretrained(..., gguf_file=)`, saved), with what llama.cpp reads there and
transformers does not (rope scaling, Gemma's soft-caps and attention scale: protocol/gguf_config.py), plus a `quantization_config` naming the
file and each linear module's GGUF tensor and type (protocol/gguf_quant.py reads it), and a
generation_config.json with the file's end-of-generation ids. No weight is copied.

transformers' GGUF reading imports torch, which the `noria serve` frontend keeps out of its
process (frontend/no_torch.py): where torch is not already imported the view is derived in a
child Python process, so no process gains torch for it. The view is keyed by the file's path,
size and modification time, built beside its final place and renamed, like the demo model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from noria.protocol import gguf_file
from noria.protocol.gguf_config import metadata_config
from noria.protocol.switches import cache_dir

VIEW_VERSION = 2  # 2: the metadata transformers does not read (protocol/gguf_config.py)
_LINEAR = ("_proj", "lm_head")


def gguf_view(model: str | os.PathLike[str]) -> Path:
    """The folder view of a GGUF file, built on first use; GGUFError (a CheckpointError) names what
    keeps the file from loading."""
    file = Path(model).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {str(model)!r} does not exist")
    st = file.stat()
    key = hashlib.sha256(f"{VIEW_VERSION}|{file}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    view = cache_dir() / "gguf" / f"{file.stem}-{key}"
    if (view / "complete").exists():
        return view
    reader = gguf_file.open_gguf(file)
    arch = gguf_file.architecture(reader, file)
    view.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gguf-view-", dir=view.parent))
    try:
        _derive(file, tmp)
        config = metadata_config(reader, arch, json.loads((tmp / "config.json").read_text()), file)
        config["quantization_config"] = {"quant_method": "gguf", "gguf_file": str(file),
                                         "tensor_types": linear_types(reader, arch)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(_generation_ids(reader), indent=2))
        (tmp / "complete").write_text("ok\n")
        try:
            os.rename(tmp, view)
        except OSError:
            if not (view / "complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return view


def linear_types(reader: Any, arch: str) -> dict[str, list[str]]:
    """Each linear module's GGUF tensor and type, by transformers' module name."""
    out = {}
    for t in reader.tensors:
        name = gguf_file.hf_name(t.name, arch)
        if name is not None and name.endswith(".weight") and name.removesuffix(".weight").endswith(_LINEAR):
            out[name.removesuffix(".weight")] = [t.name, t.tensor_type.name]
    return out


def _generation_ids(reader: Any) -> dict[str, Any]:
    """bos and the end-of-generation ids llama.cpp stops on (eos, and end-of-turn where the file names one)."""
    eos = [gguf_file.field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    out: dict[str, Any] = {"eos_token_id": sorted({int(e) for e in eos if e is not None})}
    bos = gguf_file.field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    return out


def _derive(file: Path, out: Path) -> None:
    """config.json and the tokenizer files, by transformers, here where torch already is, else in a child."""
    if sys.modules.get("torch") is not None:
        derive(file, out)
        return
    proc = subprocess.run([sys.executable, "-m", "noria.frontend.gguf_view", str(file), str(out)],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise gguf_file.GGUFError(f"cannot read the model description of {file}: "
                                  f"{lines[-1] if lines else 'exit status ' + str(proc.returncode)}")


def derive(file: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:  # transformers raises many kinds; the user needs the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise gguf_file.GGUFError(f"transformers cannot read the model description of {file}: {first}") from None
    cfg = config.to_dict()
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    tokenizer.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


if __name__ == "__main__":
    derive(Path(sys.argv[1]), Path(sys.argv[2]))
