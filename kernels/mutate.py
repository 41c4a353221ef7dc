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

from noria.kernels.mutants import CONTROL, MUTANTS, ROOT, TESTS, Mutant
from noria.kernels.options import SOURCE_DIR

__all__ = ["CONTROL", "MUTANTS", "Mutant", "Outcome", "main", "run", "run_all", "table"]

SCHEDULES = ("forward", "greedy", "greedy-reverse", "random:7")
RUN_TIMEOUT = 300.0  # seconds per mutant; a kernel that never finishes counts as caught
TIMED_OUT = -1000


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
