"""llama.cpp's `llama-server` as a process: its command line, its environment, its start and stop.

One slot per request in flight, continuous batching, the thread count noria's worker uses;
the binary is bench/llama_cpp_build.py's, its client bench/llama_cpp_client.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from noria.bench.llama_cpp_build import server_binary


def threads() -> int:
    """The thread count noria's worker uses (ModelRunner: torch threads = os.cpu_count())."""
    return os.cpu_count() or 1


def context_per_request(work) -> int:
    """Tokens one slot must hold for the longest request (prompt + output), in 64s."""
    longest = max(len(w[0]) + w[1] for w in work)
    return -(-longest // 64) * 64


def server_command(binary: Path, gguf: Path, port: int, slots: int, per_request: int, n_threads: int,
                   extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """llama-server with one slot per request in flight, each slot `per_request` tokens of KV
    (the context is split evenly between slots), continuous batching, and everything else at
    llama.cpp's defaults (its batch sizes, flash attention "auto", f16 KV cache); `extra` flags
    last (bench/spec_llama_cpp.py's speculation)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(n_threads), "-tb", str(n_threads), "-np", str(slots), "-c", str(slots * per_request),
            "--cont-batching",
            "--cache-ram", "0",  # no host-memory prompt cache: every prompt is computed, as noria's are here
            "--no-webui", *extra]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """llama-server's environment: the bench's, less the OpenMP wait settings that `noria bench`
    sets for noria's worker (bench/__init__.py: worker/cli.py's PROCESS_ENV), so that llama.cpp
    waits at its OpenMP barriers as it does by default (spin a while, then sleep). ggml's threads
    meet at a barrier after every op:

      2 quiet cores, 48 W1 requests, 16 in flight: default 225-248 tok/s bf16, 128-135 f32;
                                                   PASSIVE 166-167 bf16, 116-118 f32;
      2 cores shared with other jobs, 32 requests: default 19 tok/s bf16, PASSIVE 128.

    Its default is its best on a quiet host, the one a target is set against; on a busy one its
    spinning threads wait for a descheduled one (see `latency`, which runs both)."""
    env = dict(os.environ if base is None else base)
    from noria.worker.cli import PROCESS_ENV

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if env.get(name) == PROCESS_ENV[name]:
            del env[name]
    return env


class LlamaServer:
    """llama-server on a free port; `wait` until /health says the model is loaded; `stop`."""

    def __init__(self, gguf: Path, slots: int, per_request: int, n_threads: int | None = None,
                 binary: Path | None = None, log_path: Path | None = None, env: dict[str, str] | None = None,
                 extra_args: list[str] | tuple[str, ...] = ()) -> None:
        from noria.protocol.sockets import free_tcp_port

        port = free_tcp_port()
        self.http = f"http://127.0.0.1:{port}"
        self.command = server_command(binary or server_binary(), gguf, port, slots, per_request,
                                      n_threads or threads(), extra_args)
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.command, env=server_env() if env is None else env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def health(self) -> str:
        """"ok" once the model is loaded; "loading" while /health answers 503; "down" before it listens."""
        try:
            with urllib.request.urlopen(f"{self.http}/health", timeout=2) as r:
                return json.loads(r.read() or b"{}").get("status", "ok") if r.status == 200 else "loading"
        except urllib.error.HTTPError as e:
            return "loading" if e.code == 503 else f"http {e.code}"
        except OSError:
            return "down"

    def wait(self, timeout: float = 300.0) -> LlamaServer:
        deadline = time.monotonic() + timeout
        try:
            while (state := self.health()) != "ok":
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with code {self.proc.returncode} while starting"
                                       f" ({' '.join(self.command)})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama-server not ready within {timeout:.0f} s (last /health: {state})")
                time.sleep(0.1)  # poll interval; the deadline bounds the wait
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int:
        import signal

        from noria.protocol.lifecycle import stop_child

        rc = stop_child(self.proc, signal.SIGTERM, 30.0)
        if self.log is not subprocess.DEVNULL:
            self.log.close()  # type: ignore[union-attr]
        return rc

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
