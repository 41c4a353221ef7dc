"""The routed experts of a mixture-of-experts block in one native call (worker/csrc/moe_f32.c)
against the block's Python loop over experts (bit for bit: the same GEMM and SiLU kernels in
the same order per element) and against a float64 loop over tokens and their choices, on
routings the router alone rarely gives: every expert chosen by every token, experts with no
rows, one expert with all of them, 1 to 300 tokens; built for the host and for AVX2; at 1-3
threads."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from noria.protocol.model_spec import model_spec
from noria.worker import (
    fused_kernels,
    gemm_amx_kernels,
    gemm_bf16_kernels,
    gemm_kernels,
    moe_kernels,
)
from noria.worker.models.linear import packed
from noria.worker.models.moe import SparseMoeBlock
from noria.worker.models.ops import CpuOps
from noria.worker.models.parallel import TensorParallel
from tests.tiny_models import MOE_ARCHS, tiny_config

ROWS = (1, 2, 5, 13, 64, 193, 300)


def _block(arch: str, top_k: int = 2, seed: int = 0, weights: str = "float32") -> SparseMoeBlock:
    """weights: "float32", or "widen" / "dot" / "amx" for experts kept in bf16 in that GEMM layout, "f16"
    for experts kept in float16."""
    spec = model_spec(tiny_config(arch, num_experts_per_tok=top_k))
    block = SparseMoeBlock(spec, TensorParallel(), CpuOps(spec.activation))
    g = torch.Generator().manual_seed(seed)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if weights == "float32":
        block.pack()
    else:
        if gemm_bf16_kernels.load() is None or (weights == "dot" and gemm_bf16_kernels.layout() not in ("dot", "amx")):
            pytest.skip(f"no native bf16 GEMM in the {weights} layout on this host")
        if weights == "amx" and not gemm_amx_kernels.ready():
            pytest.skip("the experts' tiles need a CPU with AMX-BF16 (tests/test_worker_gemm_amx.py runs "
                        "their panel entry emulated everywhere)")
        dtype = gemm_bf16_kernels.LAYOUT_DTYPES[weights]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gemm_bf16_kernels, "layout", lambda _dtype: weights)
            block.pack(dtype)
        assert block.experts_gate_up.dtype == block.experts_down.dtype == dtype
        assert block.experts_gate_up.is_meta  # the panels are the only copy
        assert all(w.kind == weights for w in (packed(op) for op in block.gate_up_ops + block.down_ops))
    if block.native is None:
        pytest.skip("no native GEMM and fused kernels on this host")
    return block


def _python(block: SparseMoeBlock, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    native, block.native = block.native, None
    try:
        return block.experts(x, weights, ids)
    finally:
        block.native = native


def _reference(block: SparseMoeBlock, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), token by token, in float64."""
    i = block.inter
    gate_up, down = (torch.stack([packed(op).unpack() for op in ops]).double()  # type: ignore[union-attr]
                     for ops in (block.gate_up_ops, block.down_ops))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, row in enumerate(x.double()):
        for e, w in zip(ids[t].tolist(), weights[t].double().tolist(), strict=True):
            h = gate_up[e] @ row
            out[t] += w * (down[e] @ (F.silu(h[:i]) * h[i:]))
    return out


def _routing(kind: str, t: int, k: int, e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, k] float32, distinct ids [t, k]) for a routing of the given kind."""
    if kind == "random":
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    elif kind == "one expert has all rows":  # k = 1: expert 5 alone; others empty
        ids = torch.full((t, k), 5) if k == 1 else torch.stack([torch.tensor([5, *range(k - 1)])] * t)
    elif kind == "every expert":
        ids = torch.stack([torch.randperm(e, generator=g) for _ in range(t)])
    else:
        raise AssertionError(kind)
    weights = torch.rand(ids.shape, generator=g)
    return weights / weights.sum(dim=-1, keepdim=True), ids


# The float64 reference's tolerance per kind of weights: float32's elementwise; for the dot layout
# bf16's, normwise (it rounds x and the SiLU product to bf16, the reference keeps them exact,
# and an output near zero by cancellation has no relative accuracy left).
TOLERANCE = {"float32": 1e-5, "widen": 5e-5, "f16": 5e-5, "dot": 1e-2, "amx": 1e-2}


def _close(got: torch.Tensor, want: torch.Tensor, weights: str) -> None:
    if weights in ("dot", "amx"):
        assert (got.double() - want).norm() <= TOLERANCE[weights] * want.norm()
    else:
        torch.testing.assert_close(got.double(), want, rtol=TOLERANCE[weights], atol=TOLERANCE[weights])


@pytest.mark.parametrize("weights", list(TOLERANCE))
@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize(("kind", "k"), [("random", 2), ("random", 3), ("one expert has all rows", 1),
                                         ("one expert has all rows", 2), ("every expert", 8)])
def test_native_experts_match_the_python_loop_and_float64(arch: str, kind: str, k: int, weights: str) -> None:
    block = _block(arch, weights=weights)
    assert block.num_experts == 8
    g = torch.Generator().manual_seed(len(kind) + k)
    for t in ROWS:
        x = torch.randn(t, block.experts_gate_up.shape[-1], generator=g)
        routing, ids = _routing(kind, t, k, block.num_experts, g)
        got = block.experts(x, routing, ids)
        assert got.shape == x.shape and got.dtype == torch.float32
        assert torch.equal(got, _python(block, x, routing, ids)), (kind, t)
        _close(got, _reference(block, x, routing, ids), weights)
        if kind == "one expert has all rows":
            assert (ids == 5).any(dim=1).all() and set(ids.flatten().tolist()) == set(range(k - 1)) | {5}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_block_routes_into_the_native_call(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole block (router, experts, Qwen2-MoE's shared expert) takes the native call, and
    answers as it does without it."""
    block = _block(arch)
    calls = []
    real = moe_kernels.experts
    monkeypatch.setattr(moe_kernels, "experts", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(37, block.experts_gate_up.shape[-1], generator=torch.Generator().manual_seed(3))
    got = block(x)
    assert calls == [37]
    native, block.native = block.native, None
    assert torch.equal(got, block(x))
    block.native = native


@pytest.mark.parametrize("weights", list(TOLERANCE))
def test_the_thread_count_does_not_change_the_numbers(weights: str) -> None:
    block = _block("qwen3_moe", seed=4, weights=weights)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(150, block.experts_gate_up.shape[-1], generator=g)
    weights, ids = _routing("random", 150, 2, block.num_experts, g)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(block.experts(x, weights, ids))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.equal(outs[0], _python(block, x, weights, ids))


def test_expert_ids_out_of_range_are_refused() -> None:
    block = _block("mixtral")
    x = torch.randn(3, block.experts_gate_up.shape[-1])
    ids = torch.tensor([[0, 1], [2, 8], [3, 4]])
    assert block.native is not None
    with pytest.raises(ValueError, match="expert ids"):
        moe_kernels.experts(x, torch.full((3, 2), 0.5), ids, block.native)


def test_the_avx2_builds_match_the_python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemm_f32.c, fused_f32.c and moe_f32.c built for AVX2 (x86-64-v3: 8-float vectors and
    16-wide GEMM panels, where an AVX-512 host's -march=native build has 16 and 32)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is an x86 instruction set")
    modules = (gemm_kernels, fused_kernels, moe_kernels)
    for module in modules:
        monkeypatch.setattr(module, "_FLAGS", ["-march=x86-64-v3" if f == "-march=native" else f
                                               for f in module._FLAGS])
    loads = [m.load for m in modules]
    for load in loads:
        load.cache_clear()
    try:
        if moe_kernels.load() is None:
            pytest.skip("no compiler for the AVX2 builds")
        gemm = gemm_kernels.load()
        assert gemm is not None and gemm.gemm_nr() == 16
        block = _block("qwen2_moe", top_k=3, seed=5)  # packed by the AVX2 build's panel width
        g = torch.Generator().manual_seed(5)
        for t in (1, 7, 300):
            x = torch.randn(t, block.experts_gate_up.shape[-1], generator=g)
            weights, ids = _routing("random", t, 3, block.num_experts, g)
            got = block.experts(x, weights, ids)
            assert torch.equal(got, _python(block, x, weights, ids))
            torch.testing.assert_close(got.double(), _reference(block, x, weights, ids), rtol=1e-5, atol=1e-5)
    finally:
        monkeypatch.undo()
        for load in loads:
            load.cache_clear()
