"""bin/gpu-session's runner (after the install, bench/gpu_session.py): the phases of
bench/gpu_session_phases.py in order, each under its time budget, its children killed at its
deadline with every process they started (engine workers start their own sessions, so a process
group is not enough: descendants are followed through /proc while the phase runs); the report
rewritten after every phase (atomically: a reader, or a kill, never sees half a file) and every
child's output appended to the log beside it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.bench.gpu_session_phases import PHASES, PhaseError

ROOT = Path(__file__).resolve().parents[1]
LOG_LIMIT = 12 << 20  # the device tool brings back files of at most 16 MiB
OUTPUT_LIMIT = 8 << 20  # of one child's output kept in memory for its phase to read
TAIL_LINES = 40
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL


class Interrupted(BaseException):
    """SIGTERM or SIGINT to the session: the phase in flight is cut, the report says so."""


@dataclass
class Call:
    rc: int | None  # None: killed at the phase's deadline
    output: str
    seconds: float


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[1]), fields[19]) if fields[0] not in ("Z", "X") else None


def descendants(root: int) -> set[tuple[int, str]]:
    """Every live process under `root`, as (pid, start time): the start time tells a pid that was
    reused from the one seen, so nothing but what the phase started is ever signalled."""
    if not os.path.isdir("/proc"):
        return set()
    children: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))):
            children.setdefault(st[0], []).append((int(name), st[1]))
    found, todo = set(), [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if (pid, start) not in found:
                found.add((pid, start))
                todo.append(pid)
    return found


def _signal_all(proc: subprocess.Popen[bytes], seen: set[tuple[int, str]], sig: int) -> int:
    alive = 0
    if proc.poll() is None:
        alive += 1
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, sig)
    for pid, start in seen:
        st = _stat(pid)
        if st and st[1] == start:
            alive += 1
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
    return alive


def stop(proc: subprocess.Popen[bytes], seen: set[tuple[int, str]]) -> None:
    """SIGTERM to the child's group and every descendant seen, SIGKILL to what is left after a grace."""
    seen |= descendants(proc.pid) if proc.poll() is None else set()
    if not _signal_all(proc, seen, signal.SIGTERM):
        return
    end = time.monotonic() + KILL_GRACE
    while time.monotonic() < end and _signal_all(proc, seen, 0):
        time.sleep(0.1)
    _signal_all(proc, seen, signal.SIGKILL)
    proc.wait()


class Report:
    def __init__(self, out: Path, meta: dict[str, Any], names: list[str]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path, self.log_path = (out / "gpu-session.json", out / "gpu-session.md",
                                                       out / "gpu-session.log")
        self.meta = meta
        self.phases: dict[str, dict[str, Any]] = {n: {"status": "pending"} for n in names}
        self.log_path.write_text("")
        self._log_bytes, self._lock = 0, threading.Lock()
        self.flush()

    def log(self, text: str) -> None:
        with self._lock:
            if self._log_bytes > LOG_LIMIT:
                return
            data = text if self._log_bytes + len(text) <= LOG_LIMIT else text + "\n[log cut: over its size limit]\n"
            self._log_bytes += len(data)
            with self.log_path.open("a") as f:
                f.write(data)

    def set(self, name: str, **fields: Any) -> None:
        self.phases[name] = {k: v for k, v in fields.items() if v is not None}
        self.flush()

    def flush(self) -> None:
        data = {"meta": self.meta, "phases": self.phases}
        for path, text in ((self.json_path, json.dumps(data, indent=2, default=str)), (self.md_path, self.markdown())):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, path)

    def markdown(self) -> str:
        from noria.bench.gpu_session_report import markdown

        return markdown(self.meta, self.phases)


class Ctx:
    """What a phase function gets: where things go, how long it has, and `call` for its children."""

    def __init__(self, name: str, args: argparse.Namespace, out: Path, work: Path, report: Report,
                 deadline: float) -> None:
        self.name, self.out, self.work, self.report, self.deadline = name, out, work, report, deadline
        self.dry_run, self.python, self.fault = args.dry_run, sys.executable, args.faults.get(name)
        self.timed_out = False
        self.outputs: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def tail(self, lines: int = TAIL_LINES) -> str:
        return "\n".join("".join(self.outputs).splitlines()[-lines:])

    def call(self, argv: list[str], env: dict[str, str] | None = None) -> Call:
        if self.fault == "fail":
            argv = [self.python, "-c", "import sys; print('injected failure'); sys.exit(1)"]
        elif self.fault == "hang":  # a grandchild in a session of its own, as the engine's workers are
            argv = [self.python, "-c", "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(3600)'], start_new_session=True); print('injected hang; grandchild', "
                    "p.pid, flush=True); time.sleep(3600)"]
        start = time.monotonic()
        if self.left() <= 0:
            self.timed_out = True
            return Call(None, "", 0.0)
        self.report.log(f"\n==== {self.name}: {' '.join(argv)}\n")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        chunks: list[str] = []
        size = [0]

        def read() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace")
                self.report.log(line)
                chunks.append(line)
                size[0] += len(line)
                while size[0] > OUTPUT_LIMIT and len(chunks) > 1:
                    size[0] -= len(chunks.pop(0))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        seen: set[tuple[int, str]] = set()
        try:
            while proc.poll() is None and time.monotonic() < self.deadline:
                seen |= descendants(proc.pid)
                time.sleep(0.25)
            if proc.poll() is None:
                self.timed_out = True
                self.report.log(f"\n==== {self.name}: over its time budget, stopped\n")
        finally:  # also on Interrupted: nothing the phase started outlives it
            stop(proc, seen)
            reader.join(timeout=KILL_GRACE)
        output = "".join(chunks)
        self.outputs.append(output)
        return Call(None if self.timed_out else proc.returncode, output, time.monotonic() - start)


def _git(*argv: str) -> str:
    try:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


class _Signals:
    """SIGTERM and SIGINT raise Interrupted while the phases run."""

    def __enter__(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            raise Interrupted(signal.Signals(signum).name)

        self.old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def __exit__(self, *exc: object) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def run(args: argparse.Namespace, out: Path, work: Path, started: float, install_entry: dict[str, Any] | None) -> int:
    deadline = started + args.time_budget
    meta = {"mode": "dry run (CPU, emulator, tiny sizes: checks the plumbing, not a measurement)" if args.dry_run
            else "GPU", "commit": _git("rev-parse", "--short", "HEAD"), "dirty": bool(_git("status", "--porcelain")),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "time_budget_s": args.time_budget,
            "command": " ".join(["bin/gpu-session", *sys.argv[1:]]), "out": str(out), "work": str(work)}
    report = Report(out, meta, ["install", *(p.name for p in PHASES)])
    if install_entry is not None:
        report.set("install", **install_entry)
    else:
        report.set("install", status="skipped", seconds=0.0, note="dry run: nothing installed" if args.dry_run
                   else "--no-install")
    for phase in PHASES:
        if phase.name not in args.phase_list:
            report.set(phase.name, status="skipped", seconds=0.0, note="not asked for (--phases)")
    print(f"gpu-session ({meta['mode']}): budget {args.time_budget:.0f} s; report in {report.md_path}", flush=True)
    failed = int(report.phases["install"].get("status") == "failed")
    try:
        with _Signals():
            for phase in PHASES:
                failed += _run_phase(phase, args, out, work, report, deadline) not in ("ok", "skipped")
    except Interrupted as e:
        for name, entry in report.phases.items():
            if entry.get("status") in ("pending", "running"):
                report.set(name, **(entry | {"status": "not run" if entry["status"] == "pending" else "cut short",
                                             "note": f"the session was stopped ({e})"}))
        print(f"gpu-session: stopped ({e}); report {report.md_path}", flush=True)
        return 130
    report.meta["elapsed_s"] = round(time.monotonic() - started, 1)
    report.flush()
    print(report.markdown().split("\n## ")[0], flush=True)
    print(f"gpu-session: {failed} phase(s) failed or cut short; report {report.md_path}, log {report.log_path}", flush=True)
    return 1 if failed else 0


def _run_phase(phase: Any, args: argparse.Namespace, out: Path, work: Path, report: Report, deadline: float) -> str:
    """One phase, start to report: its status."""
    if phase.name not in args.phase_list:
        report.set(phase.name, status="skipped", seconds=0.0, note="not asked for (--phases)")
        return "skipped"
    left = deadline - time.monotonic()
    need = 0.0 if args.dry_run else phase.need
    if left < max(need, 1.0):
        report.set(phase.name, status="skipped", seconds=0.0, note=f"time: needs ~{need:.0f} s, {max(left, 0):.0f} s left")
        print(f"[{phase.name}] skipped: {max(left, 0):.0f} s left", flush=True)
        return "skipped"
    budget = min(args.caps.get(phase.name, phase.dry_cap if args.dry_run else phase.cap), left)
    ctx = Ctx(phase.name, args, out, work, report, time.monotonic() + budget)
    report.set(phase.name, status="running", budget_s=round(budget, 1), note=phase.title)
    print(f"[{phase.name}] {phase.title} (budget {budget:.0f} s)", flush=True)
    start, summary, note = time.monotonic(), {}, ""
    try:
        summary = phase.run(ctx)
        status = "cut short" if ctx.timed_out else "ok"
    except PhaseError as e:
        summary, note, status = e.summary, str(e), "cut short" if ctx.timed_out else "failed"
    except Exception as e:  # noqa: BLE001 - a bug in a phase's reading must not stop the next phase
        note, status = f"{type(e).__name__}: {e}", "failed"
        ctx.outputs.append(traceback.format_exc())
    if ctx.timed_out:
        note = f"over its {budget:.0f} s budget" + (f"; {note}" if note else "")
    report.set(phase.name, status=status, seconds=round(time.monotonic() - start, 2), budget_s=round(budget, 1),
               note=note, summary=summary, tail=ctx.tail() if status != "ok" else ctx.tail(8))
    print(f"[{phase.name}] {status} in {time.monotonic() - start:.0f} s{': ' + note if note else ''}", flush=True)
    return status
