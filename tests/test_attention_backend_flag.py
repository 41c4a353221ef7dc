"""--attention-backend {auto,kernels,torch}: parsed and typed, carried to the worker, decided
there once (worker/attention_select.py), refused in one sentence where `kernels` cannot run, and
reported by /health."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from noria.frontend.cli import add_engine_args, engine_flags
from noria.frontend.startup import make_config
from noria.protocol import switches
from noria.protocol.config import EngineConfig
from noria.protocol.errors import ParamError
from noria.worker.attention import LayerAttention, TorchAttentionBackend
from noria.worker.attention_select import CUDA_INSTALL_HINT, select_attention_backend
from noria.worker.errors import WorkerFatal
from tests.procs import serve_http
from tests.workers import health

LAYER = LayerAttention(4, 2, 32, 0.2)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # CUDA: only named, never used


def _parse(*argv: str) -> EngineConfig:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(list(argv))
    return make_config(args.model, **engine_flags(args))


def test_the_flags_parse_into_the_engine_config() -> None:
    config = _parse("--attention-backend", "kernels", "--gpu-memory-utilization", "0.75")
    assert (config.attention_backend, config.gpu_memory_utilization) == ("kernels", 0.75)
    assert (_parse().attention_backend, _parse().gpu_memory_utilization) == ("auto", 0.9)
    with pytest.raises(SystemExit):
        _parse("--attention-backend", "flash")


@pytest.mark.parametrize("flags, param", [
    ({"attention_backend": "cuda"}, "attention_backend"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
])
def test_bad_values_name_the_flag(flags: dict, param: str) -> None:
    with pytest.raises(ParamError) as e:
        make_config("demo", **flags)
    assert e.value.param == param


@pytest.fixture
def no_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(switches.EMULATED_KERNELS, raising=False)


def test_auto_on_a_cpu_is_the_native_torch_path(no_emulator: None) -> None:
    choice = select_attention_backend(CPU, [LAYER])
    assert isinstance(choice.backend, TorchAttentionBackend) and choice.backend.native
    assert (choice.name, choice.reason) == ("torch", "")


def test_kernels_on_a_cpu_without_the_emulator_is_refused_in_one_sentence(no_emulator: None) -> None:
    with pytest.raises(WorkerFatal) as e:
        select_attention_backend(CPU, [LAYER], choice="kernels")
    text = str(e.value)
    assert "\n" not in text and "--attention-backend kernels" in text and CUDA_INSTALL_HINT in text
    assert "cpu" in text


def test_kernels_without_cupy_is_refused_not_fallen_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(WorkerFatal, match="CuPy is not installed"):
        select_attention_backend(CUDA, [LAYER], choice="kernels")
    choice = select_attention_backend(CUDA, [LAYER])  # auto: torch, and why
    assert isinstance(choice.backend, TorchAttentionBackend) and not choice.backend.native
    assert choice.name == "torch" and "CuPy is not installed" in choice.reason


def test_kernels_that_do_not_work_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> int:
        raise RuntimeError("cudaErrorInsufficientDriver")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_driver)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(WorkerFatal, match="InsufficientDriver"):
        select_attention_backend(CUDA, [LAYER], choice="kernels")


def test_torch_never_touches_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(switches.EMULATED_KERNELS, "1")  # auto would take the emulated kernels here

    class Untouchable:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the kernel backend was used: {name}")

    choice = select_attention_backend(CPU, [LAYER], choice="torch", kernel_backend=Untouchable())
    assert isinstance(choice.backend, TorchAttentionBackend)
    assert (choice.name, choice.reason) == ("torch", "--attention-backend torch")


def test_kernels_on_a_cpu_engine_fails_start_up_with_the_sentence(demo_path: Path, no_emulator: None) -> None:
    argv = [sys.executable, "-m", "noria.frontend.cli", "generate", "hi", "--model", str(demo_path),
            "--device", "cpu", "--attention-backend", "kernels", "--max-tokens", "2"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("noria: error: start-up failed") and "--attention-backend kernels needs" in last, r.stderr


def test_health_reports_the_backend_the_worker_chose(demo_path: Path) -> None:
    # The flag travels frontend -> scheduler -> worker (Welcome) and the choice comes back
    # (WorkerReady -> stats -> /health).
    with serve_http("--model", str(demo_path), "--num-kv-blocks", "64", "--attention-backend", "torch") as s:
        code, body = health(s.http)
        assert code == 200, body
        assert body["attention_backend"] == "torch" and body["attention_reason"] == "--attention-backend torch"
