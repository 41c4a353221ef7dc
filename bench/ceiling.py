"""The model-only ceiling: replay recorded batch shapes as bare forward passes.

The worker writes one line per step when bench/step_log.py's observer is installed:
query lengths, sequence lengths, how many rows sampled, and the seconds its
own forward pass (model plus logits) took. Replaying the shapes through the
same model and attention backend, with metadata built ahead of time and no
scheduler, processes or sampling, gives the time the model alone needs for
exactly the batches noria ran. The recorded seconds give a second, in-run
view of the same thing: wall time minus forward time is what the engine
spent around the model (planning, IPC, sampling, batch preparation).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate
from pathlib import Path

import torch

from noria.protocol.config import EngineConfig
from noria.worker.attention import AttentionMetadata
from noria.worker.model_runner import ModelRunner

Step = tuple[list[int], list[int], int, float]


def read_steps(path: str | Path, skip: int = 0) -> list[Step]:
    """Recorded steps, leaving out the first `skip` (warm-up) lines."""
    lines = Path(path).read_text().splitlines()[skip:]
    return [tuple(json.loads(line)) for line in lines]  # type: ignore[misc]


def count_steps(path: str | Path) -> int:
    p = Path(path)
    return len(p.read_text().splitlines()) if p.exists() else 0


def recorded_model_seconds(steps: list[Step]) -> float:
    return sum(s[3] for s in steps)


def _metadata(runner: ModelRunner, query_lens: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    bs = runner.block_size
    per_row = -(-max(seq_lens) // bs)
    rows = len(query_lens)
    # Row i owns a private run of blocks, scattered like a pool that has been
    # in use for a while (contiguous runs read measurably faster than the
    # worker's real tables; wrapped so large batches stay inside the cache).
    order = torch.randperm(runner.num_kv_blocks, generator=torch.Generator().manual_seed(rows))
    tables = order[torch.arange(rows * per_row, dtype=torch.long).view(rows, per_row) % runner.num_kv_blocks]
    ctx = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
    q_lens = torch.tensor(query_lens)
    starts = [0, *accumulate(query_lens)]
    offsets = torch.tensor(ctx) - torch.tensor(starts[:-1])
    positions = torch.arange(starts[-1]) + torch.repeat_interleave(offsets, q_lens)
    seq_index = torch.repeat_interleave(torch.arange(rows), q_lens)
    slots = tables[seq_index, positions // bs] * bs + positions % bs
    meta = AttentionMetadata(
        positions=positions, slot_mapping=slots, query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens), block_tables=tables, block_size=bs,
        query_lens_host=list(query_lens), seq_lens_host=list(seq_lens), query_start_host=starts,
    )
    runner.attention.prepare(meta)
    return torch.full((starts[-1],), 5, dtype=torch.long), meta


@torch.inference_mode()
def replay(config: EngineConfig, steps: list[Step], around: Callable[[], AbstractContextManager] = nullcontext) -> float:
    """Seconds of forward + logits over `steps`; `around()` wraps the replay loop alone (e.g. a profiler)."""
    runner = ModelRunner(config)
    model = runner.model
    # The replayed contexts were never written here. Untouched pages of the
    # torch.empty cache all map to the kernel's one zero page, which sits in
    # cache, so reading them would be unrealistically fast. Writing the cache
    # first makes every context read hit real memory, as in the worker.
    runner.kv_cache.device_cache.uniform_(-1, 1)
    total = 0.0
    with around():
        for query_lens, seq_lens, num_sampled, _ in steps:
            ids, meta = _metadata(runner, query_lens, seq_lens)
            sample_index = torch.tensor([i - 1 for i in meta.query_start_host[1:]][:num_sampled], dtype=torch.long)
            t0 = time.perf_counter()
            # Named ranges for torch.profiler traces; nearly free when no profiler runs.
            with torch.profiler.record_function("noria: forward"):
                hidden = model(ids, meta.positions, meta, runner.attention, runner._kv_layers)
            if num_sampled:
                with torch.profiler.record_function("noria: logits"):
                    model.compute_logits(hidden[sample_index])
            total += time.perf_counter() - t0
    return total
