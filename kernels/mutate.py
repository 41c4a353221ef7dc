"""Mutation check: inject known bugs into the attention kernels and show the tests catch each.

Every mutant is a one-line edit of a copy of kernels/csrc; the kernel tests then run against
that copy (pytest --kernels-src=COPY) in a subprocess, so a mutant that crashes the emulator
(an out-of-bounds read) takes down only its own run — which counts as caught.

    python -m noria.kernels.mutate                 # stop each run at its first failing test
    python -m noria.kernels.mutate --per-schedule  # run every oracle test: which thread orders catch it
    python -m noria.kernels.mutate --per-schedule --update-readme
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from noria.kernels.options import SOURCE_DIR

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "kernels"
SCHEDULES = ("forward", "greedy", "greedy-reverse", "random:7")
RUN_TIMEOUT = 300.0  # seconds per mutant; a kernel that never finishes counts as caught
TIMED_OUT = -1000

_DECODE_TESTS = (str(TESTS / "test_decode_attention.py") + "::test_decode_matches_reference",)
_PREFILL_TESTS = (str(TESTS / "test_prefill_attention.py") + "::test_prefill_matches_reference",)


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    source: str
    old: str
    new: str
    tests: tuple[str, ...]
    # One float32 configuration: the tightest tolerance, and one module to compile per mutant.
    keyword: str = "float32-d128-b16"


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "decode-no-q-barrier",
        "removed `__syncthreads` (after staging q in shared memory)",
        "decode_attention.cu",
        "q_s[d] = to_float(q[d]) * scale;\n  __syncthreads();",
        "q_s[d] = to_float(q[d]) * scale;",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-no-merge-barrier",
        "removed `__syncthreads` (before the cross-group merge)",
        "decode_attention.cu",
        "    grp_l[gid] = l;\n  }\n  __syncthreads();",
        "    grp_l[gid] = l;\n  }",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-gqa-mapping",
        "wrong GQA head mapping (`head % num_kv_heads`)",
        "decode_attention.cu",
        "const int kv_head = head / (num_heads / num_kv_heads);",
        "const int kv_head = head % num_kv_heads;",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-block-off-by-one",
        "off-by-one in the block index (next table entry)",
        "decode_attention.cu",
        "const long long phys = table[logical_block];",
        "const long long phys = table[logical_block + 1];",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-block-count-short",
        "off-by-one in the block count (partial last block dropped)",
        "decode_attention.cu",
        "const int num_blocks = (end - start + BLOCK_SIZE - 1) / BLOCK_SIZE;",
        "const int num_blocks = (end - start) / BLOCK_SIZE;",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-reduction-short",
        "reduction one level short (Q.K over a lane group)",
        "decode_attention.cu",
        "for (int offset = kGroup / 2; offset > 0; offset >>= 1)",
        "for (int offset = kGroup / 2; offset > 1; offset >>= 1)",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-no-block-table",
        "skipped block table lookup (logical block used as physical)",
        "decode_attention.cu",
        "const long long phys = table[logical_block];",
        "const long long phys = logical_block;",
        _DECODE_TESTS,
    ),
    Mutant(
        "decode-softmax-scale",
        "wrong softmax scale (scale not applied)",
        "decode_attention.cu",
        "q_s[d] = to_float(q[d]) * scale;",
        "q_s[d] = to_float(q[d]);",
        _DECODE_TESTS,
    ),
    Mutant(
        "splitk-sum-short",
        "reduction one level short (split-K merge, block sum)",
        "common.cuh",
        "for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)\n    v += __shfl_xor_sync",
        "for (int offset = kWarpSize / 2; offset > 1; offset >>= 1)\n    v += __shfl_xor_sync",
        _DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "splitk-reused-scratch",
        "removed `__syncthreads` (block_max's trailing barrier)",
        "common.cuh",
        "for (int w = 1; w < kNumWarps; ++w) r = fmaxf(r, scratch[w]);\n  __syncthreads();",
        "for (int w = 1; w < kNumWarps; ++w) r = fmaxf(r, scratch[w]);",
        _DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "prefill-no-tile-barrier",
        "removed `__syncthreads` (after staging a K/V block)",
        "prefill_attention.cu",
        "        v_s[j][c * kVec + i] = v[i];\n      }\n    }\n    __syncthreads();",
        "        v_s[j][c * kVec + i] = v[i];\n      }\n    }",
        _PREFILL_TESTS,
    ),
    Mutant(
        "prefill-causal-off-by-one",
        "off-by-one in the causal mask (a query misses itself)",
        "prefill_attention.cu",
        "if (kpos > qpos) s[t] = neg_inf();",
        "if (kpos >= qpos) s[t] = neg_inf();",
        _PREFILL_TESTS,
    ),
    Mutant(
        "prefill-gqa-mapping",
        "wrong GQA head mapping (`head % num_kv_heads`)",
        "prefill_attention.cu",
        "const int kv_head = head / (num_heads / num_kv_heads);",
        "const int kv_head = head % num_kv_heads;",
        _PREFILL_TESTS,
    ),
    Mutant(
        "prefill-row-max-short",
        "reduction one level short (row max over 8 threads)",
        "prefill_attention.cu",
        "for (int offset = kRowThreads / 2; offset > 0; offset >>= 1)\n      bmax",
        "for (int offset = kRowThreads / 2; offset > 1; offset >>= 1)\n      bmax",
        _PREFILL_TESTS,
    ),
    # Off by one past the end: the values stay right (the stray bytes land in padding or in
    # memory that is overwritten or ignored), so only the emulator's memory check sees them.
    Mutant(
        "decode-q-staging-past-end",
        "off-by-one past the end (query staging writes `q_s[HEAD_DIM]`)",
        "decode_attention.cu",
        "for (int d = threadIdx.x; d < HEAD_DIM; d += kNumThreads) q_s[d]",
        "for (int d = threadIdx.x; d <= HEAD_DIM; d += kNumThreads) q_s[d]",
        _DECODE_TESTS,
    ),
    Mutant(
        "splitk-max-past-end",
        "off-by-one past the end (split-K merge reads `part_max[parts]`)",
        "decode_attention.cu",
        "for (int p = threadIdx.x; p < parts; p += kNumThreads) mx = fmaxf(mx, pm[p]);",
        "for (int p = threadIdx.x; p <= parts; p += kNumThreads) mx = fmaxf(mx, pm[p]);",
        _DECODE_TESTS,
        keyword="float32-d128-b16 and split",
    ),
    Mutant(
        "prefill-tile-staging-past-end",
        "off-by-one past the end (K/V staging writes row `kKeyTile` of `k_s`, `v_s`)",
        "prefill_attention.cu",
        "for (int idx = threadIdx.x; idx < kKeyTile * kChunks; idx += kNumThreads)",
        "for (int idx = threadIdx.x; idx <= kKeyTile * kChunks; idx += kNumThreads)",
        _PREFILL_TESTS,
    ),
)


# Not a bug: the unmodified sources through the same machinery must pass, which shows the
# oracle tests are green on correct code and the forked runs themselves work.
CONTROL = Mutant(
    "control", "none (unmodified sources)", "common.cuh", "", "", _DECODE_TESTS + _PREFILL_TESTS
)


@dataclass
class Outcome:
    mutant: Mutant
    caught: bool
    how: str  # "failed", "crashed" or "survived"
    first_failure: str = ""
    per_schedule: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def apply(m: Mutant, src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    if m is CONTROL:
        return
    path = dst / m.source
    text = path.read_text()
    if text.count(m.old) != 1:
        raise ValueError(f"{m.name}: the snippet occurs {text.count(m.old)} times in {m.source}")
    path.write_text(text.replace(m.old, m.new))


def _schedule_of(test_id: str) -> str:
    """The thread order in a test id such as name[greedy-reverse-split-float32-d128-b16]."""
    params = test_id.partition("[")[2]
    matches = [s for s in SCHEDULES if params.startswith(s + "-")]
    return max(matches, key=len) if matches else ""


def _results(junit: Path) -> dict[str, bool]:
    """test id -> passed, from pytest's JUnit XML."""
    out: dict[str, bool] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = any(c.tag in ("failure", "error") for c in case)
        out[case.get("name", "")] = not failed
    return out


def _pytest_args(m: Mutant, mutated: Path, junit: Path, per_schedule: bool) -> list[str]:
    args = [
        # Assert rewriting and the hypothesis plugin (unused here) each cost more than a
        # whole mutant's tests.
        *m.tests,
        "-k",
        m.keyword,
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",
        "--assert=plain",
        f"--rootdir={ROOT}",
        f"--kernels-src={mutated}",
        f"--junitxml={junit}",
    ]
    return args if per_schedule else [*args, "-x"]


def _forked_pytest(args: list[str]) -> int:
    """Run pytest in a fork of this process: torch and the test modules are already imported
    (and their cached reference results shared), which saves seconds per mutant, and a
    mutant that crashes still takes down only the child."""
    pid = os.fork()
    if pid == 0:  # child
        code = 3
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            import pytest
            import torch

            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
            code = int(pytest.main(args))
        finally:
            os._exit(code)
    deadline = time.monotonic() + RUN_TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return TIMED_OUT
        time.sleep(0.02)


def _preload() -> None:
    """Import what every forked run needs once, in the parent."""
    import pytest  # noqa: F401
    import torch  # noqa: F401

    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    for module in {Path(t.split("::")[0]).stem for m in MUTANTS for t in m.tests}:
        __import__(module)


def _subprocess_pytest(args: list[str]) -> int:
    try:
        return subprocess.run(
            [sys.executable, "-m", "pytest", *args],
            cwd=ROOT,
            capture_output=True,
            timeout=RUN_TIMEOUT,
        ).returncode
    except subprocess.TimeoutExpired:
        return TIMED_OUT


def run(m: Mutant, per_schedule: bool, fork: bool, src: Path = SOURCE_DIR) -> Outcome:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        mutated = Path(tmp) / "csrc"
        apply(m, src, mutated)
        junit = Path(tmp) / "junit.xml"
        args = _pytest_args(m, mutated, junit, per_schedule)
        rc = _forked_pytest(args) if fork else _subprocess_pytest(args)
        elapsed = time.monotonic() - start
        if rc not in (0, 1) or not junit.exists():
            # pytest died (a segfault in the emulated kernel), hung, or could not run at all.
            how = "hung" if rc == TIMED_OUT else "crashed" if rc < 0 else f"error rc={rc}"
            return Outcome(m, rc < 0, how, "", {s: how for s in SCHEDULES}, elapsed)
        results = _results(junit)
    failures = [name for name, ok in results.items() if not ok]
    per = {
        s: "CAUGHT" if any(not ok for n, ok in results.items() if _schedule_of(n) == s) else "pass"
        for s in SCHEDULES
    }
    if not results:
        return Outcome(m, False, "no tests selected", "", per, elapsed)
    return Outcome(
        m,
        bool(failures),
        "failed" if failures else "survived",
        failures[0] if failures else "",
        per,
        elapsed,
    )


def run_all(
    per_schedule: bool, mutants: Sequence[Mutant] = MUTANTS, jobs: int = 2, fork: bool = True
) -> list[Outcome]:
    # Forking is only safe while this process runs no other Python threads.
    fork = fork and threading.active_count() == 1
    if fork:
        _preload()
        # Forks must not race other threads for locks, so forked runs go one at a time
        # from this thread; each child uses the emulator's worker threads.
        outcomes = [run(m, per_schedule, fork=True) for m in (CONTROL, *mutants)]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(
                pool.map(lambda m: run(m, per_schedule, fork=False), (CONTROL, *mutants))
            )
    control, rest = outcomes[0], outcomes[1:]
    if control.how != "survived":
        raise RuntimeError(f"the unmutated kernels do not pass the oracle tests: {control}")
    return rest


def table(outcomes: Sequence[Outcome], per_schedule: bool) -> str:
    if per_schedule:
        head = "| mutant | injected bug | " + " | ".join(SCHEDULES) + " | result |"
        sep = "|---|---|" + "---|" * len(SCHEDULES) + "---|"
    else:
        head, sep = "| mutant | injected bug | result | first failing test |", "|---|---|---|---|"
    lines = [head, sep]
    for o in outcomes:
        result = "caught" if o.caught else "**SURVIVED**"
        if o.how == "crashed":
            result = "caught (crash)"
        if per_schedule:
            cells = " | ".join(o.per_schedule.get(s, "-") for s in SCHEDULES)
            lines.append(f"| `{o.mutant.name}` | {o.mutant.bug} | {cells} | {result} |")
        else:
            lines.append(f"| `{o.mutant.name}` | {o.mutant.bug} | {result} | `{o.first_failure}` |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-schedule", action="store_true")
    parser.add_argument("--update-readme", action="store_true")
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs with --subprocess")
    parser.add_argument("--subprocess", action="store_true", help="fresh interpreter per mutant")
    parser.add_argument("--only", nargs="*", help="mutant names")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    outcomes = run_all(args.per_schedule, mutants, args.jobs, fork=not args.subprocess)
    text = table(outcomes, args.per_schedule)
    print(text)
    if args.update_readme:
        from noria.kernels.readme_tables import update_readme

        update_readme("mutations", text)
    return 0 if all(o.caught for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
