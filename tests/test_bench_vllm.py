"""The vLLM CPU baseline's wrapper: its settings, its flags, its skip, its agreement count.

vLLM itself is never installed by the tests: these check what the benchmarks
would hand it, and that a machine without it skips it with a message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from noria.bench import serving_http, vllm_cpu

IOMP = Path("/venv/lib/libiomp5.so")


@pytest.mark.parametrize(("cpus", "text"), [({0, 1}, "0-1"), ({3}, "3"), ({0, 2, 3, 4, 7}, "0,2-4,7")])
def test_cpu_list_is_the_range_form_vllm_reads(cpus, text):
    assert vllm_cpu.cpu_list(cpus) == text


def test_default_configuration_leaves_vllm_its_own_binding():
    env = vllm_cpu.child_env("vllm", {"PATH": "/bin", "PYTHONPATH": "/repo"}, {0, 1}, IOMP)
    assert env == {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": vllm_cpu.KVCACHE_GIB}


def test_tuned_configuration_uses_every_core_and_intel_openmp():
    env = vllm_cpu.child_env("vllm-tuned", {"LD_PRELOAD": "/x/libjemalloc.so"}, {0, 1}, IOMP)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"] == f"{IOMP}:/x/libjemalloc.so"
    with pytest.raises(RuntimeError, match="libiomp5"):
        vllm_cpu.child_env("vllm-tuned", {}, {0, 1}, None)
    with pytest.raises(ValueError, match="unknown"):
        vllm_cpu.child_env("vllm-fast", {}, {0, 1}, IOMP)


def test_commands_run_vllms_own_interpreter(tmp_path):
    cmd = vllm_cpu.offline_command(Path("/m"), Path("/s.json"), Path("/o.json"), venv=tmp_path)
    assert cmd[0] == str(tmp_path / "bin" / "python")
    assert Path(cmd[1]).name == "vllm_offline.py" and Path(cmd[1]).exists()
    serve = vllm_cpu.serve_command(Path("/m"), 8123, ["--max-num-seqs", "8"], venv=tmp_path)
    assert serve[:5] == [str(tmp_path / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert serve[serve.index("--dtype") + 1] == "float32" and serve[serve.index("--port") + 1] == "8123"
    assert serve[-2:] == ["--max-num-seqs", "8"]
    # A --dtype among the flags comes after the default float32 one: argparse keeps the last.
    bf16 = vllm_cpu.serve_command(Path("/m"), 8123, serving_http.vllm_flags(["--dtype", "bfloat16"]), venv=tmp_path)
    assert bf16[len(bf16) - 1 - bf16[::-1].index("--dtype") + 1] == "bfloat16"


def test_vllm_gets_the_knobs_it_shares_with_noria():
    flags = ["--num-kv-blocks", "4096", "--max-num-batched-tokens", "512", "--max-model-len", "4064",
             "--no-enable-chunked-prefill", "--enable-prefix-caching", "--max-num-seqs", "16", "--dtype", "bfloat16"]
    assert serving_http.vllm_flags(flags) == [
        "--max-num-batched-tokens", "512", "--max-model-len", "4064", "--no-enable-chunked-prefill",
        "--enable-prefix-caching", "--max-num-seqs", "16", "--dtype", "bfloat16"]
    with pytest.raises(ValueError, match="--swap-space"):
        serving_http.vllm_flags(["--swap-space", "4"])


def test_agreement_counts_tokens_before_the_first_difference():
    noria = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [9, 9, 9]]
    same, tokens = vllm_cpu.agreement(noria, other)
    assert same == pytest.approx(1 / 3)
    assert tokens == pytest.approx((4 + 2 + 2) / (4 + 4 + 3))


def test_compare_pairs_rounds_and_best_runs():
    noria = [{"system": "noria-llm", "seconds": 10.0, "token_ids": [[1, 2]]},
             {"system": "noria-llm", "seconds": 8.0}]
    vllm = [{"system": "vllm", "seconds": 12.0, "token_ids": [[1, 3]]}, {"system": "vllm", "seconds": 6.0}]
    out = vllm_cpu.compare(noria, vllm)
    assert out["noria-llm / vllm (tok/s, best runs)"] == pytest.approx(6.0 / 8.0)
    assert out["noria-llm / vllm, median of rounds"] == pytest.approx(12.0 / 10.0)  # pairs 1.2 and 0.75
    assert out["vllm: requests greedy-identical to noria-llm"] == 0.0
    assert out["vllm: tokens before the first difference"] == pytest.approx(0.5)


def test_noria_is_measured_against_the_faster_vllm_configuration():
    rows = [{"system": "vllm", "seconds": 150.0}, {"system": "vllm-tuned", "seconds": 90.0}]
    out = vllm_cpu.versus_best(rows, {"system": "noria-llm", "seconds": 75.0})
    assert list(out.values()) == [pytest.approx(1.2)] and "vllm-tuned" in next(iter(out))
    assert vllm_cpu.versus_best([], {"seconds": 1.0}) == {}


def test_missing_venv_is_a_reason_not_an_error(tmp_path):
    why = vllm_cpu.setup(install=False, venv=tmp_path / "none")
    assert why is not None and str(tmp_path / "none") in why


def test_throughput_skips_vllm_where_it_is_not_installed(tmp_path):
    """The bench runs its other systems and says why vLLM did not run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["NORIA_VLLM_VENV"] = str(tmp_path / "no-vllm")
    log = tmp_path / "log"
    with open(log, "w") as f:
        # A file, not a pipe: the run is over when the bench exits, not when every grandchild has closed it.
        rc = subprocess.run(
            [sys.executable, "-m", "noria.bench.throughput", "--model", "serving", "--systems",
             "vllm,noria-llm,vllm-tuned", "--rounds", "1", "--num-requests", "2", "--max-tokens", "4",
             "--num-kv-blocks", "64", "--no-vllm-install", "--out", str(tmp_path / "out" / "tp")],
            cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=480).returncode
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert f"skipping vllm, vllm-tuned: no vllm-cpu {vllm_cpu.VERSION} in {tmp_path / 'no-vllm'}" in text
    assert "noria-llm" in text.split("runs (s)")[1]


def test_stream_chunks_are_counted_in_tokens():
    count = serving_http._tokens_in
    assert count({"text": "", "token_ids": [4, 5]}) == 2  # vLLM with return_token_ids
    assert count({"text": "", "logprobs": {"tokens": ["token_id:4"]}}) == 1  # noria: a token with no text
    assert count({"text": "", "finish_reason": "length"}) == 0
