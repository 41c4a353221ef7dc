"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): the grouped expert block against
a per-token loop in float64, greedy parity with transformers at the worker (chunked prefill,
prefix hits, a resumed request) and through the whole engine (preemption, prefix cache), both
checkpoint layouts (the hub's per-expert tensors and transformers 5's fused ones), bfloat16
logprobs, tensor parallelism over two ranks, and the torch-free pre-check of the checkpoint.

The tiny checkpoints (tests/tiny_models.py) have 8 experts, top-2, hidden 64: Mixtral sparse
everywhere and renormalised; Qwen2-MoE with a shared expert and raw top-k weights; Qwen3-MoE
renormalised with a dense first layer. Skipping the renormalisation or the shared expert's
gate changes the greedy tokens of most prompts, so the parity tests notice either.
"""

from __future__ import annotations

import multiprocessing
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from noria import LLM, SamplingParams
from noria.protocol.checkpoint import CheckpointError, check_checkpoint
from noria.protocol.model_shapes import ShardedShapes, read_shapes, tensor_parallel_error
from noria.protocol.model_spec import model_spec
from noria.protocol.sockets import free_tcp_port
from noria.worker import gemm_kernels
from noria.worker.models import moe
from noria.worker.models.linear import LinearOp
from noria.worker.models.linear import packed as packed_weight
from noria.worker.models.moe import SparseMoeBlock
from noria.worker.models.ops import choose_ops
from noria.worker.models.parallel import TensorParallel
from tests import test_engine_half, test_engine_parity, test_worker_parity, test_worker_tp
from tests.tiny_models import (
    MOE_ARCHS,
    load_reference,
    make_checkpoint,
    make_model,
    reference_greedy,
    tiny_config,
)


def _fused_checkpoint(arch: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """The same weights as make_checkpoint's, saved as transformers 5 holds them in memory
    (experts fused: [E, 2I, H] gate_up_proj and [E, H, I] down_proj), not as save_pretrained
    writes them (per expert)."""
    from safetensors.torch import save_file

    model = make_model(arch, seed=seed, **overrides)
    path.mkdir(parents=True)
    model.config.save_pretrained(str(path))
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_checkpoint(arch, root / arch) for arch in MOE_ARCHS}


# -- the grouped block against a per-token loop ----------------------------------------------


def _weight(op: LinearOp) -> torch.Tensor:
    """The weight a linear kind computes with (a packed kind keeps it only in its panels)."""
    w = packed_weight(op)
    return op.weight if w is None else w.unpack()  # type: ignore[union-attr]


def _per_token(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's definition, one token and one chosen expert at a time, in float64."""
    i = block.inter
    out = torch.zeros(x.shape, dtype=torch.float64)
    router = block.router.detach().double()
    gate_up, down = (torch.stack([_weight(op) for op in ops]).double() for ops in (block.gate_up_ops, block.down_ops))
    for t, row in enumerate(x.double()):
        probs = torch.softmax(router @ row, dim=-1)
        chosen = sorted(range(block.num_experts), key=lambda e: -probs[e].item())[: block.top_k]
        weights = probs[chosen]
        if block.norm_topk_prob:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            h = gate_up[e] @ row
            out[t] += w * (down[e] @ (F.silu(h[:i]) * h[i:]))
        if block.shared_gate_up is not None and block.shared_down is not None and block.shared_expert_gate is not None:
            s, h = block.shared_inter, _weight(block.shared_gate_up.op).double() @ row
            shared = _weight(block.shared_down.op).double() @ (F.silu(h[:s]) * h[s:])
            out[t] += torch.sigmoid(block.shared_expert_gate.double() @ row)[0] * shared
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["torch", "native-gemm"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_grouped_experts_match_a_per_token_loop(arch: str, top_k: int, packed: bool) -> None:
    spec = model_spec(tiny_config(arch, num_experts_per_tok=top_k))
    block = SparseMoeBlock(spec, TensorParallel(), choose_ops(spec.activation, torch.device("cpu"), torch.float32))
    g = torch.Generator().manual_seed(top_k)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if packed:
        if gemm_kernels.load() is None:
            pytest.skip("no native GEMM on this host")
        block.pack()
        assert all(packed_weight(op) is not None for op in block.gate_up_ops + block.down_ops)
    for tokens in (0, 1, 6, 67):
        x = torch.randn(tokens, spec.hidden_size, generator=g)
        got = block(x)
        assert got.shape == x.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), _per_token(block, x), rtol=1e-5, atol=1e-5)
    # Every expert ran on some of the 67 tokens: the loop over experts is not skipping any.
    _, ids = block.route(x)
    assert set(ids.flatten().tolist()) == set(range(spec.num_experts))


def test_spec_reads_each_family_as_transformers_does() -> None:
    mixtral = model_spec(tiny_config("mixtral"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 48)
    assert mixtral.norm_topk_prob and not mixtral.router_weights_in_model_dtype
    assert mixtral.sparse_layers == (True, True) and mixtral.sliding_windows == (48, 48)
    qwen2 = model_spec(tiny_config("qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert qwen2.sparse_layers == (False, True, False, False)
    assert qwen2.shared_expert_intermediate_size == 48 and not qwen2.norm_topk_prob and qwen2.qkv_bias
    qwen3 = model_spec(tiny_config("qwen3_moe"))
    assert qwen3.sparse_layers == (False, True) and qwen3.norm_topk_prob and qwen3.qk_norm
    assert qwen3.shared_expert_intermediate_size == 0
    with pytest.raises(ValueError, match="num_experts_per_tok 9"):
        model_spec(tiny_config("qwen3_moe", num_experts_per_tok=9))


# -- greedy parity at the worker ---------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_matches_transformers(arch: str, checkpoints: dict[str, Path],
                                     caplog: pytest.LogCaptureFixture) -> None:
    """The worker parity test of the dense families (chunked prefill under a token budget,
    arrivals mid-decode, prefix hits on shared blocks, a resumed request) on the MoE ones."""
    with caplog.at_level("INFO", logger="noria.worker"):
        test_worker_parity.test_greedy_matches_transformers(arch, checkpoints)
    sparse = sum(model_spec(tiny_config(arch)).sparse_layers)
    assert f"mixture of experts: {sparse} of 2 layers sparse, 8 experts" in caplog.text


@pytest.mark.parametrize(
    ("arch", "layout", "overrides"),
    [
        ("mixtral", "fused", {}),
        ("qwen2_moe", "fused", {}),
        ("qwen3_moe", "fused", {}),
        ("qwen2_moe", "sharded", {}),
        # Sparse every other layer (decoder_sparse_step) with a dense layer forced by mlp_only_layers.
        ("qwen2_moe", "per-expert", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    ],
    ids=["mixtral-fused", "qwen2_moe-fused", "qwen3_moe-fused", "qwen2_moe-sharded", "qwen2_moe-sparse-step"],
)
def test_checkpoint_layouts(arch: str, layout: str, overrides: dict[str, Any], tmp_path: Path) -> None:
    if layout == "fused":
        path = _fused_checkpoint(arch, tmp_path / arch, seed=3, **overrides)
    else:
        path = make_checkpoint(arch, tmp_path / arch, seed=3, shard=layout == "sharded", **overrides)
        if layout == "sharded":  # the experts of one layer spread over several files
            assert len(list(path.glob("*.safetensors"))) > 1
    check_checkpoint(path)
    ref = load_reference(path)
    prompts = test_worker_parity._prompts(seed=7)[::3]
    driver = test_worker_parity.Driver(test_worker_parity._runner(path), token_budget=48)
    for i, prompt in enumerate(prompts):
        driver.add(test_worker_parity.Req(i, list(prompt), len(prompt), 6, arrival=i))
    assert driver.run() == {i: reference_greedy(ref, p, 6) for i, p in enumerate(prompts)}


def test_missing_expert_weights_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from noria.protocol.config import EngineConfig
    from noria.worker.model_runner import ModelRunner

    path = make_checkpoint("qwen2_moe", tmp_path / "q")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks 1 weight tensor\(s\).*layers\.1\.mlp\.experts\.5\.up_proj"):
        check_checkpoint(path)
    with pytest.raises(ValueError, match=r"missing weights for: layers\.1\.mlp\.experts_gate_up"):
        ModelRunner(EngineConfig(model=str(path), num_kv_blocks=4, swap_space=0))


# -- the pre-check ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_precheck_knows_the_expert_tensors(arch: str, tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    for layout in ("per-expert", "fused"):
        folder = tmp_path / layout
        path = make_checkpoint(arch, folder) if layout == "per-expert" else _fused_checkpoint(arch, folder)
        check_checkpoint(path)
        # An expert of another size than config.json says.
        cfg = json.loads((path / "config.json").read_text())
        key = "intermediate_size" if arch == "mixtral" else "moe_intermediate_size"
        bad = dict(cfg, **{key: cfg[key] * 2})
        (path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="do not belong to this config"):
            check_checkpoint(path)
        (path / "config.json").write_text(json.dumps(cfg))
        # A router gone.
        weights = load_file(path / "model.safetensors")
        router = next(n for n in weights if n.endswith("layers.1.block_sparse_moe.gate.weight")
                      or n.endswith("layers.1.mlp.gate.weight"))
        del weights[router]
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=r"lacks 1 weight tensor\(s\) .*first: layers\.1\.\w+\.gate\.weight"):
            check_checkpoint(path)


# -- through the whole engine -------------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_engine_greedy_with_preemption_and_prefix_hits(arch: str, checkpoints: dict[str, Path],
                                                       demo_path: Path, tmp_path: Path) -> None:
    ckpt = test_engine_parity._with_tokenizer(shutil.copytree(checkpoints[arch], tmp_path / arch), demo_path)
    rng = random.Random(11)  # the scheduling does not depend on the model: one workload for all
    system = [rng.randrange(5, 500) for _ in range(40)]
    prompts = [system + [rng.randrange(5, 500) for _ in range(rng.randint(1, 50))] for _ in range(8)]
    prompts += [[rng.randrange(5, 500) for _ in range(rng.randint(1, 20))] for _ in range(2)]
    max_new = [rng.randint(4, 20) for _ in prompts]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    # 10 blocks of 16 tokens for 4 running sequences of up to 110 tokens: preemption; a 32-token
    # budget chunks every long prompt; the shared 40-token prefix hits the cache.
    with LLM(str(ckpt), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=10,
             block_size=16, preemption_mode="recompute") as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert stats.blocks_consistent and stats.num_free_blocks == stats.num_kv_blocks
    ref = load_reference(ckpt)
    for prompt, m, out in zip(prompts, max_new, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(ref, prompt, m), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bfloat16_logprobs_match_transformers(arch: str, checkpoints: dict[str, Path], demo_path: Path,
                                              tmp_path: Path) -> None:
    """test_engine_half's comparison (teacher-forced logprobs within 8 bfloat16 ulps) on the MoE families."""
    ckpt = test_engine_parity._with_tokenizer(shutil.copytree(checkpoints[arch], tmp_path / arch), demo_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 30, 61)]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(str(ckpt), dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=32,
             block_size=16) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    tol = test_engine_half._tolerance(torch.bfloat16)
    for prompt, out in zip(prompts, outs, strict=True):
        done = out.outputs[0]
        assert len(done.token_ids) == 10 and done.logprobs is not None
        ref = test_engine_half._reference_logprobs(ckpt, torch.bfloat16, prompt, done.token_ids)
        ref_chosen = ref[torch.arange(10), torch.tensor(done.token_ids)]
        got = torch.tensor([lp.logprob for lp in done.logprobs])
        assert (got - ref_chosen).abs().max().item() <= tol, (got, ref_chosen)
        assert (ref.max(-1).values - ref_chosen).max().item() <= tol


# -- tensor parallelism -----------------------------------------------------------------------------


def _rank_main(rank: int, size: int, path: str, init: str, out: str) -> None:
    runner = test_worker_tp._runner(path, size, rank, init)
    try:
        block = next(layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        facts = {"gate_up": tuple(block.experts_gate_up.shape), "down": tuple(block.experts_down.shape),
                 "shared": None if block.shared_down is None else tuple(block.shared_down.weight.shape),
                 "router": tuple(block.router.shape)}
        outputs, logits = test_worker_tp._drive(runner, 512)
        torch.save({"outputs": outputs, "logits": logits, **facts}, out)
    finally:
        runner.close()


@pytest.mark.parametrize("arch, layout", [("qwen2_moe", "per-expert"), ("mixtral", "fused")])
def test_tensor_parallel_shards_experts(arch: str, layout: str, tmp_path: Path) -> None:
    """Two ranks over gloo, each with half of every expert's (and the shared expert's) columns:
    rank 0's logits match one rank's, and every rank's tokens transformers'."""
    path = (_fused_checkpoint(arch, tmp_path / arch, seed=11) if layout == "fused"
            else make_checkpoint(arch, tmp_path / arch, seed=11))
    single, single_logits = test_worker_tp._drive(test_worker_tp._runner(str(path), 1), 512)
    ref = load_reference(path)
    prompts = test_worker_tp._prompts(512)
    assert single == {i: reference_greedy(ref, p, m)
                      for i, (p, m) in enumerate(zip(prompts, test_worker_tp.MAX_TOKENS, strict=True))}

    ctx = multiprocessing.get_context("spawn")  # gloo and torch threads do not survive fork
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    files = [tmp_path / f"rank{r}.pt" for r in range(2)]
    procs = [ctx.Process(target=_rank_main, args=(r, 2, str(path), init, str(files[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"rank exit codes {codes}"
    ranks = [torch.load(f) for f in files]
    spec = model_spec(ref.config)
    half = spec.moe_intermediate_size // 2
    for rank, got in enumerate(ranks):
        assert got["outputs"] == single, f"rank {rank}"
        assert got["gate_up"] == (8, 2 * half, 64) and got["down"] == (8, 64, half)
        assert got["router"] == (8, 64)  # replicated
        assert got["shared"] == (None if arch == "mixtral" else (64, 24))
    # Partial sums in another order than one rank's: float32 noise only (as test_worker_tp).
    for step, (a, b) in enumerate(zip(ranks[0]["logits"], single_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_engine_tensor_parallel_two_ranks(checkpoints: dict[str, Path], demo_path: Path, tmp_path: Path) -> None:
    ckpt = test_engine_parity._with_tokenizer(shutil.copytree(checkpoints["qwen3_moe"], tmp_path / "q"), demo_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    max_new = [rng.randint(1, 12) for _ in prompts]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    with LLM(str(ckpt), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
             block_size=16, tensor_parallel_size=2) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ref = load_reference(ckpt)
    assert outs == [reference_greedy(ref, p, m) for p, m in zip(prompts, max_new, strict=True)]


def test_expert_sizes_that_cannot_be_split_are_refused(checkpoints: dict[str, Path]) -> None:
    shapes = read_shapes(checkpoints["qwen2_moe"])
    assert shapes == ShardedShapes(4, 2, 128, (("moe_intermediate_size", 32), ("shared_expert_intermediate_size", 48)))
    assert tensor_parallel_error(shapes, 2) is None
    assert tensor_parallel_error(ShardedShapes(4, 2, 128, (("moe_intermediate_size", 30),)), 4) == \
        "tensor_parallel_size 4 does not divide moe_intermediate_size 30"
    assert read_shapes(checkpoints["mixtral"]) == ShardedShapes(4, 2, 48)  # its experts are intermediate_size
    spec = model_spec(tiny_config("qwen2_moe"))
    line = moe.describe(spec, TensorParallel(0, 2))
    assert line == ("mixture of experts: 2 of 2 layers sparse, 8 experts of 32, top-2 (not renormalised), a shared "
                    "expert of 48; each expert's 32 intermediate columns split over 2 ranks (16 per rank, one "
                    "all_reduce per block), router replicated")


def test_bench_builds_its_qwen3_moe_checkpoint(tmp_path: Path, demo_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`noria bench throughput --model qwen3-moe-small` builds its model as "small" is built;
    here at a tiny width, into a private cache."""
    from noria.bench import throughput, workloads
    from noria.worker.loader import load_spec

    monkeypatch.setattr(workloads, "cache_root", lambda: tmp_path)
    tiny = {**workloads.QWEN3_MOE_SMALL, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 32,
            "vocab_size": 512}
    path = workloads._checkpoint("moe", tiny, family="qwen3_moe")
    check_checkpoint(path)
    spec = load_spec(path)
    assert spec.architecture == "Qwen3MoeForCausalLM" and spec.sparse_layers == (True, True)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob) == (8, 2, True)
    assert (path / "tokenizer.json").is_file()
    assert throughput._parser().parse_args(["--model", "qwen3-moe-small"]).model == "qwen3-moe-small"


def test_greedy_on_the_emulated_gpu_layer_path(checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA kernels' layer path, run by the CPU emulator: attention on the kernels, and the
    experts' SiLU-and-mul on the fused kernel, as a GPU runs a sparse layer."""
    from noria.worker.attention_select import EMULATED_KERNELS_ENV

    monkeypatch.setenv(EMULATED_KERNELS_ENV, "1")
    path = checkpoints["qwen3_moe"]
    runner = test_worker_parity._runner(path)
    assert runner.attention_choice.backend.name == "kernels"
    calls = []
    from noria.kernels import fused_ops

    silu = fused_ops.silu_and_mul
    monkeypatch.setattr(fused_ops, "silu_and_mul", lambda x, **kw: calls.append(x.shape) or silu(x, **kw))
    ref = load_reference(path)
    prompts = test_worker_parity._prompts(seed=5)[::4]
    driver = test_worker_parity.Driver(runner, token_budget=48)
    for i, prompt in enumerate(prompts):
        driver.add(test_worker_parity.Req(i, list(prompt), len(prompt), 5, arrival=i))
    assert driver.run() == {i: reference_greedy(ref, p, 5) for i, p in enumerate(prompts)}
    assert any(shape[1] == 2 * 32 for shape in calls)  # an expert's gate/up rows went through the kernel
