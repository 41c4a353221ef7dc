"""Wrong checkpoints fail at start-up with one sentence, before any engine process starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from noria.protocol.checkpoint import CheckpointError


def _broken(demo_path: Path, tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / kind
    shutil.copytree(demo_path, folder)
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if kind == "no_tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (folder / f).unlink()
    elif kind == "architecture":
        cfg["architectures"], cfg["model_type"] = ["GPTBigCodeForCausalLM"], "gpt_bigcode"
    elif kind == "truncated":
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif kind == "shape":
        cfg["intermediate_size"] = cfg["intermediate_size"] // 2
    elif kind == "missing_tensor":  # the config has one layer more than the weights
        cfg["num_hidden_layers"] += 1
    elif kind == "no_weights":
        (folder / "model.safetensors").rename(folder / "model.bin")
    elif kind == "missing_shard":
        index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg_file.write_text(json.dumps(cfg))
    return folder


EXPECTED = {"no_tokenizer": "has no tokenizer", "architecture": "does not implement", "truncated": "is truncated",
            "shape": "do not belong to this config", "missing_tensor": "lacks 9 weight tensor(s)",
            "no_weights": "has no *.safetensors weights", "missing_shard": "that are not in the folder"}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_llm_refuses_a_wrong_checkpoint_in_one_sentence(demo_path, tmp_path, kind):
    from noria import LLM

    with pytest.raises(CheckpointError) as e:
        LLM(str(_broken(demo_path, tmp_path, kind)))
    message = str(e.value)
    assert EXPECTED[kind] in message and "\n" not in message
    assert e.value.__suppress_context__ or e.value.__context__ is None  # no chained traceback


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_prints_one_line_and_no_traceback(demo_path, tmp_path, command):
    folder = _broken(demo_path, tmp_path, "truncated" if command == "generate" else "shape")
    argv = [sys.executable, "-m", "noria.frontend.cli", command]
    argv += ["hi", "--model", str(folder)] if command == "generate" else ["--model", str(folder), "--zmq-port", "0"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("noria: error: "), r.stderr


def test_an_engine_that_cannot_start_is_one_final_line_and_exit_1(demo_path):
    """The worker fails after the pre-checks (here: --device cuda where torch has no CUDA):
    the log says why without a traceback, and the command ends with the reason, not a traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA, so --device cuda starts")
    argv = [sys.executable, "-m", "noria.frontend.cli", "generate", "hi", "--model", str(demo_path),
            "--device", "cuda", "--max-tokens", "2"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("noria: error: start-up failed") and "no CUDA device" in last, r.stderr


def test_the_demo_checkpoint_passes(demo_path):
    from noria.protocol.checkpoint import check_checkpoint

    check_checkpoint(demo_path)
