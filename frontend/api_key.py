"""The HTTP/websocket API key: where it comes from, and how it stays out of child processes.

Only the bridge needs the key. `noria serve` hands it to its bridge child through
a pipe on the child's standard input (`--api-key-file -`): a command line shows in
`ps` and an environment variable in /proc/PID/environ for the whole life of the
process (and is inherited by anything it starts), while a pipe is read once and gone.
"""

from __future__ import annotations

import argparse
import os
import sys

from noria.protocol import switches

API_KEY_ENV = switches.API_KEY


def add_api_key_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on HTTP and websocket (default: ${API_KEY_ENV})")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file ('-': standard input)")


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file or $NORIA_API_KEY, in that order.

    The variable is removed from this process's environment either way, so that
    no child process (scheduler, workers, bridge) inherits it."""
    from_env = switches.take_api_key()
    if args.api_key is not None:
        return args.api_key or None
    if args.api_key_file is not None:
        return read_key_file(args.api_key_file)
    return from_env or None


def read_key_file(path: str) -> str:
    if path == "-":
        text = sys.stdin.read()
    else:
        with open(path) as f:
            text = f.read()
    key = text.strip()
    if not key:
        raise ValueError(f"--api-key-file {path}: no key in it")
    return key


def child_env() -> dict[str, str]:
    """This process's environment without the API key, for child processes."""
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    return env
