"""The emulator itself: CUDA semantics of conversions, shuffles, votes, barriers, atomics and
shared memory, and the bugs it must report instead of hiding (races under some thread
orders, divergent barriers, bad shuffles, wrong argument types, launch limits)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from noria.kernels.emu import SCHEDULES, EmuConfig, EmuKernelError, EmuLaunchError, EmuRawModule

PROBES = Path(__file__).with_name("emu_probe_kernels.cu")
ALL_ORDERS = [*SCHEDULES[:-1], "random:1", "random:2"]


@functools.cache
def probes(schedule: str = "forward", workers: int = 1, strict: bool = True) -> EmuRawModule:
    base = _base_module()
    return base.with_config(schedule=schedule, workers=workers, strict=strict)


@functools.cache
def _base_module() -> EmuRawModule:
    module = EmuRawModule(code=PROBES.read_text(), source_name=PROBES.name)
    module.compile()
    return module


def launch(
    name: str,
    grid: int | tuple[int, ...],
    block: int | tuple[int, ...],
    args: tuple,
    schedule: str = "forward",
    **kw: object,
) -> None:
    probes(schedule, **{k: v for k, v in kw.items() if k in ("workers", "strict")}).get_function(
        name
    )(grid, block, args, shared_mem=int(kw.get("shared_mem", 0)))  # type: ignore[arg-type]


def test_float_to_half_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    special = np.array(
        [
            0.0,
            -0.0,
            65504.0,
            65519.99,
            65520.0,
            1e6,
            -1e6,
            np.inf,
            -np.inf,
            2.0**-24,
            2.0**-25,
            3 * 2.0**-25,
            2.0**-14,
            2.0**-14 - 2.0**-25,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
        ],
        dtype=np.float32,
    )
    every_half = np.arange(65536, dtype=np.uint16).view(np.float16)
    every_half = every_half[np.isfinite(every_half)].astype(np.float32)  # exact round trip
    x = np.concatenate(
        [
            special,
            -special,
            every_half,
            rng.standard_normal(20000).astype(np.float32),
            (rng.standard_normal(5000) * 1e-5).astype(np.float32),
            (rng.standard_normal(5000) * 3e4).astype(np.float32),
        ]
    )
    out = np.empty_like(x)
    bits = np.empty(x.shape, np.uint16)
    launch("to_half_and_back", -(-x.size // 256), 256, (x, out, bits, np.int32(x.size)))
    with np.errstate(over="ignore"):  # overflow to inf is part of what is checked
        expected = x.astype(np.float16)
    assert np.array_equal(bits, expected.view(np.uint16))
    assert np.array_equal(out, expected.astype(np.float32))
    nan = np.array([np.nan], np.float32)
    launch("to_half_and_back", 1, 32, (nan, out[:1], bits[:1], np.int32(1)))
    assert np.isnan(out[0])


def test_float_to_bfloat16_matches_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(20000, generator=g),
            torch.randn(2000, generator=g) * 1e-38,
            torch.tensor(
                [
                    0.0,
                    -0.0,
                    float("inf"),
                    float("-inf"),
                    3.3895314e38,
                    3.4e38,
                    1.00390625,
                    1.01171875,
                ]
            ),
        ]
    ).float()
    bits = np.empty(x.numel(), np.uint16)
    launch("to_bf16", -(-x.numel() // 256), 256, (x.numpy(), bits, np.int32(x.numel())))
    assert np.array_equal(bits, x.bfloat16().view(torch.int16).numpy().view(np.uint16))


def model_shuffle(op: int, params: list[int], width: int) -> list[int]:
    """CUDA's documented results for value 100 + lane."""
    out = []
    for lane in range(32):
        seg = lane - lane % width
        p = params[lane]
        if op == 0:
            src = seg + p % width
        elif op == 1:
            src = lane - p if lane - p >= seg else lane
        elif op == 2:
            src = lane + p if lane + p < seg + width else lane
        else:
            src = lane ^ p if (lane ^ p) < seg + width else lane
        out.append(100 + src)
    return out


@pytest.mark.parametrize("op", [0, 1, 2, 3], ids=["idx", "up", "down", "xor"])
@pytest.mark.parametrize("width", [32, 16, 8, 2])
def test_shuffles_follow_cuda(op: int, width: int) -> None:
    rng = np.random.default_rng(op * 100 + width)
    for _ in range(3):
        # Deltas past the segment are legal (the lane keeps its value); PTX only reads the
        # low 5 bits, so stay below 32.
        params = rng.integers(0, 32 if op in (0, 3) else min(32, width + 2), 32).astype(np.int32)
        out = np.zeros(32, np.int32)
        launch("shuffle", 1, 32, (params, out, np.int32(op), np.int32(width)))
        assert out.tolist() == model_shuffle(op, params.tolist(), width)


def test_votes_and_warp_reductions() -> None:
    pred = (np.arange(32) % 3 == 0).astype(np.int32)
    out = np.zeros(5, np.uint32)
    launch("votes", 1, 32, (pred, out))
    lanes = np.flatnonzero(pred)
    assert out[0] == sum(1 << int(i) for i in lanes)
    assert out[1] == 1 and out[2] == 0
    assert out[3] == lanes.sum()
    assert out[4].astype(np.int32) == -7


def test_barrier_reductions() -> None:
    pred = (np.arange(96) % 4 == 1).astype(np.int32)
    out = np.zeros(3 * 96, np.int32)
    launch("barrier_counts", 1, 96, (pred, out))
    assert (out.reshape(96, 3) == [pred.sum(), 0, 1]).all()


def test_global_atomics_across_worker_threads() -> None:
    counter = np.zeros(1, np.uint64)
    fsum = np.zeros(1, np.float32)
    launch("count_atomically", 64, 256, (counter, fsum), workers=2)
    assert counter[0] == 64 * 256 and fsum[0] == 64 * 256


@pytest.mark.parametrize("workers", [1, 2])
def test_shared_memory_is_private_per_block(workers: int) -> None:
    out = np.zeros(40 * 64, np.int32)
    launch("block_private_shared", 40, 64, (out,), workers=workers)
    assert (out.reshape(40, 64) == np.arange(40)[:, None]).all()


def test_built_in_coordinates() -> None:
    grid, block = (3, 2, 2), (4, 3, 2)
    out = np.zeros((12, 24, 4), np.int32)
    launch("coordinates", grid, block, (out,))
    tz, ty, tx = np.meshgrid(range(2), range(3), range(4), indexing="ij")
    assert (out[:, :, 0] == (tx + 10 * ty + 100 * tz).ravel()).all()
    bz, by, bx = np.meshgrid(range(2), range(2), range(3), indexing="ij")
    assert (out[:, :, 1] == (bx + 10 * by + 100 * bz).ravel()[:, None]).all()
    assert (out[:, :, 2] == 4 + 30 + 200).all() and (out[:, :, 3] == 3 + 20 + 200).all()


def test_missing_barrier_shows_under_some_orders_only() -> None:
    x = np.arange(128, dtype=np.float32)
    results = {}
    for order in ALL_ORDERS:
        out = np.zeros(128, np.float32)
        launch("reverse_through_shared", 1, 128, (x, out, np.int32(0)), schedule=order)
        results[order] = np.array_equal(out, x[::-1])
        out[:] = 0
        launch("reverse_through_shared", 1, 128, (x, out, np.int32(1)), schedule=order)
        assert np.array_equal(out, x[::-1]), order
    assert not all(results.values()), "no order exposed the missing __syncthreads"


def test_warp_synchronous_code_needs_syncwarp() -> None:
    x = np.random.default_rng(1).standard_normal(32).astype(np.float32)
    wrong = 0
    for order in ALL_ORDERS:
        out = np.zeros(1, np.float32)
        launch("warp_sum_without_syncwarp", 1, 32, (x, out, np.int32(1)), schedule=order)
        assert np.isclose(out[0], x.sum(), atol=1e-5)
        launch("warp_sum_without_syncwarp", 1, 32, (x, out, np.int32(0)), schedule=order)
        wrong += not np.isclose(out[0], x.sum(), atol=1e-5)
    assert wrong > 0


def test_unwritten_shared_memory_reads_as_nan() -> None:
    out = np.zeros(64, np.float32)
    launch("read_unwritten_shared", 1, 64, (out,))
    assert (out[:32] == 1).all() and np.isnan(out[32:]).all()


def test_dynamic_shared_memory_and_its_limit() -> None:
    n = 20000  # 80 KB: needs the opt-in, as on a GPU
    out = np.zeros(64, np.float32)
    kern = probes().get_function("dynamic_shared")
    with pytest.raises(EmuLaunchError, match="max_dynamic_shared_size_bytes"):
        kern(1, 64, (out, np.int32(n)), shared_mem=4 * n)
    kern.max_dynamic_shared_size_bytes = 4 * n
    kern(1, 64, (out, np.int32(n)), shared_mem=4 * n)
    assert np.array_equal(out, np.arange(n - 1, n - 65, -1, dtype=np.float32))


@pytest.mark.parametrize(
    ("kernel", "block", "message"),
    [
        ("divergent_barrier", 128, "__syncthreads|exited|deadlock"),
        ("return_before_barrier", 64, "exited|returned"),
        ("shuffle_outside_mask", 32, "not in mask"),
        ("mixed_collectives", 32, "different collectives"),
        ("partial_warp_full_mask", 48, "do not exist"),
        ("traps", 32, "__trap"),
    ],
)
def test_undefined_behaviour_is_reported(kernel: str, block: int, message: str) -> None:
    out = np.zeros(128, np.float32 if kernel != "shuffle_outside_mask" else np.int32)
    with pytest.raises(EmuKernelError, match=message):
        launch(kernel, 2, block, (out,))


def test_exited_threads_may_skip_barriers_when_not_strict() -> None:
    out = np.zeros(64, np.float32)
    launch("return_before_barrier", 1, 64, (out,), strict=False)
    assert out[5] == 0 and out.sum() == 63


def test_disjoint_half_warp_collectives() -> None:
    out = np.zeros(32, np.int32)
    launch("half_warp_groups", 1, 32, (out,))
    assert out.tolist() == [lane ^ 1 for lane in range(32)]


def test_arguments_are_checked_like_a_gpu_would_not() -> None:
    out = np.zeros(1, np.float32)
    kern = probes().get_function("takes_scalars")
    kern(1, 1, (out, np.int32(1), np.float32(2.5), np.int64(3)))
    assert out[0] == 6.5
    with pytest.raises(TypeError, match="4-byte"):
        kern(1, 1, (out, 1, np.float32(2.5), np.int64(3)))  # CuPy sends a Python int as 8 bytes
    with pytest.raises(TypeError, match="float64"):
        kern(1, 1, (out, np.int32(1), 2.5, np.int64(3)))
    with pytest.raises(TypeError, match="pointer"):
        kern(1, 1, (np.float32(0), np.int32(1), np.float32(2.5), np.int64(3)))
    with pytest.raises(TypeError, match="parameters"):
        kern(1, 1, (out, np.int32(1)))


def test_invalid_launches() -> None:
    out = np.zeros(1, np.float32)
    kern = probes().get_function("traps")
    with pytest.raises(EmuLaunchError, match="invalid launch"):
        kern(0, 32, (out,))
    with pytest.raises(EmuLaunchError, match="invalid launch"):
        kern(1, 2048, (out,))


def test_unknown_schedule_is_rejected() -> None:
    with pytest.raises(ValueError, match="schedule"):
        EmuConfig(schedule="sideways").policy()


def test_memcheck_names_the_shared_variable_and_index() -> None:
    out = np.zeros(32, np.float32)
    launch("shared_past_end", 1, 32, (out, np.int32(0)))
    assert np.all(out == 3.0)
    # One float past `first` lands, without the check, in padding or in `second` (which is
    # rewritten before it is read): the result would still be right.
    with pytest.raises(EmuKernelError, match=r"block \(0,0,0\) thread \(0,0,0\): out-of-bounds shared "
                       r"memory write of 4 bytes: variable shared_past_end::first \(128 bytes\), index 32 "):
        launch("shared_past_end", 1, 32, (out, np.int32(1)))
    probes_off = probes().with_config(memcheck=False)
    probes_off.get_function("shared_past_end")(1, 32, (out, np.int32(1)))  # unchecked: silent
    assert np.all(out == 3.0)


def test_memcheck_names_the_argument_and_index() -> None:
    src, dst = np.ones(64, np.float32), np.zeros(64, np.float32)
    launch("copy_with_overrun", 2, 32, (src, dst, np.int32(64), np.int32(64)))
    with pytest.raises(EmuKernelError, match=r"block \(1,0,0\) thread \(31,0,0\): out-of-bounds global "
                       r"memory read of 4 bytes: argument in \(4-byte elements\), index 63 "):
        launch("copy_with_overrun", 2, 32, (src[:63], dst, np.int32(64), np.int32(64)))
    with pytest.raises(EmuKernelError, match="global memory write of 4 bytes: argument out .* index 63"):
        launch("copy_with_overrun", 2, 32, (src, dst[:63], np.int32(64), np.int32(64)))


def test_memcheck_sees_holes_of_strided_views() -> None:
    """`in` is every other element of a buffer; a kernel that reads it as contiguous touches
    the elements between, which are inside the view's span but not in the view."""
    buf = np.ones(128, np.float32)
    dst = np.zeros(64, np.float32)
    launch("copy_with_overrun", 1, 32, (buf[:32], dst, np.int32(32), np.int32(32)))
    with pytest.raises(EmuKernelError, match=r"thread \(1,0,0\): out-of-bounds global memory read "
                       r"of 4 bytes: argument in \(4-byte elements\), index 1"):
        launch("copy_with_overrun", 1, 32, (buf[::2], dst, np.int32(32), np.int32(32)))


def test_memcheck_bounds_dynamic_shared_memory_by_the_launch_size() -> None:
    out = np.zeros(32, np.float32)
    launch("dynamic_past_launch_size", 1, 32, (out, np.int32(32)), shared_mem=128)
    with pytest.raises(EmuKernelError, match=r"variable dyn_smem \(128 bytes of dynamic shared memory"):
        launch("dynamic_past_launch_size", 1, 32, (out, np.int32(33)), shared_mem=128)
