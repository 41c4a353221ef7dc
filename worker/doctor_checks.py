"""The checks `noria doctor` runs: the GPU set and the CPU/emulator subset (see worker/doctor.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from noria.kernels.instances import AttentionConfig, all_configs, decode_module, prefill_module
from noria.protocol import switches
from noria.protocol.doctor import GenerationProbe, GenerationRun

if TYPE_CHECKING:
    from noria.worker.doctor import Report

# The demo model's attention (head size 32, block size 16, float32) plus the shapes of common
# 7-8B checkpoints in half precision.
QUICK_CONFIGS = [AttentionConfig("float32", 32, 16), AttentionConfig("bfloat16", 128, 16),
                 AttentionConfig("float16", 64, 32)]
# Under the emulator: one shape per dtype, small head sizes and short contexts (seconds each).
EMU_CONFIGS = [AttentionConfig("float32", 32, 16), AttentionConfig("bfloat16", 64, 8),
               AttentionConfig("float16", 32, 32)]
# Greedy tokens may part at a near tie: there the reference's two best log-probabilities are
# closer than this, so a rounding difference may pick either (float32 on both sides).
NEAR_TIE = 1e-3
LOGPROB_TOL = 2e-3  # |device - reference| of the chosen tokens' log-probabilities, float32


def gpu_checks(report: Report, quick: bool, max_tokens: int) -> None:
    from noria.kernels.device_info import cupy_status, device_facts

    ok, line = cupy_status()
    if not report.check("CuPy", lambda: _require(ok, line)):
        print("  (the engine falls back to torch attention here; the kernel checks are skipped)")
        report.check("greedy generation, GPU (torch attention) vs CPU", lambda: compare_generation(
            {"device": "cuda"}, {"device": "cpu"}, max_tokens))
        return
    facts = device_facts()
    print(f"  info  device: {facts.name}, sm_{facts.arch}, {facts.sm_count} SMs, {facts.memory_gib:.0f} GiB, "
          f"peak {facts.peak_gbps:.0f} GB/s (memory clock x bus width)")
    report.check(f"compile every instance for sm_{facts.arch}", lambda: _compile_all(facts.arch))
    configs = QUICK_CONFIGS if quick else all_configs()
    report.check(f"kernel contracts on the GPU ({len(configs)} configurations)",
                 lambda: _contracts(configs, "cuda", long=3001))
    # attention_backend kernels: a silent fall back to torch would fail the check, not pass it.
    report.check("greedy generation, GPU kernels vs CPU", lambda: compare_generation(
        {"device": "cuda", "attention_backend": "kernels"}, {"device": "cpu"}, max_tokens))
    report.check("swap preemption on the GPU (copy_blocks through pinned memory) vs CPU", lambda: compare_generation(
        {"device": "cuda", **SWAP}, {"device": "cpu"}, max(max_tokens, SWAP_TOKENS)))
    report.check("decode bandwidth", lambda: _bandwidth(facts.peak_gbps))


def cpu_checks(report: Report, max_tokens: int) -> None:
    from noria.kernels.device_info import cupy_status

    report.check("native CPU kernels", lambda: _cpu_kernels(report))
    ok, line = cupy_status()
    print(f"  info  CuPy: {line}")
    report.check("NVRTC compile of the demo model's instances (sm_80, sm_90)", _compile_demo_offline)
    report.check(f"kernel contracts under the CPU emulator ({len(EMU_CONFIGS)} configurations)",
                 lambda: _contracts(EMU_CONFIGS, "cpu", long=600))
    report.check("greedy generation, emulated kernels vs torch backend", lambda: compare_generation(
        {"device": "cpu", "emulated": True}, {"device": "cpu"}, max_tokens))
    report.check("swap preemption on emulated kernels (copy_blocks) vs torch backend", lambda: compare_generation(
        {"device": "cpu", "emulated": True, **SWAP}, {"device": "cpu"}, max(max_tokens, SWAP_TOKENS)))


BF16_GEMM_KINDS = {"amx": "AMX-BF16 tiles on bf16-rounded activations", "dot": "vdpbf16ps on bf16-rounded activations",
                   "widen": "bf16 weights widened to float32"}
FP8_GEMM_KINDS = {"dot": "e4m3 widened to bf16, vdpbf16ps on bf16-rounded activations",
                  "widen": "e4m3 widened to float32"}


def cpu_kernel_report() -> tuple[list[str], str]:
    """What a CPU worker here would run on: (info lines: the CPU and the ISA flags the kernels care
    about, the 16-bit GEMMs' layouts, what `--dtype auto` picks for a bfloat16 checkpoint and why
    (worker/device.py); each native kernel family's path, worker/cpu_ops.py's, in one line)."""
    from noria.worker import cpu_ops, host
    from noria.worker.device import GiB, bf16_gemm, choose_dtype

    flags = host.cpu_flags()
    has = " ".join(f for f in host.ISA_FLAGS if f in flags) or "none"
    lacks = " ".join(f for f in host.ISA_FLAGS if f not in flags)
    kind, missing = bf16_gemm()
    gemm = f"{kind} ({BF16_GEMM_KINDS.get(kind, kind)})" if kind else f"none ({missing}): torch's bf16 operators"
    if kind and "amx_bf16" in flags and kind != "amx":
        from noria.worker import gemm_amx_kernels

        gemm += f"; AMX tiles unused: {gemm_amx_kernels.not_ready_reason()}"
    if kind:
        gemm += "; float16 weights widened by vcvtph2ps"
    auto = choose_dtype("auto", torch.device("cpu"), "bfloat16", flags=flags)
    said = f"{auto.name} ({auto.reason})"
    if auto.dtype != torch.bfloat16:
        said += f"; bfloat16 where float32 weights would not fit in {host.memory_available() / GiB:.1f} GiB available"
    info = [f"CPU: {host.cpu_model()}, {host.cpu_count()} cores; ISA: {has}" + (f" (not {lacks})" if lacks else ""),
            f"bf16 GEMM: {gemm}",
            f"--dtype auto, bfloat16 checkpoint: {said}",
            f"quantized GEMMs: {_quant_gemms()}"]
    return info, " ".join(f"{family}={path}" for family, path in cpu_ops.paths().items())


def _w4a8_tiles() -> str:
    from noria.worker import gemm_quant_groups

    tiles, rows = gemm_quant_groups.w4a8_tiles()
    return "" if tiles is None else f" (4-bit groups of a multiple of 64 on AMX-INT8 tiles from {rows} rows)"


def _quant_gemms() -> str:
    from noria.worker import gemm_quant_kernels, gemm_quant_tiles

    if not gemm_quant_kernels.usable():
        return "none (not built): quantized layers on torch's operators"
    tiles, rows = gemm_quant_tiles.w8a8_tiles()
    amx = f" (AMX-INT8 tiles from {rows} rows)" if tiles is not None else ""
    line = (f"int8 W8A8 on the {gemm_quant_kernels.isa()} path{amx}, activations quantized per token; "
            + ("4/8-bit weight-only widened to float32 in registers (NORIA_CPU_W4A16=1)" if switches.cpu_w4a16()
               else "4/8-bit weight-only on int8 activations per group" + _w4a8_tiles()))
    from noria.worker import gemm_fp8_kernels

    if gemm_fp8_kernels.usable():
        line += f"; fp8 {gemm_fp8_kernels.layout()} ({FP8_GEMM_KINDS[gemm_fp8_kernels.layout()]})"
    return line


def _cpu_kernels(report: Report) -> str:
    # A family on torch is a slower host, not a broken one: only an error here fails the check.
    info, families = cpu_kernel_report()
    for line in info:
        report.line("info", line)
    return families


def _require(ok: bool, line: str) -> str:
    if not ok:
        raise RuntimeError(line)
    return line


def _compile_all(arch: str) -> str:
    from noria.kernels.device_info import compile_all

    count, problems, seconds = compile_all(arch)
    if problems:
        raise AssertionError(f"{len(problems)} instance(s) spill or overflow: " + "; ".join(problems[:5]))
    return f"{count} kernels, no spills, no stack, static shared memory within 48 KB ({seconds:.0f} s of NVRTC)"


def _compile_demo_offline() -> str:
    """RawModule's NVRTC call with no device (kernels.nvrtc_check), for the demo model's
    modules only: the whole matrix takes minutes on a small CPU host; CI compiles it all."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "skipped: CuPy is not installed (pip install -r kernels/requirements-test.txt)"
    from noria.kernels import nvrtc_check
    from noria.kernels.device_info import compile_every_time
    from noria.kernels.options import PTXAS_VERBOSE, compile_options, read_source

    cfg = QUICK_CONFIGS[0]
    count = 0
    with compile_every_time():
        for arch in ("80", "90"):
            for spec in (decode_module(cfg), prefill_module(cfg)):
                with nvrtc_check.offline_nvrtc(arch) as calls:
                    log = nvrtc_check.rawmodule_compile(read_source(spec.source),
                                                        compile_options() + PTXAS_VERBOSE, spec.names)
                for u in nvrtc_check.parse_ptxas(log, arch, spec.source, calls[0]["mapping"] or {}):
                    if u.spill_stores or u.spill_loads:
                        raise AssertionError(f"sm_{arch} {u.name} spills")
                    count += 1
    return f"{count} kernels compiled, no spills"


def _contracts(configs: list[AttentionConfig], device: str, long: int) -> str:
    from noria.kernels.backends import CupyBackend, EmuBackend
    from noria.kernels.contracts import run_contracts

    be = CupyBackend() if device == "cuda" else EmuBackend()
    if isinstance(be, EmuBackend):
        specs = [s for c in configs for s in (decode_module(c), prefill_module(c))]
        be.prebuild(specs)  # g++ builds in parallel threads
    results = run_contracts(configs, be, torch.device(device), long=long)
    bad = [r for r in results if r.error]
    if bad:
        raise AssertionError(f"{len(bad)} of {len(results)} failed; " +
                             "; ".join(f"{r.name}: {r.error}" for r in bad[:3]))
    return f"{len(results)} kernel checks match the float64 reference"


_RESULTS: dict[tuple[Any, ...], tuple[list[tuple[list[int], list[Any]]], Any]] = {}


def _generate(flags: dict[str, Any], max_tokens: int) -> tuple[list[tuple[list[int], list[Any]]], Any]:
    """(token ids and logprobs per prompt, the engine's stats) of a short greedy run of the
    demo model in float32, in a child that runs `LLM` (frontend/doctor_generation.py); a
    reference run is computed once per doctor run."""
    key = (tuple(sorted(flags.items())), max_tokens)
    if key in _RESULTS:
        return _RESULTS[key]
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 700) for _ in range(n)] for n in (3, 20, 25, 30, 40, 77)]
    engine = {k: v for k, v in flags.items() if k != "emulated"}
    engine.setdefault("num_kv_blocks", 64)
    probe = GenerationProbe(prompts=prompts, max_tokens=max_tokens, engine=engine)
    env = {k: v for k, v in os.environ.items() if k != switches.EMULATED_KERNELS}
    if flags.get("emulated"):
        env[switches.EMULATED_KERNELS] = "1"
    with tempfile.TemporaryDirectory(prefix="noria-doctor-") as tmp:
        out = Path(tmp) / "run.json"
        # stdout stays the doctor's report: the child's (and its engine's) output goes to stderr.
        child = subprocess.run([sys.executable, "-m", "noria.frontend.doctor_generation",
                                msgspec.json.encode(probe).decode(), str(out)],
                               env=env, stdout=2, check=False)
        if child.returncode != 0:
            raise RuntimeError(f"the generation child exited with status {child.returncode} (its output is above)")
        run = msgspec.json.decode(out.read_bytes(), type=GenerationRun)
    _RESULTS[key] = [(s.token_ids, s.logprobs) for s in run.samples], run.stats
    return _RESULTS[key]


def attention_summary(stats: Any) -> str:
    """The engine's attention backend as its stats report it, with why not the kernels."""
    name = stats.attention_backend or "unknown"
    return f"{name} ({stats.attention_reason})" if stats.attention_reason else name


def compare_generation(flags: dict[str, Any], ref_flags: dict[str, Any], max_tokens: int) -> str:
    """Greedy tokens of the demo model must match the reference's; where they part, the
    reference's two best candidates must be a near tie (then the rest is not compared).
    With swap preemption in `flags`, swaps must have happened and every block come back."""
    (got, stats), (ref, _) = _generate(flags, max_tokens), _generate(ref_flags, max_tokens)
    worst, ties = 0.0, 0
    for p, ((ids, lps), (ref_ids, ref_lps)) in enumerate(zip(got, ref, strict=True)):
        for i, (a, b) in enumerate(zip(ids, ref_ids, strict=True)):
            top = ref_lps[i].top_logprobs
            if a != b:
                gap = top[0] - top[1] if len(top) > 1 else float("inf")
                if gap > NEAR_TIE:
                    raise AssertionError(f"prompt {p} token {i}: {a} vs reference {b} (reference margin {gap:.2g})")
                ties += 1
                break
            worst = max(worst, abs(lps[i].logprob - ref_lps[i].logprob))
    if worst > LOGPROB_TOL:
        raise AssertionError(f"chosen tokens' log-probabilities differ by up to {worst:.2g} (> {LOGPROB_TOL})")
    if not stats.blocks_consistent or stats.num_free_blocks != stats.num_kv_blocks:
        raise AssertionError(f"KV blocks not all returned: {stats}")
    detail = f"{sum(len(ids) for ids, _ in got)} tokens identical, max |logprob diff| {worst:.1e}"
    detail += f", attention backend {attention_summary(stats)}"
    if flags.get("preemption_mode") == "swap":
        if stats.num_swap_outs == 0 or stats.num_swap_ins != stats.num_swap_outs:
            raise AssertionError(f"expected swaps out and back in: {stats.num_swap_outs} out, {stats.num_swap_ins} in")
        detail += f", {stats.num_swap_outs} swap-outs and as many swap-ins"
    return detail + (f", {ties} near tie(s)" if ties else "")


# Too few blocks for the six prompts at once (they need 21): the latest are swapped out to
# the CPU area and back in, through copy_blocks where attention runs on kernels.
# 8 blocks (128 tokens) for 195 prompt tokens: at least two swaps whatever order the prompts board in
# (10 blocks gave one swap, and none when the prompts reached the scheduler in an unlucky split).
SWAP_TOKENS = 16  # running requests must grow into blocks that are not there: fewer tokens may never swap
SWAP = {"num_kv_blocks": 8, "preemption_mode": "swap", "swap_space": 0.01}


def _bandwidth(peak_gbps: float) -> str:
    from noria.kernels.device_info import copy_gbps, decode_timing

    t = decode_timing(AttentionConfig("bfloat16", 128, 16), num_seqs=64, context=4096)
    copy = copy_gbps()
    return (f"decode bf16 head 128 block 16, 64 x 4096 tokens, 32/8 heads: {t.seconds * 1e3:.3f} ms, "
            f"{t.gbps:.0f} GB/s = {t.gbps / peak_gbps:.0%} of peak {peak_gbps:.0f} GB/s, "
            f"{t.gbps / copy:.0%} of a device copy ({copy:.0f} GB/s read + write)")
