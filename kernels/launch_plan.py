"""How a step's attention is cut into launches, decided on the host once per step: the split-K
partitions of decode and the tensor-core prefill kernel's work list (decode_launch.py and
prefill_launch.py launch them), and the launch shapes the kernels are written for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

NUM_THREADS = 128  # decode, reduce and prefill kernels are written for 4 warps
PREFILL_TILE = 16  # query rows per CUDA-core (float32) prefill CTA
GQA_ROWS = 16  # query heads per CTA of the tensor-core decode kernel (the mma's M)
PREFILL_TC_ROWS = 64  # packed (query token, head) rows per tensor-core prefill CTA
DEFAULT_PARTITION_SIZE = 512  # tokens per split-K partition
SPLIT_MIN_CONTEXT = 1024  # below this one CTA per (head, sequence) is always enough
SINGLE_PARTITION = 1 << 30  # a partition size no context reaches
GQA_MIN_CHUNK = 256  # tokens: a shorter partition costs more in partials and merge than it gives
GQA_CTAS_PER_SM = 2  # the balanced split aims at this many CTAs per SM


def block_threads(work: int, cap: int = 256) -> int:
    """Threads per CTA of an elementwise kernel with `work` items per CTA: whole warps, at
    least one, at most `cap`."""
    return max(32, min(cap, (work + 31) // 32 * 32))


def choose_num_partitions(
    max_seq_len: int,
    num_seqs: int,
    num_heads: int,
    sm_count: int,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> int:
    """Split-K only pays off for long contexts, and only when one CTA per (head, sequence)
    leaves SMs idle; otherwise the extra partial writes and merge pass cost more than they
    give."""
    parts = -(-max_seq_len // partition_size)
    if parts <= 1 or max_seq_len < SPLIT_MIN_CONTEXT:
        return 1
    if num_seqs * num_heads >= 4 * sm_count:
        return 1
    return parts


@dataclass(frozen=True)
class DecodePlan:
    """How the tensor-core decode kernel splits a step: partitions of `chunk` tokens (a
    sequence's last one takes the rest), `parts[s]` of them for sequence s."""

    chunk: int
    parts: tuple[int, ...]

    @property
    def num_items(self) -> int:
        return sum(self.parts)

    @property
    def max_parts(self) -> int:
        return max(self.parts, default=1)


def plan_decode_split(
    seq_lens_host: Sequence[int],
    ctas_per_item: int,
    sm_count: int,
    block_size: int,
    *,
    min_chunk: int = GQA_MIN_CHUNK,
    ctas_per_sm: int = GQA_CTAS_PER_SM,
) -> DecodePlan:
    """Work-balanced split-K for one launch. Without a split the grid has one CTA group per
    sequence and the longest sequence sets the step's time; with a chunk of C tokens sequence s
    becomes ceil(len_s / C) work items, so long sequences split and short ones do not. The
    chunk is the smallest multiple of the block size (at least min_chunk) whose items still fit
    in ctas_per_sm x sm_count CTAs (ctas_per_item CTAs each: KV heads x head groups): as much
    parallelism for the long sequences as the GPU takes in about one wave. Steps that already
    fill the GPU, or whose contexts are all short, are not split."""
    lens = [max(0, int(n)) for n in seq_lens_host]
    max_len = max(lens, default=0)
    target = ctas_per_sm * sm_count
    if len(lens) * ctas_per_item >= target or max_len <= min_chunk:
        return DecodePlan(SINGLE_PARTITION, (1,) * len(lens))

    def items(chunk: int) -> int:
        return sum(max(1, -(-n // chunk)) for n in lens)

    lo, hi = -(-min_chunk // block_size), -(-max_len // block_size)  # chunk in blocks
    while lo < hi:
        mid = (lo + hi) // 2
        if items(mid * block_size) * ctas_per_item <= target:
            hi = mid
        else:
            lo = mid + 1
    chunk = lo * block_size
    return DecodePlan(chunk, tuple(max(1, -(-n // chunk)) for n in lens))


def windowed_lengths(seq_lens_host: Sequence[int], window: int | None) -> list[int]:
    """The keys a decode query sees per sequence: its context, or at most the sliding window.
    The split plans count this as a sequence's work, so a long sliding-window context costs
    its window."""
    lens = [int(n) for n in seq_lens_host]
    return lens if window is None else [min(n, window) for n in lens]


def prefill_work_items(query_lens: Sequence[int], group: int) -> np.ndarray:
    """The tensor-core prefill kernel's flat work list, int32 [items, 2]: (sequence, tile) for
    every tile of PREFILL_TC_ROWS packed rows (a sequence's q_len tokens times the `group`
    query heads of one KV head); a sequence with no query tokens has none. The grid is this
    list (times the KV heads), so a long chunk beside many short rows launches no empty CTAs."""
    lens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    tiles = -(-lens * group // PREFILL_TC_ROWS)
    seqs = np.repeat(np.arange(len(lens), dtype=np.int64), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)  # each item's sequence's first item
    items = np.stack([seqs, np.arange(len(seqs), dtype=np.int64) - first], axis=1)
    return items.astype(np.int32)


@dataclass
class StepPlan:
    """How one step's sequences split between the kernels, decided on the host once per step
    (plan_step) and shared by every layer: in a mixed step the sequences with one query token
    go to the decode kernel and the others to the prefill kernel's work list, each kernel
    launched only over its own rows."""

    query_lens: list[int]  # per sequence, this step
    seq_lens: list[int]  # per sequence, context after this step
    decode_seqs: list[int]  # sequences with exactly one query token
    device: torch.device
    # A mixed step's decode rows: slices when they are consecutive sequences, else indices.
    decode_seq_index: slice | torch.Tensor | None = None
    decode_token_index: slice | torch.Tensor | None = None
    _work: dict[tuple[int, bool], torch.Tensor] = field(default_factory=dict)

    def work(self, group: int, skip_decode: bool) -> torch.Tensor:
        """The prefill work list for `group` query heads per KV head, on the step's device;
        skip_decode leaves out the decode sequences (the decode kernel computes them)."""
        key = (group, skip_decode)
        if key not in self._work:
            lens = list(self.query_lens)
            if skip_decode:
                for s in self.decode_seqs:
                    lens[s] = 0
            items = torch.from_numpy(prefill_work_items(lens, group))
            if self.device.type == "cuda":  # pinned, so the copy does not block the host
                items = items.pin_memory().to(self.device, non_blocking=True)
            self._work[key] = items
        return self._work[key]


def plan_step(query_lens: Sequence[int], seq_lens: Sequence[int], device: torch.device) -> StepPlan:
    """A step's plan from its per-sequence query and context lengths (the worker's host lists:
    no device sync)."""
    query_lens, seq_lens = [int(n) for n in query_lens], [int(n) for n in seq_lens]
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    plan = StepPlan(query_lens, seq_lens, decode, device)
    if decode and len(decode) < len(query_lens):
        starts = np.concatenate([[0], np.cumsum(query_lens, dtype=np.int64)])
        if decode[-1] - decode[0] == len(decode) - 1:  # consecutive: views, no copies
            first = int(starts[decode[0]])
            plan.decode_seq_index = slice(decode[0], decode[-1] + 1)
            plan.decode_token_index = slice(first, first + len(decode))
        else:
            plan.decode_seq_index = torch.tensor(decode, dtype=torch.long, device=device)
            plan.decode_token_index = torch.from_numpy(starts[decode]).to(device)
    return plan
