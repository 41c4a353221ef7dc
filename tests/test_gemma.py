"""Gemma 2 and Gemma 3 (text) against transformers.

The tiny checkpoints (tests/tiny_models.py: `_gemma_config`) alternate sliding-window and
global layers with a window of 20 tokens, shorter than most prompts here; Gemma 2 soft-caps
attention logits at 1.0, which changes the greedy tokens (without the cap they differ), and
both soft-cap the final logits at 3.0, which no argmax shows, so the logprobs are compared.
Norm weights are random, so a (1 + w) norm that forgot its 1 or sits in the wrong place shows.

* the worker driven by hand-built plans (the toy scheduler of test_worker_parity: chunked
  prefill, requests boarding mid-decode, prefix hits, a resumed request) on both attention
  paths of the CPU, the native paged kernel and torch (SDPA, or the soft-capped attention),
  and on the CUDA kernels under the CPU emulator;
* logprobs in float32 with the final soft-cap;
* the whole engine (real processes) with preemption, prefix hits and chunked prefill, in
  float32 token for token and in bfloat16 within test_engine_half's logprob tolerance;
* tensor parallelism over two ranks;
* the config facts (spec) and the checkpoint pre-check.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from noria import LLM, SamplingParams
from noria.protocol.checkpoint import CheckpointError, check_checkpoint
from noria.protocol.config import EngineConfig
from noria.protocol.model_spec import model_spec
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import NewRequestData, StepPlan, StepResult
from noria.worker import native_stack
from noria.worker.attention_select import EMULATED_KERNELS_ENV
from noria.worker.model_runner import ModelRunner
from tests.test_engine_half import _reference_logprobs, _tolerance
from tests.test_engine_parity import _hf_greedy
from tests.test_worker_parity import Driver, Req, _prompts, _runner
from tests.tiny_models import (
    GEMMA_ARCHS,
    load_reference,
    make_checkpoint,
    reference_greedy,
    tiny_config,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, demo_path: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    out = {}
    for arch in GEMMA_ARCHS:
        path = make_checkpoint(arch, root / arch, tied=True, seed=2)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (demo_path / name).exists():
                shutil.copy(demo_path / name, path / name)
        out[arch] = path
    return out


@pytest.mark.parametrize("attention", ["native", "torch", "emulated-kernels"])
@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_greedy_matches_transformers(arch: str, attention: str, checkpoints: dict[str, Path],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoints[arch]
    if attention == "emulated-kernels":
        # The GPU's path under the CPU emulator: the CUDA attention kernels with their window and
        # soft-cap arguments, and the fused rotary and add + RMSNorm kernels (1 + w weights).
        monkeypatch.setenv(EMULATED_KERNELS_ENV, "1")
    else:
        monkeypatch.delenv(EMULATED_KERNELS_ENV, raising=False)
    ref = load_reference(path)
    prompts = _prompts(seed=5)[::2]  # 1 to 81 tokens: most longer than the 20-token window
    max_tokens = [(i * 5) % 11 + 2 for i in range(len(prompts))]
    max_tokens[5] = max_tokens[6] = 14  # prefix sources stay alive until the sharers arrive
    expected = {i: reference_greedy(ref, p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))}

    runner = _runner(path)
    if attention == "emulated-kernels":
        assert (runner.attention_choice.name, runner.attention_choice.reason) == ("kernels", "")
    else:
        # "torch": decode rows gathered for SDPA (or the soft-capped attention), prefills one call per sequence.
        runner.attention.native = attention == "native"
    driver = Driver(runner, token_budget=40)  # prompts over 40 tokens are chunked
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        driver.add(Req(i, list(prompt), len(prompt), m, arrival=i))
    # Prefix hits on requests 5 (40 tokens) and 6 (57): their first full blocks, then new tokens.
    g = torch.Generator().manual_seed(9)
    extra = {100: prompts[5][:32] + torch.randint(3, 512, (9,), generator=g).tolist(),
             101: prompts[6][:48] + torch.randint(3, 512, (30,), generator=g).tolist()}
    driver.add(Req(100, list(extra[100]), len(extra[100]), 5, arrival=12, prefix=(5, 32)))
    driver.add(Req(101, list(extra[101]), len(extra[101]), 5, arrival=12, prefix=(6, 48)))
    # A resumed request: its prompt and 4 outputs known, none of it computed.
    resumed = prompts[7]
    full = reference_greedy(ref, resumed, 8)
    driver.add(Req(102, resumed + full[:4], len(resumed), 8, arrival=3, outputs=full[:4]))

    got = driver.run()
    stack = runner.model._stack
    if attention == "native":  # decode steps and short prefills ran on the native decoder stack
        assert stack is not None and stack.layer_runs > 0
    for rid, prompt in extra.items():
        expected[rid] = reference_greedy(ref, prompt, 5)
    expected[102] = full
    assert {rid: got[rid] for rid in expected} == expected


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_logprobs_match_transformers_with_the_final_soft_cap(arch: str, checkpoints: dict[str, Path]) -> None:
    """The final soft-cap (3.0) squashes the logits: the top-5 logprobs of the first sampled token
    match transformers' capped ones and are far from the uncapped ones."""
    path = checkpoints[arch]
    ref = load_reference(path)
    runner = _runner(path)
    prompts = _prompts(seed=8)[5:12:3]
    news, block = [], 0
    for rid, prompt in enumerate(prompts):
        n = -(-len(prompt) // 16)
        news.append(NewRequestData(rid, prompt, list(range(block, block + n)), 0, 0, len(prompt)))
        block += n
    result = runner.execute(StepPlan(0, [(r.req_id, len(r.token_ids)) for r in news], new_requests=news,
                                     params=[EngineSamplingParams(temperature=0.0, logprobs=5)]))
    assert result.logprobs is not None
    for prompt, got in zip(prompts, result.logprobs, strict=True):
        assert got is not None
        with torch.inference_mode():
            logits = ref(torch.tensor([prompt])).logits[0, -1].double()
        want = torch.log_softmax(logits, -1)
        top = torch.topk(want, 5)
        assert got.top_token_ids == top.indices.tolist()
        assert got.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        cap = ref.config.final_logit_softcapping
        uncapped = torch.log_softmax(torch.atanh(logits / cap) * cap, -1)[top.indices]
        assert (uncapped - top.values).abs().max() > 0.1


def _engine_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 36-70 tokens, most sharing a 32-token system prompt (prefix hits)."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 500) for _ in range(32)]
    prompts = [system + [rng.randrange(5, 500) for _ in range(rng.randint(4, 38))] for _ in range(6)]
    prompts.append([rng.randrange(5, 500) for _ in range(50)])
    params = [SamplingParams(max_tokens=rng.randint(6, 16), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize(("arch", "mode"), [("gemma2", "recompute"), ("gemma3", "swap")])
def test_engine_greedy_with_preemption_prefix_hits_and_chunks(arch: str, mode: str,
                                                             checkpoints: dict[str, Path]) -> None:
    path = checkpoints[arch]
    prompts, params = _engine_workload(len(arch) + len(mode))
    with LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=24, num_kv_blocks=12,
             block_size=16, preemption_mode=mode, swap_space=0.01) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert stats.prefix_cache_hits > 0
    assert (stats.num_preemptions if mode == "recompute" else stats.num_swap_outs) > 0, stats
    assert stats.blocks_consistent and stats.num_free_blocks == stats.num_kv_blocks
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out == _hf_greedy(str(path), prompt, p.max_tokens), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_bfloat16_engine_matches_transformers_logprobs(arch: str, checkpoints: dict[str, Path]) -> None:
    """test_engine_half's comparison (teacher-forced, 8 bfloat16 ulps) on Gemma, whose norms
    compute in float32 and round once where a Llama norm rounds before its weight."""
    path = checkpoints[arch]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 30, 61)]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=32,
             block_size=16) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    tol = _tolerance(torch.bfloat16)
    for prompt, out in zip(prompts, outs, strict=True):
        done = out.outputs[0]
        assert len(done.token_ids) == 10 and done.logprobs is not None
        ref = _reference_logprobs(path, torch.bfloat16, prompt, done.token_ids)
        ids = torch.tensor(done.token_ids)
        ref_chosen = ref[torch.arange(len(ids)), ids]
        got = torch.tensor([lp.logprob for lp in done.logprobs])
        assert (got - ref_chosen).abs().max().item() <= tol, (got, ref_chosen)
        assert (ref.max(-1).values - ref_chosen).max().item() <= tol


def test_tensor_parallel_matches_one_rank_and_transformers(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Gemma 2 over two ranks (one KV head each; soft-capped attention per rank, the final cap
    after the vocab-parallel logits are gathered): test_worker_tp's driver and checks."""
    from tests.test_worker_tp import MAX_TOKENS, _drive, _run_ranks
    from tests.test_worker_tp import _prompts as tp_prompts

    path = checkpoints["gemma2"]
    single, single_logits = _drive(_runner(path), 512)
    ref = load_reference(path)
    expected = {i: reference_greedy(ref, p, m) for i, (p, m) in enumerate(zip(tp_prompts(512), MAX_TOKENS,
                                                                                strict=True))}
    assert single == expected
    ranks = _run_ranks(path, 2, 512, tmp_path)
    for rank, got in enumerate(ranks):
        assert got["outputs"] == expected, f"rank {rank}"
        assert got["num_heads"] == 2 and got["kv_cache_shape"][4:] == (1, 32)
        assert got["packed_ok"]
    for step, (a, b) in enumerate(zip(ranks[0]["logits"], single_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_the_start_up_line_says_the_native_stack_is_on(arch: str, checkpoints: dict[str, Path],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="noria.worker"):
        runner = ModelRunner(EngineConfig(model=str(checkpoints[arch]), dtype="float32", device="cpu",
                                          num_kv_blocks=8, swap_space=0))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("native CPU stack: ")]
    assert lines == ["native CPU stack: on for all 3 layers"]
    assert native_stack.describe(native_stack.coverage(runner.model, runner._kv_layers)) == lines[0]


def _greedy_steps(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[StepResult]:
    """Every prompt in one step (as rows of the paged kernel: 40 tokens at most), then
    decode steps; greedy with the top-5 logprobs (of the soft-capped logits) of every sample."""
    news, block = [], 0
    for rid, prompt in enumerate(prompts):
        n = -(-(len(prompt) + steps) // runner.block_size)
        news.append(NewRequestData(rid, prompt, list(range(block, block + n)), 0, 0, len(prompt)))
        block += n
    plan = StepPlan(0, [(r.req_id, len(r.token_ids)) for r in news], new_requests=news,
                    params=[EngineSamplingParams(temperature=0.0, logprobs=5)])
    results = []
    for step in range(steps):
        results.append(runner.execute(plan))
        plan = StepPlan(step + 1, [(r.req_id, 1) for r in news])
    return results


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_native_stack_on_and_off_give_the_same_tokens_and_logprobs(arch: str,
                                                                   checkpoints: dict[str, Path]) -> None:
    """The worker with the native decoder stack and with its layers in Python (the same kernels
    called one by one): the same tokens and the same logprobs, bit for bit, over prompts and
    decode steps; with it on, the stack ran every layer of every step."""
    prompts = _prompts(seed=11)[2:11:2]  # 3 to 40 tokens: sliding (window 20) and global layers differ
    on = _runner(checkpoints[arch])
    off = _runner(checkpoints[arch])
    off.model._native_stack = lambda *a: None  # type: ignore[method-assign]
    steps = 6
    got_on, got_off = _greedy_steps(on, prompts, steps), _greedy_steps(off, prompts, steps)
    assert got_on == got_off
    assert all(len(r.req_ids) == len(prompts) and r.logprobs for r in got_on)
    stack = on.model._stack
    assert stack is not None and stack.layer_runs == steps * len(on.model.layers)
    assert off.model._stack is None


def test_spec_reads_gemma_configs() -> None:
    from transformers import Gemma3TextConfig

    g2 = model_spec(tiny_config("gemma2", tied=True))
    assert g2.attn_softcap == 1.0 and g2.final_softcap == 3.0
    assert g2.sliding_windows == (20, None, 20) and g2.head_dim == 32 and not g2.qk_norm
    assert g2.scale == 24**-0.5 and g2.local_rope is None
    assert (g2.norm, g2.sandwich_norms, g2.activation, g2.embed_scale) == ("rms_one_plus", True, "gelu_tanh", True)
    # A Gemma 3 config as older checkpoints write it: rope_theta / rope_local_base_freq and a
    # sliding_window_pattern instead of layer_types; attn_logit_softcapping, which transformers
    # never applies in Gemma 3, stays off.
    old = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           sliding_window_pattern=3, rope_theta=5e5, rope_local_base_freq=1e3,
                           rope_scaling={"rope_type": "linear", "factor": 8.0}, attn_logit_softcapping=50.0)
    g3 = model_spec(old)
    assert g3.architecture == "Gemma3ForCausalLM" and g3.qk_norm
    assert g3.sliding_windows == (8, 8, None, 8, 8, None, 8)
    assert (g3.rope.theta, g3.rope.rope_type, g3.rope.factor) == (5e5, "linear", 8.0)
    assert g3.local_rope is not None
    assert (g3.local_rope.theta, g3.local_rope.rope_type) == (1e3, "default")
    assert g3.attn_softcap is None and g3.final_softcap is None
    with pytest.raises(ValueError, match="bidirectional"):
        model_spec(Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="unsupported activation"):
        model_spec(tiny_config("gemma2", hidden_activation="relu"))


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_checkpoint_precheck_knows_gemma_tensors(arch: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(arch, tmp_path / arch, tied=True)
    check_checkpoint(path)  # no lm_head: tied
    cfg = json.loads((path / "config.json").read_text())
    del cfg["tie_word_embeddings"]  # transformers' Gemma default: tied
    (path / "config.json").write_text(json.dumps(cfg))
    check_checkpoint(path)
    weights = load_file(path / "model.safetensors")
    gone = "self_attn.q_norm.weight" if arch == "gemma3" else "post_feedforward_layernorm.weight"
    del weights[f"model.layers.2.{gone}"]
    weights["model.layers.0.pre_feedforward_layernorm.weight"] = torch.ones(65)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"pre_feedforward_layernorm.weight has shape \(65,\)"):
        check_checkpoint(path)
    weights["model.layers.0.pre_feedforward_layernorm.weight"] = torch.ones(64)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"layers.2.{gone}"):
        check_checkpoint(path)
