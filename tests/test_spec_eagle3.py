"""EAGLE-3 speculation (`{"method": "eagle3", "model": HEAD}`): a head as SpecForge and the EAGLE
authors save it (seeded random weights, a draft vocabulary smaller than the target's), read by
the real loading code.

The head's proposals are compared with a float64 reference written here from the published
layout alone: transformers' hidden states of the target (`output_hidden_states`: the stream
entering each layer), fused by `fc`, one Llama layer over the normed embedding beside the normed
hidden state, full causal attention recomputed from scratch, the final norm, the draft
vocabulary's argmax mapped by `d2t`. The worker's path (its own paged KV, filled after each
target step over prompt chunks, decodes and verified rows, then k passes) must give the same
tokens. Through the whole engine the outputs equal speculation off, token for token, with
preemption by recompute and by swap, prefix caching and two tensor-parallel ranks; a head that
does not fit is refused in one sentence.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from noria import LLM, SamplingParams
from noria.bench.spec_models import write_eagle3_head
from noria.protocol.sampling import EngineSamplingParams
from noria.protocol.step import NewRequestData, StepPlan
from tests.spec_heads import (
    HeadReference,
    bfloat16_equals_speculation_off,
    head_runner,
    mix_equals_speculation_off,
    outputs_equal_transformers,
    rms,
    rope,
    walk_proposals,
)
from tests.test_engine_parity import _hf_greedy, _with_tokenizer
from tests.test_spec_decode import PREEMPTIONS
from tests.tiny_models import make_checkpoint

AUX = [1, 2, 4]  # of the target's 6 layers


def make_head(target: Path, path: Path, **options: Any) -> Path:
    return write_eagle3_head(target, path, aux=AUX, draft_vocab=300, **options)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, demo_path: Path) -> tuple[Path, Path]:
    """A six-layer Llama target (the demo's tokenizer) and a head for it."""
    root = tmp_path_factory.mktemp("eagle3")
    target = _with_tokenizer(make_checkpoint("llama", root / "target", num_hidden_layers=6,
                                                  vocab_size=706), demo_path)
    return target, make_head(target, root / "head")


def _eagle(head: Path | str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


# -- the reference ------------------------------------------------------------------------


class _Reference(HeadReference):
    """The head (tests/spec_heads.py's HeadReference)."""

    def __init__(self, target: Path, head: Path, aux: list[int] = AUX) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        cfg = json.loads((head / "config.json").read_text())
        self.heads, self.kv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.t = {k: v.double() for k, v in load_file(head / "model.safetensors").items() if k != "t2d"}
        self.t["d2t"] = self.t["d2t"].long()
        self.target = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float64).eval()
        self.aux = aux
        self.embed = self.t.get("embed_tokens.weight", self.target.model.embed_tokens.weight.detach())

    def layer(self, tokens: list[int], hidden: torch.Tensor, pos: torch.Tensor,
              keys: list[torch.Tensor]) -> torch.Tensor:
        t, p = self.t, "midlayer."
        x = torch.cat([rms(self.embed[tokens], t[p + "input_layernorm.weight"]),
                       rms(hidden, t[p + "hidden_norm.weight"])], -1)
        n_q, heads, kv, hd = len(tokens), self.heads, self.kv, self.hd
        q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(n_q, heads, hd), pos)
        k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(n_q, kv, hd), pos)
        v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n_q, kv, hd)
        h = self.attend(q, k, v, keys) @ t[p + "self_attn.o_proj.weight"].T + hidden
        m = rms(h, t[p + "post_attention_layernorm.weight"])
        return (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
            @ t[p + "mlp.down_proj.weight"].T + h

    def token(self, out: torch.Tensor) -> int:
        best = int((rms(out, self.t["norm.weight"]) @ self.t["lm_head.weight"].T).argmax())
        return best + int(self.t["d2t"][best])

    def output(self, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():
            states = self.target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        fused = torch.cat([states[i][0] for i in self.aux], -1) @ self.t["fc.weight"].T
        return self.first_pass(tokens, fused)


def test_head_proposals_equal_a_float64_reference(pair: tuple[Path, Path]) -> None:
    """The head's proposals are the reference's after every step of tests/spec_heads.py's walk
    (prompt chunks, decodes, a verified draft, the request's worker state rebuilt)."""
    target, head = pair
    ref = _Reference(target, head)
    runner = head_runner(target, _eagle(head))
    walk_proposals(runner, ref.drafts)


def test_outputs_equal_speculation_off_and_transformers(pair: tuple[Path, Path]) -> None:
    target, head = pair
    outputs_equal_transformers(target, _eagle(head), target)


@PREEMPTIONS
def test_sampling_mix_equals_speculation_off(pair: tuple[Path, Path], flags: dict) -> None:
    target, head = pair
    mix_equals_speculation_off(target, _eagle(head), flags)


def test_two_ranks_own_embedding_and_the_authors_format(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """A head with its own embedding table, saved as pytorch_model.bin with `layers.0.` names,
    drafting for a target sharded over two ranks (the first drafts and broadcasts)."""
    target, _ = pair
    head = make_head(target, tmp_path / "head", seed=5, own_embed=True, prefix="layers.0.", fmt="bin")
    rng = random.Random(8)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True) for _ in prompts]
    with LLM(str(target), dtype="float32", tensor_parallel_size=2, max_num_seqs=4,
             speculative_config=_eagle(head, 2)) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        st = llm.stats()
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(str(target), p, 20)
    assert st.spec_drafts > 0, st


def test_default_layers_of_a_shallow_target(tmp_path: Path, demo_path: Path) -> None:
    """Without eagle_config the head reads layers (2, L // 2, L - 3): for a four-layer target
    (2, 2, 1), layer 2's stream twice, in layer order."""
    target = _with_tokenizer(make_checkpoint("llama", tmp_path / "t4", num_hidden_layers=4, vocab_size=706),
                             demo_path)
    head = write_eagle3_head(target, tmp_path / "h4", draft_vocab=300, eagle_config=None)
    ref = _Reference(target, head, aux=[1, 2, 2])
    runner = head_runner(target, _eagle(head), num_kv_blocks=16)
    rng = random.Random(3)
    prompt = [rng.randrange(5, 700) for _ in range(20)]
    runner.execute(StepPlan(0, [(0, 20)], new_requests=[NewRequestData(0, prompt, [2, 5], 0, 0, 20)],
                            params=[EngineSamplingParams(temperature=0.0)]))
    state = runner.requests[0]
    assert runner.drafter.propose([(state, 3)])[0] == ref.drafts(state.token_ids, 3)


def test_heads_that_do_not_fit_are_refused_in_one_sentence(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, _ = pair
    cases = [
        ({"num_hidden_layers": 2}, "has 2 layers; noria runs one-layer heads"),
        ({"vocab_size": 800}, "has 800 tokens, the target 706: a head needs the target's tokenizer"),
        ({"target_hidden_size": 128}, "reads hidden states of width 128, the target's are 64"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, "three of its 6 layers are needed"),
        ({"architectures": ["Qwen2ForCausalLMEagle3"]}, "noria reads Llama-layer heads"),
    ]
    for i, (config, message) in enumerate(cases):
        head = make_head(target, tmp_path / str(i), **config)
        with pytest.raises(ValueError, match=message):
            LLM(str(target), speculative_config=_eagle(head))
    with pytest.raises(ValueError, match="needs model \\(the EAGLE-3 head's folder\\)"):
        LLM(str(target), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="needs MTP layers in the served checkpoint"):
        LLM(str(target), speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="EAGLE-1 heads are not read"):
        LLM(str(target), speculative_config={"method": "eagle", "model": str(target), "num_speculative_tokens": 1})


def test_bfloat16_equals_speculation_off(pair: tuple[Path, Path]) -> None:
    target, head = pair
    bfloat16_equals_speculation_off(target, _eagle(head))
