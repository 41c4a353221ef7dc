"""kernels.ops without running kernels: argument checks, launch shapes, and which kernel a
step dispatches to. A recording backend stands in for CuPy / the emulator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from noria.kernels import ops
from noria.kernels.backends import KernelBackend
from noria.kernels.instances import ModuleSpec


class Recorder(KernelBackend):
    def __init__(self) -> None:
        super().__init__()
        self.launches: list[dict[str, Any]] = []

    def kernel(self, spec: ModuleSpec, name: str) -> Any:
        assert name in spec.names

        def launch(grid: Any, block: Any, args: Sequence[Any], shared_mem: int = 0) -> None:
            self.launches.append(
                {
                    "name": name,
                    "grid": tuple(grid),
                    "block": tuple(block),
                    "args": args,
                    "shared_mem": shared_mem,
                }
            )

        return launch

    def ptr(self, t: torch.Tensor) -> Any:
        return np.uint64(t.data_ptr())

    def pointer_table(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)

    @property
    def sm_count(self) -> int:
        return 132


def cache(blocks: int = 8, bs: int = 16, kvh: int = 2, d: int = 64, dtype: Any = torch.float16):
    return torch.zeros(blocks, bs, kvh, d, dtype=dtype), torch.zeros(
        blocks, bs, kvh, d, dtype=dtype
    )


def test_scalar_arguments_have_exact_widths() -> None:
    """CuPy packs numpy scalars by their own size, so every scalar must be a sized numpy type.
    float32: the CUDA-core decode kernel (the 16-bit one: test_decode_attention_gqa.py)."""
    rec = Recorder()
    k, v = cache(dtype=torch.float32)
    q = torch.zeros(3, 4, 64, dtype=torch.float32)
    ops.paged_attention_decode(
        torch.empty_like(q),
        q,
        k,
        v,
        torch.zeros(3, 2, dtype=torch.int32),
        torch.tensor([5, 9, 1], dtype=torch.int32),
        0.125,
        backend=rec,
    )
    [launch] = rec.launches
    assert launch["grid"] == (4, 3, 1) and launch["block"] == (128,)
    assert all(isinstance(a, np.generic) for a in launch["args"])
    assert launch["args"][9].dtype == np.float32  # scale
    assert all(a.dtype == np.int32 for a in launch["args"][10:-1])  # ..., partition size, window
    assert launch["args"][-1].dtype == np.float32  # soft-cap


def test_split_decode_launches_partials_and_merge() -> None:
    rec = Recorder()
    k, v = cache(dtype=torch.float32)
    q = torch.zeros(2, 4, 64, dtype=torch.float32)
    ops.paged_attention_decode(
        torch.empty_like(q),
        q,
        k,
        v,
        torch.zeros(2, 8, dtype=torch.int32),
        torch.tensor([100, 7], dtype=torch.int32),
        0.1,
        split=True,
        partition_size=32,
        backend=rec,
    )
    decode, merge = rec.launches
    assert decode["name"].startswith("paged_attention_decode") and decode["grid"] == (4, 2, 4)
    assert merge["name"].startswith("paged_attention_reduce") and merge["grid"] == (4, 2)
    assert merge["shared_mem"] == 4 * 4


@pytest.mark.parametrize(
    ("max_query_len", "tokens", "expected"),
    [
        (1, 3, "paged_attention_decode"),
        (5, 9, "paged_attention_prefill"),
        (1, 2, "paged_attention_prefill"),
    ],
)
def test_paged_attention_dispatch(max_query_len: int, tokens: int, expected: str) -> None:
    rec = Recorder()
    k, v = cache()
    q = torch.zeros(tokens, 4, 64, dtype=torch.float16)
    qsl = torch.tensor([0, 1, 1, tokens], dtype=torch.int32)
    ops.paged_attention(
        torch.empty_like(q),
        q,
        k,
        v,
        torch.zeros(3, 2, dtype=torch.int32),
        torch.tensor([4, 3, 9], dtype=torch.int32),
        qsl,
        0.1,
        max_query_len=max_query_len,
        max_seq_len=9,
        backend=rec,
    )
    assert rec.launches[0]["name"].startswith(expected)
    if expected.endswith("prefill"):
        # float16: the tensor-core kernel, one CTA per (work item, KV head)
        items = ops.prefill_work_items([1, 0, tokens - 1], 2)
        assert rec.launches[0]["grid"] == (len(items), 2)


def test_empty_batches_launch_nothing() -> None:
    rec = Recorder()
    k, v = cache()
    none = torch.zeros(0, 2, 64, dtype=torch.float16)
    ops.reshape_and_cache(none, none, k, v, torch.zeros(0, dtype=torch.int64), backend=rec)
    q = torch.zeros(0, 4, 64, dtype=torch.float16)
    ops.paged_attention_decode(
        q,
        q,
        k,
        v,
        torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        1.0,
        max_seq_len=0,
        backend=rec,
    )
    ops.copy_blocks([k], [v], torch.zeros(0, 2, dtype=torch.int64), backend=rec)
    assert rec.launches == []


def test_shape_and_dtype_errors() -> None:
    rec = Recorder()
    k, v = cache()
    seqs = torch.tensor([3], dtype=torch.int32)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        ops.paged_attention_decode(q, q, k, v[:, :8], tables, seqs, 1.0, backend=rec)
    with pytest.raises(ValueError, match="group evenly"):
        q3 = torch.zeros(1, 3, 64, dtype=torch.float16)
        ops.paged_attention_decode(q3, q3, k, v, tables, seqs, 1.0, backend=rec)
    with pytest.raises(ValueError, match="int32"):
        ops.paged_attention_decode(q, q, k, v, tables.long(), seqs, 1.0, backend=rec)
    with pytest.raises(ValueError, match="contiguous"):
        ops.paged_attention_decode(
            q, q.transpose(1, 2).contiguous().transpose(1, 2), k, v, tables, seqs, 1.0, backend=rec
        )
    with pytest.raises(TypeError, match="dtype"):
        ops.reshape_and_cache(
            q[:, :2].float(), q[:, :2].float(), k, v, torch.zeros(1, dtype=torch.int64), backend=rec
        )
    with pytest.raises(ValueError, match="head size"):
        k96, v96 = cache(d=72)
        q96 = torch.zeros(1, 4, 72, dtype=torch.float16)
        ops.paged_attention_decode(q96, q96, k96, v96, tables, seqs, 1.0, backend=rec)
    with pytest.raises(ValueError, match="same bytes per block"):
        ops.copy_blocks(
            [k],
            [torch.zeros(8, 16, 2, 32, dtype=torch.float16)],
            torch.tensor([[0, 1]]),
            backend=rec,
        )
    assert rec.launches == []


def test_copy_units() -> None:
    assert ops.copy_unit(4096, [0, 256]) == 16
    assert ops.copy_unit(4100, [0, 256]) == 4
    assert ops.copy_unit(4096, [0, 260]) == 4
    with pytest.raises(ValueError, match="aligned"):
        ops.copy_unit(4098, [0])
