"""Tensor parallelism through the whole engine: `LLM(..., tensor_parallel_size=2)`
starts two worker ranks that meet over gloo at the address the launcher picks;
greedy output must equal one rank's and transformers'."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from noria import LLM, SamplingParams
from tests.test_engine_parity import _hf_greedy, _with_tokenizer
from tests.tiny_models import make_checkpoint


def _generate(ckpt: Path, tp: int, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    with LLM(str(ckpt), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
             block_size=16, tensor_parallel_size=tp) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    # Llama with as many KV heads as query heads (2 per rank); Qwen2 with GQA,
    # 2 KV heads for 4 query heads (1 per rank).
    [("llama", {"num_key_value_heads": 4}), ("qwen2", {})],
    ids=["llama-mha", "qwen2-gqa"],
)
def test_tp2_greedy_matches_tp1_and_transformers(arch: str, overrides: dict[str, Any], tmp_path: Path,
                                                 demo_path: Path) -> None:
    ckpt = _with_tokenizer(make_checkpoint(arch, tmp_path / arch, **overrides), demo_path)
    rng = random.Random(arch)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(1, 90))] for _ in range(10)]
    max_new = [rng.randint(1, 16) for _ in range(10)]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_new]
    tp2 = _generate(ckpt, 2, prompts, params)
    tp1 = _generate(ckpt, 1, prompts, params)
    assert tp2 == tp1
    assert tp1 == [_hf_greedy(str(ckpt), p, m) for p, m in zip(prompts, max_new, strict=True)]


def test_unsplittable_model_is_refused_at_start(tmp_path: Path, demo_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _with_tokenizer(make_checkpoint("llama", tmp_path / "llama"), demo_path)

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started before the model was checked: {args[:1]}")

    # Refused by the frontend from config.json, before any process is started.
    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        LLM(str(ckpt), tensor_parallel_size=3)
