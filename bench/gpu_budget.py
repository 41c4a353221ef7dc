"""`noria bench gpu`'s phases, the sizes each measures at, and the time budget they share: a phase
that does not fit is skipped, one that overruns is cut short by SIGALRM, one that fails is
recorded without losing the others' figures."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from noria.bench.gpu_report import Report

# In order of value, so that a budget cut keeps the rows that matter most: decode at batch 1 and
# 32 in the model's dtype (the roofline target), then FP8 and W4A16 beside it (issue 39's FP8
# >= 1.6x target), then offline throughput, TTFT, speculative decoding's ITL, transformers'
# anchor, and eager decode.
PHASES = ("probe", "checkpoint", "itl", "fp8", "w4a16", "throughput", "ttft", "spec", "hf", "eager")


@dataclass(frozen=True)
class Sizes:
    requests: int = 256
    prompt: int = 1024
    output: int = 256
    ttft_prompts: tuple[int, ...] = (2048, 8192)
    itl_batches: tuple[int, ...] = (1, 16, 32)  # 16: the anchor's larger batch
    itl_prompt: int = 512
    itl_tokens: int = 128
    hf_batches: tuple[int, ...] = (1, 16)
    # The quantized kinds beside the model's dtype: decode at these batches, and a short offline run.
    quant_batches: tuple[int, ...] = (1, 32)
    quant_requests: int = 32
    quant_prompt: int = 512
    quant_output: int = 128
    spec_batches: tuple[int, ...] = (1, 16)  # beside the itl phase's rows at the same batches
    max_model_len: int = 8192 + 256
    # Seconds a phase needs at least (skipped when less is left) and may take at most.
    need: dict[str, float] = field(default_factory=lambda: {
        "probe": 5, "checkpoint": 5, "itl": 30, "fp8": 30, "w4a16": 30, "throughput": 90, "ttft": 30, "spec": 60,
        "hf": 60, "eager": 60})
    cap: dict[str, float] = field(default_factory=lambda: {
        "probe": 30, "checkpoint": 60, "itl": 120, "fp8": 100, "w4a16": 120, "throughput": 200, "ttft": 90,
        "spec": 120, "hf": 150, "eager": 120})


TINY_SIZES = Sizes(requests=6, prompt=24, output=6, ttft_prompts=(32, 96), itl_batches=(1, 2, 3), itl_prompt=16,
                   itl_tokens=6, hf_batches=(1, 2), quant_batches=(1, 2), quant_requests=3, quant_prompt=16,
                   quant_output=6, spec_batches=(1, 2), max_model_len=256,
                   need=dict.fromkeys(PHASES, 0.0), cap=dict.fromkeys(PHASES, 120.0))


class PhaseTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise PhaseTimeout


class Budget:
    def __init__(self, seconds: float, report: Report, sizes: Sizes, only: set[str]) -> None:
        self.deadline = time.monotonic() + seconds
        self.report, self.sizes, self.only = report, sizes, only
        self.ok: set[str] = set()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[bool]:
        """Yields whether to run `name`; records how it ended. SIGALRM cuts it at its cap or at
        the deadline, whichever comes first."""
        if name not in self.only:
            self.report.phase(name, "skipped", 0.0, "not asked for (--phases)")
            yield False
            return
        need, left = self.sizes.need[name], self.left()
        if left < max(need, 1.0):
            self.report.phase(name, "skipped", 0.0, f"time: needs ~{need:.0f} s, {max(left, 0):.0f} s left")
            print(f"[{name}] skipped: {max(left, 0):.0f} s of the budget left", flush=True)
            yield False
            return
        print(f"[{name}]", flush=True)
        start = time.monotonic()
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, max(1.0, min(self.sizes.cap[name], left)))
        try:
            yield True
            self.ok.add(name)
            self.report.phase(name, "ok", time.monotonic() - start)
        except PhaseTimeout:
            self.report.phase(name, "cut short", time.monotonic() - start, "over its time budget")
            print(f"[{name}] cut short: over its time budget", flush=True)
        except Exception as e:  # noqa: BLE001 - one failed phase must not lose the others' figures
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.report.phase(name, "failed", time.monotonic() - start, f"{type(e).__name__}: {first}"[:300])
            print(f"[{name}] failed: {type(e).__name__}: {first}", flush=True)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
