"""llama.cpp's own server as a baseline for the benchmarks: its build, its GGUF files, its server.

Everything lives under `$NORIA_CACHE/llama-cpp/` and is made on first use by a benchmark that
names a llama.cpp system, or by `python -m noria.bench.llama_cpp setup`:

  build   the llama.cpp source that the `llama-cpp-python` sdist (VERSION, pinned by its
          sha256) vendors, built with cmake: `llama-server` and `llama-quantize` only, Release,
          GGML_NATIVE (this CPU's instruction set), CPU backend alone, no UI, no TLS; build.json
          records the llama.cpp commit the sdist pins and the compiler (bench/llama_cpp_build.py).
  convert the source's own convert_hf_to_gguf script with its own gguf-py, in a venv of its own
          (the script's pinned requirements, torch pinned to noria's CPU build; never noria's
          venv), on a Hugging Face checkpoint folder (bench/llama_cpp_convert.py: two fallbacks
          for noria's demo tokenizer); one GGUF per (checkpoint, type) in `gguf/`: f32, bf16 and
          q8_0 from the converter, q4_k_m by `llama-quantize` from the float one
          (bench/llama_cpp_build.py); bench/workloads.py names the quantized files as models
          ("small-q8_0", "small-q4_k_m", ...).
  serve   `llama-server` on a free port, one slot per request in flight, continuous batching,
          the thread count noria's worker uses (bench/llama_cpp_server.py); a client (aiohttp)
          that sends token-id prompts to its native `/completion`, greedy, `ignore_eos`, no
          prompt cache (bench/llama_cpp_client.py).

This module is their public face: the systems, their skip (`available`), the runs the benchmarks
call (`run_throughput`, `serve`, `drive`), batch-1 latency and the command line; every public
name of the three modules above is importable from here too.

Systems: "llama.cpp" serves the benchmark model's own GGUF file as it is (a GGUF model such as
"small-q4_k_m": noria and llama.cpp then run the very same file; refused for a checkpoint folder).
llama.cpp-f32 and llama.cpp-bf16 convert a checkpoint folder, each to the GGUF's tensor type
(every weight matrix, the embedding and lm_head included; norms stay float32). With BF16
weights ggml rounds each matmul's activations to bf16 too and multiplies in bf16 dot products
(AVX512_BF16 where the CPU has it), as noria's --dtype bfloat16 does only in its "dot" layout. llama.cpp's own defaults otherwise:
its f16 KV cache, its batch sizes, flash attention "auto", OpenMP's default wait (server_env).

`python -m noria.bench.llama_cpp latency` prints batch-1 inter-token latency, noria's and
llama.cpp's interleaved, on the "small" model as f32/bf16 (noria on the folder in that dtype) or as
a q8_0/q4_k_m GGUF (noria and llama.cpp on the same file); `noria bench throughput --systems
noria-llm,llama.cpp-f32,...` and `noria bench serving --systems noria,llama.cpp-bf16` run them
beside noria (`--model small-q4_k_m --systems noria-llm,noria-serve-16,llama.cpp`: the same file).
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
    GGUF_TYPES,
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
    quantize_binary,
    quantize_command,
    quantize_from,
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
    "CMAKE_FLAGS", "GGUF_TYPES", "IN_FLIGHT", "LATENCY_CHOICES", "LATENCY_PROMPT", "LlamaServer", "OUTTYPE_DTYPE",
    "SDIST", "SDIST_SHA256", "SIMPLE_INDEX", "SYSTEMS", "VERSION", "available", "build_dir", "build_info",
    "cmake_commands", "completion_body", "completion_tokens", "context_per_request", "convert", "convert_command",
    "convert_python", "drive", "gguf_for", "gguf_path", "is_gguf", "latency", "latency_models", "latency_servers",
    "main", "ms_per_token", "noria_ms_per_token", "pre_tokenizer", "quantize_binary", "quantize_command",
    "quantize_from", "refusal", "root", "run_batch", "run_throughput", "serve", "server_binary", "server_command",
    "server_env", "setup", "source_dir", "stream_tokens", "threads",
]

# Each system's GGUF type, converted from the checkpoint folder; None: the model's own GGUF file.
SYSTEMS: dict[str, str | None] = {"llama.cpp": None, "llama.cpp-f32": "f32", "llama.cpp-bf16": "bf16"}


def is_gguf(model: Path | str) -> bool:
    """Whether a benchmark model is a GGUF file (bench/workloads.py's "small-q4_k_m", ...) rather than a folder."""
    return str(model).lower().endswith(".gguf")


def refusal(system: str, model: Path) -> str | None:
    """Why `system` cannot run `model`, in one sentence, or None."""
    if SYSTEMS[system] is None and not is_gguf(model):
        return (f"{system} serves the model's own GGUF file, and {model} is a checkpoint folder: pick a GGUF model "
                f"(small-q8_0, small-q4_k_m, ...) or llama.cpp-f32 / llama.cpp-bf16, which convert the folder")
    if SYSTEMS[system] is not None and is_gguf(model):
        return (f"{system} converts a checkpoint folder to {SYSTEMS[system]} GGUF, and {model.name} is a GGUF file "
                f"already: run llama.cpp, which serves that file as it is")
    return None


def gguf_for(system: str, model: Path, base: Path | None = None, log=sys.stderr) -> Path:
    """The GGUF file `system` serves for the benchmark model `model` (a folder or a GGUF file)."""
    why = refusal(system, model)
    if why:
        raise ValueError(why)
    outtype = SYSTEMS[system]
    return model if outtype is None else convert(model, outtype, base, log)


def available(systems: list[str], checkpoint: Path, install: bool = True, base: Path | None = None,
              log=sys.stderr) -> list[str]:
    """`systems` less the llama.cpp ones where llama.cpp cannot be built or the checkpoint
    converted (said in one line); the build and GGUF files are made here, before any timing."""
    wanted = [s for s in systems if s in SYSTEMS]
    if not wanted:
        return systems
    refused = [why for s in wanted if (why := refusal(s, checkpoint))]
    if refused:  # not a skip: the command line asks for what cannot be
        raise SystemExit("; ".join(refused))
    why = setup(install=install, base=base, log=log)
    if why is None:
        try:
            for s in wanted:
                gguf_for(s, checkpoint, base, log)
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
    gguf = gguf_for(system, checkpoint)
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
            "settings": {"command": server.command[3:], "llama_cpp": (build_info() or {}).get("llama_cpp_commit"),
                         "gguf": str(gguf)}}


def serve(system: str, checkpoint: Path, batches) -> LlamaServer:
    """A started llama-server for bench/serving.py's batches: a slot for every request of the
    largest batch (no request ever waits for a slot), each as long as the longest request."""
    gguf = gguf_for(system, checkpoint)
    return LlamaServer(gguf, max(map(len, batches)), context_per_request([r for b in batches for r in b])).wait()


# --- batch-1 latency --------------------------------------------------------------------------

OUTTYPE_DTYPE = {"f32": "float32", "bf16": "bfloat16"}  # noria's --dtype on the folder beside a float GGUF
LATENCY_CHOICES = {"both": ("f32", "bf16"), "all": GGUF_TYPES, **{t: (t,) for t in GGUF_TYPES}}


def latency_models(checkpoint: Path, outtype: str, log=sys.stderr) -> tuple[Path, Path, str]:
    """(the GGUF llama-server serves, the model noria loads, noria's --dtype) for one latency type:
    a float type beside the folder in that dtype; a quantized one (q8_0, q4_k_m) the same file,
    noria in its default dtype for it."""
    gguf = convert(checkpoint, outtype, log=log)
    if outtype in OUTTYPE_DTYPE:
        return gguf, checkpoint, OUTTYPE_DTYPE[outtype]
    return gguf, gguf, "auto"


def _noria_llm(model: Path, dtype: str):
    from noria import LLM

    return LLM(str(model), dtype=dtype, num_kv_blocks=512, seed=0)


def noria_ms_per_token(model: Path, dtype: str, tokens: int = 256) -> float:
    """One greedy request of `tokens` + 1 tokens, less the time to its first token, per token
    (gemm_bf16.engine_ms_per_token's measurement, on any model)."""
    from noria import SamplingParams

    with _noria_llm(model, dtype) as llm:
        def run(n: int) -> float:
            start = time.perf_counter()
            llm.generate([LATENCY_PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                         use_tqdm=False)
            return time.perf_counter() - start

        run(16)  # warm: the kernels' first calls
        return (run(tokens + 1) - run(1)) / tokens * 1e3


def _noria_tokens(model: Path, dtype: str, tokens: int) -> list[int]:
    from noria import SamplingParams

    with _noria_llm(model, dtype) as llm:
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


def latency(outtypes: list[str], rounds: int, tokens: int = 256, log=sys.stderr, model: str = "small") -> list[dict]:
    """Batch-1 inter-token latency on a benchmark model (a checkpoint folder: "small" by default),
    noria (LLM.generate, noria_ms_per_token) and llama-server (in each of latency_servers'
    environments), interleaved round by round; each outtype as latency_models pairs them."""
    from contextlib import ExitStack

    from noria.bench.gemm_bf16 import cpu_facts
    from noria.bench.workloads import CHECKPOINTS

    checkpoint = CHECKPOINTS[model]()
    if is_gguf(checkpoint):
        raise SystemExit(f"latency converts a checkpoint folder and {model} is a GGUF file: name its folder "
                         f"model and the type with --dtype (e.g. --model small --dtype q4_k_m)")
    print(cpu_facts(), flush=True)
    rows: list[dict] = []
    per_request = context_per_request([(LATENCY_PROMPT, tokens + 16)])
    for outtype in outtypes:
        gguf, noria_model, dtype = latency_models(checkpoint, outtype, log)
        print(f"{outtype:<6} llama.cpp on {gguf.name}; noria on {noria_model.name} (--dtype {dtype})", flush=True)
        with ExitStack() as stack:
            # Started together, idle in turn: an idle llama-server's threads sleep on its task queue.
            servers = {label: stack.enter_context(LlamaServer(gguf, 1, per_request, env=env).wait())
                       for label, env in latency_servers().items()}
            for r in range(rounds):
                noria = noria_ms_per_token(noria_model, dtype, tokens)
                line = f"{outtype:<6} round {r + 1}: noria {noria:6.2f} ms/token"
                for label, server in servers.items():
                    llama, ids = ms_per_token(server, tokens)
                    rows.append({"dtype": outtype, "round": r + 1, "llama_cpp_env": label, "noria_ms": noria,
                                 "llama_cpp_ms": llama})
                    line += f" | llama.cpp ({label}) {llama:6.2f} ms/token, {llama / noria:4.2f}x noria's time"
                print(line, flush=True)
        same = _noria_tokens(noria_model, dtype, tokens + 1)
        print(f"{outtype:<6} greedy tokens, llama.cpp vs noria: {_first_difference(same, ids)}", flush=True)
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
                    help="setup: build llama-server, llama-quantize and the converter's venv; check: say whether "
                         "they are made; convert: the model as GGUF files (--dtype); latency: batch-1 ms per output "
                         "token, noria and llama.cpp interleaved")
    ap.add_argument("--jobs", type=int, default=None, help="setup: parallel compile jobs (default: every core)")
    ap.add_argument("--dtype", choices=tuple(LATENCY_CHOICES), default="both",
                    help="convert, latency: which GGUF types (both: f32 and bf16, noria on the folder in that dtype; "
                         "q8_0, q4_k_m: noria and llama.cpp on the same GGUF file; all: the four)")
    ap.add_argument("--rounds", type=int, default=2, help="latency: interleaved rounds")
    ap.add_argument("--tokens", type=int, default=256, help="latency: output tokens timed after the first")
    ap.add_argument("--model", default="small", help="convert, latency: the benchmark model (a checkpoint folder)")
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

        for outtype in LATENCY_CHOICES[args.dtype]:
            print(convert(CHECKPOINTS[args.model](), outtype))
    if args.action == "latency":
        latency(list(LATENCY_CHOICES[args.dtype]), args.rounds, args.tokens, model=args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
