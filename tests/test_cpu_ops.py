"""worker/cpu_ops.py: one place decides, per CPU op family, native kernels or torch; no private torch API."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from noria.worker import cpu_kernels, cpu_ops, fused_kernels, gemm_kernels, native_stack

_LOADS = (gemm_kernels.load, fused_kernels.load, cpu_kernels.load, native_stack.load)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_loads() -> Iterator[None]:
    """Each family's load() decided anew under the test's environment, and again after it."""
    for load in _LOADS:
        load.cache_clear()
    yield
    for load in _LOADS:
        load.cache_clear()


needs_compiler = pytest.mark.skipif(native_stack.load() is None, reason="no C compiler for the native kernels")


@needs_compiler
def test_every_family_is_native_where_the_kernels_build(fresh_loads: None) -> None:
    assert cpu_ops.summary() == "cpu ops: gemm=native fused=native attention=native stack=native"


@needs_compiler
@pytest.mark.parametrize("family", sorted(cpu_ops.FAMILY_ENV))
def test_one_switch_puts_one_family_on_torch(family: str, monkeypatch: pytest.MonkeyPatch,
                                             fresh_loads: None) -> None:
    env = cpu_ops.FAMILY_ENV[family]
    monkeypatch.setenv(env, "1")
    paths = cpu_ops.paths()
    assert paths[family] == f"torch ({env}=1)"
    # The stack calls the other three kernels: without any of them it is off too.
    others = {"stack": "torch (needs gemm, fused and attention native)"} if family != "stack" else {}
    for other in cpu_ops.FAMILY_ENV.keys() - {family}:
        assert paths[other] == others.get(other, "native"), other


@needs_compiler
def test_the_switches_reach_the_call_sites(monkeypatch: pytest.MonkeyPatch, fresh_loads: None) -> None:
    """With every family on torch, nothing reaches a kernel: the torch path of each family serves."""
    monkeypatch.setenv(cpu_ops.ALL_ENV, "1")
    assert set(cpu_ops.paths().values()) == {f"torch ({cpu_ops.ALL_ENV}=1)"}
    from noria.worker.models.linear import TorchLinear, linear_op
    from noria.worker.models.ops import TorchOps, choose_ops

    assert isinstance(linear_op(torch.randn(8, 8)), TorchLinear)
    assert type(choose_ops("silu", torch.device("cpu"), torch.float32)) is TorchOps
    assert not fused_kernels.usable(torch.randn(2, 8))
    k_cache = torch.zeros(4, 16, 2, 8)
    assert not cpu_kernels.usable(torch.randn(3, 4, 8), k_cache)


def test_the_line_is_logged_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_ops, "_logged", False)
    with caplog.at_level("INFO", logger="noria.worker"):
        cpu_ops.log_once()
        cpu_ops.log_once()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu ops: ")]
    assert lines == [cpu_ops.summary()]
    assert re.fullmatch(r"cpu ops: gemm=\S+( \(.*\))? fused=.* attention=.* stack=.*", lines[0])


# torch's private operator namespaces and C bindings: a torch upgrade may rename or drop them.
_PRIVATE = re.compile(r"torch\.ops\.(mkldnn|quantized|onednn)\b|torch\._C\b|_linear_pointwise|"
                      r"_reorder_linear_weight|torch\._prims|torch\._inductor")


def test_no_private_torch_api_in_the_sources() -> None:
    offenders = []
    for folder in ("worker", "kernels", "scheduler", "frontend", "protocol", "bench", "noria"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _PRIVATE.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
