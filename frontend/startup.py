"""Brings up an engine (processes + tokenizer) behind a FrontendCore."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from noria.frontend.core import FrontendCore
from noria.frontend.demo_model import resolve_model
from noria.frontend.engine_client import EngineClient
from noria.frontend.processor import InputProcessor, eos_token_ids, load_tokenizer
from noria.protocol.config import EngineConfig, config_error
from noria.protocol.model_shapes import check_tensor_parallel

log = logging.getLogger("noria")


def make_config(model: str = "demo", **flags: Any) -> EngineConfig:
    """An EngineConfig from CLI-style snake_case flags; unknown flags are an error."""
    known = set(EngineConfig.__struct_fields__)
    unknown = sorted(set(flags) - known)
    if unknown:
        raise TypeError(f"unknown engine flag(s): {', '.join(unknown)}")
    config = EngineConfig(model=model, **{k: v for k, v in flags.items() if v is not None})
    problem = config_error(config)
    if problem:
        raise ValueError(problem)
    return config


def start_core(config: EngineConfig) -> FrontendCore:
    model_path = resolve_model(config.model)
    check_tensor_parallel(model_path, config.tensor_parallel_size)  # before any process starts
    config = msgspec.structs.replace(config, model=model_path)
    tokenizer = load_tokenizer(config.tokenizer or model_path)
    engine = EngineClient(config)
    ready = engine.ready
    log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d", ready.num_kv_blocks, ready.block_size, ready.max_model_len)
    processor = InputProcessor(tokenizer, eos_token_ids(model_path, tokenizer), ready.vocab_size, ready.max_model_len)
    return FrontendCore(engine, processor)
