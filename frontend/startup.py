"""Brings up an engine (processes + tokenizer) behind a FrontendCore."""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec

from noria.frontend.chat_output import ChatConfig, reasoning_end_token
from noria.frontend.chat_template import load_chat_template
from noria.frontend.core import FrontendCore, Limits
from noria.frontend.demo_model import resolve_model
from noria.frontend.embeddings import Embedder
from noria.frontend.engine_client import EngineClient
from noria.frontend.engine_group import EngineGroup
from noria.frontend.generation_config import describe as describe_generation_defaults
from noria.frontend.generation_config import generation_defaults
from noria.frontend.processor import InputLimits, InputProcessor, eos_token_ids, load_tokenizer
from noria.protocol.checkpoint import CheckpointError, check_checkpoint, check_mtp_layer
from noria.protocol.config import EngineConfig, WorkerLinkConfig
from noria.protocol.eagle3 import read_eagle3
from noria.protocol.errors import ParamError
from noria.protocol.model_identity import context_error, model_facts, spec_facts
from noria.protocol.model_shapes import check_tensor_parallel
from noria.protocol.model_spec import ModelSpec
from noria.protocol.pooling import engine_pooling
from noria.protocol.quant_fp8 import online_quant
from noria.protocol.score import engine_score
from noria.protocol.speculative import SpeculativeConfig, parse_speculative_config
from noria.protocol.validation import convert

log = logging.getLogger("noria")


def make_config(model: str | os.PathLike[str] = "demo", **flags: Any) -> EngineConfig:
    """An EngineConfig from CLI-style snake_case flags, checked against its field types;
    an unknown flag is a TypeError, a bad value a ParamError (a ValueError) naming the flag."""
    known = set(EngineConfig.__struct_fields__)
    unknown = sorted(set(flags) - known)
    if unknown:
        raise TypeError(f"unknown engine flag(s): {', '.join(unknown)}")
    if isinstance(flags.get("speculative_config"), dict):  # vLLM's defaults filled in, its odd keys dropped
        flags["speculative_config"] = _speculative(flags["speculative_config"])
    return convert({"model": os.fspath(model), **{k: v for k, v in flags.items() if v is not None}}, EngineConfig)


def _speculative(value: dict[str, Any]) -> dict[str, Any]:
    try:
        return parse_speculative_config(value)
    except ValueError as e:
        raise ParamError("speculative_config", str(e)) from None


def start_core(config: EngineConfig, link: WorkerLinkConfig | None = None, limits: Limits | None = None,
               input_limits: InputLimits | None = None) -> FrontendCore:
    """Start the engine (its worker link as `link` says: local ranks over ipc by default)."""
    chat = chat_config(config)
    model_path = resolve_model(config.model)
    # A bad checkpoint is one sentence here, not a worker's traceback (dummy weights: its config).
    spec = check_checkpoint(model_path, weights=config.load_format != "dummy")
    online_quant(spec, config.quantization)  # --quantization fp8 of a quantized checkpoint: one sentence too
    check_tensor_parallel(model_path, config.tensor_parallel_size)  # before any process starts
    _check_length(spec, config.max_model_len)
    config = _speculation(msgspec.structs.replace(config, model=model_path), spec)
    # Resolved once here (a bad sentence-transformers file fails now, in one sentence), so that
    # the scheduler and every worker pool the same way.
    pooling = engine_pooling(model_path, config.runner, config.pooling)
    if pooling is not None:
        config = msgspec.structs.replace(config, pooling=pooling.mode)
        log.info("pooling runner: %s pooling%s", pooling.mode, ", normalized" if pooling.normalize else "")
    # A classifier checkpoint generates nothing; a pooling one scores with its head (protocol/score.py).
    score = engine_score(model_path, config.runner, config.hf_overrides, config.tokenizer,
                         pooling.mode if pooling is not None else None)
    if score is not None:
        head = f"the lm_head rows of tokens {list(score.token_ids)}" if score.token_ids else "its score head"
        log.info("classifier %s: %s, %d label(s), %s", score.architecture, head, score.num_labels, score.activation)
    tokenizer = _tokenizer(config.tokenizer or model_path)
    if chat.reasoning_parser is not None:
        chat = msgspec.structs.replace(chat, reasoning_end_token_id=reasoning_end_token(tokenizer))
    # Read before the engine starts: a generation_config.json no request could use is one sentence.
    sampling_defaults = generation_defaults(model_path, config.generation_config)
    if config.runner == "generate":
        # A warning where the checkpoint overrides vLLM's defaults, as vLLM warns: outputs change.
        log.log(logging.WARNING if sampling_defaults else logging.INFO, "%s",
                describe_generation_defaults(sampling_defaults, config.generation_config))
    chat_template = load_chat_template(config.chat_template)  # a path that cannot be read fails now
    rank = config.data_parallel_rank
    if rank is not None and rank >= config.data_parallel_size:
        raise ValueError(f"--data-parallel-rank {rank} must be less than --data-parallel-size "
                         f"{config.data_parallel_size}")
    engine: EngineClient | EngineGroup
    if config.data_parallel_size > 1 and config.data_parallel_rank is None:
        engine = EngineGroup(config, config.data_parallel_size, link)
        log.info("data parallel: %d engines behind this frontend", config.data_parallel_size)
    else:
        engine = EngineClient(config, link=link)
    ready = engine.ready
    if ready.num_kv_blocks:
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d", ready.num_kv_blocks, ready.block_size,
                 ready.max_model_len)
    else:  # remote workers only: requests wait until one has registered
        log.info("engine ready, waiting for workers to register; max_model_len %d", ready.max_model_len)
    processor = InputProcessor(tokenizer, eos_token_ids(model_path, tokenizer), ready.vocab_size, ready.max_model_len,
                               input_limits, config.scheduling_policy, chat_template=chat_template,
                               trust_request_chat_template=config.trust_request_chat_template,
                               sampling_defaults=sampling_defaults)
    embedder = Embedder(pooling, spec.hidden_size, score) if pooling is not None else None
    core = FrontendCore(engine, processor, limits, embedder, chat)  # type: ignore[arg-type]
    if isinstance(engine, EngineGroup):
        engine.resubmit = core.resubmit
    core.data_parallel_rank = rank or 0
    return core


def _speculation(config: EngineConfig, target: ModelSpec) -> EngineConfig:
    """A drafter on the worker (a draft model, an EAGLE-3 head, an MTP layer) is checked here, in
    one sentence, and named by its folder from then on."""
    spec = config.speculative_config
    if spec is None:
        return config
    if config.runner != "generate":
        raise ValueError("--speculative-config speeds up generation: a pooling engine (--runner pooling) "
                         "generates nothing")
    if not spec.on_worker:
        return config  # the scheduler says what speculation is on
    transfer = config.kv_transfer_config
    if transfer is not None and transfer.kv_role != "kv_producer":
        raise ValueError(f"--speculative-config {spec.method} cannot draft over KV blocks pulled from another "
                         "instance (they hold no draft KV): drop it, or --kv-transfer-config's consumer role")
    checked = _mtp(config, spec, target) if spec.method == "mtp" else _draft_model(config, spec, target)
    return msgspec.structs.replace(config, speculative_config=checked)


def _mtp(config: EngineConfig, spec: SpeculativeConfig, target: ModelSpec) -> SpeculativeConfig:
    """The target drafts for itself with the first of its MTP layers (vLLM's `mtp`): there must be
    one, in a layout the worker reads, and no other model is named."""
    what = "--speculative-config method 'mtp'"
    if spec.model is not None and resolve_model(spec.model) != config.model:
        raise ValueError(f"{what} drafts with the served model's own MTP layers; drop model ({spec.model})")
    if not target.mtp_layers:
        raise ValueError(f"{what} needs MTP layers in the served checkpoint (config.json's "
                         f"num_nextn_predict_layers); this {target.architecture} has none")
    if target.architecture != "MiMoForCausalLM" or target.quantization is not None:
        raise ValueError(f"{what}: noria reads MiMo's float MTP layers, not those of a "
                         f"{'quantized ' if target.quantization is not None else ''}{target.architecture}")
    if config.load_format == "dummy":
        raise ValueError(f"{what} reads its MTP layer's weights from the checkpoint: drop --load-format dummy")
    check_mtp_layer(config.model, target)
    return msgspec.structs.replace(spec, model=config.model)


def _draft_model(config: EngineConfig, spec: SpeculativeConfig, target: ModelSpec) -> SpeculativeConfig:
    """The draft model's (or EAGLE-3 head's) folder and context (its own `max_model_len` at
    most): a request is not drafted past it."""
    assert spec.model is not None
    folder = resolve_model(spec.model)
    if spec.method == "eagle3":
        head = read_eagle3(folder, target, weights=True)  # (--load-format dummy is the target's alone)
        own = head.layer.context_length
        return msgspec.structs.replace(spec, model=folder, max_model_len=min(spec.max_model_len or own, own))
    draft = check_checkpoint(folder, weights=config.load_format != "dummy")
    if draft.vocab_size > target.vocab_size:
        raise ValueError(f"--speculative-config draft model {spec.model} has {draft.vocab_size} tokens, more "
                         f"than the target's {target.vocab_size}: a draft needs the target's tokenizer")
    if draft.num_experts:
        raise ValueError(f"--speculative-config draft model {spec.model} is a mixture of experts; "
                         "noria drafts with dense models")
    own = model_facts(folder).max_model_len
    length = min(spec.max_model_len or own, own)
    return msgspec.structs.replace(spec, model=folder, max_model_len=length)


def chat_config(config: EngineConfig) -> ChatConfig:
    """The frontend's chat flags; --enable-auto-tool-choice needs a parser to read the calls (vLLM's rule)."""
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return ChatConfig(enable_auto_tool_choice=config.enable_auto_tool_choice,
                      tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser)


def _check_length(spec: ModelSpec, max_model_len: int | None) -> None:
    """The worker's own check, made here too: with remote workers the engine is up before
    any worker has loaded the model, and a length no worker accepts must fail now."""
    if max_model_len is None:
        return
    facts = spec_facts(spec)
    if max_model_len > facts.max_model_len:
        raise ValueError(context_error(max_model_len, facts))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _tokenizer(path: str) -> Any:
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise CheckpointError(f"{path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
                              "pass --tokenizer with a folder that has one")
    try:
        return load_tokenizer(path)
    except Exception as e:  # transformers raises many kinds; the user needs the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load the tokenizer from {path}: {first}") from None
