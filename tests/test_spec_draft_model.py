"""Speculative decoding with a draft model (`{"method": "draft_model", "model": ...}`) through the
whole engine: the draft proposes on the worker, over its own KV cache in the target's blocks.

A draft equal to the target has every greedy proposal kept; a draft whose logits are all zero
proposes token 0, which the target never picks here, and has none kept; a draft of another
shape (one layer of the target's two) has some kept and some rejected. In every case the
outputs equal speculation off token for token, through preemption by recompute and by swap
(the draft's cache moves with the target's), prefix-cache hits (the draft computes a cached
prefix itself, once it drafts) and two tensor-parallel ranks (the first drafts and broadcasts), and greedy
equals transformers' `generate`. A bad draft is refused in one sentence before anything starts.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from noria import LLM, SamplingParams
from tests.test_async_scheduling import _run
from tests.test_engine_parity import _hf_greedy, _with_tokenizer
from tests.test_spec_decode import PREEMPTIONS, _mix
from tests.tiny_models import make_checkpoint


def _variant(src: Path, dst: Path, *, layers: int | None = None, zero_head: bool = False) -> str:
    """A copy of the checkpoint `src`: its first `layers` layers only, or its lm_head zeroed."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    weights = load_file(dst / "model.safetensors")
    if layers is not None:
        config["num_hidden_layers"] = layers
        weights = {k: v for k, v in weights.items()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    if zero_head:
        weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    (dst / "config.json").write_text(json.dumps(config))
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _draft(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def _greedy_prompts(n: int = 8) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(3, 50))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(10, 40), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


@PREEMPTIONS
def test_outputs_equal_speculation_off(demo_path, tmp_path, flags):
    """The sampling mix of tests/test_spec_decode.py (seeds, penalties, n > 1, logprobs, stops,
    structured output) with a one-layer draft of the two-layer target."""
    draft = _draft(_variant(demo_path, tmp_path / "draft", layers=1))
    results, stats = {}, {}
    for spec in (None, draft):
        with LLM("demo", speculative_config=spec, max_num_seqs=8, **flags) as llm:
            results[spec is not None] = _run(llm, *_mix())
            stats[spec is not None] = llm.stats()
    assert results[True][0] == results[False][0]
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-4)
    on = stats[True]
    # How many steps draft is the switch's timing (scheduler/spec_governor.py): at least one does.
    # Drafts all kept and all rejected are the next test's, whatever the count.
    assert on.spec_drafts > 0, on
    if "preemption_mode" in flags:
        assert on.num_preemptions > 0, on
    for st in stats.values():
        assert st.blocks_consistent and st.num_free_blocks == st.num_kv_blocks and st.num_running == 0


@pytest.mark.parametrize("which", ["target", "zero_head"])
def test_draft_equal_to_target_keeps_all_and_wrong_draft_keeps_none(demo_path, tmp_path, which):
    model = str(demo_path) if which == "target" else _variant(demo_path, tmp_path / "zero", zero_head=True)
    prompts, params = _greedy_prompts()
    # Shared prefixes: the later requests' cached blocks come without the draft's KV computed.
    prompts += [prompts[0][:32] + [7, 8, 9], prompts[0][:32] + [10]]
    params += [params[0], params[1]]
    outs = {}
    for spec in (None, _draft(model)):
        with LLM("demo", speculative_config=spec, max_num_seqs=4, enable_prefix_caching=True) as llm:
            outs[spec is not None] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            st = llm.stats()
    assert outs[True] == outs[False]
    assert st.spec_drafts > 0 and st.prefix_cache_hits > 0, st
    if which == "target":
        assert st.spec_accepted_tokens == st.spec_draft_tokens, st
    else:
        assert all(0 not in ids for ids in outs[False])  # so every proposal (token 0) is wrong
        assert st.spec_accepted_tokens == 0, st


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_matches_transformers(tp, tmp_path, demo_path):
    """A llama target and a qwen2 draft of other shapes (heads, head size, layers) with its vocabulary."""
    ckpt = _with_tokenizer(make_checkpoint("llama", tmp_path / "llama", num_key_value_heads=4), demo_path)
    draft = make_checkpoint("qwen2", tmp_path / "qwen2", seed=3, num_hidden_layers=1, hidden_size=32,
                            num_attention_heads=2, num_key_value_heads=1)
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(2, 30))] for _ in range(6)]
    max_new = [rng.randint(8, 30) for _ in prompts]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_new]
    for model in (str(ckpt), str(draft)):
        with LLM(str(ckpt), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
                 block_size=16, tensor_parallel_size=tp, speculative_config=_draft(model, 3)) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.stats()
        for p, m, out in zip(prompts, max_new, outs, strict=True):
            assert out.outputs[0].token_ids == _hf_greedy(str(ckpt), p, m), f"prompt of {len(p)} tokens"
        assert stats.spec_drafts > 0, stats
        if model == str(ckpt):
            assert stats.spec_accepted_tokens == stats.spec_draft_tokens, stats


def test_bad_drafts_are_refused_in_one_sentence(demo_path, tmp_path):
    big = make_checkpoint("llama", tmp_path / "big", vocab_size=1024)
    with pytest.raises(ValueError, match="more than the target's 706: a draft needs the target's tokenizer"):
        LLM("demo", speculative_config=_draft(str(big)))
    with pytest.raises(FileNotFoundError, match="not a local checkpoint folder"):
        LLM("demo", speculative_config=_draft(str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="pulled from another instance"):
        LLM("demo", speculative_config=_draft("demo"),
            kv_transfer_config={"kv_connector": "NoriaConnector", "kv_role": "kv_consumer"})


def test_draft_kv_validity_follows_the_block_ids(demo_path):
    """Which blocks' draft KV a prefix-cache hit may trust: those a request that computed them
    marked, until a block is given out to be written or is swapped into."""
    from noria.protocol.config import EngineConfig
    from noria.protocol.speculative import SpeculativeConfig
    from noria.worker.block_table import BlockTables
    from noria.worker.draft_model import DraftModel
    from noria.worker.step_inputs import RequestState

    spec = SpeculativeConfig(method="draft_model", model=str(demo_path), num_speculative_tokens=2)
    draft = DraftModel(EngineConfig(model=str(demo_path), block_size=4, speculative_config=spec),
                       torch.device("cpu"), torch.float32, None, torch.float32)
    tables = BlockTables(8, 16)
    draft.allocate(16, 4, tables)

    def state(req_id: int, blocks: list[int], computed: int) -> RequestState:
        s = RequestState(req_id, list(range(5, 5 + 4 * len(blocks))), computed, tables.add(blocks), None,
                         num_prompt_tokens=computed)
        draft.added(s, blocks)
        return s

    a = state(1, [0, 1, 2], 0)
    a.num_computed_tokens, a.draft_len = 11, 10  # the draft followed 10 of the 11 computed tokens
    draft.mark(a)
    assert draft.full == {0, 1}  # the third block is neither full nor followed whole
    assert state(2, [0, 1, 5], 8).draft_len == 8  # a hit on both: the draft starts after them
    draft.fresh([1])  # block 1 evicted and given out to be written
    assert state(3, [0, 1, 6], 8).draft_len == 4  # only block 0 is still the draft's
    draft.swap([], [(0, 0)])  # block 0 now holds what was swapped in
    assert state(4, [0, 7], 4).draft_len == 0 and not draft.full
    b = state(5, [8, 9], 0)
    b.num_computed_tokens = b.draft_len = 8
    draft.mark(b)
    state(6, [10, 8], 0)  # block 8 given to a new request past its computed tokens: to be written
    assert draft.full == {9}


def test_a_draft_with_a_shorter_context_drafts_within_it(demo_path):
    """vLLM's max_model_len key caps the draft's context: a request is drafted only while its
    proposals stay inside it, and a prompt longer than it is not followed past it."""
    prompts, params = _greedy_prompts(4)
    prompts[0] = prompts[0] + list(range(100, 160))  # past the draft's 48 positions from its prompt on
    prompts[1] = prompts[1][:10]  # drafted until its output reaches them
    outs, stats = {}, {}
    for spec in (None, {**_draft(str(demo_path)), "max_model_len": 48}):
        with LLM("demo", speculative_config=spec, max_num_seqs=1) as llm:
            outs[spec is not None] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats[spec is not None] = llm.stats()
    assert outs[True] == outs[False]
    st = stats[True]
    assert st.spec_drafts > 0 and st.spec_accepted_tokens == st.spec_draft_tokens, st
    # Every proposal is kept, so each drafted token has a position of its own: from the prompt's
    # end to the last the draft's KV reaches a token before (47) and one more.
    room = sum(max(0, 49 - len(p)) for p in prompts)
    assert st.spec_draft_tokens <= room, (st.spec_draft_tokens, room)
