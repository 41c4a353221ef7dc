"""The step recorder and the ceiling replay that bench/throughput.py builds on."""

from __future__ import annotations

import pytest

from noria import LLM, SamplingParams
from noria.bench import step_log
from noria.bench.ceiling import read_steps, recorded_model_seconds, replay
from noria.frontend.startup import make_config


@pytest.mark.parametrize("chunk", [None, 24])
def test_recorded_steps_account_for_every_token_and_replay(demo_path, tmp_path, monkeypatch, chunk):
    record = tmp_path / "steps"
    for name, value in step_log.env(record).items():
        monkeypatch.setenv(name, value)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
    outs = [4, 9, 6]
    flags = {"num_kv_blocks": 64, "enable_prefix_caching": False}
    if chunk:
        flags["max_num_batched_tokens"] = chunk
    with LLM("demo", **flags) as llm:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in outs]
        llm.generate(prompts, params, use_tqdm=False)
    steps = read_steps(record)
    # Every prompt token and every generated token but the last passes through
    # the model exactly once; one row samples per generated token.
    computed = sum(sum(q) for q, _, _, _ in steps)
    assert computed == sum(len(p) for p in prompts) + sum(outs) - len(outs)
    assert sum(n for _, _, n, _ in steps) == sum(outs)
    assert len(steps) >= max(outs)
    for q, s, n, seconds in steps:
        assert len(q) == len(s) and all(0 < a <= b for a, b in zip(q, s, strict=True))
        assert 0 <= n <= len(q) and seconds > 0
        if chunk:
            assert sum(q) <= chunk
    assert recorded_model_seconds(steps) > 0
    assert replay(make_config(str(demo_path), num_kv_blocks=64), steps) > 0
