"""Where a server's memory goes, per process: the bench helper that reads it (bench/process_rss.py)
on real processes, and `noria serve` keeping torch out of every process but the workers
(frontend/no_torch.py: torch was ~230 MiB of the frontend's ~300 MiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from noria.bench.process_rss import MiB, format_rss, role, rss_bytes, server_processes, server_rss
from noria.frontend.client import Client
from noria.protocol.sampling import SamplingParams
from tests.procs import serve_http

ALLOC_MIB = 64
# The parent touches ALLOC_MIB and starts one child per command-line tail, each of which says
# "up" once running; the parent says "ready" once all have, then both wait for stdin to close.
PARENT = f"""
import subprocess, sys
buf = bytearray({ALLOC_MIB} * 2**20)
for i in range(0, len(buf), 4096):
    buf[i] = 1
child = "import sys; print('up', flush=True); sys.stdin.read()"
tails = [["-m", "noria.scheduler"], ["-m", "noria.worker", "--rank", "0"], ["-m", "noria.worker", "--rank", "1"],
         ["-m", "noria.frontend.cli", "bridge"], [], []]
kids = [subprocess.Popen([sys.executable, "-c", child, *t], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for t in tails]
for k in kids:
    assert k.stdout.readline() == "up\\n"
print("ready", *(k.pid for k in kids), flush=True)
sys.stdin.read()
for k in kids:
    k.stdin.close()
    k.wait()
"""


def test_rss_and_roles_of_a_real_process_tree() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdin is not None
        word, *pids = parent.stdout.readline().split()
        assert word == "ready"
        kids = [int(p) for p in pids]
        # Python's own name for the plain children: comm is the interpreter's file name, cut to 15.
        comm = Path(f"/proc/{kids[-1]}/comm").read_text().strip()
        assert server_processes(parent.pid) == {
            "frontend": parent.pid, "scheduler": kids[0], "worker": kids[1], "worker rank 1": kids[2],
            "bridge": kids[3], comm: kids[4], f"{comm} #2": kids[5]}
        assert role(kids[1]) == "worker"
        assert server_processes(parent.pid, depth=1) == server_processes(parent.pid)  # no grandchildren here
        rss = server_rss(parent.pid)
        assert list(rss) == list(server_processes(parent.pid))
        assert rss["frontend"] >= ALLOC_MIB * MiB  # the touched buffer is resident
        assert all(0 < b < ALLOC_MIB * MiB for name, b in rss.items() if name != "frontend")
        line = format_rss(rss)
        assert line.startswith("frontend ") and line.endswith(f"= {sum(rss.values()) / MiB:,.0f} MiB")
    finally:
        if parent.stdin is not None:
            parent.stdin.close()
        parent.wait(timeout=60)
    assert rss_bytes(parent.pid) == 0 and server_processes(parent.pid) == {"frontend": parent.pid}


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_only_the_workers_of_a_server_load_torch() -> None:
    with serve_http("--num-kv-blocks", "64", "--max-model-len", "256") as s:
        with Client(s.address, timeout=120) as c:
            # The tokenizer, the chat template and the detokenizer all run in the frontend.
            params = SamplingParams(max_tokens=4, temperature=0.0)
            assert c.chat([{"role": "user", "content": "hello"}], params).outputs[0].token_ids
            assert c.generate("the water wheel", params).outputs[0].token_ids
        procs = server_processes(s.proc.pid)
        assert {"frontend", "scheduler", "worker", "bridge"} <= set(procs), procs
        assert "libtorch_cpu" in _maps(procs["worker"])  # what the check looks for is there to see
        loaded = [name for name in ("frontend", "scheduler", "bridge") if "libtorch" in _maps(procs[name])]
        assert not loaded, f"torch is loaded in {loaded}"
        assert all(b > 0 for b in server_rss(s.proc.pid).values())


KEPT_OUT = """
import json, sys
from noria.frontend.no_torch import keep_torch_out
from noria.frontend.processor import load_tokenizer
first, again = keep_torch_out(), keep_torch_out()
tok = load_tokenizer(sys.argv[1])
ids = tok("the water wheel", add_special_tokens=False)["input_ids"]
chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
try:
    import torch  # noqa: F401
    refused = False
except ImportError:
    refused = True
print(json.dumps([first, again, refused, ids, tok.decode(ids), chat]))
"""

SAME_WITH_TORCH = """
import json, sys
import torch  # noqa: F401
from noria.frontend.no_torch import keep_torch_out
from noria.frontend.processor import load_tokenizer
tok = load_tokenizer(sys.argv[1])
ids = tok("the water wheel", add_special_tokens=False)["input_ids"]
chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
print(json.dumps([keep_torch_out(), ids, tok.decode(ids), chat]))
"""


def test_a_process_without_torch_tokenizes_as_one_with_it(demo_path: Path) -> None:
    def run(code: str) -> tuple[list, str]:
        out = subprocess.run([sys.executable, "-c", code, str(demo_path)], capture_output=True, text=True,
                             timeout=300, check=True)
        return json.loads(out.stdout.splitlines()[-1]), out.stderr

    (first, again, refused, *kept), stderr = run(KEPT_OUT)
    assert first and again and refused  # idempotent, and torch stays out
    assert "PyTorch was not found" not in stderr  # deliberate: transformers' warning is dropped
    (already, *with_torch), _ = run(SAME_WITH_TORCH)
    assert already is False  # a process that has torch keeps it
    assert kept == with_torch
