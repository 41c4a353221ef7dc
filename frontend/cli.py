"""The frontend's `noria` subcommands: serve, generate, bridge, keygen (noria/cli.py adds the rest)."""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from typing import Any

from noria.frontend.api_key import add_api_key_args, resolve_api_key
from noria.protocol import logs
from noria.protocol.config import (
    RESTART_WINDOW,
    AttentionBackendChoice,
    BlockSize,
    Device,
    Dtype,
    EngineConfig,
    GenerationConfigMode,
    PoolingType,
    PreemptionMode,
    ReasoningParserName,
    Runner,
    SchedulingPolicy,
    ToolCallParserName,
    WorkerLinkConfig,
)
from noria.protocol.errors import NoriaError


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
    g.add_argument("--dtype", choices=_choices(Dtype), default=None,
                   help="auto (default): the checkpoint's on a GPU; on a CPU a bfloat16 checkpoint's where the CPU "
                        "computes bf16 natively, else float32 unless that would not fit in memory (the worker "
                        "logs the choice and why)")
    g.add_argument("--device", choices=_choices(Device), default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never capture or replay CUDA graphs: every decode step runs eagerly")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes to capture as CUDA graphs (default: 1 2 4 8 and every multiple of 8 "
                        "up to --max-num-seqs); a batch runs in the graph of the next size up, padded")
    g.add_argument("--runner", choices=_choices(Runner), default=None,
                   help="generate (default): text generation; pooling: one embedding per input (/v1/embeddings)")
    g.add_argument("--pooling", choices=_choices(PoolingType), default=None,
                   help="how --runner pooling pools the final hidden states (default: the checkpoint's "
                        "sentence-transformers modules.json, else last)")
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


DEFAULT_MAX_QUEUED = 4096
DEFAULT_SCHEDULER_RESTARTS = 3


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


def cmd_serve(args: argparse.Namespace) -> int:
    import threading

    from noria.frontend.no_torch import keep_torch_out

    keep_torch_out()  # this process runs no model: before anything imports transformers
    from noria.frontend.bridge.process import BridgeProcess, engine_address
    from noria.frontend.core import Limits
    from noria.frontend.server import FrontendServer
    from noria.frontend.startup import make_config, start_core
    from noria.frontend.supervisor import Supervisor
    from noria.protocol.security import is_loopback

    api_key = resolve_api_key(args)  # before any child starts: none of them may inherit it
    config = make_config(args.model, **engine_flags(args))
    link = worker_link_config(args)  # refuses a clear-text network bind before anything starts
    core = start_core(config, link, Limits(args.max_queued_requests or None, args.max_requests_per_connection or None),
                      input_limits(args))
    address = f"tcp://{args.zmq_host}:{args.zmq_port}"
    if not args.zmq_curve_keys and not is_loopback(address):
        print(f"noria: warning: the ZMQ client API on {address} is open to the network without authentication "
              "or encryption; pass --zmq-curve-keys DIR", file=sys.stderr, flush=True)
    supervisor = Supervisor(core, args.max_scheduler_restarts, link.worker_wait, config.startup_timeout)
    server = FrontendServer(core, address, args.model, curve_keys=args.zmq_curve_keys, supervisor=supervisor,
                            drain_timeout=args.drain_timeout)
    server.install_signal_handlers()
    # The bridge is a separate process and a ZMQ client like any other; if it dies it
    # is restarted (bounded), and if it cannot start (say its port is taken), the whole
    # server goes down non-zero.
    extra = ["--max-requests-per-connection", str(args.max_requests_per_connection), *bridge_limit_argv(args)]
    if args.return_tokens_as_token_ids:
        extra.append("--return-tokens-as-token-ids")
    if server.bridge_keys is not None:
        extra += ["--zmq-curve-keys", server.bridge_keys]
    bridge = BridgeProcess(engine_address(args.zmq_host, args.zmq_port), args.host, args.port, api_key, extra=extra)
    bridge_failed = threading.Event()

    def on_bridge_exit(rc: int) -> None:
        bridge_failed.set()
        server.stop_event.set()

    server.on_drain.append(bridge.hold_restarts)
    bridge.watch(on_bridge_exit)
    print(f"noria: serving {args.model!r} on {address} and http://{args.host}:{args.port}", flush=True)
    try:
        rc = server.serve_forever()
    finally:
        bridge.stop()
        server.close()
        core.engine.close()
    return 1 if bridge_failed.is_set() else rc


def add_verbose_arg(ap: argparse.ArgumentParser) -> None:
    """Marks a one-shot command: warnings and its final error line only, unless -v."""
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="show every process's log (time-stamped, from INFO up) instead of warnings only")
    ap.set_defaults(one_shot=True)


def cmd_generate(args: argparse.Namespace) -> int:
    from noria.frontend.no_torch import keep_torch_out

    keep_torch_out()  # the model runs in the worker processes `LLM` starts
    from noria.frontend.llm import LLM
    from noria.protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    with LLM(args.model, **engine_flags(args)) as llm:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def cmd_bridge(args: argparse.Namespace) -> int:
    from noria.frontend.bridge.main import run

    return run(args.engine, args.host, args.port, resolve_api_key(args), parent_pid=args.parent_pid,
               limits=bridge_limits(args), curve_keys=args.zmq_curve_keys,
               return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from noria.protocol.security import generate_keys

    written = generate_keys(args.dir, args.name)
    for path in written:
        print(f"wrote {path}")
    folder = Path(args.dir)
    print(f"the scheduler's host keeps {folder}; copy to the worker's host: "
          f"{folder / 'scheduler.key'} {folder / (args.name + '.key')} {folder / (args.name + '.key_secret')}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="start frontend, scheduler, workers (and the bridge)")
    add_engine_args(s)
    add_worker_link_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="HTTP/websocket port")
    s.add_argument("--zmq-host", default="127.0.0.1",
                   help="interface of the ZMQ client API (default loopback, whatever --host says: the API has no "
                        "API key; expose it with --zmq-curve-keys)")
    s.add_argument("--zmq-port", type=int, default=5555, help="ZMQ client API port")
    s.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                   help="CURVE-encrypt the ZMQ client API and admit only the public keys in DIR/authorized "
                        "(protocol/security.py's key folder)")
    s.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED, metavar="N",
                   help="requests waiting to start, at most; more are refused as `overloaded` (HTTP 429); 0: no cap")
    s.add_argument("--drain-timeout", type=_seconds, default=30.0, metavar="S",
                   help="on SIGTERM, take no new requests and let open ones finish this long, then end the rest "
                        "(default 30)")
    s.add_argument("--max-scheduler-restarts", type=int, default=DEFAULT_SCHEDULER_RESTARTS, metavar="N",
                   help=f"a scheduler that dies is started again (with the local workers) and open requests go on, "
                        f"at most N times per {RESTART_WINDOW:g} s; past that the server exits non-zero "
                        f"(default {DEFAULT_SCHEDULER_RESTARTS}; 0: never)")
    add_limit_args(s)
    add_bridge_limit_args(s)
    add_bridge_output_args(s)
    add_input_limit_args(s)
    add_api_key_args(s)
    s.set_defaults(fn=cmd_serve)

    g = sub.add_parser("generate", help="offline: print the completion of one prompt")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(g)
    add_verbose_arg(g)
    g.set_defaults(fn=cmd_generate)

    br = sub.add_parser("bridge", help="HTTP/websocket/OpenAI server in front of a running engine's ZMQ API")
    br.add_argument("--engine", default="tcp://127.0.0.1:5555", help="the engine's ZMQ client API address")
    br.add_argument("--host", default="127.0.0.1")
    br.add_argument("--port", type=int, default=8000)
    br.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                    help="connect to the engine with CURVE: DIR holds the server's public key and one client pair")
    add_limit_args(br)
    add_bridge_limit_args(br)
    add_bridge_output_args(br)
    add_api_key_args(br)
    br.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # set by `noria serve`
    br.set_defaults(fn=cmd_bridge)

    k = sub.add_parser("keygen", help="write ZMQ CURVE key pairs for --curve-keys / --zmq-curve-keys")
    k.add_argument("dir", help="key folder (created; the scheduler's pair is kept if it exists)")
    k.add_argument("--name", default="worker", help="whose pair to make and authorise: a worker or a client (default: worker)")
    k.set_defaults(fn=cmd_keygen)


def parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    ap = argparse.ArgumentParser(prog="noria", description="LLM inference server with continuous batching")
    return ap, ap.add_subparsers(dest="cmd", required=True)


def run(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    args = ap.parse_args(argv)
    if getattr(args, "one_shot", False):
        logs.setup(logs.SERVICE if args.verbose else logs.BRIEF, logging.INFO)
    else:
        logs.setup(logs.SERVICE, logging.WARNING)
    try:
        return int(args.fn(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"noria: error: {e}", file=sys.stderr)
        return 2
    except NoriaError as e:  # the engine could not start: its reason in one line, not a traceback
        print(f"noria: error: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before `serve` has its own handler (say, while the model loads)
        print("noria: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    ap, sub = parser()
    add_commands(sub)
    return run(ap, argv)


if __name__ == "__main__":
    sys.exit(main())
