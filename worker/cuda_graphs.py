"""Decode steps as CUDA graphs: batch-size buckets, padding, persistent input buffers, capture.

A graph replays fixed kernels on fixed addresses, so a decode step runs in the graph
captured for the next bucket size up, its inputs copied into buffers that every graph
reads and its extra rows padded so that they touch nothing a real sequence reads: each
padded row has position 0, a sequence length of 1, a block table of null blocks and a
slot in the null block (worker/attention.py: the null block pads tables, and no real
sequence reads it within its length). Their outputs are dropped.

The buffers are also the eager decode path's inputs, on every device: the step's host
lists are packed into one host staging tensor (pinned on CUDA) and copied to the device
in one non-blocking copy, so a step stages its inputs once and the CPU runs the same code.

The worker's side of it is here too: whether it captures at all and what the graphs will
take (decided before the KV cache is sized, which keeps that back), the forward pass a
graph captures, and the capture after the KV cache, falling back to eager decode steps
when the memory runs out.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from noria.protocol.config import EngineConfig
from noria.worker.attention import AttentionBackend, AttentionMetadata
from noria.worker.kv_cache import GraphShapes

if TYPE_CHECKING:
    from noria.worker.models.causal_lm import CausalLM
    from noria.worker.models.parallel import RankShapes

log = logging.getLogger("noria.worker.cuda_graphs")
# Whether the worker captures is a line of its start-up, beside its other choices.
worker_log = logging.getLogger("noria.worker")


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The batch sizes to capture, ascending and distinct: `sizes` when given, else 1, 2, 4, 8
    and every multiple of 8 up to max_num_seqs (vLLM's default), plus the multiple of 8 just
    above it when it is not one, so that a step of max_num_seqs sequences has a graph."""
    if sizes:
        return sorted({int(n) for n in sizes})
    chosen = {n for n in (1, 2, 4, 8) if n <= max_num_seqs}
    chosen.update(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in chosen:
        chosen.add(max_num_seqs if max_num_seqs < 8 else -(-max_num_seqs // 8) * 8)
    return sorted(chosen)


def bucket_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows (`sizes` ascending), or None when
    the batch is larger than every graph (it runs eagerly)."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """One decode step's rows on the host, padded or not."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # [rows, cols] int64, on the CPU


def pad_decode(inputs: DecodeInputs, size: int, null_block: int, block_size: int) -> DecodeInputs:
    """`inputs` padded to `size` rows: the extra rows read one null-block key and write their
    K/V into the null block's first slot, so they change nothing a real row computes."""
    n = len(inputs.input_ids)
    if size < n:
        raise ValueError(f"cannot pad {n} rows to {size}")
    extra = size - n
    tables = inputs.block_tables
    if extra:
        pad = torch.full((extra, tables.shape[1]), null_block, dtype=tables.dtype)
        tables = torch.cat([tables, pad])
    return DecodeInputs(
        input_ids=inputs.input_ids + [0] * extra,
        positions=inputs.positions + [0] * extra,
        slots=inputs.slots + [null_block * block_size] * extra,
        seq_lens=inputs.seq_lens + [1] * extra,
        block_tables=tables,
    )


@dataclass(slots=True)
class DecodeViews:
    """Device views of the buffers for one step of `rows` rows and `cols` block-table columns."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor  # contiguous [rows, cols]


class DecodeBuffers:
    """Persistent decode inputs for up to `max_rows` rows, at fixed device addresses.

    Layout of the one int64 buffer (host staging and device alike): input ids, positions,
    slots, sequence lengths (max_rows each), query starts (max_rows + 1), then the block
    table, rows x cols packed so that any (rows, cols) view is contiguous. A step copies only
    the prefix it uses."""

    def __init__(self, max_rows: int, max_cols: int, device: torch.device) -> None:
        self.max_rows, self.max_cols, self.device = max_rows, max_cols, device
        self._table_at = 5 * max_rows + 1
        total = self._table_at + max_rows * max_cols
        self.device_buf = torch.zeros(total, dtype=torch.long, device=device)
        if device.type == "cuda":
            self.staging = torch.zeros(total, dtype=torch.long, pin_memory=True)
            self._copied: torch.cuda.Event | None = None
        else:
            self.staging = self.device_buf  # the CPU path writes its inputs in place
            self._copied = None
        # Query starts of a decode step are 0..rows: written once.
        self.staging[4 * max_rows : 5 * max_rows + 1] = torch.arange(max_rows + 1)
        if self.staging is not self.device_buf:
            self.device_buf.copy_(self.staging)

    def views(self, rows: int, cols: int) -> DecodeViews:
        m, buf = self.max_rows, self.device_buf
        return DecodeViews(
            input_ids=buf[0:rows],
            positions=buf[m : m + rows],
            slot_mapping=buf[2 * m : 2 * m + rows],
            seq_lens=buf[3 * m : 3 * m + rows],
            query_start_loc=buf[4 * m : 4 * m + rows + 1],
            block_tables=buf[self._table_at : self._table_at + rows * cols].view(rows, cols),
        )

    def stage(self, inputs: DecodeInputs) -> DecodeViews:
        """Write `inputs` into the staging tensor and start one copy to the device; returns the
        views the step reads (ordered after the copy on the current stream)."""
        rows, cols = inputs.block_tables.shape
        if rows > self.max_rows or cols > self.max_cols:
            raise ValueError(f"decode inputs {rows} x {cols} exceed the buffers' {self.max_rows} x {self.max_cols}")
        if self._copied is not None:
            # The previous step's copy may still be reading the staging memory.
            self._copied.synchronize()
        m, host = self.max_rows, self.staging
        host[0:rows] = torch.tensor(inputs.input_ids, dtype=torch.long)
        host[m : m + rows] = torch.tensor(inputs.positions, dtype=torch.long)
        host[2 * m : 2 * m + rows] = torch.tensor(inputs.slots, dtype=torch.long)
        host[3 * m : 3 * m + rows] = torch.tensor(inputs.seq_lens, dtype=torch.long)
        end = self._table_at + rows * cols
        host[self._table_at : end].view(rows, cols).copy_(inputs.block_tables)
        if host is not self.device_buf:
            self.device_buf[:end].copy_(host[:end], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.views(rows, cols)


def graph_metadata(views: DecodeViews, block_size: int) -> AttentionMetadata:
    """The attention metadata of a decode step that a graph captures: the buffers' views at
    the bucket's size, every row's block table at full width. Its host lists are the same for
    every step of the bucket (each row as long as the table allows), so nothing a backend plans
    from them changes between replays; the lengths on the device bound what each row reads."""
    rows, cols = views.block_tables.shape
    return AttentionMetadata(
        positions=views.positions,
        slot_mapping=views.slot_mapping,
        query_start_loc=views.query_start_loc,
        seq_lens=views.seq_lens,
        block_tables=views.block_tables,
        block_size=block_size,
        query_lens_host=[1] * rows,
        seq_lens_host=[cols * block_size] * rows,
        query_start_host=list(range(rows + 1)),
    )


# Runs the model over the views of one bucket: returns the hidden states [rows, hidden].
# A decode forward pass: the hidden states of its rows and the layer inputs the model kept for an
# EAGLE-3 head (CausalLM.captured; empty without one).
DecodeForward = Callable[[int, DecodeViews], tuple[torch.Tensor, list[torch.Tensor]]]


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the graph's output, overwritten by each replay
    # The layer inputs an EAGLE-3 head reads, outputs of the graph too: a replay runs no Python,
    # so the model's own list would still hold whatever its last eager pass kept.
    aux: list[torch.Tensor]


class DecodeGraphs:
    """One CUDA graph per bucket size over the shared DecodeBuffers, in one memory pool."""

    def __init__(self, buffers: DecodeBuffers, sizes: Sequence[int]) -> None:
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self._graphs: dict[int, _Captured] = {}
        self.memory = 0  # bytes the capture took (measured)

    def capture(self, forward: DecodeForward, null_block: int, block_size: int, reserve: int = 0) -> None:
        """Warm up and capture every size, largest first so that the smaller graphs fit in the
        pool the largest one sized; logs the time and the memory taken (the device's free
        memory before and after: the pool and whatever the warm-ups kept) in one line, beside
        `reserve`, the estimate the KV cache sizing kept back (kv_cache.graph_memory_reserve),
        and a warning when they took more."""
        device = self.buffers.device
        cols = self.buffers.max_cols
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        pool = None
        # One warm-up stream for every size: cuBLAS keeps a workspace (up to 32 MiB) per stream
        # it has run on until the process ends, so a stream per size would hold one per size.
        stream = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            empty = DecodeInputs([], [], [], [], torch.empty((0, cols), dtype=torch.long))
            views = self.buffers.stage(pad_decode(empty, size, null_block, block_size))
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up: lazy initialisation and allocator growth
                forward(size, views)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, aux = forward(size, views)
            if pool is None:
                pool = graph.pool()
            self._graphs[size] = _Captured(graph, hidden, aux)
        torch.cuda.synchronize(device)
        self.memory = used = free_before - torch.cuda.mem_get_info(device)[0]
        log.info("cuda graphs: captured %d decode sizes (%d..%d) in %.2f s, %.0f MiB (estimated %.0f MiB)",
                 len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - t0, used / 2**20,
                 reserve / 2**20)
        if used > reserve > 0:
            log.warning("cuda graphs took %.0f MiB, more than the %.0f MiB the KV cache left for them",
                        used / 2**20, reserve / 2**20)

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_size(num_seqs, self.sizes) if self._graphs else None

    def replay(self, size: int, num_seqs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the graph of `size` over the staged buffers; the first num_seqs rows' hidden
        states and kept layer inputs (valid until the next replay)."""
        captured = self._graphs[size]
        captured.graph.replay()
        return captured.hidden[:num_seqs], [a[:num_seqs] for a in captured.aux]


class ModelFacts(Protocol):
    """What the decision to capture and the graphs' shapes read of the model's spec."""

    @property
    def num_experts(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def graphs_wanted(config: EngineConfig, device: torch.device, spec: ModelFacts, attention: AttentionBackend,
                  tp_size: int, pooling: bool) -> bool:
    """CUDA graphs on one CUDA rank, unless --enforce-eager, with an attention backend whose
    decode steps a graph can replay (`graph_safe`: the torch backend's prepare() only takes
    views of the buffers; the kernel backend's prepare_graph() fixes its launches per bucket)."""
    if device.type != "cuda" or config.enforce_eager or pooling:
        return False  # a pooling engine's steps are prefills: nothing for a decode graph
    if spec.num_experts:
        # Each MoE layer reads its experts' row counts on the host, which a graph cannot replay.
        worker_log.info("cuda graphs: off (mixture-of-experts layers group their tokens by expert on the host)")
        return False
    if tp_size > 1 or not getattr(attention, "graph_safe", False):
        worker_log.info("cuda graphs: off (%s)", "tensor parallel" if tp_size > 1
                        else f"the {attention.name} attention backend runs eagerly")
        return False
    return True


def planned_graphs(config: EngineConfig, device: torch.device, spec: ModelFacts, shapes: RankShapes,
                   attention: AttentionBackend, tp_size: int, pooling: bool, buffers: DecodeBuffers,
                   sizes: Sequence[int], dtype: torch.dtype, aux_layers: int = 0) -> GraphShapes | None:
    """What the decode graphs of `sizes` over `buffers` will allocate on this rank (`shapes`:
    its slice of the model; `aux_layers`: the layer inputs it keeps for an EAGLE-3 head), for
    kv_cache.graph_memory_reserve; None where the worker captures none (graphs_wanted says why
    in the log)."""
    if not graphs_wanted(config, device, spec, attention, tp_size, pooling):
        return None
    return GraphShapes(tuple(sizes), spec.hidden_size, shapes.num_heads, shapes.num_kv_heads, spec.head_dim,
                       shapes.intermediate_size, buffers.max_cols, dtype, aux_layers)


def decode_forward(model: CausalLM, attention: AttentionBackend,
                   kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]], block_size: int, size: int,
                   views: DecodeViews) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The decode forward pass a graph of `size` rows captures: every row's block table at
    full width (the lengths on the device bound what each row reads)."""
    assert views.input_ids.shape[0] == size
    meta = graph_metadata(views, block_size)
    # A backend that plans launches on the host fixes them per bucket in prepare_graph.
    getattr(attention, "prepare_graph", attention.prepare)(meta)
    hidden = model(views.input_ids, views.positions, meta, attention, kv_layers)
    return hidden, list(model.captured)


def capture_graphs(buffers: DecodeBuffers, sizes: Sequence[int], forward: DecodeForward, null_block: int,
                   block_size: int, reserve: int) -> DecodeGraphs | None:
    """The decode graphs of `sizes`, captured after the KV cache that they address; None when
    the capture runs out of memory."""
    graphs = DecodeGraphs(buffers, sizes)
    try:
        with torch.inference_mode():  # as the steps run: no autograd state in the graphs
            graphs.capture(forward, null_block, block_size, reserve=reserve)
    except torch.cuda.OutOfMemoryError as e:
        # The KV cache took the memory first; serving eagerly beats not serving.
        worker_log.warning("cuda graphs: off, out of memory while capturing (%s); decode steps run eagerly", e)
    else:
        return graphs
    # Out here the error's frames are gone too, so nothing holds the partial graphs' pool.
    del graphs
    torch.cuda.empty_cache()
    return None
