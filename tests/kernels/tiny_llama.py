"""A tiny Llama-shaped decoder (embeddings, RMSNorm, GQA attention without RoPE, SwiGLU MLP,
logits) with two attention paths: plain causal attention over the whole sequence (the
reference), and a paged KV cache driven the way noria's worker drives the kernels."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from noria.kernels import ops
from noria.kernels.backends import KernelBackend

# attend(layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 96
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 128
    block_size: int = 16
    num_blocks: int = 24

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


class TinyLlama:
    def __init__(self, cfg: TinyConfig, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        h, kvd = cfg.hidden, cfg.kv_heads * cfg.head_dim

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

        self.cfg = cfg
        self.embed = torch.randn(cfg.vocab, h, generator=g)
        self.layers = [
            {"qkv": w(h + 2 * kvd, h), "o": w(h, h), "up": w(2 * cfg.ffn, h), "down": w(h, cfg.ffn)}
            for _ in range(cfg.layers)
        ]
        self.lm_head = w(cfg.vocab, h)
        self.scale = cfg.head_dim**-0.5

    def forward(self, ids: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Logits for flattened tokens, with attention computed by `attend`."""
        cfg = self.cfg
        x = self.embed[ids]
        for i, layer in enumerate(self.layers):
            qkv = F.rms_norm(x, (cfg.hidden,)) @ layer["qkv"].T
            q = qkv[:, : cfg.hidden].view(-1, cfg.heads, cfg.head_dim)
            k = qkv[:, cfg.hidden : cfg.hidden + cfg.kv_heads * cfg.head_dim]
            v = qkv[:, cfg.hidden + cfg.kv_heads * cfg.head_dim :]
            k = k.view(-1, cfg.kv_heads, cfg.head_dim)
            v = v.view(-1, cfg.kv_heads, cfg.head_dim)
            x = x + attend(i, q, k, v).reshape(-1, cfg.hidden) @ layer["o"].T
            gate, up = (F.rms_norm(x, (cfg.hidden,)) @ layer["up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        return F.rms_norm(x, (cfg.hidden,)) @ self.lm_head.T


def reference_generate(model: TinyLlama, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding that recomputes the whole sequence with dense causal attention."""
    tokens = list(prompt)
    group = model.cfg.heads // model.cfg.kv_heads

    def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=model.scale,
        )
        return out.transpose(0, 1)

    for _ in range(steps):
        logits = model.forward(torch.tensor(tokens), attend)
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :]


@dataclass
class Sequence:
    tokens: list[int]
    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the cache


class PagedEngine:
    """Continuous batching in miniature: each step feeds every sequence a chunk of its
    uncomputed tokens, writes their K/V with reshape_and_cache and attends through the
    block tables (decode kernel when every sequence brings one token, prefill otherwise)."""

    def __init__(self, model: TinyLlama, backend: KernelBackend, seed: int = 0) -> None:
        cfg = model.cfg
        self.model, self.backend = model, backend
        shape = (cfg.num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.full(shape, float("nan")) for _ in range(cfg.layers)]
        self.v = [torch.full(shape, float("nan")) for _ in range(cfg.layers)]
        self.free = list(range(cfg.num_blocks))
        random.Random(seed).shuffle(self.free)  # scattered physical blocks
        self.steps_by_kernel = {"decode": 0, "prefill": 0}

    def add(self, prompt: list[int], share_prefix_with: Sequence | None = None) -> Sequence:
        seq = Sequence(list(prompt), len(prompt))
        if share_prefix_with is not None:  # a prefix-cache hit: reuse full, computed blocks
            bs = self.model.cfg.block_size
            same = 0
            while same < min(len(prompt) - 1, share_prefix_with.computed) and (
                prompt[same] == share_prefix_with.tokens[same]
            ):
                same += 1
            full = same // bs
            seq.blocks = share_prefix_with.blocks[:full]
            seq.computed = full * bs
        return seq

    def step(self, batch: list[tuple[Sequence, int]]) -> dict[int, int]:
        """Run one step; returns {index in batch: greedy token} for sequences whose step
        reached their last token."""
        cfg = self.model.cfg
        ids, slots, qsl, lens = [], [], [0], []
        for seq, n in batch:
            end = seq.computed + n
            while len(seq.blocks) * cfg.block_size < end:
                seq.blocks.append(self.free.pop())
            for pos in range(seq.computed, end):
                ids.append(seq.tokens[pos])
                slots.append(
                    seq.blocks[pos // cfg.block_size] * cfg.block_size + pos % cfg.block_size
                )
            qsl.append(qsl[-1] + n)
            lens.append(end)
        width = max(len(seq.blocks) for seq, _ in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.int32)
        for i, (seq, _) in enumerate(batch):
            tables[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        query_start_loc = torch.tensor(qsl, dtype=torch.int32)
        max_q = max(n for _, n in batch)
        self.steps_by_kernel["decode" if max_q == 1 else "prefill"] += 1

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ops.reshape_and_cache(
                k, v, self.k[layer], self.v[layer], slot_mapping, backend=self.backend
            )
            out = torch.full(q.shape, float("nan"))
            ops.paged_attention(
                out,
                q,
                self.k[layer],
                self.v[layer],
                tables,
                seq_lens,
                query_start_loc,
                self.model.scale,
                max_query_len=max_q,
                max_seq_len=max(lens),
                backend=self.backend,
            )
            return out

        logits = self.model.forward(torch.tensor(ids), attend)
        picked = {}
        for i, (seq, n) in enumerate(batch):
            seq.computed += n
            if seq.computed == len(seq.tokens):
                picked[i] = int(logits[qsl[i + 1] - 1].argmax())
        return picked
