"""llama.cpp's own server as a baseline for the benchmarks: its build, its GGUF files, its server.

Everything lives under `$NORIA_CACHE/llama-cpp/` and is made on first use by a benchmark that
names a llama.cpp system, or by `python -m noria.bench.llama_cpp setup`:

  build   the llama.cpp source that the `llama-cpp-python` sdist (VERSION, pinned by its
          sha256) vendors, built with cmake: `llama-server` only, Release, GGML_NATIVE (this
          CPU's instruction set), CPU backend alone, no UI, no TLS; build.json records the
          llama.cpp commit the sdist pins and the compiler.
  convert the source's own convert_hf_to_gguf script with its own gguf-py, in a venv of its own
          (the script's pinned requirements, torch pinned to noria's CPU build; never noria's
          venv), on a Hugging Face checkpoint folder (bench/llama_cpp_convert.py: two fallbacks
          for noria's demo tokenizer); one GGUF per (checkpoint, outtype) in `gguf/`.
  serve   `llama-server` on a free port, one slot per request in flight, continuous batching,
          the thread count noria's worker uses; a client (aiohttp) that sends token-id prompts
          to its native `/completion`, greedy, `ignore_eos`, no prompt cache.

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
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from noria.protocol import switches

VERSION = "0.3.36"  # llama-cpp-python; its sdist vendors llama.cpp at one commit
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-python/"
SYSTEMS = {"llama.cpp-f32": "f32", "llama.cpp-bf16": "bf16"}
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF", "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary in the cache
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    # The web UI is either built with npm or downloaded from Hugging Face at build time: neither
    # is wanted (nor reachable here); the server then serves its API alone.
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",  # loopback HTTP only
)


def root() -> Path:
    return switches.cache_dir() / "llama-cpp"


def build_dir(base: Path | None = None) -> Path:
    return (base or root()) / VERSION


def server_binary(base: Path | None = None) -> Path:
    return build_dir(base) / "build" / "bin" / "llama-server"


def source_dir(base: Path | None = None) -> Path:
    return build_dir(base) / "src"


def build_info(base: Path | None = None) -> dict | None:
    """What setup recorded about the build (None until a build completed)."""
    path = build_dir(base) / "build.json"
    if not path.exists() or not server_binary(base).exists():
        return None
    return json.loads(path.read_text())


def convert_python(base: Path | None = None) -> Path:
    return (base or root()) / "convert-venv" / "bin" / "python"


def _converter_ready(base: Path) -> bool:
    return (convert_python(base).parent.parent / "ready").exists()


def _unsupported() -> str | None:
    """Why llama.cpp cannot be built here, or None."""
    missing = [t for t in ("cmake", "c++", "cc") if shutil.which(t) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH to build llama.cpp"
    return None


def cmake_commands(src: Path, build: Path, commit: str, jobs: int) -> list[list[str]]:
    """The configure and build commands: only the `llama-server` target is built."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [["cmake", "-S", str(src), "-B", str(build), *generator, *CMAKE_FLAGS,
             f"-DLLAMA_BUILD_COMMIT={commit}", "-DLLAMA_BUILD_NUMBER=0"],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]]


def _download(dest: Path, log) -> None:
    """The pinned sdist, through PyPI's JSON simple API (PEP 691), checked against SDIST_SHA256."""
    req = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.loads(r.read())["files"]
    [entry] = [f for f in files if f["filename"] == SDIST]
    print(f"downloading {entry['url']} ...", file=log, flush=True)
    tmp = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=300) as r, open(tmp, "wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != SDIST_SHA256:
        tmp.unlink()
        raise RuntimeError(f"{SDIST}: sha256 {digest.hexdigest()}, expected {SDIST_SHA256}")
    tmp.rename(dest)


def _extract(sdist: Path, src: Path) -> str:
    """vendor/llama.cpp of the sdist into `src`; the llama.cpp commit the sdist's submodule pins."""
    top = f"llama_cpp_python-{VERSION}/"
    vendor = top + "vendor/llama.cpp/"
    head = top + ".git/modules/vendor/llama.cpp/HEAD"
    tmp = src.with_name(src.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    commit = "unknown"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name == head:
                commit = tar.extractfile(m).read().decode().strip()  # type: ignore[union-attr]
            elif m.name.startswith(vendor) and m.name != vendor + ".git":  # a submodule's gitdir link
                m.name = m.name[len(vendor):]
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return commit


def setup(install: bool = True, base: Path | None = None, jobs: int | None = None, log=sys.stderr) -> str | None:
    """Build llama-server and the converter's venv if needed. None when ready, else why not."""
    base = base or root()
    if build_info(base) and _converter_ready(base):
        return None
    if not install:
        return (f"no llama.cpp build from llama-cpp-python {VERSION} in {build_dir(base)} "
                f"(make it with `python -m noria.bench.llama_cpp setup`)")
    why = _unsupported()
    if why:
        return why
    try:
        if not build_info(base):
            _build(base, jobs or max(1, (os.cpu_count() or 1)), log)
        if not _converter_ready(base):
            _converter_venv(base, log)
    except (OSError, RuntimeError, subprocess.CalledProcessError, ValueError) as e:
        return f"llama.cpp setup failed: {e}"
    return None


def _build(base: Path, jobs: int, log) -> None:
    out = build_dir(base)
    out.mkdir(parents=True, exist_ok=True)
    sdist = base / SDIST
    if not sdist.exists():
        _download(sdist, log)
    commit = _extract(sdist, source_dir(base))
    print(f"building llama-server (llama.cpp {commit[:12]}, from llama-cpp-python {VERSION}) "
          f"with {jobs} jobs: several minutes ...", file=log, flush=True)
    for cmd in cmake_commands(source_dir(base), out / "build", commit[:8], jobs):
        subprocess.run(cmd, stdout=log, stderr=log, check=True)
    version = subprocess.run([str(server_binary(base)), "--version"], capture_output=True, text=True, timeout=60)
    cc = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    (out / "build.json").write_text(json.dumps({
        "llama_cpp_python": VERSION, "sdist_sha256": SDIST_SHA256, "llama_cpp_commit": commit,
        "server_version": (version.stdout + version.stderr).strip(), "compiler": cc[0] if cc else "",
        "cmake_flags": list(CMAKE_FLAGS)}, indent=2))


def _converter_requirements(src: Path) -> list[str]:
    """The converter's own pinned requirements (requirements/requirements-convert_*.txt) less
    torch, gguf and index options: torch is pinned to noria's CPU build instead (PyPI's default
    torch wheel is the CUDA one, gigabytes), and gguf comes from the same source tree."""
    out: list[str] = []
    for name in ("requirements-convert_hf_to_gguf.txt", "requirements-convert_legacy_llama.txt"):
        for line in (src / "requirements" / name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-") and not line.startswith(("torch", "gguf")):
                out.append(line)
    return out


def _noria_torch() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch")


def _converter_venv(base: Path, log) -> None:
    py = convert_python(base)
    venv = py.parent.parent
    shutil.rmtree(venv, ignore_errors=True)
    src = source_dir(base)
    print(f"making the GGUF converter's venv in {venv} ...", file=log, flush=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=log, stderr=log, check=True)
    torch = f"torch=={_noria_torch()}"
    if subprocess.run([*pip, torch], stdout=log, stderr=log).returncode != 0:
        subprocess.run([*pip, "--extra-index-url", "https://download.pytorch.org/whl/cpu", torch],
                       stdout=log, stderr=log, check=True)
    # gguf-py's own needs; the converter puts the source tree's gguf-py on its path itself.
    needs = [*_converter_requirements(src), "tqdm", "pyyaml", "requests", "safetensors"]
    subprocess.run([*pip, *needs], stdout=log, stderr=log, check=True)
    (venv / "ready").write_text(json.dumps(needs + [torch]))


# --- GGUF -------------------------------------------------------------------------------------


def pre_tokenizer(checkpoint: Path) -> str | None:
    """"gpt-2" where tokenizer.json is a byte-level BPE whose pre-tokenizer is exactly GPT-2's
    (ByteLevel with its regex, nothing else): the name llama.cpp gives that pre-tokenizer.
    None otherwise (the converter's own table then decides)."""
    path = checkpoint / "tokenizer.json"
    if not path.exists():
        return None
    tok = json.loads(path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    if (tok.get("model") or {}).get("type") == "BPE" and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return None


def _fingerprint(checkpoint: Path) -> str:
    """The checkpoint's files (name, size, mtime): a rebuilt checkpoint gets new GGUF files."""
    h = hashlib.sha256(str(checkpoint.resolve()).encode())
    for f in sorted(checkpoint.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def gguf_path(checkpoint: Path, outtype: str, base: Path | None = None) -> Path:
    return (base or root()) / "gguf" / VERSION / f"{checkpoint.name}-{_fingerprint(checkpoint)}-{outtype}.gguf"


def convert_command(checkpoint: Path, outtype: str, out: Path, base: Path | None = None) -> list[str]:
    pre = pre_tokenizer(checkpoint)
    return [str(convert_python(base)), str(Path(__file__).with_name("llama_cpp_convert.py")), str(source_dir(base)),
            str(checkpoint), *(["--pre", pre] if pre else []), "--", "--outtype", outtype, "--outfile", str(out)]


def convert(checkpoint: Path, outtype: str, base: Path | None = None, log=sys.stderr) -> Path:
    """The checkpoint as a GGUF of `outtype` ("f32", "bf16"), converted once and cached."""
    out = gguf_path(checkpoint, outtype, base)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    print(f"converting {checkpoint} to GGUF ({outtype}) ...", file=log, flush=True)
    subprocess.run(convert_command(checkpoint, outtype, tmp, base), stdout=log, stderr=log, check=True)
    tmp.rename(out)
    return out


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


# --- server -----------------------------------------------------------------------------------


def threads() -> int:
    """The thread count noria's worker uses (ModelRunner: torch threads = os.cpu_count())."""
    return os.cpu_count() or 1


def context_per_request(work) -> int:
    """Tokens one slot must hold for the longest request (prompt + output), in 64s."""
    longest = max(len(w[0]) + w[1] for w in work)
    return -(-longest // 64) * 64


def server_command(binary: Path, gguf: Path, port: int, slots: int, per_request: int, n_threads: int) -> list[str]:
    """llama-server with one slot per request in flight, each slot `per_request` tokens of KV
    (the context is split evenly between slots), continuous batching, and everything else at
    llama.cpp's defaults (its batch sizes, flash attention "auto", f16 KV cache)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(n_threads), "-tb", str(n_threads), "-np", str(slots), "-c", str(slots * per_request),
            "--cont-batching",
            "--cache-ram", "0",  # no host-memory prompt cache: every prompt is computed, as noria's are here
            "--no-webui"]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """llama-server's environment: the bench's, less the OpenMP wait settings that `noria bench`
    sets for noria's worker (bench/__init__.py: worker/cli.py's PROCESS_ENV), so that llama.cpp
    waits at its OpenMP barriers as it does by default (spin a while, then sleep). ggml's threads
    meet at a barrier after every op:

      2 quiet cores, 48 W1 requests, 16 in flight: default 225-248 tok/s bf16, 128-135 f32;
                                                   PASSIVE 166-167 bf16, 116-118 f32;
      2 cores shared with other jobs, 32 requests: default 19 tok/s bf16, PASSIVE 128.

    Its default is its best on a quiet host, the one a target is set against; on a busy one its
    spinning threads wait for a descheduled one (see `latency`, which runs both)."""
    env = dict(os.environ if base is None else base)
    from noria.worker.cli import PROCESS_ENV

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if env.get(name) == PROCESS_ENV[name]:
            del env[name]
    return env


class LlamaServer:
    """llama-server on a free port; `wait` until /health says the model is loaded; `stop`."""

    def __init__(self, gguf: Path, slots: int, per_request: int, n_threads: int | None = None,
                 binary: Path | None = None, log_path: Path | None = None, env: dict[str, str] | None = None) -> None:
        from noria.protocol.sockets import free_tcp_port

        port = free_tcp_port()
        self.http = f"http://127.0.0.1:{port}"
        self.command = server_command(binary or server_binary(), gguf, port, slots, per_request,
                                      n_threads or threads())
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.command, env=server_env() if env is None else env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def health(self) -> str:
        """"ok" once the model is loaded; "loading" while /health answers 503; "down" before it listens."""
        try:
            with urllib.request.urlopen(f"{self.http}/health", timeout=2) as r:
                return json.loads(r.read() or b"{}").get("status", "ok") if r.status == 200 else "loading"
        except urllib.error.HTTPError as e:
            return "loading" if e.code == 503 else f"http {e.code}"
        except OSError:
            return "down"

    def wait(self, timeout: float = 300.0) -> LlamaServer:
        deadline = time.monotonic() + timeout
        try:
            while (state := self.health()) != "ok":
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with code {self.proc.returncode} while starting"
                                       f" ({' '.join(self.command)})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama-server not ready within {timeout:.0f} s (last /health: {state})")
                time.sleep(0.1)  # poll interval; the deadline bounds the wait
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int:
        import signal

        from noria.protocol.lifecycle import stop_child

        rc = stop_child(self.proc, signal.SIGTERM, 30.0)
        if self.log is not subprocess.DEVNULL:
            self.log.close()  # type: ignore[union-attr]
        return rc

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --- client -----------------------------------------------------------------------------------


def completion_body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    """llama-server's native /completion for a token-id prompt: greedy, exactly `max_tokens`
    tokens, no prompt cache (noria's runs here have none either).

    `ignore_eos` in llama.cpp biases every end-of-generation token to -inf (noria's only keeps
    going past one), so greedy outputs part where noria's argmax is such a token. The sampler
    chain is the temperature stage alone: at temperature 0 it keeps the argmax, which the
    default chain's top-k/top-p/min-p stages before it never change, and they would each pass
    over the whole vocabulary per token."""
    return {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": False, "stream": stream, "return_tokens": True, "samplers": ["temperature"]}


def completion_tokens(response: dict) -> list[int]:
    """The generated token ids of a non-streamed /completion answer."""
    return list(response["tokens"])


def stream_tokens(line: bytes) -> list[int] | None:
    """The token ids one server-sent-events line of a streamed /completion carries (None: not a
    data line). Every sampled token comes in its own event, text or not; the final event (stop:
    true) repeats none of them."""
    if not line.startswith(b"data: "):
        return None
    event = json.loads(line[6:])
    if "error" in event:
        raise RuntimeError(f"llama-server: {event['error']}")
    return list(event.get("tokens") or [])


def _session(aiohttp):
    # A connection per request: llama-server (cpp-httplib) can drop a kept-alive connection after a
    # streamed answer, and the next request on it fails with "Can not write request body".
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=3600))


async def _stream(http, base: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], list[int]]:
    """One streamed request: when it was sent, each token's arrival time, the token ids."""
    sent = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    async with http.post(f"{base}/completion", json=completion_body(prompt, max_tokens, True)) as r:
        r.raise_for_status()
        async for line in r.content:
            got = stream_tokens(line)
            if got:
                now = time.perf_counter()
                times.extend([now] * len(got))
                ids.extend(got)
    return sent, times, ids


async def run_batch(base: str, work, in_flight: int) -> tuple[float, list[list[int]]]:
    """Every request of `work`, at most `in_flight` at a time; wall seconds and each one's tokens."""
    import aiohttp

    gate = asyncio.Semaphore(in_flight)
    async with _session(aiohttp) as http:

        async def one(prompt: list[int], max_tokens: int) -> list[int]:
            async with gate, http.post(f"{base}/completion",
                                       json=completion_body(prompt, max_tokens, False)) as r:
                r.raise_for_status()
                return completion_tokens(await r.json())

        await one(work[0][0], 2)  # warm-up, as noria-serve's
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p, m) for p, m in work))
        return time.perf_counter() - t0, outs


async def drive(base: str, reqs) -> list[dict]:
    """bench/serving.py's rates: each request sent at its offset, streamed; per-token arrival times."""
    import aiohttp

    async with _session(aiohttp) as http:
        start = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int, offset: float) -> dict:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            sent, times, _ = await _stream(http, base, prompt, max_tokens)
            return {"sent": sent, "times": times, "prompt_len": len(prompt)}

        return await asyncio.gather(*(one(*r) for r in reqs))


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

LATENCY_PROMPT = [9, 10, 11, 12]  # noria.bench.gemm_bf16.engine_ms_per_token's


async def _ms_per_token(base: str, tokens: int) -> tuple[float, list[int]]:
    import aiohttp

    async with _session(aiohttp) as http:
        await _stream(http, base, LATENCY_PROMPT, 16)  # warm-up
        _, times, ids = await _stream(http, base, LATENCY_PROMPT, tokens + 1)
    if len(times) != tokens + 1:
        raise RuntimeError(f"llama-server streamed {len(times)} tokens, asked for {tokens + 1}")
    return (times[-1] - times[0]) / tokens * 1e3, ids


def ms_per_token(server: LlamaServer, tokens: int = 256) -> tuple[float, list[int]]:
    """One request alone, streamed: milliseconds per output token after the first (the first
    carries the prompt), and the greedy tokens."""
    return asyncio.run(_ms_per_token(server.http, tokens))


NORIA_DTYPE = {"f32": "float32", "bf16": "bfloat16"}


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
                noria = engine_ms_per_token(NORIA_DTYPE[outtype], tokens)
                line = f"{outtype:<5} round {r + 1}: noria {noria:6.2f} ms/token"
                for label, server in servers.items():
                    llama, ids = ms_per_token(server, tokens)
                    rows.append({"dtype": outtype, "round": r + 1, "llama_cpp_env": label, "noria_ms": noria,
                                 "llama_cpp_ms": llama})
                    line += f" | llama.cpp ({label}) {llama:6.2f} ms/token, {llama / noria:4.2f}x noria's time"
                print(line, flush=True)
        same = _noria_tokens(NORIA_DTYPE[outtype], tokens + 1)
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
