"""CPU attention on W1-like batches: its share of the forward, its K/V bandwidth, an A/B against a commit.

    python -m noria.bench.attention [--baseline REV] [--rounds 5] [--threads N] [--tail] [--hot N] [--json OUT]
    python -m noria.bench.attention --w1 [--stride 4]

The "small" Llama of bench/workloads.py (12 layers, 12 query / 4 KV heads, head
size 64, block size 16, float32) is loaded into a ModelRunner; its KV cache
(1 GiB, as the worker sizes it by default) is filled with random values so
that every context read hits memory. Each batch shape gets block tables of
scattered blocks, as in a pool in use for a while. Per shape and round, in
this order, alternating: the torch backend of `--baseline` (its
worker/attention.py, cpu_kernels.py and csrc/paged_decode.c, read with `git
show` and built beside the current ones) and the current backend:

* prepare: `backend.prepare(meta)`, once per step, in microseconds;
* attention: the 12 layers' `backend.forward` (KV write included), in ms;
* forward: the whole model forward with that backend, in ms, both sides in the native
  decoder stack (the baseline's kernel swapped in) where the baseline's kernel fits it,
  else both on the modules' Python path (bench/baseline_stack.py);
* write: a separate `write_kv` of the step's rows into the 12 layers, in microseconds
  (what the baseline pays per step on top of its kernel; the decode call now fuses it).

`--hot N`: every block table draws from blocks 0..N-1 alone (shuffled, wrapping), so
that K/V stays in cache (e.g. 32 blocks: 12 MiB over the 12 layers): the kernel's
compute alone, without the memory stream. Medians over the rounds. `--w1`: W1's decode steps instead (its 128 requests all
prefilled, then decode step j runs every request with more than j output tokens, at
sequence length prompt + j; every `--stride`-th step), before and after alternating
step by step; sums of attention and forward seconds. K/V GB/s is the bytes of K and V each decode row
attends to (12 layers) over the attention time; against it, in the same
rounds, a 400 MB `copy_` (bytes copied per second) and a 400 MB read (`sum`).
"""

from __future__ import annotations

import os

# As in the worker (worker/__init__.py), before torch loads: passive OpenMP waits, THP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from itertools import accumulate  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from noria.bench.baseline_stack import common_path, forward_path  # noqa: E402
from noria.worker import attention as current  # noqa: E402

# (name, query lengths, sequence lengths): W1's decode batches from its first steps
# (128 rows, short contexts) to its long tail (~16 rows of 300-770 tokens), its prefill
# steps (prompts of 32-256 tokens) and a chunked step (decodes + a chunk with context).
_rng = random.Random(0)
_TAIL = [_rng.randint(300, 770) for _ in range(16)]
_PROMPTS = [_rng.randint(32, 256) for _ in range(8)]
SHAPES: list[tuple[str, list[int], list[int]]] = [
    ("decode 1 x 16 (overhead)", [1], [16]),
    ("decode 1 x 800", [1], [800]),
    ("decode 4 x 800", [1] * 4, [800] * 4),
    ("decode 16 x 64", [1] * 16, [64] * 16),
    ("decode 16 x 300-770", [1] * 16, _TAIL),
    ("decode 32 x 500", [1] * 32, [500] * 32),
    ("decode 64 x 300", [1] * 64, [300] * 64),
    ("decode 128 x 150", [1] * 128, [150] * 128),
    ("decode 128 x 400", [1] * 128, [400] * 128),
    ("prefill 8 x 32-256", _PROMPTS, _PROMPTS),
    ("mixed 16 dec + 256 chunk", [1] * 16 + [256], _TAIL + [512]),
]

# --tail: W1's long tail (311 of its 521 steps are decodes of 16-31 sequences), contexts 256..2048.
TAIL_SHAPES: list[tuple[str, list[int], list[int]]] = [
    (f"tail {b} x {c}", [1] * b, [c] * b) for b in (16, 24, 31) for c in (256, 512, 1024, 2048)
] + [(f"tail {b} x 256-2048", [1] * b, [_rng.randint(256, 2048) for _ in range(b)]) for b in (16, 24, 31)]


def load_baseline(rev: str) -> types.ModuleType:
    """worker/attention.py of `rev`, using that commit's cpu_kernels.py and paged_decode.c."""
    root = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp(prefix="noria-attn-baseline-"))
    (tmp / "csrc").mkdir()

    def show(path: str) -> str:
        return subprocess.run(["git", "-C", str(root), "show", f"{rev}:{path}"], check=True,
                              capture_output=True, text=True).stdout

    (tmp / "csrc" / "paged_decode.c").write_text(show("worker/csrc/paged_decode.c"))
    kernels = _module("noria_baseline_cpu_kernels", tmp / "cpu_kernels.py", show("worker/cpu_kernels.py"), {})
    source = show("worker/attention.py").replace("from noria.worker import cpu_kernels", "")
    return _module("noria_baseline_attention", tmp / "attention.py", source, {"cpu_kernels": kernels})


def _module(name: str, path: Path, source: str, extra: dict[str, Any]) -> types.ModuleType:
    path.write_text(source)
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    mod.__dict__.update(extra)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(source, str(path), "exec"), mod.__dict__)  # noqa: S102 - the repository's own file at REV
    return mod


def metadata(mod: types.ModuleType, num_blocks: int, bs: int, query_lens: list[int], seq_lens: list[int],
             seed: int) -> Any:
    """Step metadata with scattered private blocks per row (wrapping inside the pool)."""
    per_row = -(-max(seq_lens) // bs)
    rows = len(query_lens)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = order[torch.arange(rows * per_row).view(rows, per_row) % num_blocks]
    ctx = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
    starts = [0, *accumulate(query_lens)]
    offsets = torch.tensor(ctx) - torch.tensor(starts[:-1])
    q_lens = torch.tensor(query_lens)
    positions = torch.arange(starts[-1]) + torch.repeat_interleave(offsets, q_lens)
    seq_index = torch.repeat_interleave(torch.arange(rows), q_lens)
    slots = tables[seq_index, positions // bs] * bs + positions % bs
    return mod.AttentionMetadata(
        positions=positions, slot_mapping=slots, query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens), block_tables=tables, block_size=bs,
        query_lens_host=list(query_lens), seq_lens_host=list(seq_lens), query_start_host=starts,
    )


def _clock(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Bench:
    def __init__(self, baseline: types.ModuleType, hot_blocks: int | None = None) -> None:
        from noria.bench.workloads import small_checkpoint
        from noria.frontend.startup import make_config
        from noria.worker.attention_select import attention_layers
        from noria.worker.model_runner import ModelRunner

        # The thread count main() set (--threads): the runner would otherwise reset it to the worker default.
        self.runner = ModelRunner(make_config(str(small_checkpoint()), dtype="float32",
                                              num_threads=torch.get_num_threads()))
        self.runner.kv_cache.device_cache.uniform_(-1, 1)
        self.pool = hot_blocks or self.runner.num_kv_blocks  # blocks the tables draw from
        self.layers = attention_layers(self.runner.model)
        self.backends = {"before": (baseline, baseline.TorchAttentionBackend()),
                         "after": (current, current.TorchAttentionBackend())}
        self.baseline = baseline
        self.path = common_path(baseline)  # both sides' forwards on one path (bench/baseline_stack.py)
        self.src = torch.empty(100_000_000).uniform_()
        self.dst = torch.empty_like(self.src).zero_()

    def bandwidth(self) -> tuple[float, float]:
        nbytes = self.src.numel() * 4
        return nbytes / _clock(lambda: self.dst.copy_(self.src)) / 1e9, nbytes / _clock(self.src.sum) / 1e9

    @torch.inference_mode()
    def once(self, variant: str, query_lens: list[int], seq_lens: list[int], seed: int) -> dict[str, float]:
        mod, backend = self.backends[variant]
        r = self.runner
        meta = metadata(mod, self.pool, r.block_size, query_lens, seq_lens, seed)
        t_prepare = _clock(lambda: backend.prepare(meta))
        la = self.layers[0]
        tokens = sum(query_lens)
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(tokens, la.num_heads, la.head_dim, generator=gen)
        k = torch.randn(tokens, la.num_kv_heads, la.head_dim, generator=gen)
        v = torch.randn(tokens, la.num_kv_heads, la.head_dim, generator=gen)

        def attend() -> None:
            for layer, (kc, vc) in zip(self.layers, r._kv_layers, strict=True):
                backend.forward(layer, q, k, v, kc, vc, meta)

        t_attn = _clock(attend)
        # The separate write (reshape_and_cache) the baseline makes per layer; fused into the decode call now.
        t_write = _clock(lambda: [current.write_kv(k, v, kc, vc, meta.slot_mapping) for kc, vc in r._kv_layers])
        ids = torch.full((tokens,), 5, dtype=torch.long)
        with forward_path(self.path, self.baseline if variant == "before" else None):
            t_fwd = _clock(lambda: r.model(ids, meta.positions, meta, backend, r._kv_layers))
        return {"prepare_us": t_prepare * 1e6, "attn_ms": t_attn * 1e3, "forward_ms": t_fwd * 1e3,
                "write_us": t_write * 1e6}


def kv_bytes(query_lens: list[int], seq_lens: list[int], layers: int = 12, kvh: int = 4, d: int = 64) -> int:
    """K and V bytes the decode rows attend to, over every layer."""
    ctx = sum(s for q, s in zip(query_lens, seq_lens, strict=True) if q == 1)
    return ctx * layers * 2 * kvh * d * 4


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    bench = Bench(load_baseline(args.baseline), args.hot)
    print(f"forwards of both sides on the {bench.path}")
    rows = []
    for name, query_lens, seq_lens in SHAPES:
        samples: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        bw: list[tuple[float, float]] = []
        for variant in ("before", "after"):  # warm-up: kernels built, pages touched
            bench.once(variant, query_lens, seq_lens, 0)
        for i in range(args.rounds):
            bw.append(bench.bandwidth())
            for variant in (("before", "after") if i % 2 == 0 else ("after", "before")):
                samples[variant].append(bench.once(variant, query_lens, seq_lens, i + 1))
        row: dict[str, Any] = {"shape": name, "copy_gbps": statistics.median(c for c, _ in bw),
                               "read_gbps": statistics.median(r for _, r in bw)}
        for variant, got in samples.items():
            for key in got[0]:
                row[f"{key}_{variant}"] = statistics.median(s[key] for s in got)
            nbytes = kv_bytes(query_lens, seq_lens)
            row[f"kv_gbps_{variant}"] = nbytes / row[f"attn_ms_{variant}"] / 1e6 if nbytes else None
        rows.append(row)
        _print_row(row, header=len(rows) == 1)
    return rows


def w1_decode_steps(stride: int) -> list[list[int]]:
    """Sequence lengths of W1's decode steps j = 1, 1 + stride, ... (see the module docstring)."""
    from noria.bench.workloads import w1

    reqs = [(len(p), m) for p, m in w1()]
    return [[p + j for p, m in reqs if m > j] for j in range(1, max(m for _, m in reqs), stride)]


def run_w1(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(load_baseline(args.baseline), args.hot)
    print(f"forwards of both sides on the {bench.path}")
    steps = w1_decode_steps(args.stride)
    totals = {f"{key}_{v}": 0.0 for key in ("attn_ms", "forward_ms") for v in ("before", "after")}
    kv = 0
    for i, seq_lens in enumerate(steps):
        kv += kv_bytes([1] * len(seq_lens), seq_lens)
        for variant in (("before", "after") if i % 2 == 0 else ("after", "before")):
            got = bench.once(variant, [1] * len(seq_lens), seq_lens, i)
            totals[f"attn_ms_{variant}"] += got["attn_ms"]
            totals[f"forward_ms_{variant}"] += got["forward_ms"]
    copy, read = bench.bandwidth()
    row = {"steps": len(steps), "stride": args.stride, "kv_gb": kv / 1e9, "copy_gbps": copy, "read_gbps": read,
           **{k: v / 1e3 for k, v in totals.items()}}
    print(f"W1 decode, {len(steps)} steps (every {args.stride}th), {kv / 1e9:.1f} GB of K/V read:")
    for v in ("before", "after"):
        print(f"  {v:<6}: attention {row[f'attn_ms_{v}']:.2f} s ({kv / 1e9 / row[f'attn_ms_{v}']:.1f} GB/s), "
              f"forward {row[f'forward_ms_{v}']:.2f} s")
    print(f"  attention {row['attn_ms_before'] / row['attn_ms_after']:.2f}x, forward "
          f"{row['forward_ms_before'] / row['forward_ms_after']:.2f}x; copy_ {copy:.1f} GB/s, read {read:.1f} GB/s")
    return row


def _print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'shape':<26} {'attn ms before':>14} {'after':>8} {'x':>5} {'KV GB/s b':>9} {'a':>5} "
              f"{'fwd ms b':>9} {'a':>7} {'attn/fwd a':>10} {'prep us b':>9} {'a':>6} {'write us':>8} {'copy':>5} "
              f"{'read':>5}")

    def gb(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"{row['shape']:<26} {row['attn_ms_before']:>14.2f} {row['attn_ms_after']:>8.2f} "
          f"{row['attn_ms_before'] / row['attn_ms_after']:>5.2f} {gb(row['kv_gbps_before']):>9} "
          f"{gb(row['kv_gbps_after']):>5} {row['forward_ms_before']:>9.1f} {row['forward_ms_after']:>7.1f} "
          f"{row['attn_ms_after'] / row['forward_ms_after']:>10.0%} {row['prepare_us_before']:>9.0f} "
          f"{row['prepare_us_after']:>6.0f} {row['write_us_after']:>8.0f} {row['copy_gbps']:>5.1f} "
          f"{row['read_gbps']:>5.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="0867a5f", help="commit whose torch backend is 'before'")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the worker's)")
    ap.add_argument("--only", default=None, help="run the shapes whose name contains this")
    ap.add_argument("--tail", action="store_true", help="W1's tail shapes (16-31 decodes x 256-2048) instead")
    ap.add_argument("--hot", type=int, default=None, help="block tables inside this many blocks: K/V in cache")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--w1", action="store_true", help="W1's decode steps instead of the fixed shapes")
    ap.add_argument("--stride", type=int, default=4, help="--w1: every this many steps")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tail:
        SHAPES[:] = TAIL_SHAPES
    if args.only:
        SHAPES[:] = [s for s in SHAPES if args.only in s[0]]
    print(f"{torch.get_num_threads()} threads; before = {args.baseline}, after = working tree")
    rows: Any = run_w1(args) if args.w1 else run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
