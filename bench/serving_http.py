"""One HTTP client for every server in `noria bench serving --systems ...`.

noria and vLLM are compared through the same door: OpenAI `POST /v1/completions`
with token-id prompts, `stream: true`, greedy, `ignore_eos` and `logprobs: 1`
(every token then comes with a logprob entry in both servers, so a chunk's
token count is exact even where a token's text is empty; vLLM is also asked
for `return_token_ids`, which noria ignores). Servers: `noria serve`
(LocalServer) and `vllm serve` from vLLM's own venv (VllmServer), each on the
same checkpoint folder in the same --dtype (float32 unless told) with the same
engine knobs. vLLM runs with
--skip-tokenizer-init (the benchmark models' tokenizer is smaller than their
vocabulary, as in the offline runs): it does not detokenize, noria does, so
any difference this makes is in vLLM's favour.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from noria.bench import vllm_cpu
from noria.frontend.local_server import LocalServer, wait_http
from noria.protocol.lifecycle import stop_child
from noria.protocol.sockets import free_tcp_port

Req = tuple[list[int], int, float]  # prompt ids, max_tokens, send offset (s)

# noria's engine flags that vLLM spells the same way; anything else (e.g. --num-kv-blocks) is noria's alone.
SHARED_FLAGS = ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--dtype")
SHARED_SWITCHES = ("--enable-chunked-prefill", "--no-enable-chunked-prefill",
                   "--enable-prefix-caching", "--no-enable-prefix-caching")
# Sized differently in vLLM (VLLM_CPU_KVCACHE_SPACE, GiB): both get far more KV than the runs need.
NORIA_ONLY_FLAGS = ("--num-kv-blocks",)


def vllm_flags(noria_flags: list[str]) -> list[str]:
    """The subset of noria's engine flags that vLLM has, with their values."""
    out: list[str] = []
    i = 0
    while i < len(noria_flags):
        f = noria_flags[i]
        takes_value = f in SHARED_FLAGS or f in NORIA_ONLY_FLAGS
        if f in SHARED_FLAGS:
            out += noria_flags[i : i + 2]
        elif f in SHARED_SWITCHES:
            out.append(f)
        elif not takes_value:
            raise ValueError(f"no vLLM equivalent known for {f!r}")
        i += 2 if takes_value else 1
    return out


class VllmServer:
    """`vllm serve` on a free port, in one of vllm_cpu's configurations; stopped with Ctrl-C."""

    def __init__(self, system: str, model: Path, noria_flags: list[str], log_path: Path | None = None) -> None:
        port = free_tcp_port()
        self.http = f"http://127.0.0.1:{port}"
        env = vllm_cpu.child_env(system, dict(os.environ), os.sched_getaffinity(0), vllm_cpu.iomp_library())
        self.log = open(log_path, "wb") if log_path else None  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(vllm_cpu.serve_command(model, port, vllm_flags(noria_flags)), env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT if self.log else None)

    def wait(self, timeout: float = 1200.0) -> None:
        # Start-up compiles the model before /health answers: about a minute and a half on 2 quiet
        # cores, over 10 minutes on 2 cores shared with other jobs.
        try:
            wait_http(self.http, self.proc, timeout)
        except RuntimeError as e:  # wait_http names noria in its message
            self.stop()
            raise RuntimeError(f"vllm serve exited with code {self.proc.returncode} while starting") from e
        except BaseException:
            self.stop()
            raise

    def stop(self) -> int:
        import signal

        rc = stop_child(self.proc, signal.SIGINT, 60.0)
        if self.log:
            self.log.close()
        return rc


def start(system: str, model: Path, flags: list[str]) -> LocalServer | VllmServer:
    """A started server of `system` ("noria", "vllm", "vllm-tuned") with `flags` (noria's spelling)."""
    if system == "noria":
        server = LocalServer("--model", str(model), *flags)
        server.wait(timeout=300, http=True)
        return server
    server = VllmServer(system, model, flags)
    server.wait()
    return server


def _model_name(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


async def drive(base: str, reqs: list[Req]) -> list[dict]:
    """Send each request at its offset; record per-token arrival times from the SSE stream."""
    import aiohttp

    model = _model_name(base)
    limit = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limit, timeout=aiohttp.ClientTimeout(total=1800)) as http:
        start = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int, offset: float) -> dict:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "logprobs": 1,
                    "return_token_ids": True, "return_tokens_as_token_ids": True}
            sent = time.perf_counter()
            times: list[float] = []
            async with http.post(f"{base}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    now = time.perf_counter()
                    for c in json.loads(line[6:]).get("choices", []):
                        times.extend([now] * _tokens_in(c))
            return {"sent": sent, "times": times, "prompt_len": len(prompt)}

        return await asyncio.gather(*(one(*r) for r in reqs))


def _tokens_in(choice: dict) -> int:
    """How many tokens a streamed choice carries: its token ids, else its logprob entries."""
    if choice.get("token_ids") is not None:
        return len(choice["token_ids"])
    lp = choice.get("logprobs") or {}
    return len(lp.get("tokens") or ([1] if choice.get("text") else []))
