"""Tensor parallelism at the worker: N ranks in N processes over gloo against one rank.

Each rank drives its own ModelRunner with the same toy scheduler (the Driver of
test_worker_parity), so every rank sees the same plans, as the real scheduler
sends them. The workload is ragged: prompts arrive over time, long ones are
chunked by the token budget while others decode. Rank 0's logits (spied on at
the sampler) must match the single-rank run's within float32 reordering noise,
and every rank's tokens must equal the single-rank run's and transformers'.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from noria.protocol.config import EngineConfig
from noria.protocol.model_shapes import ShardedShapes, kv_heads_per_rank, tensor_parallel_error
from noria.protocol.sockets import free_tcp_port
from noria.worker import gemm_kernels
from noria.worker.model_runner import ModelRunner
from noria.worker.models.linear import PackedLinear
from tests.test_worker_parity import Driver, Req
from tests.tiny_models import load_reference, make_checkpoint, reference_greedy

PROMPT_LENS = [5, 40, 1, 23, 70, 9]
MAX_TOKENS = [9, 6, 12, 4, 5, 8]


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _randomize_biases(path: Path) -> None:
    """transformers initializes biases to zero, which would hide a bias that is
    sliced wrongly or added on every rank; give them values."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for name, tensor in weights.items():
        if name.endswith(".bias"):
            weights[name] = torch.randn(tensor.shape, generator=g) * 0.1
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def _runner(path: str, tp: int, rank: int = 0, init: str | None = None) -> ModelRunner:
    # One thread per rank: the test machine has two cores for all ranks.
    config = EngineConfig(model=path, dtype="float32", device="cpu", num_kv_blocks=48, swap_space=0,
                          num_threads=1, tensor_parallel_size=tp, startup_timeout=120)
    runner = ModelRunner(config, rank, init)
    # Stand-in for garbage in never-used memory: nothing NaN may reach an output.
    runner.kv_cache.device_cache[:, :, : runner.num_kv_blocks] = float("nan")
    return runner


def _drive(runner: ModelRunner, vocab_size: int) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """Greedy outputs per request and, on rank 0, the logits of every step."""
    logits: list[torch.Tensor] = []
    if runner.sampler is not None:
        sample = runner.sampler.sample

        def spy(step_logits: torch.Tensor, states: list[Any], record: bool = True) -> Any:
            logits.append(step_logits.clone())
            return sample(step_logits, states, record)

        runner.sampler.sample = spy  # type: ignore[method-assign]
    driver = Driver(runner, token_budget=32)
    for i, (prompt, m) in enumerate(zip(_prompts(vocab_size), MAX_TOKENS, strict=True)):
        driver.add(Req(i, list(prompt), len(prompt), m, arrival=i))
    return driver.run(), logits


def _shard_facts(runner: ModelRunner) -> dict[str, Any]:
    """What a rank holds, and whether its packed (native GEMM) shards compute with its weights."""
    model = runner.model
    attn, mlp = model.layers[0].self_attn, model.layers[-1].mlp
    x = torch.randn(7, model.spec.hidden_size)
    packed_ok = True
    if model.lm_head is None and isinstance(model.head, PackedLinear):  # tied: this rank's rows of the embedding
        rows = model.embed_tokens[model.shapes.vocab_start:model.shapes.vocab_end]
        packed_ok &= torch.equal(model.head.packed.unpack(), rows)
    for op in (attn.qkv_proj.op, mlp.gate_up_proj.op, model.head):
        if hasattr(op, "native"):  # a quantized kind (tests/test_quant_compressed_tensors.py)
            continue
        assert isinstance(op, PackedLinear) or gemm_kernels.load() is None  # F.linear where nothing is built
        weight = op.packed.unpack() if isinstance(op, PackedLinear) else op.weight
        packed_ok &= torch.allclose(op(x, None), x @ weight.T, rtol=1e-5, atol=1e-5)
    return {
        "kv_cache_shape": tuple(runner.kv_cache.device_cache.shape),
        "num_heads": attn.attn.num_heads,
        "qkv_rows": attn.qkv_proj.weight.shape[0],
        "o_cols": attn.o_proj.weight.shape[1],
        "down_cols": mlp.down_proj.weight.shape[1],
        "packed_ok": packed_ok,
        "samples": runner.sampler is not None,
    }


def _rank_main(rank: int, size: int, path: str, init: str, vocab_size: int, out: str) -> None:
    runner = _runner(path, size, rank, init)
    try:
        facts = _shard_facts(runner)
        outputs, logits = _drive(runner, vocab_size)
        torch.save({"outputs": outputs, "logits": logits, **facts}, out)
    finally:
        runner.close()


def _run_ranks(path: Path, size: int, vocab_size: int, tmp_path: Path) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")  # gloo and torch threads do not survive fork
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    files = [tmp_path / f"rank{r}.pt" for r in range(size)]
    procs = [ctx.Process(target=_rank_main, args=(r, size, str(path), init, vocab_size, str(files[r])))
             for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * size, f"rank exit codes {codes}"
    return [torch.load(f) for f in files]


CASES = [
    # (arch, tp, overrides): GQA with one KV head per rank and q/k/v biases, a vocabulary that
    # does not split evenly (509 over 2: the last shard is padded); MHA with
    # tied embeddings and o_proj / MLP biases (added once, after the all_reduce);
    # more ranks than KV heads (4 ranks, 2 KV heads: each replicated twice) with
    # a sliding window.
    ("qwen2", 2, {"vocab_size": 509}),
    ("llama", 2, {"num_key_value_heads": 4, "tied": True, "attention_bias": True,
                  "mlp_bias": True}),
    ("mistral", 4, {}),
    # Phi-3's fused qkv_proj / gate_up_proj, cut at load and then sliced per rank; partial rotary
    # and longrope's short factors (the context is no longer than the original one).
    ("phi3", 2, {"original_max_position_embeddings": 512}),
]


@pytest.mark.parametrize(("arch", "tp", "overrides"), CASES, ids=["qwen2-gqa-tp2", "llama-mha-tp2", "mistral-tp4",
                                                                 "phi3-fused-tp2"])
def test_tensor_parallel_matches_one_rank(arch: str, tp: int, overrides: dict[str, Any], tmp_path: Path) -> None:
    path = make_checkpoint(arch, tmp_path / arch, seed=11, **overrides)
    _randomize_biases(path)
    vocab_size = int(overrides.get("vocab_size", 512))
    single, single_logits = _drive(_runner(str(path), 1), vocab_size)
    ref = load_reference(path)
    expected = {i: reference_greedy(ref, p, m) for i, (p, m) in enumerate(zip(_prompts(vocab_size), MAX_TOKENS,
                                                                                strict=True))}
    assert single == expected

    ranks = _run_ranks(path, tp, vocab_size, tmp_path)
    cfg = ref.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    local_kv = kv_heads_per_rank(kv_heads, tp)
    assert local_kv == max(1, kv_heads // tp)
    for rank, got in enumerate(ranks):
        assert got["outputs"] == expected, f"rank {rank}"
        # Each rank caches (and computes) only its share of the heads.
        assert got["kv_cache_shape"][4:] == (local_kv, head_dim), f"rank {rank}"
        assert got["num_heads"] == heads // tp
        assert got["qkv_rows"] == (heads // tp + 2 * local_kv) * head_dim
        assert got["o_cols"] == heads // tp * head_dim
        assert got["down_cols"] == cfg.intermediate_size // tp
        assert got["packed_ok"], f"rank {rank}: a packed shard does not compute with its weight"
        assert got["samples"] == (rank == 0), "only rank 0 holds a sampler"
        assert got["logits"] == [] or rank == 0

    # Rank 0 samples from the gathered logits. Row-parallel layers sum partial
    # products in another order than one rank does, so float32 results differ in
    # the last bits (measured: max |diff| about 2e-6 on logits up to about 3);
    # 1e-4 is far below the gaps greedy picks across, which the token check shows.
    logits = ranks[0]["logits"]
    assert len(logits) == len(single_logits)
    for step, (a, b) in enumerate(zip(logits, single_logits, strict=True)):
        assert a.shape == b.shape == (b.shape[0], vocab_size), f"step {step}"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_shapes_that_cannot_be_split_are_refused(tmp_path: Path) -> None:
    # 4 query heads, 2 KV heads, intermediate 128 (the tiny models).
    tiny = ShardedShapes(num_heads=4, num_kv_heads=2, intermediate_size=128)
    assert tensor_parallel_error(tiny, 1) is None
    assert tensor_parallel_error(tiny, 2) is None
    assert tensor_parallel_error(tiny, 4) is None  # 2 KV heads, each on 2 ranks
    assert "num_attention_heads 4" in (tensor_parallel_error(tiny, 3) or "")
    assert "num_attention_heads 4" in (tensor_parallel_error(tiny, 8) or "")
    # 12 heads split over 6 ranks, but 4 KV heads can be neither split nor replicated evenly.
    problem = tensor_parallel_error(ShardedShapes(12, 4, 96), 6) or ""
    assert "num_key_value_heads 4" in problem and "6" in problem
    assert "num_key_value_heads 6" in (tensor_parallel_error(ShardedShapes(8, 6, 96), 4) or "")
    assert "intermediate_size 100" in (tensor_parallel_error(ShardedShapes(8, 8, 100), 8) or "")
    assert kv_heads_per_rank(8, 2) == 4 and kv_heads_per_rank(2, 4) == 1

    # The worker refuses before it joins any process group (no rendezvous is given).
    path = make_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide num_attention_heads 4"):
        _runner(str(path), 3)
    with pytest.raises(ValueError, match="needs a rendezvous address"):
        _runner(str(path), 2)
