"""bin/gpu-session's markdown report: the phase table first (what ran, how it ended, in how long),
then each phase's findings (facts, checks, failed tests, kernel and engine rows against the
issue's targets), then the output tails of the phases that failed or were cut short."""

from __future__ import annotations

from typing import Any


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return "" if x is None else str(x)
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def _cell(x: Any) -> str:
    return _fmt(x).replace("|", "\\|").replace("\n", " ")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(_cell(c) for c in r) + " |" for r in rows), ""]


def _targets(targets: list[dict[str, Any]]) -> list[str]:
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    return _table(["target", "value", "verdict", "note"],
                  [[t["target"], t.get("value"), verdict[t.get("met")], t.get("note", "")] for t in targets])


def _env(s: dict[str, Any]) -> list[str]:
    out = [f"- GPU: {s.get('gpu')}; nvidia-smi: {s.get('nvidia_smi') or 'n/a'}",
           f"- torch {s.get('torch')} (CUDA {s.get('cuda')}, cuDNN {s.get('cudnn')}); CuPy: {s.get('cupy')}",
           f"- device copy {_fmt(s.get('copy_gbps'))} GB/s (read + write), bf16 matmul "
           f"{_fmt(s.get('bf16_matmul_tflops'))} TFLOP/s"]
    out += [f"- does not import: `{m}`: {why}" for m, why in (s.get("import_failures") or {}).items()]
    return [*out, ""]


def _doctor(s: dict[str, Any]) -> list[str]:
    rows = [["ok" if c["ok"] else "FAIL", c["name"], c["detail"]] for c in s.get("checks", [])]
    return [*_table(["", "check", "detail"], rows), *([s["verdict"], ""] if s.get("verdict") else [])]


def _tests(s: dict[str, Any]) -> list[str]:
    out = [f"{', '.join(f'{n} {k}' for k, n in s.get('counts', {}).items()) or 'no result line'}:", ""]
    out += [f"- {', '.join(g['files'])} ({g['workers']} pytest worker(s), exit {g['rc']}): "
            + (", ".join(f"{n} {k}" for k, n in g["counts"].items()) or "nothing seen") for g in s.get("groups", [])]
    out.append("")
    failed = s.get("failed", [])
    if failed:
        out += _table(["status", "test", "why"], [[f["status"], f["test"], f["why"]] for f in failed[:40]])
        if len(failed) > 40:
            out += [f"... and {len(failed) - 40} more in gpu-session.json", ""]
    return out


def _kernels(s: dict[str, Any]) -> list[str]:
    rows = []
    for r in s.get("rows", []):
        if r["kind"] == "mixed":
            shape = f"{r['chunk']} + {r['decodes']} x {r['context']}"
            rate = f"{r['mixed_over_parts']:.2f} x its parts ({r['decode_us']:.0f} + {r['prefill_us']:.0f} us)"
        else:
            shape = f"{r['seqs']} x {r.get('context') or r.get('prompt') or r.get('length')}"
            rate = (f"{_fmt(r['gbps'])} GB/s" + (f" ({r['of_copy']:.0%} of copy)" if r.get("of_copy") else "")
                    if r.get("gbps") is not None else f"{_fmt(r['tflops'])} TFLOP/s" if r.get("tflops") is not None else "")
        rows.append([r["kind"], r.get("backend", "noria"), shape, r.get("us"), rate, r.get("note", "")])
    return [*_table(["kind", "backend", "shape", "us", "rate", "note"], rows), *_targets(s.get("targets", []))]


def _bench_gpu(s: dict[str, Any]) -> list[str]:
    rows = [[r["phase"], r["name"], r.get("value"), r.get("unit"), r.get("floor"),
             f"{r['of_roofline']:.0%}" if r.get("of_roofline") else "", r.get("note", "")] for r in s.get("rows", [])]
    phases = [[k, v.get("status"), v.get("seconds"), v.get("note", "")] for k, v in s.get("phases", {}).items()]
    return [f"Checkpoint cache: {s.get('checkpoint_cache')}; full report: {s.get('report')}", "",
            *_table(["phase", "measurement", "value", "unit", "roofline", "of roofline", "note"], rows),
            *_table(["bench gpu phase", "status", "s", "note"], phases), *_targets(s.get("targets", []))]


SECTIONS = {"env": _env, "doctor": _doctor, "tests": _tests, "kernels": _kernels, "bench_gpu": _bench_gpu}


def markdown(meta: dict[str, Any], phases: dict[str, dict[str, Any]]) -> str:
    gpu = (meta.get("env") or {}).get("gpu", {}).get("gpu") or "no GPU"
    lines = [f"# gpu-session: {gpu}", "",
             f"{meta.get('mode')}; commit {meta.get('commit')}{' with uncommitted changes' if meta.get('dirty') else ''}; "
             f"started {meta.get('started')}; budget {_fmt(meta.get('time_budget_s'))} s"
             + (f", took {_fmt(meta.get('elapsed_s'))} s" if meta.get("elapsed_s") else "") + ".",
             f"Command: `{meta.get('command')}`.", ""]
    if meta.get("copy_gbps"):
        lines += [f"Ceilings measured here: device copy {_fmt(meta['copy_gbps'])} GB/s (read + write), bf16 matmul "
                  f"{_fmt(meta.get('matmul_tflops'))} TFLOP/s.", ""]
    if meta.get("error"):
        lines += [f"**{meta['error']}**", ""]
    lines += _table(["phase", "status", "s", "budget s", "note"],
                    [[k, v.get("status"), v.get("seconds"), v.get("budget_s"), v.get("note", "")] for k, v in phases.items()])
    install = phases.get("install", {})
    if install.get("wheels") is not None:
        lines += ["## install", "", f"noria: {install.get('noria')}; wheels: {', '.join(install['wheels']) or 'none'}", ""]
    for name, fn in SECTIONS.items():
        summary = phases.get(name, {}).get("summary")
        if summary:
            lines += [f"## {name}", "", *fn(summary)]
    for name, entry in phases.items():
        if entry.get("status") in ("failed", "cut short") and entry.get("tail"):
            lines += [f"## {name}: the end of its output", "", "```", entry["tail"], "```", ""]
    return "\n".join(lines)
