"""Graph-mode decode on the kernels (kernels/graph_plan.py) under the CPU emulator.

A CUDA graph replays its launches with the grids and arguments of the capture, so a
graph-mode decode step is right only if (1) its answer comes from buffer contents alone and
(2) its launches never change between steps of one bucket. Here one bucket's persistent
buffers (worker/cuda_graphs.DecodeBuffers, the metadata the worker builds for a graph) serve
step after step of different batches: a long context that splits beside short ones, a context
as long as the table allows, padded rows. Every step must match the float64 reference and
launch the same kernels with the same grids and the same arguments (pointers and scalars) as
the first; mutants that plan the split from the step's lengths, or hand the kernels fresh
tables or scratch, must fail that check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from noria.kernels import instances, reference
from noria.kernels.attention_backend import KernelAttentionBackend
from noria.kernels.graph_plan import FixedSplit, GraphDecode, fixed_split
from noria.kernels.instances import AttentionConfig, ModuleSpec
from noria.kernels.launch_plan import DEFAULT_PARTITION_SIZE, SINGLE_PARTITION
from noria.kernels.scenes import TORCH_DTYPES, assert_matches
from noria.worker.attention import LayerAttention
from noria.worker.cuda_graphs import DecodeBuffers, DecodeInputs, graph_metadata, pad_decode

CONFIGS = [AttentionConfig("float32", 64, 16), AttentionConfig("bfloat16", 64, 16)]
ROWS, COLS = 4, 64  # the bucket; the longest context is COLS x 16 = 1024 tokens
NUM_BLOCKS = 160  # the null block is the last, index NUM_BLOCKS
HEADS, KV_HEADS = 8, 2
LAYERS = [
    LayerAttention(HEADS, KV_HEADS, 64, scale=0.125),
    LayerAttention(HEADS, KV_HEADS, 64, scale=0.125, sliding_window=100, logits_soft_cap=2.0),
]
# Each step's real context lengths (the rest of the bucket is padding): a 600-token context
# that splits beside short ones, one of the table's full length, one short row alone.
STEPS = [[600, 1, 17, 33], [5, 300], [16, COLS * 16, 2], [1]]


def emu_specs(params: dict[str, Any]) -> list[ModuleSpec]:
    worker = AttentionConfig("float32", 64, 8)  # the worker test's model
    return [
        *(spec for c in CONFIGS for spec in (instances.reshape_module(c.dtype), instances.decode_module(c))),
        instances.fused_module("float32"), instances.decode_module(worker), instances.prefill_module(worker),
    ]


def _arg(a: Any) -> Any:
    if isinstance(a, np.ndarray):  # the emulator's pointer argument: a view at the address
        return ("ptr", a.__array_interface__["data"][0])
    if isinstance(a, np.generic):
        return (a.dtype.str, a.item())
    return a


class Recorder:
    """An emulator backend that records every launch: kernel, grid, block, shared memory and
    argument values (pointers as addresses)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.launches: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def kernel(self, spec: ModuleSpec, name: str) -> Any:
        kern = self.backend.kernel(spec, name)

        def launch(grid: Any, block: Any, args: Any, shared_mem: int = 0) -> None:
            self.launches.append((name, tuple(grid), tuple(block), shared_mem, tuple(_arg(a) for a in args)))
            kern(grid, block, args, shared_mem=shared_mem)

        return launch


def run_steps(emu_backend: Any, cfg: AttentionConfig) -> list[list[tuple[Any, ...]]]:
    """Every STEPS batch through one bucket's buffers, both layers per step; checks each real
    row against the float64 reference and that the padded rows wrote only the null block.
    Returns each step's launches, the step's attention outputs' addresses named "out"."""
    recorder = Recorder(emu_backend)
    backend = KernelAttentionBackend(backend=recorder)
    dtype, bs, d = TORCH_DTYPES[cfg.dtype], cfg.block_size, cfg.head_dim
    null = NUM_BLOCKS
    g = torch.Generator().manual_seed(7)
    shape = (NUM_BLOCKS + 1, bs, KV_HEADS, d)
    k_cache = torch.empty(shape, dtype=dtype)
    v_cache = torch.empty(shape, dtype=dtype)
    buffers = DecodeBuffers(ROWS, COLS, torch.device("cpu"))
    # The step's new rows, persistent as a graph's activations are.
    q = torch.empty(ROWS, HEADS, d, dtype=dtype)
    k = torch.empty(ROWS, KV_HEADS, d, dtype=dtype)
    v = torch.empty(ROWS, KV_HEADS, d, dtype=dtype)
    # Every step's metadata and outputs stay alive, so that a tensor made afresh on a later
    # step cannot land at a freed address of an earlier one and pass for the same buffer.
    kept: list[Any] = []
    steps = []
    for lens in STEPS:
        n = len(lens)
        perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        tables = torch.full((n, COLS), null, dtype=torch.long)
        for s, length in enumerate(lens):
            for b in range(-(-length // bs)):
                tables[s, b] = perm.pop()
        # NaN wherever no real row's context lies: a kernel reading it shows NaN.
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        for s, length in enumerate(lens):
            pos = torch.arange(length - 1)  # the cached context; the step writes the last key
            blocks = tables[s, pos // bs]
            k_cache[blocks, pos % bs] = torch.randn(len(pos), KV_HEADS, d, generator=g).to(dtype)
            v_cache[blocks, pos % bs] = torch.randn(len(pos), KV_HEADS, d, generator=g).to(dtype)
        positions = [length - 1 for length in lens]
        slots = [int(tables[s, p // bs]) * bs + p % bs for s, p in enumerate(positions)]
        inputs = pad_decode(DecodeInputs([0] * n, positions, slots, list(lens), tables), ROWS, null, bs)
        meta = graph_metadata(buffers.stage(inputs), bs)
        q.copy_(torch.randn(ROWS, HEADS, d, generator=g))
        k.copy_(torch.randn(ROWS, KV_HEADS, d, generator=g))
        v.copy_(torch.randn(ROWS, KV_HEADS, d, generator=g))
        if backend.graph._scratch is not None:
            backend.graph._scratch.fill_(float("nan"))  # partials from an earlier step must not count
        before_k, before_v = k_cache.clone(), v_cache.clone()

        recorder.launches = []
        backend.prepare_graph(meta)
        outs = [backend.forward(layer, q, k, v, k_cache, v_cache, meta) for layer in LAYERS]
        kept.append((meta, outs))

        # Only the real rows' slots and the null block changed.
        changed = torch.zeros(NUM_BLOCKS + 1, bs, dtype=torch.bool)
        changed[null] = True
        for slot in slots:
            changed[slot // bs, slot % bs] = True
        for after, before in ((k_cache, before_k), (v_cache, before_v)):
            same = (after == before) | (after.isnan() & before.isnan())
            assert same[~changed].all(), "a padded row wrote outside the null block"
        lens_t = torch.tensor(lens, dtype=torch.int32)
        for layer, out in zip(LAYERS, outs, strict=True):
            expected = reference.paged_attention_decode(
                q[:n], k_cache, v_cache, tables.to(torch.int32), lens_t, layer.scale,
                window=layer.sliding_window, soft_cap=layer.logits_soft_cap)
            assert_matches(out[:n], expected, cfg.dtype)
            assert not out[n:].isnan().any(), "a padded row produced NaN"
        names = {out.data_ptr(): "out" for out in outs}
        steps.append([(*launch[:4], tuple(("ptr", names.get(a[1], a[1])) if isinstance(a, tuple) and a[0] == "ptr"
                                          else a for a in launch[4]))
                      for launch in recorder.launches])
    return steps


def assert_same_launches(steps: list[list[tuple[Any, ...]]]) -> None:
    first = steps[0]
    for i, launches in enumerate(steps[1:], start=1):
        assert len(launches) == len(first), f"step {i} launched {len(launches)} kernels, step 0 {len(first)}"
        for a, b in zip(first, launches, strict=True):
            assert a == b, f"step {i} launched differently:\n  step 0: {a}\n  step {i}: {b}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.dtype)
def test_graph_decode_steps_share_launches_and_match_reference(emu: Any, cfg: AttentionConfig) -> None:
    steps = run_steps(emu("greedy-reverse"), cfg)
    assert_same_launches(steps)
    names = [launch[0].partition("<")[0] for launch in steps[0]]
    # The full layer splits (a merge follows its decode launch); the windowed one does not.
    merge = "paged_attention_decode_gqa_merge" if cfg.dtype != "float32" else "paged_attention_reduce"
    decode = "paged_attention_decode_gqa" if cfg.dtype != "float32" else "paged_attention_decode"
    assert names == ["reshape_and_cache", decode, merge, "reshape_and_cache", decode]


def _split_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager plan: the split from the step's longest context, read from the device."""
    real = GraphDecode._launch

    def per_step(self: GraphDecode, be: Any, step: Any, *args: Any) -> Any:
        self._launches.clear()
        return real(self, be, dataclasses.replace(step, max_len=int(step.seq_lens.max())), *args)

    monkeypatch.setattr(GraphDecode, "_launch", per_step)


def _fresh_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """int32 tables and lengths made afresh each step (as the eager prepare() converts them)."""
    monkeypatch.setattr(GraphDecode, "_buffers", lambda self, rows, cols, device: (
        torch.zeros((rows, cols), dtype=torch.int32, device=device), torch.ones(rows, dtype=torch.int32, device=device)))


def _fresh_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-K partials allocated per step (as the eager launch does)."""
    real = GraphDecode._launch
    old: list[Any] = []  # kept alive, so that a new buffer cannot reuse an old one's address

    def fresh(self: GraphDecode, *args: Any) -> Any:
        old.append((dict(self._launches), self._scratch))
        self._launches.clear()
        self._scratch = None
        return real(self, *args)

    monkeypatch.setattr(GraphDecode, "_launch", fresh)


@pytest.mark.parametrize("mutant", [_split_per_step, _fresh_tables, _fresh_scratch],
                         ids=["split-per-step", "fresh-tables", "fresh-scratch"])
def test_mutants_change_launches(emu: Any, monkeypatch: pytest.MonkeyPatch,
                                 mutant: Callable[[pytest.MonkeyPatch], None]) -> None:
    """Each mutant still computes the right values (run_steps checks them) but launches
    differently from step to step, which a replayed graph would not: the check must see it."""
    mutant(monkeypatch)
    steps = run_steps(emu("forward"), CONFIGS[1])
    with pytest.raises(AssertionError, match="launched differently"):
        assert_same_launches(steps)


def test_fixed_split_rules() -> None:
    """The bucket's split: the eager planners' choice for rows that all have the longest
    context, on the GPU's SM count."""
    f32, bf16 = CONFIGS
    # float32: a context of 1024 tokens or more splits into 512-token partitions while
    # rows x heads leave SMs idle (132 SMs: below 4 x 132 = 528 CTAs).
    assert fixed_split(f32, 4, 4096, 32, 8, 132) == FixedSplit(8, DEFAULT_PARTITION_SIZE)
    assert fixed_split(f32, 4, 1000, 32, 8, 132) == FixedSplit(1, SINGLE_PARTITION)
    assert fixed_split(f32, 17, 4096, 32, 8, 132) == FixedSplit(1, SINGLE_PARTITION)  # 544 CTAs
    # A window bounds the span: its keys start at most 15 tokens into their first block.
    assert fixed_split(f32, 4, 4096, 32, 8, 132, window=1500) == FixedSplit(3, DEFAULT_PARTITION_SIZE)
    # Tensor cores: items x KV heads fill 2 x 132 CTAs: 4 rows x 8 KV heads -> 8 items per
    # row, 4096 / 8 = 512-token partitions; a bucket that fills the GPU does not split.
    assert fixed_split(bf16, 4, 4096, 32, 8, 132) == FixedSplit(8, 512)
    assert fixed_split(bf16, 64, 4096, 32, 8, 132) == FixedSplit(1, SINGLE_PARTITION)
    assert fixed_split(bf16, 4, 4096, 32, 8, 132, window=256) == FixedSplit(1, SINGLE_PARTITION)


# -- the worker ---------------------------------------------------------------------

# head size 64 over 4 query / 2 KV heads, and a context of 2048 tokens: a graph's rows span
# 256 blocks of 8, so the float32 kernel's fixed split has 4 partitions, 3 of them empty here.
OVERRIDES = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.tiny_models import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("graph-kernels") / "llama", **OVERRIDES)


def test_worker_graph_steps_on_kernels_match_eager(emu: Any, checkpoint: Any) -> None:
    """The ModelRunner with attention on the emulated kernels: decode steps through the graph
    path (a stand-in graph that re-runs the captured forward over the buffers, padded to
    buckets of 1, 4, 8 and 16 rows) give the eager kernel path's tokens and logprobs."""
    from noria.worker.attention import TorchAttentionBackend
    from tests.test_worker_cuda_graphs import PARAMS, EagerGraphs, drive, make_runner

    def runner(**kw: Any) -> Any:
        r = make_runner(checkpoint, **kw)
        r.use_attention(KernelAttentionBackend(fallback=TorchAttentionBackend(), backend=emu("forward")))
        return r

    eager = runner()
    replayed = runner(cuda_graph_sizes=[1, 4, 8, 16])
    graphs = EagerGraphs.install(replayed)
    got, got_lp = drive(replayed, PARAMS[0])
    want, want_lp = drive(eager, PARAMS[0])
    assert got == want
    for a, b in zip(got_lp, want_lp, strict=True):
        for x, y in zip(a or [], b or [], strict=True):
            assert x.token_id == y.token_id and x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
    assert {size for size, n in graphs.replayed if n < size}, "no step was padded"
    # The decode steps ran the graph path's fixed launches: 4 partitions per row.
    splits = {launch.split for launch in replayed.attention.graph._launches.values()}
    assert splits == {FixedSplit(4, DEFAULT_PARTITION_SIZE)}
    assert eager.attention.graph._launches == {}
