"""MTP speculation (`{"method": "mtp", "num_speculative_tokens": k}`): a MiMo checkpoint (Qwen2's
decoder, `num_nextn_predict_layers` 1, `model.mtp_layers.0.*` beside it; seeded random weights)
drafts for itself with its MTP layer, read by the real loading code.

The layer's proposals are compared with a float64 reference written here from the published
layout alone: transformers' Qwen2 over the same decoder weights for the target's output (after its
final norm), then cat[hidden_layernorm(h), token_layernorm(embedding)] (the embedding at position
0 zeroed), input_proj, one Qwen2 decoder layer with full causal attention recomputed from scratch,
final_layernorm, the target's lm_head, argmax; each further token from the previous output. The
worker's path (its own paged KV, filled after each target step over prompt chunks, decodes and
verified rows, then k passes) must give the same tokens. Through the whole engine the outputs
equal transformers' and speculation off, token for token, with preemption by recompute and by
swap and with prefix caching; what it cannot serve is refused in one sentence.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from noria import LLM, SamplingParams
from noria.protocol.config import EngineConfig
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.speculative import Draft, SpeculativeConfig
from noria.protocol.step import NewRequestData, StepPlan
from noria.worker.model_runner import ModelRunner
from tests.test_async_scheduling import _run
from tests.test_engine_parity import _hf_greedy, _with_tokenizer
from tests.test_spec_decode import PREEMPTIONS, _mix
from tests.tiny_models import MTP, add_mtp_layer, make_checkpoint


def make_mimo(qwen2: Path, path: Path) -> Path:
    """`qwen2`'s files as a MiMo checkpoint, with an MTP layer."""
    shutil.copytree(qwen2, path)
    return add_mtp_layer(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, demo_path: Path) -> tuple[Path, Path]:
    """A four-layer Qwen2 (transformers' reference) and the same decoder as a MiMo with an MTP layer."""
    root = tmp_path_factory.mktemp("mtp")
    qwen2 = _with_tokenizer(make_checkpoint("qwen2", root / "qwen2", num_hidden_layers=4, vocab_size=706),
                            demo_path)
    return qwen2, make_mimo(qwen2, root / "mimo")


def _mtp(k: int = 3) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


# -- the reference ------------------------------------------------------------------------


class _Reference:
    """The MTP layer in float64 over a whole sequence, attention recomputed from every key."""

    def __init__(self, qwen2: Path, mimo: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        cfg = json.loads((mimo / "config.json").read_text())
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg["rms_norm_eps"]
        rope = cfg.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        self.t = {k.removeprefix(MTP): v.double() for k, v in load_file(mimo / "model-mtp.safetensors").items()
                  if k.startswith(MTP)}
        self.target = AutoModelForCausalLM.from_pretrained(str(qwen2), dtype=torch.float64).eval()
        self.embed = self.target.model.embed_tokens.weight.detach()
        self.lm_head = self.target.lm_head.weight.detach()

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = pos[:, None].double() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + half * sin

    def layer(self, tokens: list[int], hidden: torch.Tensor, pos: torch.Tensor,
              keys: list[torch.Tensor]) -> torch.Tensor:
        t, rms = self.t, self._rms
        emb = self.embed[tokens] * (pos != 0)[:, None]
        x = torch.cat([rms(hidden, t["hidden_layernorm.weight"]), rms(emb, t["token_layernorm.weight"])], -1)
        x = x @ t["input_proj.weight"].T
        a = rms(x, t["input_layernorm.weight"])
        n_q, heads, kv, hd = len(tokens), self.heads, self.kv, self.hd

        def proj(name: str, n: int) -> torch.Tensor:
            return (a @ t[f"self_attn.{name}.weight"].T + t[f"self_attn.{name}.bias"]).view(n_q, n, hd)

        q, k, v = self._rope(proj("q_proj", heads), pos), self._rope(proj("k_proj", kv), pos), proj("v_proj", kv)
        keys[0], keys[1] = torch.cat([keys[0], k]), torch.cat([keys[1], v])
        kk, vv = keys[0].repeat_interleave(heads // kv, 1), keys[1].repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / hd**0.5
        n = kk.shape[0]
        scores = scores.masked_fill(torch.arange(n)[None, :] > (n - n_q + torch.arange(n_q))[:, None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(n_q, heads * hd)
        h = attn @ t["self_attn.o_proj.weight"].T + x
        m = rms(h, t["post_attention_layernorm.weight"])
        h = (F.silu(m @ t["mlp.gate_proj.weight"].T) * (m @ t["mlp.up_proj.weight"].T)) @ t["mlp.down_proj.weight"].T + h
        return rms(h, t["final_layernorm.weight"])

    def token(self, out: torch.Tensor) -> int:
        return int((out @ self.lm_head.T).argmax())

    def output(self, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layer's output at the last position the target has computed (all but the last
        token of `tokens`), and its keys and values so far."""
        with torch.no_grad():
            hidden = self.target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        keys = [torch.zeros(0, self.kv, self.hd, dtype=torch.float64)] * 2
        return self.layer(tokens[1:], hidden, torch.arange(len(tokens) - 1), keys)[-1:], keys

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The layer's k proposals after `tokens`, all but the last of which the target has computed."""
        out, keys = self.output(tokens)
        proposals = [self.token(out[0])]
        for step in range(1, k):
            out = self.layer(proposals[-1:], out, torch.tensor([len(tokens) - 2 + step]), keys)
            proposals.append(self.token(out[0]))
        return proposals


def test_mtp_proposals_equal_a_float64_reference(pair: tuple[Path, Path]) -> None:
    """A prompt in two chunks, then two decodes, the second verifying a draft, then the request's
    worker state rebuilt: after each, the layer's proposals are the reference's over its tokens."""
    qwen2, mimo = pair
    ref = _Reference(qwen2, mimo)
    runner = ModelRunner(EngineConfig(model=str(mimo), dtype="float32", num_kv_blocks=32, block_size=16,
                                      num_threads=2, speculative_config=SpeculativeConfig(**_mtp())))
    rng = random.Random(4)
    prompt = [rng.randrange(5, 700) for _ in range(40)]
    new = NewRequestData(0, prompt, [3, 1, 4, 5], 0, 0, len(prompt))
    greedy = [EngineSamplingParams(temperature=0.0)]
    runner.execute(StepPlan(0, [(0, 25)], new_requests=[new], params=greedy))
    runner.execute(StepPlan(1, [(0, 15)], params=greedy))
    state = runner.requests[0]
    # The output itself, not only its argmax (a wrong zero at position 0 moves it a little).
    position, out = runner.drafter.last[0]
    assert position == len(state.token_ids) - 2
    torch.testing.assert_close(out.double(), ref.output(state.token_ids)[0][0], atol=2e-5, rtol=0)
    for step in (2, 3):
        proposals = runner.drafter.propose([(state, 3)])[0]
        assert proposals == ref.drafts(state.token_ids, 3), f"after {len(state.token_ids)} tokens"
        draft = [Draft(0, proposals[:2])] if step == 3 else []
        runner.execute(StepPlan(step, [(0, 1 + sum(len(d.token_ids) for d in draft))], drafts=draft, params=greedy))
    assert runner.drafter.propose([(state, 4)])[0] == ref.drafts(state.token_ids, 4)
    # Swapped out and back in: the worker rebuilds the request's state and computes nothing; the
    # layer still has its output (and its KV moved with the blocks).
    tokens = list(state.token_ids)
    other = NewRequestData(1, prompt[:10], [6], 0, 0, 10)  # a step runs while it is out
    runner.execute(StepPlan(4, [(1, 10)], finished_req_ids=[0], new_requests=[other], params=greedy))
    runner.execute(StepPlan(5, [], new_requests=[
        NewRequestData(0, tokens, [3, 1, 4, 5], len(tokens) - 1, 0, len(prompt))], params=greedy))
    assert runner.requests[0] is not state
    assert runner.drafter.propose([(runner.requests[0], 3)])[0] == ref.drafts(tokens, 3)


def test_outputs_equal_speculation_off_and_transformers(pair: tuple[Path, Path]) -> None:
    qwen2, mimo = pair
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(2, 40) if i else 40)] for i in range(6)]
    # Shared prefixes: cached blocks hold the layer's KV too (it ran over every computed token).
    prompts += [prompts[0][:34] + [7, 8], prompts[0][:34] + [9]]
    max_new = [rng.randint(8, 30) for _ in prompts]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    with LLM(str(mimo), dtype="float32", max_num_seqs=4, enable_prefix_caching=True,
             speculative_config=_mtp()) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        st = llm.stats()
    for p, m, out in zip(prompts, max_new, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(str(qwen2), p, m), f"prompt of {len(p)} tokens"
    assert st.spec_drafts > 0 and st.prefix_cache_hits > 0, st
    assert st.blocks_consistent and st.num_free_blocks == st.num_kv_blocks


@PREEMPTIONS
def test_sampling_mix_equals_speculation_off(pair: tuple[Path, Path], flags: dict) -> None:
    """tests/test_spec_decode.py's mix (seeds, penalties, n > 1, logprobs, stops, structured
    output) with and without the MTP layer."""
    _, mimo = pair
    results, stats = {}, {}
    for spec in (None, _mtp(2)):
        with LLM(str(mimo), dtype="float32", speculative_config=spec, max_num_seqs=8, **flags) as llm:
            results[spec is not None] = _run(llm, *_mix())
            stats[spec is not None] = llm.stats()
    assert results[True][0] == results[False][0]
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-4)
    assert stats[True].spec_drafts > 0, stats[True]
    if "preemption_mode" in flags:
        assert stats[True].num_preemptions > 0, stats[True]
    for st in stats.values():
        assert st.blocks_consistent and st.num_free_blocks == st.num_kv_blocks and st.num_running == 0


def test_what_mtp_cannot_serve_is_refused_in_one_sentence(pair: tuple[Path, Path], tmp_path: Path) -> None:
    qwen2, mimo = pair
    with pytest.raises(ValueError, match="needs MTP layers in the served checkpoint .* Qwen2ForCausalLM has none"):
        LLM(str(qwen2), speculative_config=_mtp())
    with pytest.raises(ValueError, match="drafts with the served model's own MTP layers; drop model"):
        LLM(str(mimo), speculative_config={**_mtp(), "model": str(qwen2)})
    with pytest.raises(ValueError, match="drafts on one rank"):
        LLM(str(mimo), tensor_parallel_size=2, speculative_config=_mtp())
    # A checkpoint that names an MTP layer it lacks fails at load, naming the tensor.
    broken = shutil.copytree(qwen2, tmp_path / "broken")
    cfg = json.loads((broken / "config.json").read_text())
    cfg.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="missing weights for: mtp_layers.0"):
        LLM(str(broken), speculative_config=_mtp())


def test_bfloat16_equals_speculation_off(pair: tuple[Path, Path]) -> None:
    """The CPU's bf16 mode (bf16 weights and KV cache, the MTP layer's too): greedy outputs equal
    speculation off in the same mode."""
    _, mimo = pair
    rng = random.Random(6)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(2, 40))] for _ in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    outs, stats = {}, {}
    for spec in (None, _mtp()):
        with LLM(str(mimo), dtype="bfloat16", max_num_seqs=4, speculative_config=spec) as llm:
            outs[spec is not None] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats[spec is not None] = llm.stats()
    assert outs[True] == outs[False]
    assert stats[True].spec_drafts > 0, stats[True]
