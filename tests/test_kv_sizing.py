"""KV cache sizing (worker/kv_cache.py): --gpu-memory-utilization against a fake device's
memory, the overrides, the CPU's rule, the start-up line, and the profiling steps' shapes.
The expected block counts are worked out here by hand from the numbers, not by the code."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from noria.protocol.config import EngineConfig
from noria.worker.errors import WorkerFatal
from noria.worker.kv_cache import (
    GRAPH_POOL_OVERHEAD,
    GiB,
    GraphShapes,
    KVLayout,
    capacity_line,
    graph_memory_reserve,
    kv_blocks_from_memory,
    needs_profile,
    num_device_blocks,
)
from noria.worker.memory_profile import profile_batches

MiB = 1 << 20


@dataclass
class FakeMemory:
    """A device as DeviceMemory reports it (bytes)."""

    total_: int
    free_: int
    weights_: int
    peak_: int

    def total(self) -> int:
        return self.total_

    def free(self) -> int:
        return self.free_

    def weights(self) -> int:
        return self.weights_

    def peak(self) -> int:
        return self.peak_


H100 = FakeMemory(total_=80 * GiB, free_=60 * GiB, weights_=16 * GiB, peak_=2 * GiB)
# 32 layers x 8 KV heads x head size 128, bfloat16, blocks of 16: 2 x 32 x 16 x 8 x 128 x 2 = 2 MiB.
LLAMA8B = KVLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def test_the_layout_s_block_is_two_mib() -> None:
    assert LLAMA8B.bytes_per_block == 2 * MiB


def test_the_cache_takes_what_utilization_leaves_after_weights_and_peak() -> None:
    # 0.9 x 80 = 72 GiB; minus 16 (weights) and 2 (peak) = 54 GiB = 54 x 512 blocks of 2 MiB.
    assert kv_blocks_from_memory(H100, 0.9, 2 * MiB) == 54 * 512
    assert kv_blocks_from_memory(H100, 0.5, 2 * MiB) == 22 * 512  # 40 - 18 GiB
    # The graph reserve comes out of it too: 1 GiB fewer.
    assert kv_blocks_from_memory(H100, 0.9, 2 * MiB, graph_reserve=GiB) == 53 * 512


def test_whole_blocks_only() -> None:
    block = 3 * MiB + 7
    mem = FakeMemory(total_=100 * block + block - 1 + 10 * GiB, free_=200 * GiB, weights_=10 * GiB, peak_=0)
    # utilization 1.0: the budget is 100 blocks and block - 1 bytes: rounded down to 100.
    assert kv_blocks_from_memory(mem, 1.0, block) == 100


def test_never_more_than_is_free_beside_the_peak() -> None:
    # Another process holds most of the device: 5 GiB free though the budget is 54 GiB; the
    # step's 2 GiB peak must still fit beside the cache, and so must the graphs' 1 GiB.
    crowded = FakeMemory(total_=80 * GiB, free_=5 * GiB, weights_=16 * GiB, peak_=2 * GiB)
    assert kv_blocks_from_memory(crowded, 0.9, 2 * MiB) == 3 * 512
    assert kv_blocks_from_memory(crowded, 0.9, 2 * MiB, graph_reserve=GiB) == 2 * 512


@pytest.mark.parametrize("mem, utilization", [
    (FakeMemory(total_=24 * GiB, free_=20 * GiB, weights_=16 * GiB, peak_=4 * GiB), 0.8),  # budget < 0
    (FakeMemory(total_=24 * GiB, free_=MiB, weights_=16 * GiB, peak_=GiB), 0.9),  # 1 MiB free < one block
])
def test_too_little_memory_is_one_sentence_with_the_numbers(mem: FakeMemory, utilization: float) -> None:
    with pytest.raises(WorkerFatal) as e:
        kv_blocks_from_memory(mem, utilization, 2 * MiB)
    text = str(e.value)
    assert "\n" not in text and text.count(". ") == 0, text
    assert f"--gpu-memory-utilization {utilization:g}" in text and "24.00 GiB" in text and "16.00 GiB" in text
    assert "2097152 bytes" in text and "--kv-cache-memory" in text


def test_overrides_win_over_the_profile() -> None:
    tight = FakeMemory(total_=8 * GiB, free_=0, weights_=8 * GiB, peak_=GiB)  # would not fit a block
    assert num_device_blocks(EngineConfig(num_kv_blocks=77), LLAMA8B, 4096, tight) == 77
    assert num_device_blocks(EngineConfig(kv_cache_memory=1.5), LLAMA8B, 4096, tight) == 768
    assert num_device_blocks(EngineConfig(gpu_memory_utilization=0.9), LLAMA8B, 4096, H100) == 54 * 512
    with pytest.raises(WorkerFatal):
        num_device_blocks(EngineConfig(), LLAMA8B, 4096, tight)


# Llama 3 8B's shapes on one rank, graphs of 1, 2, 4 and 8 rows, 4096-token rows in blocks of 16.
LLAMA8B_GRAPHS = GraphShapes(sizes=(1, 2, 4, 8), hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                             intermediate_size=14336, max_blocks=256, dtype=torch.bfloat16)


def test_graph_reserve_is_the_largest_graph_s_activations_and_every_output() -> None:
    # Per row, in bfloat16: 5 x 4096 (hidden, residual, norm, o_proj and MLP outputs)
    # + (32 + 2 x 8) x 128 (q, k, v) + 32 x 128 (attention output) + 3 x 14336 (gate, up, SiLU)
    # = 20480 + 6144 + 4096 + 43008 = 73728 elements = 147456 bytes; 8 rows: 1179648 bytes.
    # Outputs: (1 + 2 + 4 + 8) x 4096 x 2 = 122880 bytes. Tables: int32 8 x (256 + 1) = 8224 bytes.
    want = GRAPH_POOL_OVERHEAD + 1179648 + 122880 + 8224
    assert graph_memory_reserve(EngineConfig(), LLAMA8B_GRAPHS) == want
    # No graphs (a CPU, tensor parallel, ...: the worker passes None), or --enforce-eager: nothing.
    assert graph_memory_reserve(EngineConfig(), None) == 0
    assert graph_memory_reserve(EngineConfig(enforce_eager=True), LLAMA8B_GRAPHS) == 0
    # Twice the rows in the largest graph: twice its activations and tables, one more output.
    wider = GraphShapes(**{**LLAMA8B_GRAPHS.__dict__, "sizes": (1, 2, 4, 8, 16)})
    assert graph_memory_reserve(EngineConfig(), wider) == GRAPH_POOL_OVERHEAD + 2 * (1179648 + 8224) + 31 * 8192


def test_the_graph_reserve_comes_out_of_the_kv_cache() -> None:
    reserve = graph_memory_reserve(EngineConfig(), LLAMA8B_GRAPHS)
    assert reserve == GRAPH_POOL_OVERHEAD + 1310752  # 129.25 MiB: 65 blocks of 2 MiB
    # 54 GiB after weights and peak (see above), less the reserve, in whole 2 MiB blocks.
    want = (54 * GiB - reserve) // (2 * MiB)
    assert want == 54 * 512 - 65
    assert num_device_blocks(EngineConfig(), LLAMA8B, 4096, H100, LLAMA8B_GRAPHS) == want
    assert num_device_blocks(EngineConfig(), LLAMA8B, 4096, H100, None) == 54 * 512
    # On a CPU (no device memory) the graphs change nothing.
    assert num_device_blocks(EngineConfig(max_num_seqs=4), LLAMA8B, 4096, None, LLAMA8B_GRAPHS) == 512


def test_only_a_gpu_without_a_size_given_is_profiled() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert needs_profile(EngineConfig(), cuda)
    assert not needs_profile(EngineConfig(), cpu)
    assert not needs_profile(EngineConfig(num_kv_blocks=4), cuda)
    assert not needs_profile(EngineConfig(kv_cache_memory=1.0), cuda)


def test_the_cpu_keeps_its_rule() -> None:
    # No device memory: every sequence at full length (4 x 256 blocks) under the 1 GiB cap (512 blocks).
    assert num_device_blocks(EngineConfig(max_num_seqs=4), LLAMA8B, 4096, None) == 512
    assert num_device_blocks(EngineConfig(max_num_seqs=1), LLAMA8B, 4096, None) == 256


def test_tensor_parallel_ranks_size_alone_and_the_group_takes_the_smallest() -> None:
    # Two ranks of one group on devices with different free memory: each sizes its own cache;
    # the scheduler plans with the smallest (scheduler/worker_group.py, test_worker_group.py).
    rank0 = kv_blocks_from_memory(H100, 0.9, 2 * MiB)
    rank1 = kv_blocks_from_memory(FakeMemory(80 * GiB, 30 * GiB, 16 * GiB, 2 * GiB), 0.9, 2 * MiB)
    assert (rank0, rank1) == (54 * 512, 28 * 512)  # rank 1: 30 GiB free less its 2 GiB peak


def test_the_start_up_line() -> None:
    # 1000 blocks of 16 = 16000 tokens; a 4096-token sequence takes 256 blocks: 3 fit.
    assert capacity_line(1000, 16, 4096) == "KV cache: 1000 blocks, 16000 tokens, 3 sequences of max_model_len 4096"
    assert capacity_line(1000, 16, 100) == "KV cache: 1000 blocks, 16000 tokens, 142 sequences of max_model_len 100"


def test_profiling_steps_are_the_longest_chunk_and_the_widest_batch() -> None:
    assert profile_batches(2048, 256, 4096) == [[2048], [8] * 256]
    assert profile_batches(2048, 3, 4096) == [[2048], [683, 683, 682]]
    assert profile_batches(100, 256, 4096) == [[100], [1] * 100]
    # Sequences no longer than max_model_len: 8192 tokens, 2 sequences of at most 1000.
    assert profile_batches(8192, 2, 1000) == [[1000], [1000, 1000]]


class FakeCudaCounters:
    """torch.cuda's memory counters, driven by hand: the profiling pass runs its steps on the
    CPU while the counters report what the test says."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.allocated = 5 * GiB
        self.step_peaks = [3 * GiB, 1 * GiB]  # above the base of each step, in order
        self.steps = 0
        for name in ("synchronize", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self._peak)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (50 * GiB, 80 * GiB))

    def _peak(self, *a: object) -> int:
        self.steps += 1
        return self.allocated + self.step_peaks[self.steps - 1]


def test_the_profiling_pass_runs_the_worst_steps_and_leaves_nothing_behind(
    demo_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU (the counters faked): both steps run through the runner with sampling and
    prompt logprobs, the larger peak is kept, and no request or cache is left."""
    from noria.worker.memory_profile import profile_memory
    from noria.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(demo_path), num_kv_blocks=8, max_num_batched_tokens=96,
                                      max_num_seqs=5, max_model_len=64, num_threads=2))
    layout = runner.kv_cache.layout
    executed: list[tuple[int, int]] = []
    run = runner.execute

    def execute(plan):  # type: ignore[no-untyped-def]
        result = run(plan)
        if plan.scheduled:
            executed.append((len(plan.scheduled), len(result.req_ids)))
            assert result.prompt_logprobs and all(p is not None for p in result.prompt_logprobs)
        return result

    monkeypatch.setattr(runner, "execute", execute)
    counters = FakeCudaCounters(monkeypatch)
    memory = profile_memory(runner, layout)
    # One 64-token chunk, then 96 tokens over 5 sequences: every sequence sampled.
    assert executed == [(1, 1), (5, 5)]
    assert counters.steps == 2
    assert (memory.weights(), memory.peak(), memory.total(), memory.free()) == (5 * GiB, 3 * GiB, 80 * GiB, 50 * GiB)
    assert runner.requests == {} and runner.kv_cache is None
