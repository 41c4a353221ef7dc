"""The walk a drafting head's proposals are checked over (an EAGLE-3 head, tests/test_spec_eagle3.py;
an MTP layer, tests/test_spec_mtp.py): one request through the worker, its proposals compared
with a reference's after every kind of step that feeds the head."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from noria import LLM, SamplingParams
from noria.protocol.config import EngineConfig
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.speculative import Draft, SpeculativeConfig
from noria.protocol.step import NewRequestData, StepPlan
from noria.worker.model_runner import ModelRunner
from noria.worker.step_inputs import RequestState


def head_runner(model: Path, spec: dict, num_kv_blocks: int = 32) -> ModelRunner:
    """A float32 worker of `model` drafting with `spec`, in process (its drafter at `.drafter`)."""
    return ModelRunner(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=num_kv_blocks, block_size=16,
                                    num_threads=2, speculative_config=SpeculativeConfig(**spec)))


def walk_proposals(runner: ModelRunner, drafts: Callable[[list[int], int], list[int]],
                   after_prompt: Callable[[RequestState], None] | None = None) -> None:
    """A prompt in two chunks, then two decodes, the second verifying a draft, then the request's
    worker state rebuilt: after each, the head's proposals are `drafts(tokens, k)`, the
    reference's over the request's tokens. `after_prompt`: more checks once the prompt is in."""
    rng = random.Random(4)
    prompt = [rng.randrange(5, 700) for _ in range(40)]
    new = NewRequestData(0, prompt, [3, 1, 4, 5], 0, 0, len(prompt))
    greedy = [EngineSamplingParams(temperature=0.0)]
    runner.execute(StepPlan(0, [(0, 25)], new_requests=[new], params=greedy))
    runner.execute(StepPlan(1, [(0, 15)], params=greedy))
    state = runner.requests[0]
    if after_prompt is not None:
        after_prompt(state)
    for step in (2, 3):
        proposals = runner.drafter.propose([(state, 3)])[0]
        assert proposals == drafts(state.token_ids, 3), f"after {len(state.token_ids)} tokens"
        draft = [Draft(0, proposals[:2])] if step == 3 else []
        runner.execute(StepPlan(step, [(0, 1 + sum(len(d.token_ids) for d in draft))], drafts=draft, params=greedy))
    assert runner.drafter.propose([(state, 4)])[0] == drafts(state.token_ids, 4)
    # Swapped out and back in: the worker rebuilds the request's state and computes nothing; the
    # head still has its output (and its KV moved with the blocks).
    tokens = list(state.token_ids)
    other = NewRequestData(1, prompt[:10], [6], 0, 0, 10)  # a step runs while it is out
    runner.execute(StepPlan(4, [(1, 10)], finished_req_ids=[0], new_requests=[other], params=greedy))
    runner.execute(StepPlan(5, [], new_requests=[
        NewRequestData(0, tokens, [3, 1, 4, 5], len(tokens) - 1, 0, len(prompt))], params=greedy))
    assert runner.requests[0] is not state
    assert runner.drafter.propose([(runner.requests[0], 3)])[0] == drafts(tokens, 3)


# -- what the float64 references share -----------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


class HeadReference:
    """A head's one layer in float64 over a whole sequence, attention recomputed from every key
    kept so far (`keys`: [K, V], each [positions, kv heads, head dim]). A reference gives
    `output`, the layer's output at the last position the target has computed and its keys, and
    `token`, the proposal after an output; `drafts` chains them as the worker does."""

    heads: int
    kv: int
    hd: int

    def output(self, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError

    def layer(self, tokens: list[int], hidden: torch.Tensor, pos: torch.Tensor,
              keys: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def token(self, out: torch.Tensor) -> int:
        raise NotImplementedError

    def first_pass(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layer over every position the target computed (`hidden`, a row each) beside the
        next token: its output at the last, and the keys and values it leaves."""
        keys = [torch.zeros(0, self.kv, self.hd, dtype=torch.float64)] * 2
        return self.layer(tokens[1:], hidden, torch.arange(len(tokens) - 1), keys)[-1:], keys

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
        """Causal attention of the new rows' q (their k and v appended to `keys`) over every key:
        [rows, heads * head dim]."""
        n_q, heads, kv, hd = q.shape[0], self.heads, self.kv, self.hd
        keys[0], keys[1] = torch.cat([keys[0], k]), torch.cat([keys[1], v])
        kk, vv = keys[0].repeat_interleave(heads // kv, 1), keys[1].repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / hd**0.5
        n = kk.shape[0]
        scores = scores.masked_fill(torch.arange(n)[None, :] > (n - n_q + torch.arange(n_q))[:, None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(n_q, heads * hd)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The head's k proposals after `tokens`, all but the last of which the target has computed."""
        out, keys = self.output(tokens)
        proposals = [self.token(out[0])]
        for step in range(1, k):
            out = self.layer(proposals[-1:], out, torch.tensor([len(tokens) - 2 + step]), keys)
            proposals.append(self.token(out[0]))
        return proposals


# -- through the whole engine ---------------------------------------------------------------


def outputs_equal_transformers(model: Path, spec: dict, reference: Path) -> None:
    """Greedy outputs with `spec` equal transformers' on `reference` (the same network), over
    prompts that share prefixes: cached blocks hold the head's KV too (it ran over every
    computed token)."""
    from tests.tiny_models import load_reference, reference_greedy

    rng = random.Random(2)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(2, 40) if i else 40)] for i in range(6)]
    prompts += [prompts[0][:34] + [7, 8], prompts[0][:34] + [9]]
    max_new = [rng.randint(8, 30) for _ in prompts]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    with LLM(str(model), dtype="float32", max_num_seqs=4, enable_prefix_caching=True, speculative_config=spec) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        st = llm.stats()
    hf = load_reference(reference)  # (EOS off, as the requests ignore it)
    for p, m, out in zip(prompts, max_new, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(hf, p, m), f"prompt of {len(p)} tokens"
    assert st.spec_drafts > 0 and st.prefix_cache_hits > 0, st
    assert st.blocks_consistent and st.num_free_blocks == st.num_kv_blocks


def mix_equals_speculation_off(model: Path, spec: dict, flags: dict) -> None:
    """tests/test_spec_decode.py's mix (seeds, penalties, n > 1, logprobs, stops, structured
    output, which a head does not draft) with and without `spec`, under the engine `flags`."""
    from tests.test_async_scheduling import _run
    from tests.test_spec_decode import _mix

    results, stats = {}, {}
    for config in (None, spec):
        with LLM(str(model), dtype="float32", speculative_config=config, max_num_seqs=8, **flags) as llm:
            results[config is not None] = _run(llm, *_mix())
            stats[config is not None] = llm.stats()
    assert results[True][0] == results[False][0]
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-4)
    assert stats[True].spec_drafts > 0, stats[True]
    if "preemption_mode" in flags:
        assert stats[True].num_preemptions > 0, stats[True]
    for st in stats.values():
        assert st.blocks_consistent and st.num_free_blocks == st.num_kv_blocks and st.num_running == 0


def bfloat16_equals_speculation_off(model: Path, spec: dict) -> None:
    """The CPU's bf16 mode (bf16 weights and KV cache, the head's too): greedy outputs with `spec`
    equal speculation off in the same mode."""
    rng = random.Random(6)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(2, 40))] for _ in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    outs, stats = {}, {}
    for config in (None, spec):
        with LLM(str(model), dtype="bfloat16", max_num_seqs=4, speculative_config=config) as llm:
            outs[config is not None] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats[config is not None] = llm.stats()
    assert outs[True] == outs[False]
    assert stats[True].spec_drafts > 0, stats[True]
