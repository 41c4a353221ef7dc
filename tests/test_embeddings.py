"""Embeddings (`--runner pooling`): the engine's vectors against transformers' `AutoModel` on the
same random float32 checkpoint (its `last_hidden_state` pooled and normalized, within 1e-4) for
last, mean and cls pooling and a sentence-transformers pooling config; prompts longer than the
step's token budget (chunked prefill), many inputs at once, preemption, prefix caching; every
block free afterwards; and the scheduler's side against a fake worker that checks the rules a
pooling request lives by."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch

from noria import LLM, SamplingParams
from noria.protocol.config import EngineConfig
from noria.protocol.engine import EngineRequest
from noria.protocol.errors import NoriaError
from noria.protocol.pooling import PoolingSpec, pooling_spec
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import StepPlan, StepResult
from noria.scheduler.scheduler import Scheduler
from tests.tiny_models import make_checkpoint

TOL = 1e-4


def with_tokenizer(ckpt: Path, demo_path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (demo_path / name).exists():
            shutil.copy(demo_path / name, ckpt / name)
    return ckpt


def reference(path: Path, prompts: list[list[int]], mode: str, normalize: bool = True) -> list[torch.Tensor]:
    """transformers' final hidden states (after the model's final norm), pooled one prompt at a time."""
    from transformers import AutoModel
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            h = model(torch.tensor([p])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode]
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def assert_close(got: list[list[float]], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        diff = (torch.tensor(g, dtype=torch.float64) - w.double()).abs().max().item()
        assert diff < TOL, f"input {i}: max difference {diff}"


def prompts_for(seed: str, count: int, longest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(1, longest))] for _ in range(count)]


# ---- through the whole engine (LLM: real scheduler and worker processes) -------------------------


@pytest.mark.parametrize(("arch", "mode"), [("qwen3", "last"), ("llama", "mean"), ("qwen2", "cls")])
def test_llm_embed_matches_transformers(arch, mode, tmp_path, demo_path):
    ckpt = with_tokenizer(make_checkpoint(arch, tmp_path / arch), demo_path)
    # Many inputs, several longer than the 32-token step budget (chunked over steps); the same
    # long prompt twice, so that the second could hit the prefix cache the first filled.
    prompts = prompts_for(arch, 24, 120)
    prompts.append(list(prompts[0]) if len(prompts[0]) > 40 else [7] * 90)
    prompts.append(list(prompts[-1]))
    # Few blocks, swap preemption and async scheduling (a step planned while finished requests
    # still hold their blocks): prompts are preempted mid-prefill; mean and cls must compute
    # every position again, last may swap.
    flags = dict(dtype="float32", max_num_seqs=6, max_num_batched_tokens=48, num_kv_blocks=9, block_size=16,
                 preemption_mode="swap", async_scheduling=True)
    with LLM(str(ckpt), runner="pooling", pooling=mode, **flags) as llm:
        got = llm.embed(prompts, use_tqdm=False)
        again = llm.embed(prompts[-1])
        stats = llm.stats()
    want = reference(ckpt, prompts, mode)
    assert_close(got, want)
    assert_close(again, want[-1:])  # alone, after its blocks went to the prefix cache
    print("preemptions", stats.num_preemptions, "swap outs", stats.num_swap_outs)
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_kv_blocks == 9 and stats.blocks_consistent
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.generation_tokens == 0


def test_sentence_transformers_pooling_config(tmp_path, demo_path):
    """No --pooling: the checkpoint's modules.json and 1_Pooling/config.json decide (mean here),
    and without a Normalize module the vector is not normalized (nor after `dimensions` cuts it)."""
    ckpt = with_tokenizer(make_checkpoint("qwen3", tmp_path / "st"), demo_path)
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (ckpt / "1_Pooling").mkdir()
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    prompts = prompts_for("st", 5, 70)
    with LLM(str(ckpt), runner="pooling", dtype="float32", max_num_batched_tokens=32, num_kv_blocks=32) as llm:
        got = llm.embed(prompts, use_tqdm=False)
        short = llm.embed(prompts, dimensions=8, use_tqdm=False)
        with pytest.raises(NoriaError) as e:
            llm.embed("hello", dimensions=65)
        assert e.value.param == "dimensions" and "64" in e.value.message
    want = reference(ckpt, prompts, "mean", normalize=False)
    assert_close(got, want)
    assert_close(short, [w[:8] for w in want])


def test_llm_wrong_runner_and_lengths(tmp_path, demo_path):
    with LLM(str(demo_path), runner="pooling", max_model_len=64, num_kv_blocks=16) as llm:
        with pytest.raises(NoriaError) as e:
            llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert e.value.code == "invalid_request" and "pooling runner" in e.value.message
        # A pooling request needs no room for an output token: max_model_len tokens fit, one more does not.
        assert len(llm.embed([[5] * 64])[0]) == len(llm.embed("hi")[0])
        with pytest.raises(NoriaError) as e:
            llm.embed([[5] * 65])
        assert e.value.code == "prompt_too_long" and "64" in e.value.message
        assert llm.stats().num_free_blocks == 16
    with LLM(str(demo_path), num_kv_blocks=16) as llm:
        with pytest.raises(NoriaError) as e:
            llm.embed("hello")
        assert e.value.code == "invalid_request" and "generate runner" in e.value.message


# ---- the pooling spec -------------------------------------------------------------------------------


def _st_folder(path: Path, pooling: dict | None, normalize: bool) -> Path:
    path.mkdir()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    return path


def test_pooling_spec_reads_sentence_transformers_files(tmp_path):
    assert pooling_spec(tmp_path) == PoolingSpec("last", True)  # no files: last token, normalized
    assert pooling_spec(tmp_path, "cls") == PoolingSpec("cls", True)
    last = _st_folder(tmp_path / "a", {"pooling_mode_lasttoken": True}, normalize=True)
    assert pooling_spec(last) == PoolingSpec("last", True)
    assert pooling_spec(last, "mean") == PoolingSpec("mean", True)  # the flag wins
    cls = _st_folder(tmp_path / "b", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False)
    assert pooling_spec(cls) == PoolingSpec("cls", False)
    assert pooling_spec(_st_folder(tmp_path / "c", None, True)) == PoolingSpec("last", True)
    with pytest.raises(ValueError, match="max_tokens pooling"):
        pooling_spec(_st_folder(tmp_path / "d", {"pooling_mode_max_tokens": True}, True))


# ---- the scheduler against a fake pooling worker -------------------------------------------------------


class FakePoolingWorker:
    """Mirrors what a pooling worker holds per request and checks each plan against it: a mean
    request's positions must all be computed by it, in order (no prefix hit, no swap). Its
    "embedding" of a prompt is (sum of its token ids, its length)."""

    def __init__(self) -> None:
        self.reqs: dict[int, list] = {}  # req_id -> [token ids, computed, sum so far]

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in plan.new_requests:
            assert new.num_computed_tokens == 0, f"request {new.req_id} comes with positions it did not compute"
            self.reqs[new.req_id] = [list(new.token_ids), 0, 0]
        ids, vectors = [], []
        for rid, n in plan.scheduled:
            r = self.reqs[rid]
            r[2] += sum(r[0][r[1]:r[1] + n])
            r[1] += n
            assert r[1] <= len(r[0])
            if r[1] == len(r[0]):
                ids.append(rid)
                vectors.append(struct.pack("<2f", r[2], r[1]))
        return StepResult(plan.step_id, [], [], pooled_req_ids=ids, pooled=vectors, epoch=plan.epoch)


def _pooling_scheduler(num_blocks: int, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=4, runner="pooling", pooling="mean", max_num_batched_tokens=16, **kw)
    return Scheduler(cfg, num_blocks, 256)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scheduler_pooling_requests_end_once_with_their_vector(async_scheduling):
    s = _pooling_scheduler(12, preemption_mode="swap", max_num_seqs=5, async_scheduling=async_scheduling)
    w = FakePoolingWorker()
    rng = random.Random(1)
    prompts = {i: [rng.randrange(1, 50) for _ in range(rng.randint(1, 40))] for i in range(30)}
    prompts[30] = list(prompts[0])  # a repeat: the prefix cache holds its blocks by then, maybe
    for i, p in prompts.items():
        s.add_request(EngineRequest(i, p, EngineSamplingParams(max_tokens=None), [2]))
    done: dict[int, bytes] = {}
    in_flight: list[StepResult] = []
    for _ in range(10_000):
        for u in s.take_updates():
            assert u.req_id not in done and u.finish_reason == "stop" and u.new_token_ids == []
            assert u.embedding is not None
            done[u.req_id] = u.embedding
        if not s.has_work() and not in_flight:
            break
        in_flight.append(w.execute(s.schedule()))
        if not async_scheduling or len(in_flight) == 2 or not s.has_work():
            s.update_from_result(in_flight.pop(0))
    assert sorted(done) == sorted(prompts)
    for i, p in prompts.items():
        assert struct.unpack("<2f", done[i]) == (sum(p), len(p))
    # Prefill-only requests are preempted only while finished ones still hold their blocks:
    # with a step planned ahead of its predecessor's result.
    assert s.stats.num_preemptions > 0 or not async_scheduling
    assert s.check_blocks() is None and s.kv.pool.num_free == s.kv.pool.num_blocks
    assert not s.requests and s.stats.generation_tokens == 0


def test_scheduler_pooling_abort_after_plan_gets_no_vector():
    s = _pooling_scheduler(16)
    s.add_request(EngineRequest(0, [3] * 10, EngineSamplingParams(max_tokens=None), [2]))
    w = FakePoolingWorker()
    result = w.execute(s.schedule())
    assert result.pooled_req_ids == [0]
    s.abort([0])
    s.update_from_result(result)
    updates = s.take_updates()
    assert [(u.req_id, u.finish_reason, u.embedding) for u in updates] == [(0, "abort", None)]
    assert s.kv.pool.num_free == 16 and s.check_blocks() is None


def test_scheduler_pooling_prompt_may_fill_max_model_len():
    s = _pooling_scheduler(64)
    s.add_request(EngineRequest(0, [3] * 256, EngineSamplingParams(max_tokens=None), [2]))
    s.add_request(EngineRequest(1, [3] * 257, EngineSamplingParams(max_tokens=None), [2]))
    errors = {u.req_id: u.error_code for u in s.take_updates()}
    assert errors == {1: "prompt_too_long"}
    assert 0 in s.requests
