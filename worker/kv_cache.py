"""Device KV cache and CPU swap area: sizing, allocation and swaps.

Both live in one tensor each, [num_layers, 2 (K, V), num_blocks, block_size,
num_kv_heads, head_dim], so a swap of any set of blocks is one batched
operation over every layer, K and V at once: with `block_copier` set (the kernel
attention backend's `copy_blocks`, on CUDA) one `copy_blocks` kernel launch that
reads and writes the pinned CPU area directly through UVA; otherwise an
index_select + index_copy_.

Stream order (CUDA): the copies go on torch's current stream, the one the
forward pass runs on, so a swap-out finishes before the step overwrites its
source blocks and a swap-in before the step reads its blocks, with no host
synchronisation. The launch returns at once: the host builds the step's batch
(ModelRunner._prepare) while the copy runs. Nothing on the host reads the CPU
area; it is only ever read back by a later swap-in on the same stream.

An fp8 cache (worker/kv_fp8.py) is one byte per value, so a block takes a quarter of a float32
one's bytes (--kv-cache-memory holds 4x the blocks) and swaps move its bytes as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from noria.protocol.config import EngineConfig
from noria.worker.errors import WorkerFatal
from noria.worker.kv_fp8 import as_bytes, describe

GiB = 1 << 30
# copy_blocks(src_caches, dst_caches, block_mapping [pairs, 2]): dst[c][d] = src[c][s].
BlockCopier = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], torch.Tensor], None]
DEFAULT_KV_CACHE_GIB = 1.0


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # A draft model's cache, in the same block ids (worker/draft_model.py): sized with the target's.
    draft_bytes_per_block: int = 0

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem \
            + self.draft_bytes_per_block


class DeviceMemory(Protocol):
    """What KV cache sizing reads of a GPU, in bytes (CudaMemory; a fake one in tests)."""

    def total(self) -> int:
        """The device's memory in all."""

    def free(self) -> int:
        """Free now (after the profiling pass, its activations released): other processes and
        the CUDA context are already out of it."""

    def weights(self) -> int:
        """Held by the loaded model."""

    def peak(self) -> int:
        """The profiling forward's peak above the weights (activations, logits, sampling)."""


# What capturing the decode graphs costs beyond the activations counted below: cuBLAS's
# workspaces for the warm-up stream and the capture stream (up to 32 MiB each on sm_90, kept
# per stream), the caching allocator's segments in the graphs' pool (2 MiB for small blocks,
# 20 MiB and up for large ones, each only partly used) and the driver's graph objects.
GRAPH_POOL_OVERHEAD = 128 << 20


@dataclass(frozen=True)
class GraphShapes:
    """What the decode graphs a worker captures allocate, from its model's shapes on this rank."""

    sizes: tuple[int, ...]  # the captured batch sizes
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_blocks: int  # block-table columns of a row (graphs read tables at full width)
    dtype: torch.dtype
    aux_layers: int = 0  # layer inputs kept for an EAGLE-3 head, outputs of every graph too


def graph_memory_reserve(config: EngineConfig, graphs: GraphShapes | None) -> int:
    """Bytes the KV cache leaves for CUDA graph capture, estimated before capture from the
    model's shapes (`graphs`, None where the worker captures none: a CPU, --enforce-eager, ...).

    The graphs share one memory pool and are captured largest first, so what the pool holds
    is the activations of the largest size's forward pass (a decode layer's intermediates per
    row: hidden states, residual, norm and projection outputs, q/k/v, the attention output,
    gate/up, the MLP's activation and output; all counted as live at once, an upper bound)
    plus every graph's output rows (hidden states, and the layer inputs an EAGLE-3 head reads),
    which stay allocated for its replays, plus the int32 block
    tables of the kernels' graph path (kernels/graph_plan.py) and GRAPH_POOL_OVERHEAD. The
    capture logs what it really took beside this estimate (worker/cuda_graphs.py)."""
    if graphs is None or not graphs.sizes or config.enforce_eager:
        return 0
    g = graphs
    elem = torch.empty((), dtype=g.dtype).element_size()
    per_row = elem * (5 * g.hidden_size + (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
                      + g.num_heads * g.head_dim + 3 * g.intermediate_size)
    largest = max(g.sizes)
    outputs = elem * g.hidden_size * sum(g.sizes) * (1 + g.aux_layers)
    tables = 4 * largest * (g.max_blocks + 1)
    return GRAPH_POOL_OVERHEAD + largest * per_row + outputs + tables


def kv_blocks_from_memory(memory: DeviceMemory, utilization: float, bytes_per_block: int,
                          graph_reserve: int = 0) -> int:
    """Device KV blocks for --gpu-memory-utilization: the worker may use `utilization` x total;
    weights, the profiled peak and the graph reserve come out of it, the cache takes the rest,
    in whole blocks, and never more than is actually free once the peak and the graphs have
    their room (other processes may hold part of the device). Raises WorkerFatal (one sentence
    with the numbers) when not one block fits. Each tensor-parallel rank sizes its own; the
    scheduler uses the smallest count of the group (scheduler/worker_group.py)."""
    total, free, weights, peak = memory.total(), memory.free(), memory.weights(), memory.peak()
    budget = int(utilization * total) - weights - peak - graph_reserve
    available = min(budget, free - peak - graph_reserve)
    blocks = max(0, available) // bytes_per_block
    if blocks < 1:
        raise WorkerFatal(
            f"no room for the KV cache: --gpu-memory-utilization {utilization:g} of {_gib(total)} GiB is "
            f"{_gib(int(utilization * total))} GiB, of which the weights take {_gib(weights)} GiB, the profiled "
            f"peak {_gib(peak)} GiB and CUDA graphs {_gib(graph_reserve)} GiB, with {_gib(free)} GiB free, "
            f"and one KV block needs {bytes_per_block} bytes: raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens, or give --kv-cache-memory"
        )
    return blocks


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def num_device_blocks(config: EngineConfig, layout: KVLayout, max_model_len: int,
                      memory: DeviceMemory | None = None, graphs: GraphShapes | None = None) -> int:
    """--num-kv-blocks, else --kv-cache-memory, else (on a GPU, `memory` given) what
    --gpu-memory-utilization leaves beside the CUDA graphs' reserve, else (a CPU) the default
    below."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        blocks = int(config.kv_cache_memory * GiB) // layout.bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory} GiB holds no KV block "
                f"({layout.bytes_per_block} bytes each)"
            )
        return blocks
    if memory is not None:
        return kv_blocks_from_memory(memory, config.gpu_memory_utilization, layout.bytes_per_block,
                                     graph_memory_reserve(config, graphs))
    # A CPU: enough for every sequence at full length, but never more than a modest
    # default, so that an idle server does not reserve the whole machine.
    per_seq = -(-max_model_len // layout.block_size)
    cap = max(1, int(DEFAULT_KV_CACHE_GIB * GiB) // layout.bytes_per_block)
    return min(config.max_num_seqs * per_seq, cap)


def needs_profile(config: EngineConfig, device: torch.device) -> bool:
    """Whether the KV cache is sized from a profiling pass (a GPU with no size given)."""
    return device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory is None


def capacity_line(num_blocks: int, block_size: int, max_model_len: int, dtype: torch.dtype | None = None) -> str:
    """The start-up line: how many sequences of full length fit at once (and in what dtype)."""
    tokens = num_blocks * block_size
    per_seq = -(-max_model_len // block_size)
    line = (f"KV cache: {num_blocks} blocks, {tokens} tokens, {num_blocks // per_seq} sequences of "
            f"max_model_len {max_model_len}")
    return line if dtype is None else f"{line}, {describe(dtype)}"


def num_swap_blocks(config: EngineConfig, layout: KVLayout) -> int:
    # Only swap preemption uses the area; pinned host memory is not free on a GPU host.
    if config.preemption_mode != "swap":
        return 0
    return int(config.swap_space * GiB) // layout.bytes_per_block


class KVCache:
    """Device cache with a trailing zero "null block", plus the CPU swap area."""

    def __init__(self, layout: KVLayout, num_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.null_block = num_blocks
        shape = (layout.num_layers, 2, num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.head_dim)
        # Zeroed, and so committed, at start-up (as vLLM does): the page faults of the whole
        # cache are paid here, not by the first requests to touch each block (~1 s of W1's
        # ~45 s over 2,400 fresh blocks), and a cache too large for the host fails at start-up,
        # not mid-serving. (What a block holds past a sequence's length never reaches an
        # output: see TorchAttentionBackend._decode.)
        self.device_cache = torch.zeros(shape, dtype=layout.dtype, device=device)
        cpu_shape = (layout.num_layers, 2, num_cpu_blocks, *shape[3:])
        self.cpu_cache = torch.empty(
            cpu_shape, dtype=layout.dtype, device="cpu", pin_memory=device.type == "cuda"
        )
        self.device = device
        self.block_copier: BlockCopier | None = None

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V cache of one layer, each [num_blocks + 1, block_size, num_kv_heads, head_dim]."""
        return self.device_cache[index, 0], self.device_cache[index, 1]

    def check_blocks(self, block_ids: list[int], what: str) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise ValueError(f"{what}: block id out of range [0, {self.num_blocks}): {block_ids}")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> CPU block for every (device_block, cpu_block) pair."""
        if not pairs:
            return
        dev, cpu = zip(*pairs, strict=True)
        self.check_blocks([*dev], "swap_out")
        self._check_cpu([*cpu], "swap_out")
        if self.block_copier is not None:
            self._copy_kernel(self.device_cache, self.cpu_cache, pairs)
            return
        moved = as_bytes(self.device_cache).index_select(2, self._index(dev)).to("cpu")
        as_bytes(self.cpu_cache).index_copy_(2, torch.tensor(cpu, dtype=torch.long), moved)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU block -> device block for every (device_block, cpu_block) pair."""
        if not pairs:
            return
        dev, cpu = zip(*pairs, strict=True)
        self.check_blocks([*dev], "swap_in")
        self._check_cpu([*cpu], "swap_in")
        if self.block_copier is not None:
            self._copy_kernel(self.cpu_cache, self.device_cache, [(c, d) for d, c in pairs])
            return
        moved = as_bytes(self.cpu_cache).index_select(2, torch.tensor(cpu, dtype=torch.long))
        as_bytes(self.device_cache).index_copy_(2, self._index(dev), moved.to(self.device, non_blocking=True))

    def _copy_kernel(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """One launch for every layer's K and V: per-layer views of the two areas."""
        assert self.block_copier is not None
        views = [(src[layer, kv], dst[layer, kv]) for layer in range(self.layout.num_layers) for kv in (0, 1)]
        mapping = torch.tensor(pairs, dtype=torch.int64)
        self.block_copier([s for s, _ in views], [d for _, d in views], mapping)

    def _check_cpu(self, block_ids: list[int], what: str) -> None:
        if min(block_ids) < 0 or max(block_ids) >= self.num_cpu_blocks:
            raise ValueError(f"{what}: CPU block id out of range [0, {self.num_cpu_blocks}): {block_ids}")

    def _index(self, ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)
