"""What a GPU host has and how fast the decode kernel reads the KV cache on it: device facts
from CuPy, every instance compiled for the local arch, and timings with CUDA events.

Used by `noria doctor` and `noria bench kernels`; nothing here runs without a GPU except
`cupy_status`, which says why CuPy is not usable, and the timings with `device="cpu"`: the same
launches under the CPU emulator, timed by the host clock (`noria bench kernels --emulated`, a
check of the harness, not a measurement).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from noria.kernels import ops
from noria.kernels.backends import CupyBackend
from noria.kernels.instances import AttentionConfig
from noria.kernels.scenes import TORCH_DTYPES

# cudaDeviceAttr numbers (stable across CUDA releases; CUDA 13 dropped the matching
# cudaDeviceProp fields, the attributes remain).
_ATTR_MEMORY_CLOCK_KHZ = 36
_ATTR_BUS_WIDTH_BITS = 37


def cupy_status() -> tuple[bool, str]:
    """(usable, a line saying what CuPy is or why it does not work)."""
    try:
        import cupy

        CupyBackend().check()
        return True, f"CuPy {cupy.__version__}, NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}"
    except ImportError as e:
        return False, f"CuPy is not installed ({e}); on a GPU host: pip install noria[cuda]"
    except Exception as e:  # noqa: BLE001 - a broken install can raise anything
        return False, f"CuPy does not work here: {type(e).__name__}: {e}"


@dataclass
class DeviceFacts:
    name: str
    arch: str  # "90" for sm_90
    sm_count: int
    memory_gib: float
    peak_gbps: float  # memory clock x bus width x 2 (double data rate)


def device_facts(index: int = 0) -> DeviceFacts:
    import cupy

    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(index)
    clock_khz = rt.deviceGetAttribute(_ATTR_MEMORY_CLOCK_KHZ, index)
    bus_bits = rt.deviceGetAttribute(_ATTR_BUS_WIDTH_BITS, index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return DeviceFacts(
        name=name,
        arch=f"{props['major']}{props['minor']}",
        sm_count=int(props["multiProcessorCount"]),
        memory_gib=props["totalGlobalMem"] / 2**30,
        peak_gbps=2 * clock_khz * 1e3 * bus_bits / 8 / 1e9,
    )


@contextlib.contextmanager
def compile_every_time() -> Iterator[None]:
    # The NVRTC check refuses CuPy's disk cache (a cached cubin would skip the compile).
    saved = os.environ.get("CUPY_CACHE_IN_MEMORY")
    os.environ["CUPY_CACHE_IN_MEMORY"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUPY_CACHE_IN_MEMORY"]
        else:
            os.environ["CUPY_CACHE_IN_MEMORY"] = saved


def compile_all(arch: str) -> tuple[int, list[str], float]:
    """Every instance through RawModule's NVRTC call for sm_`arch`, with ptxas' report:
    (instances compiled, problems: spills, stack use, static shared memory over 48 KB; seconds)."""
    from noria.kernels import nvrtc_check

    start = time.perf_counter()
    with compile_every_time():
        records = nvrtc_check.check([arch])
    problems = [
        f"{u.name}: {u.spill_stores}/{u.spill_loads} B spilled, {u.stack_bytes} B stack, {u.shared_bytes} B smem"
        for r in records
        for u in r.usage
        if u.spill_stores or u.spill_loads or u.stack_bytes or u.shared_bytes > 48 * 1024
    ]
    return sum(len(r.usage) for r in records), problems, time.perf_counter() - start


def time_cuda(fn: Callable[[], None], iters: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call, timed with CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_on(device: torch.device, fn: Callable[[], None], iters: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call: CUDA events on a GPU, the host clock elsewhere (the emulator)."""
    if device.type == "cuda":
        return time_cuda(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


@dataclass
class DecodeTiming:
    cfg: AttentionConfig
    num_seqs: int
    context: int
    num_heads: int
    num_kv_heads: int
    seconds: float
    kv_bytes: int  # K and V bytes the kernel must read

    @property
    def gbps(self) -> float:
        return self.kv_bytes / self.seconds / 1e9


def decode_timing(
    cfg: AttentionConfig, num_seqs: int, context: int, num_heads: int = 32, num_kv_heads: int = 8,
    split: bool | None = None, device: str = "cuda", iters: int = 20,
) -> DecodeTiming:
    """The decode kernel on one step of `num_seqs` sequences of `context` tokens each, their
    blocks scattered over the cache (as after a while of serving)."""
    dev = torch.device(device)
    dtype = TORCH_DTYPES[cfg.dtype]
    per_seq = -(-context // cfg.block_size)
    num_blocks = num_seqs * per_seq
    shape = (num_blocks, cfg.block_size, num_kv_heads, cfg.head_dim)
    k = torch.randn(shape, dtype=dtype, device=dev)
    v = torch.randn(shape, dtype=dtype, device=dev)
    tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(num_seqs, per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=dev)
    q = torch.randn(num_seqs, num_heads, cfg.head_dim, dtype=dtype, device=dev)
    out = torch.empty_like(q)
    lens_host = [context] * num_seqs  # as the worker passes them: the split plan needs no sync
    seconds = time_on(dev, lambda: ops.paged_attention_decode(
        out, q, k, v, tables, seq_lens, 0.1, max_seq_len=context, split=split, seq_lens_host=lens_host),
        iters=iters, warmup=min(3, iters))
    kv_bytes = 2 * num_seqs * context * num_kv_heads * cfg.head_dim * k.element_size()
    return DecodeTiming(cfg, num_seqs, context, num_heads, num_kv_heads, seconds, kv_bytes)


def prefill_timing(cfg: AttentionConfig, num_seqs: int, prompt: int, num_heads: int = 32,
                   num_kv_heads: int = 8, device: str = "cuda", iters: int = 5) -> tuple[float, float]:
    """(seconds, TFLOP/s) of the prefill kernel over `num_seqs` whole prompts of `prompt` tokens
    (causal: about half the QK^T and PV products of a full square)."""
    dev = torch.device(device)
    dtype = TORCH_DTYPES[cfg.dtype]
    per_seq = -(-prompt // cfg.block_size)
    shape = (num_seqs * per_seq, cfg.block_size, num_kv_heads, cfg.head_dim)
    k = torch.randn(shape, dtype=dtype, device=dev)
    v = torch.randn(shape, dtype=dtype, device=dev)
    tables = torch.randperm(shape[0], device=dev).to(torch.int32).view(num_seqs, per_seq)
    seq_lens = torch.full((num_seqs,), prompt, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, (num_seqs + 1) * prompt, prompt, dtype=torch.int32, device=dev)
    q = torch.randn(num_seqs * prompt, num_heads, cfg.head_dim, dtype=dtype, device=dev)
    out = torch.empty_like(q)
    # Built once per step from host lengths, as the worker does: the work list costs no sync.
    plan = ops.plan_step([prompt] * num_seqs, [prompt] * num_seqs, dev)
    seconds = time_on(dev, lambda: ops.paged_attention_prefill(
        out, q, k, v, tables, seq_lens, qsl, 0.1, max_query_len=prompt, plan=plan), iters=iters, warmup=1)
    flops = prefill_flops(num_seqs, prompt, num_heads, cfg.head_dim)
    return seconds, flops / seconds / 1e12


def prefill_flops(num_seqs: int, prompt: int, num_heads: int, head_dim: int) -> float:
    """QK^T and PV of causal attention over whole prompts: 2 products x 2 FLOPs per
    multiply-add x the (query, key) pairs at or before the query."""
    return 2 * 2 * num_seqs * num_heads * head_dim * prompt * (prompt + 1) / 2


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read and written (what the decode
    kernel's figure is compared with: it only reads, so its ceiling is about the copy's)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), iters=10)
    return 2 * nbytes / seconds / 1e9
