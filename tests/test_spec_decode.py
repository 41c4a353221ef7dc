"""Speculative decoding through the whole engine (real processes), `speculative_config` n-gram
and suffix (a draft model: tests/test_spec_draft_model.py).

Lossless by construction: with speculation on, every output equals speculation off token for
token, greedy and seeded alike (a seeded request's noise follows its output index), across
greedy, seeded top-k/top-p/min-p sampling, n > 1, penalties, bad words, logit bias, min_tokens,
logprobs, prompt logprobs, stop strings and stop tokens that land inside an accepted run,
structured output (never drafted), and preemption by recompute and by swap, with drafts both
accepted and rejected; every request ends once and every block is free afterwards. Greedy
equals transformers' `generate` on a tiny checkpoint, on one rank and on two (tensor
parallelism). Through `noria serve`: the start-up line, the openai client streaming, and the
acceptance counters under vLLM's metric names.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from noria import LLM, SamplingParams, StructuredOutput
from tests.procs import serve_http, wait_metrics
from tests.test_async_scheduling import _run
from tests.test_engine_parity import _hf_greedy, _with_tokenizer
from tests.tiny_models import make_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
# No preemption, and preemption by recompute and by swap (a cache too small for the mix), with
# async scheduling (the default: a plan made while a draft is verified may preempt its request),
# and recompute also without it.
PREEMPTIONS = pytest.mark.parametrize(
    "flags",
    [{}, {"num_kv_blocks": 20, "preemption_mode": "recompute"},
     {"num_kv_blocks": 20, "preemption_mode": "swap", "swap_space": 0.01},
     {"num_kv_blocks": 20, "preemption_mode": "recompute", "async_scheduling": False}],
    ids=["default", "recompute", "swap", "sync-recompute"],
)


def _mix(stops: tuple[str, int] | None = None) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    motif = [rng.randrange(5, 700) for _ in range(12)]
    # Prompts that repeat themselves (the n-gram lookup's case) and prompts that do not.
    prompts = [motif * 3 + [rng.randrange(5, 700) for _ in range(rng.randint(1, 20))] if i % 2 else
               [rng.randrange(5, 700) for _ in range(rng.randint(20, 60))] for i in range(12)]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    params = [
        SamplingParams(max_tokens=40, **greedy),
        SamplingParams(max_tokens=33, **greedy),
        SamplingParams(max_tokens=30, min_tokens=10, **greedy),
        SamplingParams(max_tokens=24, n=3, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, top_k=20, top_p=0.9, min_p=0.01, seed=3, ignore_eos=True,
                       logprobs=2),
        SamplingParams(max_tokens=20, prompt_logprobs=1, **greedy),
        SamplingParams(max_tokens=16, structured_output=StructuredOutput(choice=["yes", "no way", "maybe"]),
                       **greedy),
        SamplingParams(max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                       **greedy),
        SamplingParams(max_tokens=30, bad_words=["Hello"], logit_bias={611: -2.0, 17: 1.5}, **greedy),
        SamplingParams(max_tokens=30, logprobs=1, **greedy),
        SamplingParams(max_tokens=40, **greedy),  # a stop string from its greedy text (below)
        SamplingParams(max_tokens=40, **greedy),  # a stop token from its greedy ids (below)
    ]
    if stops is not None:
        params[10] = SamplingParams(max_tokens=40, stop=[stops[0]], **greedy)
        params[11] = SamplingParams(max_tokens=40, stop_token_ids=[stops[1]], **greedy)
    return prompts, params


@pytest.mark.parametrize("method", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@PREEMPTIONS
def test_outputs_equal_speculation_off(demo_path, flags, method):
    results, stats = {}, {}
    for spec in (None, method):
        with LLM("demo", speculative_config=spec, max_num_seqs=8, **flags) as llm:
            prompts, params = _mix()
            if spec is None:  # stops that end generation inside what a draft would cover
                first = llm.generate(prompts[10:12], params[10:12], use_tqdm=False)
                text = first[0].outputs[0].text
                stops = (text[len(text) // 2: len(text) // 2 + 2], first[1].outputs[0].token_ids[13])
            results[spec is not None] = _run(llm, *_mix(stops))
            stats[spec is not None] = llm.stats()
    assert results[True][0] == results[False][0]
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-4)
    plain = results[False][0]
    assert plain[10][0][3] == "stop" and len(plain[10][0][1]) < 40  # the stop string ended it
    assert plain[11][0][3] == "stop" and len(plain[11][0][1]) <= 14  # the stop token ended it
    on, off = stats[True], stats[False]
    assert off.spec_drafts == 0 and on.spec_drafts > 0
    # Drafts kept and drafts rejected (where the switch lets the steps draft: it times them, and
    # suffix decoding's first proposals are short; tests/test_spec_decode_scheduler.py does not time).
    # (With async scheduling a drafted step also pays the wait for its plan, which steps planned
    # ahead do not: the switch drafts less, and how much is the host's timing.)
    if method is NGRAM and not flags.get("async_scheduling", True):
        assert 0 < on.spec_accepted_tokens < on.spec_draft_tokens, on
    assert sum(on.spec_accepted_per_pos) == on.spec_accepted_tokens and len(on.spec_accepted_per_pos) == 4
    if "preemption_mode" in flags:
        assert on.num_preemptions > 0, on
    if flags.get("async_scheduling", True):  # steps that do not draft are planned while another runs
        assert on.steps_planned_ahead > 0, on
    else:
        assert on.steps_planned_ahead == 0, on
    for st in (on, off):
        assert st.blocks_consistent and st.num_free_blocks == st.num_kv_blocks and st.num_running == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_matches_transformers(tp, tmp_path, demo_path):
    ckpt = _with_tokenizer(make_checkpoint("llama", tmp_path / "llama", num_key_value_heads=4), demo_path)
    rng = random.Random(2)
    motifs = [[rng.randrange(5, 500) for _ in range(rng.randint(2, 9))] for _ in range(8)]
    prompts = [m * rng.randint(2, 6) for m in motifs]
    max_new = [rng.randint(8, 30) for _ in prompts]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_new]
    with LLM(str(ckpt), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16,
             tensor_parallel_size=tp, speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    for p, m, out in zip(prompts, max_new, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(str(ckpt), p, m), f"prompt of {len(p)} tokens"
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0, stats


def test_served_with_speculation(demo_path):
    """`noria serve --speculative-config` with async scheduling (the default): said at start-up, streams
    through the openai client, counts drafts under vLLM's names and noria's."""
    import openai

    with serve_http("--model", str(demo_path), "--num-kv-blocks", "256", "--speculative-config", json.dumps(NGRAM),
                    stderr=subprocess.PIPE) as s:
        client = openai.OpenAI(base_url=f"{s.http}/v1", api_key="none")
        prompt = "one two three four one two three four one two three"
        stream = client.completions.create(model=str(demo_path), prompt=prompt, max_tokens=32, temperature=0.0,
                                           stream=True)
        streamed = "".join(c.choices[0].text for c in stream)
        whole = client.completions.create(model=str(demo_path), prompt=prompt, max_tokens=32, temperature=0.0)
        assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 32
        m = wait_metrics(s.http, lambda m: m["noria_spec_decode_drafts_total"] > 0)
        drafts = [v for k, v in m.items() if k.startswith("vllm:spec_decode_num_drafts_total")]
        accepted = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"))
        assert drafts == [m["noria_spec_decode_drafts_total"]] and drafts[0] > 0
        assert accepted == m["noria_spec_decode_accepted_tokens_total"] > 0
        assert m["noria_spec_decode_draft_tokens_total"] >= accepted
    assert s.proc.stderr is not None
    log = s.proc.stderr.read().decode()
    assert "speculative decoding: ngram, 4 tokens, n-grams of 1-3" in log
    assert "--async-scheduling is off" not in log


@pytest.mark.parametrize("method", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_constrained_requests_are_drafted_within_their_grammar(demo_path, method):
    """Only constrained requests: drafted, with a mask per verified position, their outputs
    those of speculation off (greedy and seeded) and inside their grammars."""
    import re

    rng = random.Random(4)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["ab", "cd"]}}},
              "required": ["tags"], "additionalProperties": False}
    constraints = [StructuredOutput(regex="[a-z ]{1,90}"), StructuredOutput(json=schema)]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_output=constraints[i % 2]) for i in range(4)]
    params += [SamplingParams(max_tokens=60, temperature=0.7, seed=i, structured_output=constraints[i % 2])
               for i in range(2)]
    outs, stats = {}, {}
    for spec in (None, method):
        with LLM("demo", speculative_config=spec, max_num_seqs=4) as llm:
            outs[spec is not None] = [(o.outputs[0].token_ids, o.outputs[0].text)
                                      for o in llm.generate(prompts, params, use_tqdm=False)]
            stats[spec is not None] = llm.stats()
    assert outs[True] == outs[False]
    for i, (_, text) in enumerate(outs[True]):
        if i % 2 == 0:
            assert re.fullmatch("[a-z ]{1,90}", text), text
        else:  # the schema's JSON, or its beginning where the tags run on past max_tokens
            assert re.fullmatch(r'\{"tags":\[("(ab|cd)",)*("(ab|cd)"?)?(\]\})?', text), text
    assert stats[True].spec_drafts > 0, stats[True]
