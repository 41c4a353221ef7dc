"""Greedy parity with transformers through the whole engine (real processes).

Each architecture is a tiny random checkpoint saved with save_pretrained and
loaded back through noria's loader; HF `generate` runs one prompt at a time.
noria runs all prompts together with a small sequence cap and token budget,
so requests board while others are mid-decode and prompts are chunked.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from noria import LLM, SamplingParams
from tests.tiny_models import make_checkpoint

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _with_tokenizer(ckpt, demo_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_path / name).exists():
            shutil.copy(demo_path / name, ckpt / name)
    return ckpt


def _hf_greedy(path, prompt: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _hf_greedy.cache.get(path)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _hf_greedy.cache[path] = model
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


_hf_greedy.cache = {}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tmp_path, demo_path):
    ckpt = _with_tokenizer(make_checkpoint(arch, tmp_path / arch), demo_path)
    rng = random.Random(arch)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(1, 90))] for _ in range(16)]
    max_new = [rng.randint(1, 24) for _ in range(16)]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_new]
    with LLM(str(ckpt), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for p, m, out in zip(prompts, max_new, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(str(ckpt), p, m), f"prompt of {len(p)} tokens"
