"""The frontend's argument groups and what reads them back: the engine's flags, the worker link,
the request, connection and HTTP limits, the bridge's output; frontend/cli.py puts them on its
subcommands, and bench/ reuses the engine's.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any

from noria.protocol.config import (
    RESTART_WINDOW,
    AttentionBackendChoice,
    BlockSize,
    Device,
    Dtype,
    EngineConfig,
    GenerationConfigMode,
    KvCacheDtype,
    LoadFormat,
    PoolingType,
    PreemptionMode,
    QuantizationChoice,
    ReasoningParserName,
    Runner,
    SchedulingPolicy,
    ToolCallParserName,
    WorkerLinkConfig,
)


def _choices(literal: Any) -> list[Any]:
    return list(typing.get_args(literal))


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("engine")
    g.add_argument("--model", default="demo", help="local HF checkpoint folder, or 'demo' (default)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--block-size", type=int, choices=_choices(BlockSize), default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="override the computed number of KV blocks")
    g.add_argument("--kv-cache-memory", type=float, default=None, help="GiB for the device KV cache")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the GPU's memory the worker may use; the KV cache takes what weights and a "
                        "profiling pass leave of it (default 0.9; --kv-cache-memory overrides)")
    g.add_argument("--attention-backend", choices=_choices(AttentionBackendChoice), default=None,
                   help="auto (default): the CUDA kernels where usable, else torch with one line saying why; "
                        "kernels: refuse to start without them; torch: never the kernels")
    g.add_argument("--swap-space", type=float, default=None, help="GiB of CPU memory for swapped KV blocks")
    g.add_argument("--preemption-mode", choices=_choices(PreemptionMode), default=None)
    g.add_argument("--scheduling-policy", choices=_choices(SchedulingPolicy), default=None,
                   help="fcfs (default): arrival order, and a request with a non-zero `priority` is refused; "
                        "priority: lower `priority` first, then arrival")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan the next step while the worker runs this one")
    g.add_argument("--tensor-parallel-size", type=int, default=None)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="engines (a scheduler with its workers each) behind this server's one frontend, which "
                        "sends each request to the engine that holds the longest prefix of its prompt unless that "
                        "one is much busier (default 1); an engine that dies has its requests sent to the others")
    g.add_argument("--data-parallel-rank", type=int, default=None,
                   help="serve as this one rank of --data-parallel-size engines balanced from outside (a router "
                        "addresses each rank); its KV-event ports are offset by the rank, as vLLM's")
    g.add_argument("--dtype", choices=_choices(Dtype), default=None,
                   help="auto (default): the checkpoint's on a GPU; on a CPU a bfloat16 checkpoint's where the CPU "
                        "computes bf16 natively, else float32 unless that would not fit in memory (the worker "
                        "logs the choice and why)")
    g.add_argument("--quantization", "-q", choices=_choices(QuantizationChoice), default=None,
                   help="quantize a float checkpoint's linear weights at load (fp8: per-channel scales); "
                        "a quantized checkpoint's own quantization_config needs no flag")
    g.add_argument("--kv-cache-dtype", choices=_choices(KvCacheDtype), default=None,
                   help="auto (default): the model's dtype; fp8 / fp8_e4m3: one byte per cached value with a "
                        "per-layer scale (the checkpoint's k_scale / v_scale where it has them, else 1.0)")
    g.add_argument("--load-format", choices=_choices(LoadFormat), default=None,
                   help="auto (default): the checkpoint's weights; dummy: seeded random weights from config.json "
                        "alone, made on the device (benchmarks; no *.safetensors read or needed)")
    g.add_argument("--device", choices=_choices(Device), default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never capture or replay CUDA graphs: every decode step runs eagerly")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes to capture as CUDA graphs (default: 1 2 4 8 and every multiple of 8 "
                        "up to --max-num-seqs); a batch runs in the graph of the next size up, padded")
    g.add_argument("--runner", choices=_choices(Runner), default=None,
                   help="generate (default): text generation; pooling: one embedding per input (/v1/embeddings), "
                        "or for a sequence-classification model scores (/v1/score, /v1/rerank, /classify)")
    g.add_argument("--pooling", choices=_choices(PoolingType), default=None,
                   help="how --runner pooling pools the final hidden states (default: the checkpoint's "
                        "sentence-transformers modules.json, else last)")
    g.add_argument("--hf-overrides", type=_overrides, default=None, metavar="JSON",
                   help="config.json keys on top of the checkpoint's (vLLM's flag), for a pooling engine that "
                        "classifies: e.g. '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                        "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    g.add_argument("--kv-events-config", type=_kv_events, default=None, metavar="JSON",
                   help="publish prefix-cache changes (BlockStored, BlockRemoved, AllBlocksCleared) for KV-aware "
                        "routers as vLLM does, with vLLM's keys: enable_kv_cache_events (false), publisher "
                        "(zmq when enabled, or null), endpoint (tcp://*:5557), replay_endpoint (none), buffer_steps "
                        "(10000), hwm (100000), max_queue_size (100000), topic (\"\"); e.g. "
                        "'{\"enable_kv_cache_events\": true, \"replay_endpoint\": \"tcp://*:5558\"}'")
    g.add_argument("--kv-transfer-config", type=_kv_transfer, default=None, metavar="JSON",
                   help="prefill/decode disaggregation with vLLM's keys: kv_connector (\"NoriaConnector\"), kv_role "
                        "(kv_producer: computes prompts and keeps their blocks for a decode engine; kv_consumer: pulls "
                        "them; kv_both), kv_ip and kv_port (the producer's side channel, 127.0.0.1:14579), "
                        "kv_load_failure_policy (recompute, or fail), kv_connector_extra_config "
                        "({\"abort_request_timeout\": 480, \"transfer_timeout\": 30, \"producers\": [hosts a consumer "
                        "pulls from; default any]}); e.g. "
                        "'{\"kv_connector\": \"NoriaConnector\", \"kv_role\": \"kv_producer\"}'")
    g.add_argument("--speculative-config", type=_speculative, default=None, metavar="JSON",
                   help="speculative decoding with vLLM's keys: method (ngram: prompt lookup; suffix: suffix trees "
                        "over the prompt and the tenant's answers, suffix_decoding_max_tree_depth, "
                        "_max_cached_requests, _max_spec_factor, _min_token_prob; draft_model: a "
                        "smaller checkpoint with the same tokenizer, named by model, its context capped by "
                        "max_model_len; eagle3: an EAGLE-3 head's folder, named by model; mtp: the served MiMo "
                        "checkpoint's own MTP layer), num_speculative_tokens "
                        "(tokens proposed per step), prompt_lookup_min and prompt_lookup_max (the n-gram sizes looked "
                        "up, default 5), disable_by_batch_size (no speculation with more requests running); e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")
    c = ap.add_argument_group("chat")
    c.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="allow tool_choice \"auto\": the model decides whether to call a tool (needs --tool-call-parser)")
    c.add_argument("--tool-call-parser", choices=_choices(ToolCallParserName), default=None,
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>), llama3_json "
                        "({\"name\": ..., \"parameters\": ...}), mistral ([TOOL_CALLS][...] or [TOOL_CALLS]name[ARGS]{...}), "
                        "pythonic ([f(a=1), g(b=\"x\")])")
    c.add_argument("--reasoning-parser", choices=_choices(ReasoningParserName), default=None,
                   help="move the model's <think>...</think> text into reasoning_content")
    c.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the chat template to use instead of the tokenizer's: a file, or the Jinja template itself")
    c.add_argument("--generation-config", choices=_choices(GenerationConfigMode), default=None,
                   help="auto (default): the checkpoint's generation_config.json gives temperature, top_p, top_k, "
                        "min_p, repetition_penalty and (max_new_tokens) max_tokens to requests that do not set them; "
                        "vllm, none: vLLM's defaults")
    c.add_argument("--trust-request-chat-template", action="store_true", default=None,
                   help="let requests bring their own chat_template (Jinja code, rendered sandboxed under a 2 s "
                        "deadline and --max-chat-template-chars; without this flag such a request is refused)")


def _overrides(text: str) -> dict[str, Any]:
    from noria.protocol.score import parse_overrides

    try:
        return parse_overrides(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_events(text: str) -> dict[str, Any]:
    from noria.protocol.kv_events import parse_kv_events_config

    try:
        return parse_kv_events_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_transfer(text: str) -> dict[str, Any]:
    from noria.protocol.kv_transfer import parse_kv_transfer_config

    try:
        return parse_kv_transfer_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative(text: str) -> dict[str, Any]:
    from noria.protocol.speculative import parse_speculative_config

    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


DEFAULT_MAX_PER_CONNECTION = 1024


def add_limit_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-requests-per-connection", type=int, default=DEFAULT_MAX_PER_CONNECTION, metavar="N",
                    help="requests in flight per ZMQ connection, and sequences (prompts x n) in flight per HTTP or "
                         "websocket client address; more are refused as `overloaded` (HTTP 429); 0: no cap")


def add_bridge_limit_args(ap: argparse.ArgumentParser) -> None:
    """The HTTP/websocket bridge's own caps (frontend/bridge/limits.py; docs/protocol.md "Limits")."""
    from noria.frontend.bridge import limits as d

    g = ap.add_argument_group("HTTP and websocket limits")
    g.add_argument("--stream-buffer", type=int, default=d.DEFAULT_STREAM_BUFFER, metavar="BYTES",
                   help="output a stream (SSE response or websocket) may hold for a client that does not read; past "
                        f"it the stream's requests are aborted and its connection dropped (default {d.DEFAULT_STREAM_BUFFER}"
                        "; 0: no bound)")
    g.add_argument("--http-header-timeout", type=_seconds, default=d.DEFAULT_HEADER_TIMEOUT, metavar="S",
                   help="a connection that has not sent a whole request head this long after connecting or after "
                        f"its previous response is closed (default {d.DEFAULT_HEADER_TIMEOUT:g}; 0: never)")
    g.add_argument("--http-body-timeout", type=_seconds, default=d.DEFAULT_BODY_TIMEOUT, metavar="S",
                   help=f"a request body not all there this long after its head is answered 408 "
                        f"(default {d.DEFAULT_BODY_TIMEOUT:g}; 0: never)")
    g.add_argument("--max-connections", type=int, default=d.DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open HTTP and websocket connections; one more is answered 503 and closed "
                        f"(default {d.DEFAULT_MAX_CONNECTIONS}; 0: no cap)")


_BRIDGE_LIMIT_FLAGS = ("stream_buffer", "http_header_timeout", "http_body_timeout", "max_connections")


def bridge_limit_argv(args: argparse.Namespace) -> list[str]:
    """`noria serve`'s bridge flags, for its bridge child's command line."""
    return [a for f in _BRIDGE_LIMIT_FLAGS for a in ("--" + f.replace("_", "-"), str(getattr(args, f)))]


def bridge_limits(args: argparse.Namespace) -> Any:
    from noria.frontend.bridge.limits import BridgeLimits

    return BridgeLimits(per_client=args.max_requests_per_connection or 0, stream_buffer=args.stream_buffer,
                        header_timeout=args.http_header_timeout, body_timeout=args.http_body_timeout,
                        max_connections=args.max_connections)


def add_bridge_output_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--return-tokens-as-token-ids", action="store_true",
                    help="spell logprob tokens \"token_id:ID\" instead of their text unless a request says otherwise "
                         "(vLLM's flag; a request's return_tokens_as_token_ids wins)")


def add_input_limit_args(ap: argparse.ArgumentParser) -> None:
    """The frontend's request-size limits (frontend/processor.py InputLimits; docs/protocol.md)."""
    from noria.frontend.processor import InputLimits

    d = InputLimits()
    g = ap.add_argument_group("request size limits (a larger request is refused, naming the field)")
    g.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="characters of a prompt, chat messages counted over every field (default: max_model_len "
                        "times the longest vocabulary entry)")
    g.add_argument("--max-messages", type=int, default=d.max_messages, metavar="N",
                   help=f"chat messages per request (default {d.max_messages})")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, metavar="N",
                   help=f"stop strings per request (default {d.max_stop_strings})")
    g.add_argument("--max-bad-words", type=int, default=d.max_bad_words, metavar="N",
                   help=f"bad_words per request (default {d.max_bad_words})")
    g.add_argument("--max-word-chars", type=int, default=d.max_word_chars, metavar="N",
                   help=f"characters of a request's stop strings together, and of its bad words together "
                        f"(default {d.max_word_chars})")
    g.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, metavar="N",
                   help=f"logit_bias entries per request (default {d.max_logit_bias})")
    g.add_argument("--max-chat-template-chars", type=int, default=d.max_chat_template_chars, metavar="N",
                   help=f"characters of a request's own chat_template (default {d.max_chat_template_chars})")
    g.add_argument("--max-tools", type=int, default=d.max_tools, metavar="N",
                   help=f"OpenAI tools of a chat request (default {d.max_tools})")


def input_limits(args: argparse.Namespace) -> Any:
    from noria.frontend.processor import InputLimits
    from noria.protocol.validation import convert

    names = set(InputLimits.__struct_fields__)
    return convert({k: v for k, v in vars(args).items() if k in names and v is not None}, InputLimits)


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    names = set(EngineConfig.__struct_fields__) - {"model"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def add_worker_link_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("worker link")
    g.add_argument("--worker-listen", default=None, metavar="tcp://HOST:PORT",
                   help="bind the worker link here for `noria worker --connect` (default: a private ipc path)")
    g.add_argument("--num-local-workers", type=int, default=None,
                   help="worker ranks this command starts itself (default: --tensor-parallel-size, 0 with --worker-listen)")
    g.add_argument("--worker-timeout", type=float, default=None, metavar="S",
                   help="a worker silent this long is lost (heartbeats; default 5)")
    g.add_argument("--worker-wait", type=float, default=None, metavar="S",
                   help="without a live worker this long, waiting requests fail with engine_unavailable (default 30)")
    g.add_argument("--max-worker-restarts", type=int, default=None,
                   help=f"restarts of a local worker rank per {RESTART_WINDOW:g} s before giving up (default 5)")
    g.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="encrypt and authenticate the worker link with CURVE keys from `noria keygen DIR`")
    g.add_argument("--insecure", action="store_true",
                   help="allow --worker-listen on a network address without --curve-keys")


def worker_link_config(args: argparse.Namespace) -> WorkerLinkConfig:
    from noria.protocol.security import check_exposure
    from noria.protocol.validation import convert

    names = set(WorkerLinkConfig.__struct_fields__)
    link = convert({k: v for k, v in vars(args).items() if k in names and v is not None}, WorkerLinkConfig)
    if link.worker_listen:
        check_exposure(link.worker_listen, link.curve_keys, link.insecure)
    return link


def add_verbose_arg(ap: argparse.ArgumentParser) -> None:
    """Marks a one-shot command: warnings and its final error line only, unless -v."""
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="show every process's log (time-stamped, from INFO up) instead of warnings only")
    ap.set_defaults(one_shot=True)
