"""EAGLE-3 speculation on the worker (`{"method": "eagle3", "model": HEAD}`): the head
(worker/eagle3_head.py) proposes each drafted request's next tokens from the target's own
hidden states (worker/head_drafter.py says how): the residual stream entering three of its
layers, which the target keeps while it runs (`CausalLM.capture`), fused by the head's `fc`.
"""

from __future__ import annotations

import logging

import torch

from noria.protocol.config import EngineConfig
from noria.protocol.eagle3 import read_eagle3
from noria.worker.attention_select import attention_layers, select_attention_backend
from noria.worker.eagle3_head import Eagle3Head
from noria.worker.head_drafter import HeadDrafter
from noria.worker.kv_cache import KVLayout
from noria.worker.kv_fp8 import apply_scales
from noria.worker.loader import built_on
from noria.worker.models.causal_lm import CausalLM
from noria.worker.models.ops import choose_ops

log = logging.getLogger("noria.worker")


class Eagle3Drafter(HeadDrafter):
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 weight_dtype: torch.dtype | None, kv_dtype: torch.dtype, target: CausalLM) -> None:
        sc = config.speculative_config
        assert sc is not None and sc.model is not None
        self.path = sc.model
        self.spec = spec = read_eagle3(self.path, target.spec)
        with built_on(device, dtype):
            self.head = Eagle3Head(spec, target.embed_tokens)
        self.head.load(self.path)
        self.head.pack(weight_dtype)
        apply_scales([self.head.self_attn], kv_dtype)
        bs = config.block_size
        choice = select_attention_backend(device, attention_layers(self.head), dtype, bs,
                                          choice=config.attention_backend, kv_dtype=kv_dtype)
        self.head.use_ops(choose_ops(spec.layer.activation, device, dtype, choice.backend, bs))
        super().__init__(KVLayout(1, bs, spec.layer.num_kv_heads, spec.layer.head_dim, kv_dtype), choice.backend,
                         device)
        self.target = target
        target.capture = spec.aux_layers
        log.info("EAGLE-3 head %s: reads the target's layers %s, %d draft tokens, %d KV bytes per block beside "
                 "the target's", self.path, list(spec.aux_layers), spec.draft_vocab, self.layout.bytes_per_block)

    def fuse(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.head.fuse(features)
