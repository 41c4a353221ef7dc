"""The soak's figures from its samples: RSS drift per process after warm-up, the table, the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from noria.bench.plots import pyplot


def rss_drift(times: list[float], series: list[float], settled: float, end: float, window: float) -> dict[str, float]:
    """RSS after warm-up (the median over `window` s from `settled`), at the end (the median over
    the last `window` s up to `end`), their relative change (the drift) and the largest sample in
    between relative to the first. Medians, so that one sample taken mid-allocation does not decide."""
    first = [v for t, v in zip(times, series, strict=True) if settled <= t <= settled + window and v > 0]
    last = [v for t, v in zip(times, series, strict=True) if end - window <= t <= end and v > 0]
    after = [v for t, v in zip(times, series, strict=True) if settled <= t <= end and v > 0]
    if not first or not last:  # no samples to judge by: never called flat
        return {"after_warmup_mib": 0.0, "end_mib": 0.0, "peak_mib": 0.0, "drift": None, "peak_drift": None}
    base, tail = statistics.median(first), statistics.median(last)
    return {"after_warmup_mib": round(base, 1), "end_mib": round(tail, 1), "peak_mib": round(max(after), 1),
            "drift": round(tail / base - 1, 4), "peak_drift": round(max(after) / base - 1, 4)}


def print_report(r: dict[str, Any]) -> None:
    c = r["counts"]
    print(f"\nsoak: {r['paced_s'] / 60:.1f} min at {r['rate_rps']:.2f} req/s "
          f"({r['load']:.0%} of the {r['capacity_rps']:.2f} req/s measured in the warm-up), {r['cpu']}, "
          f"load average {r['loadavg_1min']['min']:.1f}-{r['loadavg_1min']['max']:.1f}")
    print(f"requests {c['requests']} ({r['warmup_requests']} in the warm-up, {r['paced_requests']} paced, "
          f"at most {r['peak_in_flight']} in flight (warm-up burst: {r.get('burst_peak_in_flight', 0)}); by surface: "
          f"{', '.join(f'{k} {v}' for k, v in sorted(r['by_surface'].items()))}); "
          f"aborted {c['aborted']}, connections cut {c['cut']}, preemptions {r['engine']['num_preemptions']}")
    print(f"lost {c['lost']}, duplicated {c['duplicated']}, errors {c['errors']}, "
          f"stream != final text {c['mismatched']}, stray messages {c['stray']}")
    e = r["engine"]
    print(f"at the end: blocks_consistent {e['blocks_consistent']}, KV usage {e['kv_cache_usage']}, "
          f"free blocks {e['num_free_blocks']}/{e['num_kv_blocks']}, idle after {e['idle_after_s']} s")
    print(f"{'process':<10} {'RSS after warm-up MiB':>22} {'end MiB':>8} {'peak MiB':>9} {'drift':>7} {'peak drift':>11}")
    for name, d in r["rss"].items():
        drift, peak = (f"{d[k]:.2%}" if d[k] is not None else "no data" for k in ("drift", "peak_drift"))
        print(f"{name:<10} {d['after_warmup_mib']:>22.1f} {d['end_mib']:>8.1f} {d['peak_mib']:>9.1f} "
              f"{drift:>7} {peak:>11}")
    before = {k: d.get("before_burst_mib") for k, d in r["rss"].items()}
    if any(v is not None for v in before.values()):
        print("RSS before the warm-up burst MiB: " + ", ".join(f"{k} {v}" for k, v in before.items()))
    if r["peak_in_flight"] > r.get("burst_peak_in_flight", 0):
        print(f"note: the paced run had more in flight ({r['peak_in_flight']}) than the warm-up burst "
              f"({r.get('burst_peak_in_flight', 0)}): its drift may include a new high-water mark")
    for ex in r["examples"][:10]:
        print("  problem:", ex)
    print(f"RSS flat within {r['rss_tolerance']:.0%}: {r['rss_flat']}; "
          f"nothing lost or duplicated, every stream equal to its final text: {r['requests_ok']}; ok: {r['ok']}")


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    s = r["samples"]
    minutes = [t / 60 for t in s["t"]]
    fig, (ax, kv) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    for name, series in s["rss_mib"].items():
        ax.plot(minutes, series, label=name, linewidth=1.2)
    for a in (ax, kv):
        a.axvline(r["warmup_s"] / 60, color="grey", linestyle=":", linewidth=1)
        a.axvline(r["settled_s"] / 60, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("RSS (MiB)")
    ax.set_yscale("log")
    ax.set_title(f"noria bench soak: RSS per process, {r['paced_s'] / 60:.0f} min at {r['load']:.0%} of capacity\n"
                 f"(dotted: end of capacity warm-up; dashed: drift baseline)", fontsize=10)
    ax.legend(loc="center right", fontsize=8)
    kv.plot(minutes, [100 * u for u in s["kv_cache_usage"]], color="tab:purple", linewidth=0.8, label="KV usage %")
    kv.plot(minutes, s["running"], color="tab:green", linewidth=0.8, label="running")
    kv.plot(minutes, s["waiting"], color="tab:orange", linewidth=0.8, label="waiting")
    kv.set_xlabel("minutes since the server was ready")
    kv.legend(loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
