"""`--dtype auto` (worker/device.py, `choose_dtype`): a GPU takes the checkpoint's half dtype; a
CPU takes it where the native GEMM over 16-bit weights builds (bf16: natively with avx512_bf16 /
amx_bf16, else widened; f16: widened where F16C or AVX-512F converts it), float32 otherwise
unless float32 weights would not fit in memory. The CPU's flags and its free memory are injected, so every branch runs on any host; the
worker's start-up line is checked on a real engine start, and `noria doctor`'s CPU report.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from noria.protocol import switches
from noria.worker import device, host
from noria.worker.device import DtypeChoice, choose_dtype, cpu_precision, resolve_dtype
from noria.worker.loader import checkpoint_float32_bytes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GiB = 1 << 30
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16", "f16c"})
AMX = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
AVX2 = frozenset({"avx2", "fma", "f16c"})
PLENTY = 64 * GiB


def _size(gib: float):  # float32_bytes as the worker passes it: asked only where it matters
    return lambda: int(gib * GiB)


def _never():
    raise AssertionError("not asked for: the choice does not depend on it")


@pytest.fixture
def dot_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every choice below as on a host whose compiler builds the dot-product bf16 GEMM, emulator off."""
    monkeypatch.delenv(switches.EMULATED_KERNELS, raising=False)
    monkeypatch.setattr(device, "bf16_gemm", lambda: ("dot", ""))


def test_cpu_flags_are_read_from_cpuinfo_text() -> None:
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n"
    assert host.parse_cpu_flags(x86) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert host.parse_cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert host.parse_cpu_flags("") == frozenset()
    assert host.native_bf16(frozenset({"avx2", "amx_bf16", "avx512_bf16"})) == ("avx512_bf16", "amx_bf16")
    assert host.native_bf16(AVX2) == ()


@pytest.mark.parametrize(("flags", "named"), [(AVX512_BF16, "avx512_bf16"), (AMX, "amx_bf16")])
def test_a_bf16_checkpoint_stays_bf16_where_the_cpu_computes_bf16(flags: frozenset[str], named: str,
                                                                    dot_gemm: None) -> None:
    choice = choose_dtype("auto", CPU, "bfloat16", _never, flags=flags, available=1)
    assert choice == DtypeChoice(torch.bfloat16, f"the checkpoint's; this CPU computes bf16 natively: {named}; "
                                                 "bf16 GEMM: dot")
    assert choice.line() == f"dtype auto: bfloat16 ({choice.reason})"


def test_without_native_bf16_a_bf16_checkpoint_keeps_bf16_weights_widened(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the bytes beat float32 in the AVX2 code too (bench/RESULTS.md), so the widening GEMM
    is chosen wherever it builds."""
    monkeypatch.delenv(switches.EMULATED_KERNELS, raising=False)
    monkeypatch.setattr(device, "bf16_gemm", lambda: ("widen", ""))
    choice = choose_dtype("auto", CPU, "bfloat16", _never, flags=AVX2, available=1)
    assert choice == DtypeChoice(torch.bfloat16, "the checkpoint's; bf16 widened to float32 in registers (no "
                                                 "avx512_bf16/amx_bf16), half the bytes; bf16 GEMM: widen")


def test_without_the_gemm_a_half_checkpoint_too_big_for_float32_keeps_its_dtype(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(switches.EMULATED_KERNELS, raising=False)
    monkeypatch.setattr(device, "bf16_gemm", lambda: (None, "no C compiler"))
    choice = choose_dtype("auto", CPU, "bfloat16", _size(30), flags=AVX2, available=22 * GiB)
    assert choice.dtype == torch.bfloat16
    assert choice.reason == ("float32 weights (30.0 GiB) would not fit in 22.0 GiB available; checkpoint "
                             "bfloat16, the native 16-bit GEMM is not built (no C compiler)")
    # Fits, but not with the room the KV cache and activations need beside the weights.
    assert choose_dtype("auto", CPU, "bfloat16", _size(20), flags=AVX2, available=22 * GiB).dtype == torch.bfloat16
    assert choose_dtype("auto", CPU, "bfloat16", _size(8), flags=AVX2, available=22 * GiB) == \
        DtypeChoice(torch.float32, "checkpoint bfloat16; the native 16-bit GEMM is not built (no C compiler)")
    assert choose_dtype("auto", CPU, "float16", _size(30), flags=AVX2, available=22 * GiB).dtype == torch.float16
    # The size unknown (no safetensors headers to read) or the memory unknown: float32, as before.
    assert choose_dtype("auto", CPU, "bfloat16", lambda: None, flags=AVX2, available=1).dtype == torch.float32
    assert choose_dtype("auto", CPU, "bfloat16", _size(30), flags=AVX2, available=0).dtype == torch.float32


def test_under_the_emulator_a_half_checkpoint_is_float32(monkeypatch: pytest.MonkeyPatch, dot_gemm: None) -> None:
    monkeypatch.setenv(switches.EMULATED_KERNELS, "1")
    for checkpoint in ("bfloat16", "float16"):
        choice = choose_dtype("auto", CPU, checkpoint, _size(1), flags=AVX512_BF16, available=PLENTY)
        assert choice.dtype == torch.float32 and "emulator" in choice.reason, choice


def test_a_float16_checkpoint_keeps_f16_weights_where_the_cpu_converts_f16(dot_gemm: None) -> None:
    for flags, named in ((AVX512_BF16, "f16c, avx512f"), (AVX2, "f16c")):
        choice = choose_dtype("auto", CPU, "float16", _never, flags=flags, available=1)
        assert choice == DtypeChoice(torch.float16, f"the checkpoint's; f16 widened to float32 by vcvtph2ps ({named}), "
                                                    "half the bytes")
        assert choice.line(torch.float16) == (f"dtype auto: float16 ({choice.reason}); f16 weights through the native "
                                              "f16 GEMM, f16 KV cache, float32 norms, rotary and softmax")
    old = frozenset({"sse2", "avx"})  # no conversion in hardware: the portable one is slow
    assert choose_dtype("auto", CPU, "float16", _size(1), flags=old, available=PLENTY) == \
        DtypeChoice(torch.float32, "checkpoint float16; this CPU has no float16 conversion in hardware (no f16c/avx512f)")
    assert choose_dtype("auto", CPU, "float16", _size(30), flags=old, available=8 * GiB).dtype == torch.float16


@pytest.mark.parametrize("flags", [AVX512_BF16, AVX2])
def test_float32_and_unnamed_checkpoints_stay_float32(flags: frozenset[str]) -> None:
    assert choose_dtype("auto", CPU, "float32", _never, flags=flags, available=1) == \
        DtypeChoice(torch.float32, "the checkpoint's")
    assert choose_dtype("auto", CPU, None, _never, flags=flags, available=1) == \
        DtypeChoice(torch.float32, "the checkpoint names no dtype")
    assert choose_dtype("auto", CPU, "float64", _never, flags=flags, available=1).dtype == torch.float32


@pytest.mark.parametrize("device_", [CPU, CUDA])
def test_a_given_dtype_always_wins(device_: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "bf16_gemm", lambda: ("dot", ""))
    for name, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16), ("half", torch.float16)):
        for checkpoint in ("bfloat16", "float32", "float16", None):
            choice = choose_dtype(name, device_, checkpoint, _size(1000), flags=AVX512_BF16, available=1)
            assert choice == DtypeChoice(dtype, f"--dtype {name}", auto=False)
    assert DtypeChoice(torch.float32, "--dtype float32", auto=False).line() is None
    assert DtypeChoice(torch.bfloat16, "--dtype bfloat16", auto=False).line(torch.bfloat16) == \
        "dtype: bf16 weights through the native bf16 GEMM (dot), bf16 KV cache, float32 norms, rotary and softmax"
    with pytest.raises(ValueError, match="unknown dtype"):
        choose_dtype("int8", CPU, None)


def test_a_gpu_takes_the_checkpoint_s_dtype_whatever_the_cpu() -> None:
    for flags in (AVX2, AVX512_BF16):
        assert choose_dtype("auto", CUDA, "bfloat16", _never, flags=flags, available=1).dtype == torch.bfloat16
        assert choose_dtype("auto", CUDA, "float16", _never, flags=flags, available=1).dtype == torch.float16
        assert choose_dtype("auto", CUDA, "float64", _never, flags=flags, available=1).dtype == torch.float32
        assert choose_dtype("auto", CUDA, None, _never, flags=flags, available=1).dtype == torch.float32
    assert resolve_dtype("auto", CUDA, "bfloat16") == torch.bfloat16


def test_the_line_says_what_bfloat16_becomes_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "bf16_gemm", lambda: ("widen", ""))
    choice = DtypeChoice(torch.bfloat16, "the checkpoint's; this CPU computes bf16 natively: avx512_bf16")
    assert choice.line(torch.bfloat16) == ("dtype auto: bfloat16 (the checkpoint's; this CPU computes bf16 natively: "
                                           "avx512_bf16); bf16 weights through the native bf16 GEMM (widen), "
                                           "bf16 KV cache, float32 norms, rotary and softmax")


def test_ranks_take_rank_0_s_choice() -> None:
    class Tp:  # rank 1 of 2, whose rank 0 chose bfloat16
        size, first = 2, False

        def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
            return x.fill_(1)

    mine = DtypeChoice(torch.float32, "checkpoint bfloat16; this CPU has no native bf16 compute")
    assert device.same_on_every_rank(mine, CPU, Tp()).dtype == torch.bfloat16  # type: ignore[arg-type]
    given = DtypeChoice(torch.float32, "--dtype float32", auto=False)
    assert device.same_on_every_rank(given, CPU, Tp()) is given  # type: ignore[arg-type]


def _rank_choice(rank: int, init: str, out: str) -> None:
    from noria.worker.models.parallel import destroy_tensor_parallel, init_tensor_parallel

    tp = init_tensor_parallel(rank, 2, init, CPU, 60)
    try:  # rank 0 sees a native-bf16 CPU, rank 1 an AVX2-only one
        mine = choose_dtype("auto", CPU, "bfloat16", _size(1), flags=AVX512_BF16 if rank == 0 else AVX2,
                            available=PLENTY)
        Path(out).write_text(str(device.same_on_every_rank(mine, CPU, tp).dtype))
    finally:
        destroy_tensor_parallel()


def test_cpu_ranks_agree_over_gloo(tmp_path: Path) -> None:
    import multiprocessing

    from noria.protocol.sockets import free_tcp_port

    if device.bf16_gemm()[0] is None:
        pytest.skip("the native bf16 GEMM does not build here: rank 0 would choose float32 too")
    ctx = multiprocessing.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    procs = [ctx.Process(target=_rank_choice, args=(r, init, str(tmp_path / str(r)))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [(tmp_path / str(r)).read_text() for r in range(2)] == ["torch.bfloat16"] * 2


def test_available_memory_is_the_smaller_of_meminfo_and_the_cgroup_room(tmp_path: Path, monkeypatch) -> None:
    real = host._meminfo_available()
    assert real and real > 0
    meminfo = [8 * GiB]  # MemAvailable moves between two reads on a live machine: pin it
    monkeypatch.setattr(host, "_meminfo_available", lambda: meminfo[0])
    (tmp_path / "memory.max").write_text(f"{4 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{3 * GiB}\n")
    (tmp_path / "memory.stat").write_text(f"anon 1\ninactive_file {GiB // 2}\n")
    assert host.memory_available(tmp_path) == 4 * GiB - (3 * GiB - GiB // 2)  # the cgroup's room
    meminfo[0] = GiB
    assert host.memory_available(tmp_path) == GiB  # the host's MemAvailable
    (tmp_path / "memory.max").write_text("max\n")  # no limit: MemAvailable alone
    meminfo[0] = 8 * GiB
    assert host.memory_available(tmp_path) == 8 * GiB


def test_the_float32_size_comes_from_the_safetensors_headers(tmp_path: Path) -> None:
    from tests.tiny_models import make_model

    model = make_model("llama")
    model.save_pretrained(str(tmp_path / "one"))
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    params = sum(t.numel() for t in model.state_dict().values())
    assert checkpoint_float32_bytes(tmp_path / "one") == 4 * params
    assert checkpoint_float32_bytes(tmp_path / "sharded") == 4 * params
    assert checkpoint_float32_bytes(tmp_path / "empty") is None


# ---- a real engine start ------------------------------------------------------------------------------

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def _dtype_lines(model: Path) -> list[str]:
    argv = [sys.executable, "-m", "noria.frontend.cli", "generate", "hi", "--model", str(model), "--max-tokens", "2",
            "--device", "cpu", "-v"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    return [line for line in r.stderr.splitlines() if TIMESTAMP.match(line) and " dtype auto: " in line]


def _bf16_copy(demo_path: Path, to: Path) -> Path:
    """The demo checkpoint saved as a bfloat16 one (config and weights)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(demo_path, to)
    config = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(to / "model.safetensors").items()}
    save_file(weights, to / "model.safetensors", metadata={"format": "pt"})
    return to


def test_the_worker_says_what_auto_chose_and_why(demo_path: Path, tmp_path: Path) -> None:
    lines = _dtype_lines(demo_path)  # the demo is saved in float32
    assert len(lines) == 1 and " noria.worker INFO " in lines[0], lines
    assert lines[0].endswith("dtype auto: float32 (the checkpoint's)"), lines[0]
    # A bfloat16 checkpoint: what this host's CPU makes of it, said once by the worker.
    bf16 = _bf16_copy(demo_path, tmp_path / "demo-bf16")
    lines = _dtype_lines(bf16)
    expected = choose_dtype("auto", CPU, "bfloat16", lambda: checkpoint_float32_bytes(bf16))
    said = expected.line(cpu_precision(expected.dtype, CPU)[1])
    assert said and len(lines) == 1 and lines[0].endswith(said), (lines, said)
    if host.native_bf16(host.cpu_flags()) and device.bf16_gemm()[0]:  # as on the host these results come from
        assert expected.dtype == torch.bfloat16 and "bf16 weights through the native bf16 GEMM" in said


def test_doctor_reports_the_cpu_kernels_and_the_auto_choice() -> None:
    from noria.worker import cpu_ops, doctor_checks

    info, families = doctor_checks.cpu_kernel_report()
    cpu, gemm, auto, quant = info
    assert cpu.startswith(f"CPU: {host.cpu_model()}, ") and "ISA: " in cpu
    for flag in host.ISA_FLAGS:  # each flag said: among those the CPU has, or those it lacks
        assert re.search(rf"\b{flag}\b", cpu), (flag, cpu)
    assert families == " ".join(f"{family}={path}" for family, path in cpu_ops.paths().items())
    assert {"gemm", "fused", "attention", "stack"} <= {p.split("=")[0] for p in families.split()}
    kind, _ = device.bf16_gemm()
    assert gemm.startswith(f"bf16 GEMM: {kind} (" if kind else "bf16 GEMM: none ("), gemm
    choice = choose_dtype("auto", CPU, "bfloat16", flags=host.cpu_flags())
    assert auto.startswith(f"--dtype auto, bfloat16 checkpoint: {choice.name} ({choice.reason})"), auto
    from noria.worker import gemm_quant_kernels

    assert quant.startswith(f"quantized GEMMs: int8 W8A8 on the {gemm_quant_kernels.isa()} path"
                            if gemm_quant_kernels.usable() else "quantized GEMMs: none (not built)"), quant
