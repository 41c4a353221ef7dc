"""`noria bench throughput`'s runners: each runs one system on W1 in the process bench/throughput.py
starts for it (run_isolated) and returns its row. HF's `generate` in static batches and its
continuous batching manager, noria's `LLM.generate`, `noria serve` driven by the client library,
and the ceiling (noria-llm's recorded batches replayed as bare forward passes).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

Work = list[tuple[list[int], int]]


def run_hf_static(path: Path, work: Work, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    counted = 0
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            chunk = work[i : i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            longest = max(m for _, m in chunk)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
            counted += sum(m for _, m in chunk)
    dt = time.perf_counter() - t0
    return {"system": f"hf-static-{batch}", "seconds": dt, "output_tokens": counted}


def run_hf_cb(path: Path, work: Work, max_batch_tokens: int = 256, max_requests: int = 16) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    gen = GenerationConfig(max_new_tokens=max(m for _, m in work), do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    t0 = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=m) for p, m in work]
    got = 0
    done: set[str] = set()
    while len(done) < len(ids):
        r = manager.get_result(timeout=1.0)
        if r is not None and r.is_finished():
            done.add(r.request_id)
            got += len(r.generated_tokens)
    dt = time.perf_counter() - t0
    manager.stop(block=True)
    return {"system": "hf-cb", "seconds": dt, "output_tokens": got,
            "settings": {"max_batch_tokens": max_batch_tokens, "max_requests_per_batch": max_requests}}


def run_noria_llm(path: Path, work: Work, flags: dict, record: str) -> dict:
    from noria import LLM, SamplingParams
    from noria.bench import step_log
    from noria.bench.ceiling import count_steps

    with step_log.recording(record), LLM(str(path), **flags) as llm:
        llm.generate([work[0][0]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        warm = count_steps(record)
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        stats = llm.stats()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"system": "noria-llm", "seconds": dt, "output_tokens": n, "engine_steps": stats.num_steps,
            **_recorded(record, warm, n), "record": record, "record_skip": warm,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def run_noria_serve(path: Path, work: Work, flags: list[str], record: str, in_flight: int | None = None) -> dict:
    """`noria serve` and the client library, every request at once, or at most `in_flight` at a time
    (as bench/llama_cpp_client.py drives llama-server: noria-serve-16 is its like for like)."""
    from noria import AsyncClient, SamplingParams
    from noria.bench import step_log
    from noria.bench.ceiling import count_steps
    from noria.bench.process_rss import server_rss
    from noria.frontend.local_server import LocalServer

    with LocalServer("--model", str(path), *flags, env={**os.environ, **step_log.env(record)}) as server:
        server.wait(timeout=300, http=True)  # the bridge too: its RSS is part of the server's
        idle = server_rss(server.proc.pid)

        async def main() -> tuple[float, int, int]:
            async with AsyncClient(server.address, timeout=600) as c:
                await c.generate(work[0][0], SamplingParams(max_tokens=2))
                warm = count_steps(record)
                params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
                gate = asyncio.Semaphore(in_flight or len(work))

                async def one(prompt: list[int], sp: SamplingParams) -> int:
                    async with gate:
                        return len((await c.generate(prompt, sp)).outputs[0].token_ids)

                t0 = time.perf_counter()
                counts = await asyncio.gather(*(one(p, sp) for (p, _), sp in zip(work, params, strict=True)))
                return time.perf_counter() - t0, sum(counts), warm

        dt, n, warm = asyncio.run(main())
        end = server_rss(server.proc.pid)
    name = "noria-serve" if in_flight is None else f"noria-serve-{in_flight}"
    return {"system": name, "seconds": dt, "output_tokens": n, **_recorded(record, warm, n),
            "rss_bytes": {"idle": idle, "end": end}}


def _recorded(record: str, warm: int, output_tokens: int) -> dict:
    """What the worker's step record says about the timed part of a run."""
    from noria.bench.ceiling import read_steps, recorded_model_seconds

    steps = read_steps(record, warm)
    return {"steps": len(steps), "avg_running_batch": output_tokens / max(len(steps), 1),
            "model_seconds": recorded_model_seconds(steps), "record": record, "record_skip": warm}


def run_ceiling(path: Path, record: str, flags: dict, skip: int) -> dict:
    from noria.bench.ceiling import read_steps, replay
    from noria.frontend.demo_model import resolve_model
    from noria.frontend.startup import make_config

    steps = read_steps(record, skip)
    # The worker's model as start_core hands it over: a GGUF file's folder view (noria-llm resolves the same).
    dt = replay(make_config(resolve_model(str(path)), **flags), steps)
    return {"system": "ceiling", "seconds": dt, "output_tokens": sum(s[2] for s in steps), "steps": len(steps)}
