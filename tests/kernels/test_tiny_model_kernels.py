"""End to end: a tiny Llama-shaped model generates greedily with its attention running
through the emulated kernels (paged cache, chunked prefill, a prefix-cache hit, mixed
prefill/decode steps) and must produce the tokens of dense torch attention."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tiny_llama import PagedEngine, Sequence, TinyConfig, TinyLlama, reference_generate

from noria.kernels import instances
from noria.kernels.instances import AttentionConfig, ModuleSpec

CFG = TinyConfig()
STEPS = 6
CHUNK = 12  # prefill tokens per sequence per step: long prompts take several steps


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    attn = AttentionConfig("float32", CFG.head_dim, CFG.block_size)
    return [
        instances.reshape_module("float32"),
        instances.decode_module(attn),
        instances.prefill_module(attn),
    ]


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    a = [rng.randrange(CFG.vocab) for _ in range(29)]
    b = a[:20] + [rng.randrange(CFG.vocab) for _ in range(4)]  # shares a's first block
    c = [rng.randrange(CFG.vocab) for _ in range(3)]
    return [a, b, c]


@pytest.mark.parametrize("schedule", ["forward", "greedy-reverse"])
def test_greedy_tokens_match_dense_attention(emu: Any, schedule: str) -> None:
    model = TinyLlama(CFG, seed=1)
    a_prompt, b_prompt, c_prompt = prompts()
    engine = PagedEngine(model, emu(schedule))
    a, c = engine.add(a_prompt), engine.add(c_prompt)
    running: list[Sequence] = [a, c]
    generated: dict[int, list[int]] = {id(a): [], id(c): []}
    b: Sequence | None = None
    while running:
        if b is None and a.computed >= CFG.block_size:  # b arrives once a's prefix is cached
            b = engine.add(b_prompt, share_prefix_with=a)
            assert b.computed == CFG.block_size and b.blocks == a.blocks[:1]
            running.append(b)
            generated[id(b)] = []
        batch = [(s, min(CHUNK, len(s.tokens) - s.computed)) for s in running]
        for i, token in engine.step(batch).items():
            seq = batch[i][0]
            seq.tokens.append(token)
            generated[id(seq)].append(token)
        running = [s for s in running if len(generated[id(s)]) < STEPS]

    assert b is not None
    for seq, prompt in ((a, a_prompt), (b, b_prompt), (c, c_prompt)):
        assert generated[id(seq)] == reference_generate(model, prompt, STEPS)
    assert engine.steps_by_kernel["decode"] > 0 and engine.steps_by_kernel["prefill"] > 0
