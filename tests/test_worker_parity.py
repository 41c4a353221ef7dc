"""Greedy parity: ModelRunner driven by hand-built StepPlans vs transformers' generate.

A small driver plays scheduler: it admits requests over time, splits prompts
into chunks under a per-step token budget, hands out blocks from a free list,
shares full prefix blocks (as the scheduler does: only full blocks, never written
again) and resumes a
request whose outputs are already known. Each prompt's output must equal
`model.generate(do_sample=False)` run on that prompt alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from noria.protocol.config import EngineConfig
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import CachedRequestData, NewRequestData, StepPlan, StepResult
from noria.worker.model_runner import ModelRunner
from tests.tiny_models import ALL_ARCHS, load_reference, make_checkpoint, reference_greedy

GREEDY = EngineSamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class Req:
    rid: int
    tokens: list[int]
    num_prompt: int
    max_tokens: int
    arrival: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    known_to_worker: bool = False
    prefix: tuple[int, int] | None = None  # (request to share KV with, tokens shared)


class Driver:
    """A toy scheduler: FCFS, a token budget per step, refcounted blocks."""

    def __init__(self, runner: ModelRunner, token_budget: int) -> None:
        self.runner = runner
        self.bs = runner.block_size
        self.budget = token_budget
        self.free = list(range(runner.num_kv_blocks))
        self.refs: dict[int, int] = {}
        self.reqs: dict[int, Req] = {}
        self.running: list[Req] = []
        self.finished: list[int] = []
        self.step_id = 0

    def add(self, req: Req) -> None:
        self.reqs[req.rid] = req

    def _alloc(self) -> int:
        block = self.free.pop(0)
        self.refs[block] = 1
        return block

    def _release(self, req: Req) -> None:
        for block in reversed(req.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)

    def _admit(self, req: Req) -> None:
        if req.prefix is not None:
            src_id, shared = req.prefix
            src = self.reqs[src_id]
            assert src in self.running, "a prefix source must still hold its blocks"
            assert src.computed >= shared and src.tokens[:shared] == req.tokens[:shared]
            assert shared % self.bs == 0, "only full blocks are shared"
            req.blocks = src.blocks[: shared // self.bs]
            for block in req.blocks:
                self.refs[block] += 1
            req.computed = shared
        self.running.append(req)

    def step(self) -> StepResult:
        for req in sorted(self.reqs.values(), key=lambda r: r.rid):
            if req.arrival == self.step_id:
                self._admit(req)
        scheduled, new, cached = [], [], []
        budget = self.budget
        for req in self.running:
            n = min(len(req.tokens) - req.computed, budget)
            if n == 0:
                continue
            budget -= n
            added = []
            while len(req.blocks) * self.bs < req.computed + n:
                block = self._alloc()
                req.blocks.append(block)
                added.append(block)
            scheduled.append((req.rid, n))
            if not req.known_to_worker:
                new.append(NewRequestData(req.rid, list(req.tokens), list(req.blocks), req.computed,
                                          0, req.num_prompt))
                req.known_to_worker = True
            elif added:
                cached.append(CachedRequestData(req.rid, added))
        plan = StepPlan(step_id=self.step_id, scheduled=scheduled, new_requests=new,
                        cached_requests=cached, finished_req_ids=self.finished, params=[GREEDY])
        result = self.runner.execute(plan)
        self.finished = []
        expect_sampled = []
        for rid, n in scheduled:
            req = self.reqs[rid]
            req.computed += n
            if req.computed == len(req.tokens):
                expect_sampled.append(rid)
        assert result.step_id == self.step_id
        assert result.req_ids == expect_sampled  # exactly the caught-up requests, in plan order
        assert len(result.token_ids) == len(result.req_ids)
        assert result.logprobs is None
        for rid, token in zip(result.req_ids, result.token_ids, strict=True):
            req = self.reqs[rid]
            req.tokens.append(token)
            req.outputs.append(token)
            if len(req.outputs) == req.max_tokens:
                self.running.remove(req)
                self._release(req)
                self.finished.append(rid)
        self.step_id += 1
        return result

    def run(self, max_steps: int = 500) -> dict[int, list[int]]:
        while self.step_id < max_steps and (
            self.running or any(r.arrival >= self.step_id for r in self.reqs.values())
        ):
            self.step()
        assert not self.running, "driver did not finish"
        self.step()  # delivers the last finished ids
        assert sorted(self.free) == list(range(self.runner.num_kv_blocks)), "blocks leaked"
        assert not self.runner.requests, "worker kept state of finished requests"
        return {rid: r.outputs for rid, r in self.reqs.items()}


PROMPT_LENS = [1, 2, 3, 7, 15, 16, 17, 24, 31, 33, 40, 48, 57, 64, 81, 100]


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _runner(path: Path, **kw: object) -> ModelRunner:
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=80,
                          swap_space=0.001, num_threads=2, **kw)  # type: ignore[arg-type]
    runner = ModelRunner(config)
    # Stand-in for garbage in never-used memory: nothing NaN may reach an output.
    runner.kv_cache.device_cache[:, :, : runner.num_kv_blocks] = float("nan")
    return runner


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(arch, root / arch) for arch in ALL_ARCHS}


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_matches_transformers(arch: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[arch]
    ref = load_reference(path)
    prompts = _prompts(seed=len(arch))
    max_tokens = [(i * 7) % 13 + 1 for i in range(len(prompts))]
    max_tokens[12] = max_tokens[13] = 16  # prefix sources stay alive until the sharers arrive
    expected = {i: reference_greedy(ref, p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))}

    block_size = 8 if arch == "llama3" else 16
    driver = Driver(_runner(path, block_size=block_size), token_budget=64)
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        # Two arrivals every other step, so new prompts join requests mid-decode
        # and long prompts are chunked by the budget.
        driver.add(Req(i, list(prompt), len(prompt), m, arrival=(i // 2) * 2))

    # Prefix hits: reuse request 12's two full blocks, and the full blocks of request
    # 13's first 40 tokens (the tokens past the last full one are computed anew).
    extra: dict[int, tuple[list[int], int]] = {}
    g = torch.Generator().manual_seed(99)
    shared_full = 2 * block_size
    p100 = prompts[12][:shared_full] + torch.randint(3, 512, (10,), generator=g).tolist()
    p101 = prompts[13][:40] + torch.randint(3, 512, (7,), generator=g).tolist()
    driver.add(Req(100, list(p100), len(p100), 6, arrival=16, prefix=(12, shared_full)))
    driver.add(Req(101, list(p101), len(p101), 6, arrival=16, prefix=(13, 40 // block_size * block_size)))
    extra[100] = (p100, 6)
    extra[101] = (p101, 6)
    # A resumed request: prompt + 3 outputs already known, nothing computed.
    resumed_prompt = prompts[9]
    full = reference_greedy(ref, resumed_prompt, 9)
    driver.add(Req(102, resumed_prompt + full[:3], len(resumed_prompt), 9, arrival=5, outputs=full[:3]))

    got = driver.run()
    for rid, (prompt, m) in extra.items():
        expected[rid] = reference_greedy(ref, prompt, m)
    expected[102] = full
    assert {rid: got[rid] for rid in expected} == expected


@pytest.mark.parametrize(
    ("arch", "tied", "shard", "overrides"),
    [
        ("llama", True, False, {}),
        ("qwen2", False, True, {}),
        ("qwen3", True, True, {}),
        ("llama", False, False, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
        # Sliding window on the second layer only (per-layer windows).
        ("qwen2", False, False, {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1}),
    ],
    ids=["tied", "sharded", "tied-sharded", "linear-rope", "per-layer-window"],
)
def test_checkpoint_variants(arch: str, tied: bool, shard: bool, overrides: dict, tmp_path: Path) -> None:
    path = make_checkpoint(arch, tmp_path / arch, tied=tied, shard=shard, seed=3, **overrides)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    ref = load_reference(path)
    prompts = _prompts(seed=7)[::4]
    driver = Driver(_runner(path), token_budget=48)
    for i, prompt in enumerate(prompts):
        driver.add(Req(i, list(prompt), len(prompt), 5, arrival=i))
    got = driver.run()
    assert got == {i: reference_greedy(ref, p, 5) for i, p in enumerate(prompts)}


def test_decode_batch_equals_single_sequence_runs(checkpoints: dict[str, Path]) -> None:
    """The batched decode path (padding, masking) must not change any sequence's
    logits: each sequence's next-token logits match a run with it alone."""
    path = checkpoints["qwen3"]
    prompts = _prompts(seed=11)[3:9]
    runner = _runner(path)
    next_block = 0
    news = []
    for rid, prompt in enumerate(prompts):
        n = -(-len(prompt) // 16) + 1
        news.append(NewRequestData(rid, prompt, list(range(next_block, next_block + n)), 0, 0, len(prompt)))
        next_block += n
    params = [EngineSamplingParams(temperature=0.0, logprobs=5)]
    first = runner.execute(StepPlan(0, [(r.req_id, len(r.token_ids)) for r in news], new_requests=news,
                                    params=params))
    batched = runner.execute(StepPlan(1, [(r.req_id, 1) for r in news]))
    assert batched.logprobs is not None
    for i, new in enumerate(news):
        alone = _runner(path)
        tokens = new.token_ids + [first.token_ids[i]]
        single = alone.execute(StepPlan(0, [(0, len(tokens))], new_requests=[
            NewRequestData(0, tokens, new.block_ids, 0, 0, len(new.token_ids))], params=params))
        assert single.token_ids[0] == batched.token_ids[i]
        assert single.logprobs is not None
        a, b = single.logprobs[0], batched.logprobs[i]
        assert a is not None and b is not None
        assert a.top_token_ids == b.top_token_ids
        assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)


def test_plan_errors_are_clear(checkpoints: dict[str, Path]) -> None:
    runner = _runner(checkpoints["llama"])
    with pytest.raises(KeyError, match="request 5"):
        runner.execute(StepPlan(0, [(5, 1)]))
    with pytest.raises(ValueError, match="block id out of range"):
        runner.execute(StepPlan(1, [(1, 3)], new_requests=[NewRequestData(1, [5, 6, 7], [10_000], 0, 0, 3)],
                                      params=[GREEDY]))
    with pytest.raises(ValueError, match="needs 2 blocks"):
        runner.execute(StepPlan(2, [(2, 20)], new_requests=[NewRequestData(2, list(range(3, 23)), [0], 0, 0, 20)],
                                      params=[GREEDY]))
    # The worker still serves after a bad plan.
    with pytest.raises(ValueError, match="params entry 1"):
        runner.execute(StepPlan(3, [(4, 3)], new_requests=[NewRequestData(4, [5, 6, 7], [1], 0, 1, 3)],
                                params=[GREEDY]))
    ok = runner.execute(StepPlan(3, [(3, 3)], new_requests=[NewRequestData(3, [5, 6, 7], [1], 0, 0, 3)],
                                 params=[GREEDY]))
    assert ok.req_ids == [3]


def test_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported model architecture"):
        ModelRunner(EngineConfig(model=str(tmp_path), num_kv_blocks=4, swap_space=0))


def test_missing_weights_are_reported(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = make_checkpoint("llama", tmp_path / "llama")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights for: layers\.1\.mlp\.gate_up_proj"):
        ModelRunner(EngineConfig(model=str(path), num_kv_blocks=4, swap_space=0))


def test_sizes(checkpoints: dict[str, Path]) -> None:
    runner = ModelRunner(EngineConfig(model=str(checkpoints["qwen3"]), device="cpu", max_num_seqs=3, swap_space=0.001,
                                      preemption_mode="swap"))
    # qwen3 tiny: 2 layers, 2 KV heads, head_dim 32, float32 -> 16 KiB per 16-token block.
    assert runner.block_size == 16
    assert runner.max_model_len == 512
    assert runner.vocab_size == 512
    assert runner.num_kv_blocks == 3 * (512 // 16)
    assert runner.num_cpu_blocks == int(0.001 * (1 << 30)) // (2 * 2 * 16 * 2 * 32 * 4)
    runner = ModelRunner(EngineConfig(model=str(checkpoints["qwen3"]), device="cpu", kv_cache_memory=0.001, swap_space=0,
                                      max_model_len=100))
    assert runner.max_model_len == 100
    assert runner.num_kv_blocks == int(0.001 * (1 << 30)) // (2 * 2 * 16 * 2 * 32 * 4)
    assert runner.num_cpu_blocks == 0


def test_dtype_and_device_resolution() -> None:
    from noria.worker.device import resolve_device, resolve_dtype

    cpu = torch.device("cpu")
    # The checkpoint's dtype as config.json names it (ModelSpec.dtype).
    # auto on a CPU follows the CPU's bf16 support and memory: tests/test_dtype_auto.py.
    assert resolve_dtype("auto", cpu, "float32") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), "float64") == torch.float32
    assert resolve_dtype("bf16", cpu, None) == torch.bfloat16
    assert resolve_dtype("half", cpu, None) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", cpu, None)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
