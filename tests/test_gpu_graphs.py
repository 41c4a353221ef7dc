"""CUDA graphs for decode steps on a real GPU: greedy and seeded outputs with graphs equal the
eager (--enforce-eager) outputs, on the torch attention backend and on the kernels (whose
graph path fixes its launches per bucket) and with an EAGLE-3 head reading the target's layer
inputs out of the graphs, every decode batch replays its bucket's graph, the
capture is logged in one line and takes no more than the KV cache sizing kept back. Skipped where there is no GPU: graphs exist only on CUDA (the
CPU tests in test_worker_cuda_graphs.py cover buckets, padding and the buffers)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from noria.bench.spec_models import write_eagle3_head
from noria.protocol.config import EngineConfig
from noria.protocol.speculative import SpeculativeConfig
from noria.worker.cuda_graphs import bucket_size
from noria.worker.model_runner import ModelRunner
from tests.test_worker_cuda_graphs import (
    BLOCK,
    PARAMS,
    _head_outputs,
    assert_same_head_outputs,
    drive,
)
from tests.tiny_models import make_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("gpu_graphs") / "llama")


def gpu_runner(path: Path, attention_backend: str = "torch", **kw: object) -> ModelRunner:
    config = EngineConfig(model=str(path), dtype="float32", device="cuda", block_size=BLOCK, num_kv_blocks=64,
                          swap_space=0.001, max_num_seqs=16, attention_backend=attention_backend,
                          **kw)  # type: ignore[arg-type]
    runner = ModelRunner(config)
    # Stand-in for garbage in never-used memory: nothing NaN may reach an output.
    runner.kv_cache.device_cache[:, :, : runner.num_kv_blocks] = float("nan")
    return runner


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_graphs_match_eager(checkpoint: Path, params: object, caplog: pytest.LogCaptureFixture,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    with caplog.at_level(logging.INFO, logger="noria.worker.cuda_graphs"):
        graphed = gpu_runner(checkpoint, cuda_graph_sizes=SIZES)
    assert graphed.graphs is not None
    lines = [r.getMessage() for r in caplog.records if r.name == "noria.worker.cuda_graphs"]
    assert len(lines) == 1 and "captured 5 decode sizes (1..16)" in lines[0] and "MiB" in lines[0]
    replays: list[tuple[int, int]] = []
    real_replay = graphed.graphs.replay
    monkeypatch.setattr(graphed.graphs, "replay",
                        lambda size, n: (replays.append((size, n)), real_replay(size, n))[1])
    eager = gpu_runner(checkpoint, enforce_eager=True)
    assert eager.graphs is None
    got, got_lp = drive(graphed, params)  # type: ignore[arg-type]
    want, want_lp = drive(eager, params)  # type: ignore[arg-type]
    assert got == want
    for a, b in zip(got_lp, want_lp, strict=True):
        for x, y in zip(a or [], b or [], strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert replays and all(size == bucket_size(n, SIZES) for size, n in replays)
    assert any(n < size for size, n in replays)


def test_eagle3_graphs_match_eager(tmp_path: Path) -> None:
    """With an EAGLE-3 head, the graphs also output the target's layer inputs the head reads:
    its outputs after every step and the tokens are the eager runner's."""
    target = make_checkpoint("llama", tmp_path / "target", num_hidden_layers=4)
    head = write_eagle3_head(target, tmp_path / "head", aux=[0, 2, 3])
    spec = SpeculativeConfig(method="eagle3", model=str(head), num_speculative_tokens=3)
    graphed = gpu_runner(target, speculative_config=spec, cuda_graph_sizes=SIZES)
    assert graphed.graphs is not None and 0 < graphed.graphs.memory <= graphed.graph_reserve
    eager = gpu_runner(target, speculative_config=spec, enforce_eager=True)
    got_heads, want_heads = _head_outputs(graphed), _head_outputs(eager)
    got, _ = drive(graphed, PARAMS[0])  # type: ignore[arg-type]
    want, _ = drive(eager, PARAMS[0])  # type: ignore[arg-type]
    assert got == want
    assert_same_head_outputs(got_heads, want_heads, 1e-4)


# Head size 64 (the kernels have no instance for the default tiny model's 16) and rows of
# 2048 tokens: on an H100 the float32 graph path splits every row into 4 partitions.
KERNEL_OVERRIDES = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "max_position_embeddings": 2048}


def test_kernel_graphs_match_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cupy")
    path = make_checkpoint("llama", tmp_path / "llama", **KERNEL_OVERRIDES)
    graphed = gpu_runner(path, "kernels", cuda_graph_sizes=SIZES)
    assert graphed.attention.name == "kernels" and graphed.graphs is not None
    # What the capture took fits in what the KV cache sizing kept back for it.
    assert 0 < graphed.graphs.memory <= graphed.graph_reserve
    replays: list[tuple[int, int]] = []
    real_replay = graphed.graphs.replay
    monkeypatch.setattr(graphed.graphs, "replay",
                        lambda size, n: (replays.append((size, n)), real_replay(size, n))[1])
    eager = gpu_runner(path, "kernels", enforce_eager=True)
    assert eager.graphs is None
    got, got_lp = drive(graphed, PARAMS[0])  # type: ignore[arg-type]
    want, want_lp = drive(eager, PARAMS[0])  # type: ignore[arg-type]
    assert got == want
    for a, b in zip(got_lp, want_lp, strict=True):
        for x, y in zip(a or [], b or [], strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert replays and any(n < size for size, n in replays)
    # The graphs hold the kernels' fixed launches (kernels/graph_plan.py), one per bucket.
    assert {key[0] for key in graphed.attention.graph._launches} == set(SIZES)
