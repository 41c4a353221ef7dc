"""The frontend's `noria` subcommands: serve, generate, bridge, keygen (noria/cli.py adds the rest)."""

from __future__ import annotations

import argparse
import logging
import sys

from noria.frontend.api_key import add_api_key_args, resolve_api_key
from noria.frontend.cli_args import (
    DEFAULT_MAX_PER_CONNECTION,
    _seconds,
    add_bridge_limit_args,
    add_bridge_output_args,
    add_engine_args,
    add_input_limit_args,
    add_limit_args,
    add_verbose_arg,
    add_worker_link_args,
    bridge_limit_argv,
    bridge_limits,
    engine_flags,
    input_limits,
    worker_link_config,
)
from noria.protocol import logs
from noria.protocol.config import RESTART_WINDOW
from noria.protocol.errors import NoriaError

# The argument groups are frontend/cli_args.py's; re-exported: tests and bench/ import them from here.
__all__ = [
    "DEFAULT_MAX_PER_CONNECTION", "DEFAULT_MAX_QUEUED", "DEFAULT_SCHEDULER_RESTARTS", "add_bridge_limit_args",
    "add_bridge_output_args", "add_commands", "add_engine_args", "add_input_limit_args", "add_limit_args",
    "add_verbose_arg", "add_worker_link_args", "bridge_limit_argv", "bridge_limits", "cmd_bridge", "cmd_generate",
    "cmd_keygen", "cmd_serve", "engine_flags", "input_limits", "main", "parser", "run", "worker_link_config",
]

DEFAULT_MAX_QUEUED = 4096
DEFAULT_SCHEDULER_RESTARTS = 3


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
