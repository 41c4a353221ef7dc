"""llama.cpp's own speculative decoding as rows of `noria bench spec`, its server beside noria's
`LLM.generate` on the same weights (the model converted to a bf16 GGUF, its draft too) and the
same requests: `llama.cpp-off`, `llama.cpp-ngram-K` (its `ngram-simple` prompt lookup: an
n-gram of noria's `prompt_lookup_max` tokens, K tokens proposed), `llama.cpp-headL-K` and
`llama.cpp-self-K` (its `draft-simple`: a draft model proposing up to K tokens, at least none).

Measured as noria's rows are: one request alone and eight together, streamed, ms from the
decode's first token to its last over the tokens between (a group: from the moment every
request has its first token to the last one's end); 32 requests at once and W1 (llama.cpp's
16 in flight, bench/llama_cpp.py's IN_FLIGHT: its best on this host), output tok/s; each part
on a server with one slot per request it has in flight. Greedy at
temperature 0 with llama.cpp's EOS ignored (bench/llama_cpp_client.py). W1 sampled is not run:
llama-server seeds each request's sampler its own way, so its sampled outputs are not
noria's. Acceptance is llama.cpp's own count per request (`timings.draft_n` and
`draft_n_accepted` of its final answers): the accepted share of drafted tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

PREFIX = "llama.cpp"


def is_llama_cpp(name: str) -> bool:
    return name == PREFIX or name.startswith(PREFIX + "-")


def method_of(name: str) -> tuple[str, int]:
    """("off", 0), ("ngram", K), ("self", K) or ("headL", K) of a llama.cpp config name; SystemExit else."""
    rest = name[len(PREFIX):].lstrip("-")
    if rest in ("", "off"):
        return "off", 0
    method, _, k = rest.rpartition("-")
    if k.isdigit() and int(k) > 0 and (method in ("ngram", "self") or method.startswith("head") and method[4:].isdigit()):
        return method, int(k)
    raise SystemExit(f"unknown config {name!r}: llama.cpp-off, llama.cpp-ngram-K, llama.cpp-self-K or llama.cpp-headL-K")


def spec_args(name: str, lookup_max: int, draft: Path | None = None) -> list[str]:
    """llama-server's speculation flags for a config; `draft`: the draft's GGUF (self and headL)."""
    method, k = method_of(name)
    if method == "off":
        return []
    if method == "ngram":
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(lookup_max),
                "--spec-ngram-simple-size-m", str(k)]
    if draft is None:
        raise ValueError(f"{name} needs its draft model's GGUF")
    return ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]


def draft_gguf(name: str, model: Path) -> Path | None:
    """The draft's bf16 GGUF for a draft-model config (converted once and cached), else None."""
    from noria.bench.llama_cpp import convert
    from noria.bench.spec_models import head_checkpoint

    method, _ = method_of(name)
    if method == "self":
        return convert(model, "bf16")
    if method.startswith("head"):
        return convert(head_checkpoint(model, int(method[4:])), "bf16")
    return None


class _Counts:
    """Drafted and accepted tokens summed over the answers of one part of a config's run."""

    def __init__(self) -> None:
        self.drafted = self.accepted = 0

    def add(self, timings: dict) -> None:
        self.drafted += int(timings.get("draft_n", 0))
        self.accepted += int(timings.get("draft_n_accepted", 0))

    def row(self) -> dict[str, Any]:
        return {"draft_tokens": self.drafted, "accepted": self.accepted,
                "accepted_rate": round(self.accepted / self.drafted, 3) if self.drafted else 0.0}


async def _group_ms(base: str, prompts: list[list[int]], tokens: int, counts: _Counts) -> float:
    """ms per decode step of `prompts` streamed together, 1 + `tokens` tokens each: from the
    moment every request has its first token to the end of the last, over `tokens`."""
    import aiohttp

    from noria.bench.llama_cpp_client import session, stream

    async with session(aiohttp) as http:
        answers = await asyncio.gather(*(stream(http, base, p, 1 + tokens, exact=True) for p in prompts))
    for _, _, _, timings in answers:
        counts.add(timings)
    first = max(times[0] for _, times, _, _ in answers)
    last = max(times[-1] for _, times, _, _ in answers)
    return (last - first) / tokens * 1e3


async def _rate(base: str, work: list[tuple[list[int], int]], in_flight: int, counts: _Counts) -> float:
    """Output tok/s of `work`, at most `in_flight` requests at a time, non-streamed."""
    import aiohttp

    from noria.bench.llama_cpp_client import complete, session

    gate = asyncio.Semaphore(in_flight)
    async with session(aiohttp) as http:

        async def one(prompt: list[int], max_tokens: int) -> int:
            async with gate:
                answer = await complete(http, base, prompt, max_tokens)
            counts.add(answer.get("timings") or {})
            return len(answer["tokens"])

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p, m) for p, m in work))
        return sum(done) / (time.perf_counter() - t0)


def run_config(name: str, model: Path, args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """One llama.cpp row of `noria bench spec` (bench/spec.py's keys; `w1_sampled` None). Each
    part gets a server of its own with a slot per request it has in flight: llama-server's
    decode attends over every slot's share of one KV cache, so idle slots would slow it (W1 at
    16 in flight ran 159 tok/s with 32 slots against ~300 with 16 on this host)."""
    from noria.bench.llama_cpp import IN_FLIGHT, LlamaServer, context_per_request, convert

    prompts = [p for p, _ in work]
    parts = {"itl_b1": ([(p, 1 + args.tokens) for p in prompts[:args.b1_prompts]], 1),
             "itl_b8": ([(p, 1 + args.tokens) for p in prompts[:8]], 8),
             "b32": ([(p, args.tokens) for p in prompts[:32]], 32), "w1": (work, IN_FLIGHT)}
    target, extra = convert(model, "bf16"), spec_args(name, args.lookup[1], draft_gguf(name, model))
    row: dict[str, Any] = {"config": name, "w1_sampled": None, "llama_cpp_args": extra}
    for part, (requests, slots) in parts.items():
        counts = _Counts()
        # Each slot a block more than its longest request: room for the draft past the last token
        # (without it a draft model's slot stopped short at the end of its context).
        per_request = context_per_request(requests) + 64
        with LlamaServer(target, slots, per_request, extra_args=extra).wait() as server:
            asyncio.run(_rate(server.http, [(prompts[0], 8)] * slots, slots, _Counts()))  # warm-up, as noria's
            if part == "itl_b1":
                row[part] = statistics.median(asyncio.run(_group_ms(server.http, [p], args.tokens, counts))
                                              for p, _ in requests)
            elif part == "itl_b8":
                row[part] = asyncio.run(_group_ms(server.http, [p for p, _ in requests], args.tokens, counts))
            else:
                row[part] = asyncio.run(_rate(server.http, requests, slots, counts))
        row[f"{part}_acceptance"] = counts.row()
    return row
