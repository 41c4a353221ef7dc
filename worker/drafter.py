"""What the worker's proposers share (a draft model, worker/draft_model.py; an EAGLE-3 head,
worker/eagle3.py): a KV cache of their own shapes in the target's block ids, so that the
scheduler's block accounting is the target's alone (a block's bytes are both caches':
`KVLayout.draft_bytes_per_block`), moved by the same swaps; and one forward pass's inputs
over spans of requests' tokens, through the target's block tables.

The hooks the model runner calls are no-ops here; a proposer that tracks which blocks hold
its KV (the draft model) or reads the target's step (a head: worker/head_drafter.py) overrides them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from noria.worker.attention import AttentionBackend, AttentionMetadata
from noria.worker.block_table import BlockTables
from noria.worker.kv_cache import KVCache, KVLayout
from noria.worker.step_inputs import Batch, RequestState, ScheduledRows, fresh_tensors


@dataclass(frozen=True, slots=True)
class Span:
    """Tokens `[start, start + len(input_ids))` of a request, run through the draft in one row."""

    state: RequestState
    start: int
    input_ids: list[int]


class PagedDrafter:
    def __init__(self, layout: KVLayout, attention: AttentionBackend, device: torch.device) -> None:
        self.layout, self.attention, self.device = layout, attention, device
        self.block_size = layout.block_size
        self.cache: KVCache | None = None
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.tables: BlockTables

    def allocate(self, num_blocks: int, num_cpu_blocks: int, tables: BlockTables) -> None:
        """Its KV cache, as many blocks as the target's, indexed by the target's block tables."""
        self.cache = KVCache(self.layout, num_blocks, num_cpu_blocks, self.device)
        self.cache.block_copier = getattr(self.attention, "copy_blocks", None)
        self.layers = [self.cache.layer(i) for i in range(self.layout.num_layers)]
        self.tables = tables

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """The same block moves as the target's."""
        if self.cache is not None:
            self.cache.swap_out(swap_out)
            self.cache.swap_in(swap_in)

    def inputs(self, spans: list[Span]) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """One pass over `spans`: its input ids, its metadata (the attention backend prepared for
        it) and the flat index of each span's last token."""
        q_lens = [len(s.input_ids) for s in spans]
        starts = [0, *accumulate(q_lens)]
        rows = ScheduledRows([s.state for s in spans], [t for s in spans for t in s.input_ids], q_lens,
                             [s.start for s in spans], [s.start + n for s, n in zip(spans, q_lens, strict=True)],
                             starts)
        input_ids, meta = fresh_tensors(rows, self.tables, self.block_size, self.device)
        self.attention.prepare(meta)
        return input_ids, meta, torch.tensor(starts[1:], dtype=torch.long, device=self.device) - 1

    def propose(self, wanted: list[tuple[RequestState, int]]) -> list[list[int]]:
        """k greedy proposals for each (request, k), in order."""
        raise NotImplementedError

    def added(self, state: RequestState, block_ids: list[int]) -> None:
        """A request new to the worker, with `block_ids`."""

    def fresh(self, block_ids: list[int]) -> None:
        """Blocks appended to a request: to be written."""

    def mark(self, state: RequestState) -> None:
        """A request the worker is done with (dropped, or rebuilt)."""

    def stepped(self, batch: Batch, requests: dict[int, RequestState]) -> None:
        """The target's step over `batch` has run and its tokens are sampled (and verified)."""
