"""llama.cpp's own server as a baseline for the benchmarks: its build, its GGUF files, its server.

Everything lives under `$NORIA_CACHE/llama-cpp/` and is made on first use by a benchmark that
names a llama.cpp system, or by `python -m noria.bench.llama_cpp setup`:

  build   the llama.cpp source that the `llama-cpp-python` sdist (VERSION, pinned by its
          sha256) vendors, built with cmake: `llama-server` only, Release, GGML_NATIVE (this
          CPU's instruction set), CPU backend alone, no UI, no TLS; build.json records the
          llama.cpp commit the sdist pins and the compiler (bench/llama_cpp_build.py).
  convert the source's own convert_hf_to_gguf script with its own gguf-py, in a venv of its own
          (the script's pinned requirements, torch pinned to noria's CPU build; never noria's
          venv), on a Hugging Face checkpoint folder (bench/llama_cpp_convert.py: two fallbacks
          for noria's demo tokenizer); one GGUF per (checkpoint, outtype) in `gguf/`
          (bench/llama_cpp_build.py).
  serve   `llama-server` on a free port, one slot per request in flight, continuous batching,
          the thread count noria's worker uses (bench/llama_cpp_server.py); a client (aiohttp)
          that sends token-id prompts to its native `/completion`, greedy, `ignore_eos`, no
          prompt cache (bench/llama_cpp_client.py).

This module is their public face: the systems, their skip (`available`), the runs the benchmarks
call (`run_throughput`, `serve`, `drive`), batch-1 latency and the command line; every public
name of the three modules above is importable from here too.

Systems: llama.cpp-f32 and llama.cpp-bf16, the GGUF's tensor type (every weight matrix, the
embedding and lm_head included; norms stay float32). With BF16 weights ggml rounds each matmul's
activations to bf16 too and multiplies in bf16 dot products (AVX512_BF16 where the CPU has it),
as noria's --dtype bfloat16 does only in its "dot" layout. llama.cpp's own defaults otherwise:
its f16 KV cache, its batch sizes, flash attention "auto", OpenMP's default wait (server_env).

`python -m noria.bench.llama_cpp latency` prints batch-1 inter-token latency, noria's and
llama.cpp's interleaved; `noria bench throughput --systems noria-llm,llama.cpp-f32,...` and
`noria bench serving --systems noria,llama.cpp-bf16` run them beside noria.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

from noria.bench.llama_cpp_build import (
    CMAKE_FLAGS,
    SDIST,
    SDIST_SHA256,
    SIMPLE_INDEX,
    VERSION,
    build_dir,
    build_info,
    cmake_commands,
    convert,
    convert_command,
    convert_python,
    gguf_path,
    pre_tokenizer,
    root,
    server_binary,
    setup,
    source_dir,
)
from noria.bench.llama_cpp_client import (
    LATENCY_PROMPT,
    completion_body,
    completion_tokens,
    drive,
    ms_per_token,
    run_batch,
    stream_tokens,
)
from noria.bench.llama_cpp_server import (
    LlamaServer,
    context_per_request,
    server_command,
    server_env,
    threads,
)

# Re-exported: the benchmarks, the tests and `python -m noria.bench.llama_cpp` reach llama.cpp through here.
__all__ = [
    "CMAKE_FLAGS", "IN_FLIGHT", "LATENCY_PROMPT", "OUTTYPE_DTYPE", "SDIST", "SDIST_SHA256", "SIMPLE_INDEX", "SYSTEMS",
    "VERSION", "LlamaServer", "available", "build_dir", "build_info", "cmake_commands", "completion_body",
    "completion_tokens", "context_per_request", "convert", "convert_command", "convert_python", "drive", "gguf_path",
    "latency", "latency_servers", "main", "ms_per_token", "pre_tokenizer", "root", "run_batch", "run_throughput",
    "serve", "server_binary", "server_command", "server_env", "setup", "source_dir", "stream_tokens", "threads",
]

SYSTEMS = {"llama.cpp-f32": "f32", "llama.cpp-bf16": "bf16"}


def available(systems: list[str], checkpoint: Path, install: bool = True, base: Path | None = None,
              log=sys.stderr) -> list[str]:
    """`systems` less the llama.cpp ones where llama.cpp cannot be built or the checkpoint
    converted (said in one line); the build and GGUF files are made here, before any timing."""
    wanted = [s for s in systems if s in SYSTEMS]
    if not wanted:
        return systems
    why = setup(install=install, base=base, log=log)
    if why is None:
        try:
            for s in wanted:
                convert(checkpoint, SYSTEMS[s], base, log)
        except (OSError, subprocess.CalledProcessError) as e:
            why = f"converting {checkpoint.name} to GGUF failed: {e}"
    if why:
        print(f"skipping {', '.join(wanted)}: {why}", flush=True)
        return [s for s in systems if s not in SYSTEMS]
    return systems


# --- systems ----------------------------------------------------------------------------------

IN_FLIGHT = 16  # W1 through llama-server: the requests in flight, one slot each


def run_throughput(system: str, checkpoint: Path, work, in_flight: int = IN_FLIGHT) -> dict:
    """bench/throughput.py's row for one llama.cpp system: W1 with `in_flight` requests at a time."""
    gguf = convert(checkpoint, SYSTEMS[system])
    t0 = time.perf_counter()
    with LlamaServer(gguf, in_flight, context_per_request(work)) as server:
        server.wait()
        started = time.perf_counter() - t0
        from noria.bench.process_rss import server_rss

        idle = server_rss(server.proc.pid, root="llama-server")
        dt, outs = asyncio.run(run_batch(server.http, work, in_flight))
        end = server_rss(server.proc.pid, root="llama-server")
    return {"system": system, "seconds": dt, "output_tokens": sum(map(len, outs)), "token_ids": outs,
            "in_flight": in_flight, "startup_seconds": started, "rss_bytes": {"idle": idle, "end": end},
            "settings": {"command": server.command[3:], "llama_cpp": (build_info() or {}).get("llama_cpp_commit")}}


def serve(system: str, checkpoint: Path, batches) -> LlamaServer:
    """A started llama-server for bench/serving.py's batches: a slot for every request of the
    largest batch (no request ever waits for a slot), each as long as the longest request."""
    gguf = convert(checkpoint, SYSTEMS[system])
    return LlamaServer(gguf, max(map(len, batches)), context_per_request([r for b in batches for r in b])).wait()


# --- batch-1 latency --------------------------------------------------------------------------

OUTTYPE_DTYPE = {"f32": "float32", "bf16": "bfloat16"}


def _noria_tokens(dtype: str, tokens: int) -> list[int]:
    from noria import LLM, SamplingParams
    from noria.bench.workloads import CHECKPOINTS

    with LLM(str(CHECKPOINTS["small"]()), dtype=dtype, num_kv_blocks=512, seed=0) as llm:
        out = llm.generate([LATENCY_PROMPT], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def latency_servers() -> dict[str, dict[str, str]]:
    """The environments batch-1 latency runs llama-server in, by label: its own (OpenMP's default
    wait, server_env) and noria's worker's (passive after a short spin). A lone request's decode
    step is hundreds of small ops, each ending at a barrier where a passive thread sleeps and must
    be woken (slower on a quiet host); under load, spinning threads wait for a descheduled one
    instead (far slower on a busy host). Both are shown, side by side."""
    from noria.worker.cli import PROCESS_ENV

    own = server_env()
    noria = {name: PROCESS_ENV[name] for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    label = " ".join(f"{k}={v}" for k, v in noria.items())
    return {"OpenMP default wait": own, label: {**own, **noria}}


def latency(outtypes: list[str], rounds: int, tokens: int = 256, log=sys.stderr) -> list[dict]:
    """Batch-1 inter-token latency on the "small" model, noria (LLM.generate,
    gemm_bf16.engine_ms_per_token) and llama-server (in each of latency_servers' environments),
    interleaved round by round."""
    from contextlib import ExitStack

    from noria.bench.gemm_bf16 import cpu_facts, engine_ms_per_token
    from noria.bench.workloads import CHECKPOINTS

    checkpoint = CHECKPOINTS["small"]()
    print(cpu_facts(), flush=True)
    rows: list[dict] = []
    per_request = context_per_request([(LATENCY_PROMPT, tokens + 16)])
    for outtype in outtypes:
        gguf = convert(checkpoint, outtype, log=log)
        with ExitStack() as stack:
            # Started together, idle in turn: an idle llama-server's threads sleep on its task queue.
            servers = {label: stack.enter_context(LlamaServer(gguf, 1, per_request, env=env).wait())
                       for label, env in latency_servers().items()}
            for r in range(rounds):
                noria = engine_ms_per_token(OUTTYPE_DTYPE[outtype], tokens)
                line = f"{outtype:<5} round {r + 1}: noria {noria:6.2f} ms/token"
                for label, server in servers.items():
                    llama, ids = ms_per_token(server, tokens)
                    rows.append({"dtype": outtype, "round": r + 1, "llama_cpp_env": label, "noria_ms": noria,
                                 "llama_cpp_ms": llama})
                    line += f" | llama.cpp ({label}) {llama:6.2f} ms/token, {llama / noria:4.2f}x noria's time"
                print(line, flush=True)
        same = _noria_tokens(OUTTYPE_DTYPE[outtype], tokens + 1)
        print(f"{outtype:<5} greedy tokens, llama.cpp vs noria: {_first_difference(same, ids)}", flush=True)
    return rows


def _first_difference(noria: list[int], llama: list[int]) -> str:
    k = next((i for i, (x, y) in enumerate(zip(noria, llama, strict=False)) if x != y), None)
    if k is None:
        return f"identical, {len(noria)} tokens"
    # On random weights the top two logits are often close: a near tie flips with summation order.
    return f"the same for {k} of {len(noria)} tokens, then noria {noria[k]}, llama.cpp {llama[k]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m noria.bench.llama_cpp")
    ap.add_argument("action", choices=("setup", "check", "convert", "latency"),
                    help="setup: build llama-server and the converter's venv; check: say whether they are made; "
                         "convert: the model as f32 and bf16 GGUF; latency: batch-1 ms per output token, noria "
                         "and llama.cpp interleaved")
    ap.add_argument("--jobs", type=int, default=None, help="setup: parallel compile jobs (default: every core)")
    ap.add_argument("--dtype", choices=("f32", "bf16", "both"), default="both", help="latency: which weights")
    ap.add_argument("--rounds", type=int, default=2, help="latency: interleaved rounds")
    ap.add_argument("--tokens", type=int, default=256, help="latency: output tokens timed after the first")
    ap.add_argument("--model", default="small", help="convert: the benchmark model")
    args = ap.parse_args(argv)
    # As `noria bench` does (bench/__init__.py): noria and llama-server under the worker's OpenMP settings.
    from noria.worker.cli import set_process_env

    set_process_env()
    why = setup(install=args.action != "check", jobs=args.jobs)
    if why:
        print(f"llama.cpp: {why}")
        return 3
    info = build_info() or {}
    print(f"llama.cpp {info.get('llama_cpp_commit', '?')[:12]} (llama-cpp-python {VERSION}): {server_binary()}; "
          f"{info.get('server_version', '').splitlines()[0] if info.get('server_version') else ''}")
    if args.action == "convert":
        from noria.bench.workloads import CHECKPOINTS

        for outtype in SYSTEMS.values():
            print(convert(CHECKPOINTS[args.model](), outtype))
    if args.action == "latency":
        latency(["f32", "bf16"] if args.dtype == "both" else [args.dtype], args.rounds, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
