"""One sequence's rows attended as tiles (worker/csrc/paged_decode_runs.h): a prefill step's prompt
tokens, each a row of the paged kernel, read their keys once per tile of rows. Checked against the
float64 reference on every cache type and ISA build, for the same bits however a sequence's rows are
cut into calls, tasks or threads, and for which rows take the path."""

from __future__ import annotations

import ctypes

import pytest
import torch

from noria.worker import cpu_kernels
from tests.test_worker_cpu_kernels import _CACHE_DTYPES, _CACHE_IDS, _kernel, _reference

RUN_MIN = 8  # paged_decode_runs.h
_ELT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}


def _rows(seed, seqs, heads, kv_heads, d, bs, dtype=torch.float32):
    """Paged caches holding every sequence's keys, and one row per new token: seqs is a list of
    (cached, new) token counts; the row of new token j sees cached + j + 1 keys through its
    sequence's (scattered) block table."""
    g = torch.Generator().manual_seed(seed)
    per = -(-max(c + n for c, n in seqs) // bs)
    nb = len(seqs) * per + 3
    seq_tables = torch.randperm(nb, generator=g)[: len(seqs) * per].view(len(seqs), per)
    k_cache = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    tables = torch.cat([seq_tables[i].expand(n, per) for i, (_, n) in enumerate(seqs)]).contiguous()
    lens = torch.tensor([c + j + 1 for c, n in seqs for j in range(n)])
    q = torch.randn(len(lens), heads, d, generator=g) * 3  # scores spread over a few units
    return q, k_cache, v_cache, tables, lens


def _row_tiles(tables, lens, bs, window, heads, kv_heads, d, dtype):
    dll = cpu_kernels.load()
    fn = dll.paged_decode_row_tiles
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_int]
    return fn(tables.data_ptr(), lens.data_ptr(), len(lens), tables.shape[1], bs, window or 0, heads, kv_heads, d,
              _ELT[dtype])


# A fresh prompt, a short one (a run of exactly RUN_MIN), a chunk after a cached prefix that crosses
# blocks, a run one row short of RUN_MIN (rows alone) and a decode row.
_SEQS = [(0, 40), (0, RUN_MIN), (29, 21), (3, RUN_MIN - 1), (50, 1)]


@pytest.mark.parametrize("dtype", _CACHE_DTYPES, ids=_CACHE_IDS)
@pytest.mark.parametrize("isa", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("shape", [(12, 4, 64, 16), (8, 2, 128, 8), (16, 1, 32, 16), (6, 3, 40, 16)],
                         ids=["gqa3-d64", "gqa4-d128-bs8", "mqa16-d32", "d40"])
@pytest.mark.parametrize("cap", [None, 4.0], ids=["uncapped", "soft-capped"])
def test_row_tiles_match_float64_reference(shape, isa, dtype, cap, monkeypatch):
    heads, kv_heads, d, bs = shape
    _kernel(isa, monkeypatch)
    q, k_cache, v_cache, tables, lens = _rows(d + heads, _SEQS, heads, kv_heads, d, bs, dtype)
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, None, soft_cap=cap)
    ref = _reference(q, k_cache, v_cache, tables, lens, d**-0.5, None, cap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    if isa == "native" and d % 16 == 0:  # every vector width divides these head sizes: tiles, whatever the host
        assert _row_tiles(tables, lens, bs, None, heads, kv_heads, d, dtype) > 0


@pytest.mark.parametrize("dtype", _CACHE_DTYPES, ids=_CACHE_IDS)
def test_a_sequence_s_rows_are_the_same_bits_however_they_are_cut(dtype):
    """Rows attended in one call, in two calls cut at a block boundary or inside a block, among
    other sequences' rows, and on one or two threads: the same outputs, bit for bit."""
    heads, kv_heads, d, bs = 12, 4, 64, 16
    q, k_cache, v_cache, tables, lens = _rows(7, [(5, 60)], heads, kv_heads, d, bs, dtype)
    whole = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, None)
    for cut in (11, 27, 40):
        parts = [cpu_kernels.paged_decode(q[s], k_cache, v_cache, tables[s], lens[s], d**-0.5, None)
                 for s in (slice(0, cut), slice(cut, None))]
        assert torch.equal(torch.cat(parts), whole), f"cut at row {cut}"
    # Among a decode row and another prompt's rows, whose lengths happen to continue this one's.
    oq, ok, ov, otables, olens = _rows(8, [(0, 1), (66, 9)], heads, kv_heads, d, bs, dtype)
    nb = k_cache.shape[0]
    k_all, v_all = torch.cat([k_cache, ok]), torch.cat([v_cache, ov])
    mixed_q = torch.cat([oq[:1], q, oq[1:]])
    assert otables.shape[1] == tables.shape[1]
    mixed_tables = torch.cat([otables[:1] + nb, tables, otables[1:] + nb])
    mixed_lens = torch.cat([olens[:1], lens, olens[1:]])
    mixed = cpu_kernels.paged_decode(mixed_q, k_all, v_all, mixed_tables, mixed_lens, d**-0.5, None)
    assert torch.equal(mixed[1 : 1 + len(lens)], whole)
    ref = _reference(mixed_q, k_all, v_all, mixed_tables, mixed_lens, d**-0.5, None)
    torch.testing.assert_close(mixed.double(), ref, atol=2e-5, rtol=2e-5)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            again = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, None)
            assert torch.equal(again, whole), f"{threads} threads"
    finally:
        torch.set_num_threads(before)


def test_which_rows_are_attended_as_tiles():
    heads, kv_heads, d, bs = 12, 4, 64, 16
    tiles = lambda seqs, window=None, dtype=torch.float32: _row_tiles(  # noqa: E731
        *_rows(1, seqs, heads, kv_heads, d, bs)[3:], bs, window, heads, kv_heads, d, dtype)
    assert tiles([(0, RUN_MIN - 1)]) == 0  # too few rows
    assert tiles([(0, RUN_MIN)]) == kv_heads  # one tile of rows per KV head
    assert tiles([(0, RUN_MIN), (0, RUN_MIN)]) == 2 * kv_heads
    # 4,096 floats of queries a tile: 64 query rows of 64, 21 tokens of a group of 3; 60 rows in 3 tiles.
    assert tiles([(0, 60)]) == 3 * kv_heads
    assert tiles([(0, 20)], window=19) == 0 and tiles([(0, 20)], window=20) == kv_heads  # keys past a window
    assert tiles([(0, 20)], dtype=torch.float8_e4m3fn) == 0  # fp8 stays on the row kernel
    # A sequence's first row one key longer than the previous sequence's last, other blocks: two runs.
    assert tiles([(0, 10), (10, 10)]) == 2 * kv_heads

