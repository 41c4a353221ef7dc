"""The profiling pass that sizes a GPU's KV cache (--gpu-memory-utilization).

After the weights are loaded, the runner runs the steps at the size the scheduler may plan
(--max-num-batched-tokens): once as one long chunk (the attention of a long prefill), once
spread over up to --max-num-seqs sequences (the most sampling rows). Every sequence samples
with the most logprobs a request may ask for and computes prompt logprobs for every token:
the activations, logits and sampling buffers of the worst step. The larger peak above the
weights is what the KV cache must leave room for (worker/kv_cache.py does the arithmetic).
The steps run on a throw-away cache just large enough for them, not counted in the peak.
"""

from __future__ import annotations

from typing import Any

import torch

from noria.protocol.sampling import MAX_LOGPROBS, EngineSamplingParams
from noria.protocol.step import NewRequestData, StepPlan
from noria.worker.block_table import BlockTables
from noria.worker.kv_cache import KVCache, KVLayout


class CudaMemory:
    """DeviceMemory of a CUDA device, read once the profiling pass is over."""

    def __init__(self, device: torch.device, weights: int, peak: int) -> None:
        free, total = torch.cuda.mem_get_info(device)
        self._free, self._total, self._weights, self._peak = free, total, weights, peak

    def total(self) -> int:
        return self._total

    def free(self) -> int:
        return self._free

    def weights(self) -> int:
        return self._weights

    def peak(self) -> int:
        return self._peak


def profile_batches(num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[list[int]]:
    """Sequence lengths of the profiling steps: one chunk as long as a step and a sequence
    allow, and `num_tokens` over as many sequences as may run together, none longer than
    max_model_len."""
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    spread_tokens = min(num_tokens, num_seqs * max_model_len)
    base, extra = divmod(spread_tokens, num_seqs)
    return [[min(num_tokens, max_model_len)], [base + (1 if i < extra else 0) for i in range(num_seqs)]]


@torch.inference_mode()
def profile_memory(runner: Any, layout: KVLayout) -> CudaMemory:
    """Run the worst steps once on `runner` (a ModelRunner with its model, attention backend
    and sampler set, and no KV cache yet) and measure them. Leaves no request or cache behind."""
    device, config = runner.device, runner.config
    batches = profile_batches(config.resolved_max_num_batched_tokens(runner.max_model_len), config.max_num_seqs,
                              runner.max_model_len)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    peak = max(_step_peak(runner, layout, lengths) for lengths in batches)
    torch.cuda.empty_cache()
    return CudaMemory(device, weights, peak)


def _step_peak(runner: Any, layout: KVLayout, lengths: list[int]) -> int:
    device, bs = runner.device, layout.block_size
    per_seq = [-(-n // bs) for n in lengths]
    cache = KVCache(layout, sum(per_seq), 0, device)
    runner.kv_cache = cache
    runner._kv_layers = [cache.layer(i) for i in range(layout.num_layers)]
    runner.block_tables = BlockTables(max(per_seq), cache.null_block)
    params = EngineSamplingParams(max_tokens=1, logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS)
    new, first = [], 0
    for i, (n, blocks) in enumerate(zip(lengths, per_seq, strict=True)):
        tokens = [(i + j) % runner.vocab_size for j in range(n)]
        new.append(NewRequestData(i, tokens, list(range(first, first + blocks)), 0, 0, n))
        first += blocks
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    try:
        runner.execute(StepPlan(0, [(r.req_id, len(r.token_ids)) for r in new], new_requests=new, params=[params]))
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    finally:
        runner.execute(StepPlan(0, [], finished_req_ids=[r.req_id for r in new]))
        runner.kv_cache = runner._kv_layers = runner.block_tables = None
