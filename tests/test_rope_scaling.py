"""Rope scaling types, partial rotary and Phi-3.

Tables: each type's inverse frequencies and attention factor (worker/models/rope.py) against
transformers' ROPE_INIT_FUNCTIONS where the two agree, and cos/sin against a float64 formula
written here from the papers' definitions (also where transformers differs: `dynamic` beyond
the original length, longrope's factors picked by the engine's context length).

Greedy parity: the ModelRunner, driven through chunked prefill by the toy scheduler of
test_worker_parity, against transformers' float32 generate on tiny random checkpoints: Qwen2
with yarn, Llama with longrope, Phi-3 (fused qkv / gate_up, partial rotary 0.5, longrope,
a sliding window).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from noria.protocol.config import EngineConfig
from noria.protocol.model_spec import model_spec
from noria.worker.model_runner import ModelRunner
from noria.worker.models.layers import RotaryEmbedding, apply_rope
from noria.worker.models.rope import rope_frequencies, uses_long_factors
from tests.test_worker_parity import Driver, Req
from tests.tiny_models import load_reference, make_checkpoint, reference_greedy, tiny_config

HEAD_DIM = 16  # the tiny models' hidden 64 / 4 heads
LONGROPE = {"short_factor": [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
            "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 32.0]}

# (name, tiny arch, rope_parameters) for the table tests.
TYPES: list[tuple[str, str, dict[str, Any]]] = [
    ("default", "llama", {"rope_type": "default", "rope_theta": 10000.0}),
    ("linear", "llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
    ("dynamic", "llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    ("yarn", "qwen2", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 64}),
    ("yarn-mscale", "llama", {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "mscale": 1.0,
                              "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                              "original_max_position_embeddings": 128}),
    ("yarn-untruncated", "qwen2", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "truncate": False}),
    ("longrope", "llama", {"rope_type": "longrope", "rope_theta": 10000.0,
                           "original_max_position_embeddings": 128, **LONGROPE}),
    ("llama3", "llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
]


def _reference_init(cfg: Any, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)


@pytest.mark.parametrize(("name", "arch", "params"), TYPES, ids=[t[0] for t in TYPES])
def test_frequencies_match_transformers(name: str, arch: str, params: dict[str, Any]) -> None:
    cfg = tiny_config(arch, rope_parameters=dict(params))
    rope = model_spec(cfg, max_model_len=None).rope
    inv_freq, factor = rope_frequencies(rope, HEAD_DIM)
    # dynamic: noria's one table is transformers' for a sequence of max_position * factor tokens;
    # longrope: with max_model_len unset the context is max_position (512) > 128, so the long factors,
    # which transformers takes for a sequence past the original length.
    seq_len = {"dynamic": 512 * 2, "longrope": 129}.get(name)
    ref_freq, ref_factor = _reference_init(cfg, seq_len)
    assert torch.equal(inv_freq, ref_freq.float()), name
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    if name.startswith("yarn") or name == "longrope":
        assert factor != 1.0  # the scaled types really scale cos and sin here


def test_longrope_factors_follow_the_context_length() -> None:
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128, **LONGROPE}
    cfg = tiny_config("llama", rope_parameters=dict(params))
    short = model_spec(cfg, max_model_len=128).rope
    long = model_spec(cfg, max_model_len=129).rope
    assert not uses_long_factors(short) and uses_long_factors(long)
    assert torch.equal(rope_frequencies(short, HEAD_DIM)[0], _reference_init(cfg, None)[0])
    assert torch.equal(rope_frequencies(long, HEAD_DIM)[0], _reference_init(cfg, 129)[0])
    # The attention factor comes from max_position / original either way.
    expected = math.sqrt(1 + math.log(512 / 128) / math.log(128))
    assert rope_frequencies(short, HEAD_DIM)[1] == pytest.approx(expected)


def _float64_cos_sin(name: str, params: dict[str, Any], positions: torch.Tensor, dim: int,
                     max_pos: int, max_model_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, dim/2] in float64 from each type's definition."""
    theta = params["rope_theta"]
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    base_freq = theta ** (-i / dim)
    scale = 1.0
    kind = params["rope_type"]
    if kind == "default":
        freq = base_freq
    elif kind == "linear":
        freq = base_freq / params["factor"]
    elif kind == "dynamic":
        # NTK-aware base for a context of max_pos * factor: theta * (f * L / max_pos - (f - 1))^(d / (d - 2)).
        f = params["factor"]
        length = max_pos * f
        base = theta * (f * length / max_pos - (f - 1)) ** (dim / (dim - 2))
        freq = base ** (-i / dim)
    elif kind == "yarn":
        f, orig = params["factor"], params["original_max_position_embeddings"]
        fast, slow = params.get("beta_fast", 32), params.get("beta_slow", 1)
        # The dim whose wavelength turns `r` times over the original length.
        low = dim * math.log(orig / (fast * 2 * math.pi)) / (2 * math.log(theta))
        high = dim * math.log(orig / (slow * 2 * math.pi)) / (2 * math.log(theta))
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        freq = base_freq / f * ramp + base_freq * (1 - ramp)
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        scale = (0.1 * m * math.log(f) + 1) / (0.1 * m_all * math.log(f) + 1) if m and m_all \
            else 0.1 * math.log(f) + 1
    elif kind == "longrope":
        orig = params["original_max_position_embeddings"]
        long = (max_model_len or max_pos) > orig
        ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float64)
        freq = base_freq / ext
        scale = math.sqrt(1 + math.log(max_pos / orig) / math.log(orig))
    elif kind == "llama3":
        f, lo, hi, orig = (params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"))
        wavelen = 2 * math.pi / base_freq
        smooth = ((orig / wavelen - lo) / (hi - lo)).clamp(0, 1)
        freq = (1 - smooth) * base_freq / f + smooth * base_freq
    else:
        raise AssertionError(name)
    angles = positions.double()[:, None] * freq[None, :]
    return angles.cos() * scale, angles.sin() * scale


@pytest.mark.parametrize(("name", "arch", "params"), TYPES, ids=[t[0] for t in TYPES])
@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["full", "half"])
def test_cos_sin_match_float64_formula(name: str, arch: str, params: dict[str, Any], partial: float) -> None:
    """Positions across the whole scaled range (dynamic: up to max_position * factor, where
    transformers would have rescaled per forward pass), whole and half-rotary heads."""
    params = dict(params)
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
        if name == "longrope":
            params = {**params, **{k: v[: len(v) // 2] for k, v in LONGROPE.items()}}
    cfg = tiny_config(arch, rope_parameters=params)
    max_model_len = 100 if name == "longrope" else None  # the short factors
    rope = model_spec(cfg, max_model_len=max_model_len).rope
    rotary = RotaryEmbedding(rope, HEAD_DIM)
    dim = int(HEAD_DIM * partial)
    assert rotary.rotary_dim == dim
    positions = torch.cat((torch.arange(0, 40), torch.tensor([63, 64, 127, 128, 511, 700, 1023])))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    exp_cos, exp_sin = _float64_cos_sin(name, params, positions, dim, 512, max_model_len)
    # float32 angles carry ~1e-7 relative error: ~1e-4 rad at position 1000.
    torch.testing.assert_close(cos[:, 0].double(), exp_cos, atol=3e-4, rtol=0)
    torch.testing.assert_close(sin[:, 0].double(), exp_sin, atol=3e-4, rtol=0)


@pytest.mark.parametrize(("name", "arch", "params"), [t for t in TYPES if t[0] not in ("dynamic", "longrope")],
                         ids=[t[0] for t in TYPES if t[0] not in ("dynamic", "longrope")])
def test_cos_sin_match_transformers_rotary(name: str, arch: str, params: dict[str, Any]) -> None:
    """Bit for bit the cos / sin transformers' rotary module gives its attention (types whose
    table transformers does not change per forward pass)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, rope_parameters=dict(params))
    model = AutoModelForCausalLM.from_config(cfg)
    positions = torch.arange(0, 300)
    ref_cos, ref_sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None, :])
    cos, sin = RotaryEmbedding(model_spec(cfg).rope, HEAD_DIM).cos_sin(positions, torch.float32)
    assert torch.equal(cos[:, 0], ref_cos[0, :, : HEAD_DIM // 2])
    assert torch.equal(sin[:, 0], ref_sin[0, :, : HEAD_DIM // 2])


def test_partial_apply_rope_matches_phi3() -> None:
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4, 16, generator=g), torch.randn(7, 2, 16, generator=g)
    cfg = tiny_config("phi3")
    cos, sin = RotaryEmbedding(model_spec(cfg, 256).rope, 16).cos_sin(torch.arange(7), torch.float32)
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # transformers' [.., rot] layout
    # transformers' layout: [batch, heads, T, D] and cos / sin [batch, T, rot].
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos[:, 0][None],
                                        full_sin[:, 0][None])
    assert torch.equal(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1))
    assert torch.equal(apply_rope(k, cos, sin), ref_k[0].transpose(0, 1))


def test_unknown_or_incomplete_rope_is_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"^unsupported rope type 'mrope'; supported: default, linear, dynamic"):
        model_spec(tiny_config("llama", rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}))
    cfg = tiny_config("llama")
    cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="needs short_factor and long_factor"):
        model_spec(cfg)


# ---- greedy parity through the ModelRunner ----


def _runner(path: Path, max_model_len: int | None) -> ModelRunner:
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=160, swap_space=0.001,
                          num_threads=2, max_model_len=max_model_len)
    runner = ModelRunner(config)
    runner.kv_cache.device_cache[:, :, : runner.num_kv_blocks] = float("nan")
    return runner


def _parity(path: Path, prompt_lens: list[int], max_model_len: int | None, max_tokens: int = 6) -> None:
    ref = load_reference(path)
    g = torch.Generator().manual_seed(sum(prompt_lens))
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in prompt_lens]
    # A 32-token budget: the longer prompts are prefilled in chunks beside running decodes.
    driver = Driver(_runner(path, max_model_len), token_budget=32)
    for i, prompt in enumerate(prompts):
        driver.add(Req(i, list(prompt), len(prompt), max_tokens, arrival=i))
    got = driver.run(max_steps=2000)
    assert got == {i: reference_greedy(ref, p, max_tokens) for i, p in enumerate(prompts)}


# original * factor = 512: yarn's context length (vLLM's rule) is the tiny model's whole length.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
LLAMA_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                  **LONGROPE}


def test_qwen2_yarn_greedy_parity(tmp_path: Path) -> None:
    path = make_checkpoint("qwen2", tmp_path / "m", seed=5, rope_parameters=dict(YARN))
    _parity(path, [3, 30, 75, 140], None)


@pytest.mark.parametrize(("max_model_len", "lens"), [(64, [5, 20, 57]), (512, [65, 90, 150])],
                         ids=["short-factors", "long-factors"])
def test_llama_longrope_greedy_parity(max_model_len: int, lens: list[int], tmp_path: Path) -> None:
    """Short factors with a context no longer than the original (transformers: every sequence that
    short); long factors with a longer context, on sequences past the original length (transformers
    switches there)."""
    path = make_checkpoint("llama", tmp_path / "m", seed=6, rope_parameters=dict(LLAMA_LONGROPE))
    _parity(path, lens, max_model_len, max_tokens=6 if max_model_len > 64 else 4)


@pytest.mark.parametrize(("max_model_len", "lens", "overrides"),
                         [(256, [4, 33, 100], {}), (512, [257, 300], {}), (256, [20, 90], {"sliding_window": 24})],
                         ids=["short-factors", "long-factors", "sliding-window"])
def test_phi3_greedy_parity(max_model_len: int, lens: list[int], overrides: dict[str, Any], tmp_path: Path) -> None:
    path = make_checkpoint("phi3", tmp_path / "m", seed=7, **overrides)
    spec = model_spec(tiny_config("phi3", **overrides), max_model_len)
    assert spec.architecture == "Phi3ForCausalLM" and spec.rope.partial_rotary_factor == 0.5
    assert spec.sliding_windows == ((overrides.get("sliding_window"),) * spec.num_layers)
    _parity(path, lens, max_model_len)


# ---- the torch-free pre-check knows Phi-3 and the rope types ----


def test_precheck_knows_phi3_and_rope_types(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    from noria.protocol import checkpoint

    path = make_checkpoint("phi3", tmp_path / "phi3")
    checkpoint.check_checkpoint(path)  # fused qkv_proj / gate_up_proj are what Phi-3 needs
    weights = load_file(path / "model.safetensors")
    weights["model.layers.1.self_attn.qkv_proj.weight"] = weights["model.layers.1.self_attn.qkv_proj.weight"][:96]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(checkpoint.CheckpointError, match=r"qkv_proj.weight has shape \(96, 64\) .* \(128, 64\)"):
        checkpoint.check_checkpoint(path)
    del weights["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks 1 weight tensor.*layers\.1\.self_attn\.qkv_proj"):
        checkpoint.check_checkpoint(path)

    llama = make_checkpoint("llama", tmp_path / "llama")
    cfg = json.loads((llama / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 10000.0}
    (llama / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(checkpoint.CheckpointError, match=r"rope type 'mrope', which noria does not implement"):
        checkpoint.check_checkpoint(llama)


# ---- the context length rope scaling gives (vLLM's rule), known without torch ----


@pytest.mark.parametrize(("rope", "model_type", "expected"), [
    (None, "llama", 512),
    ({"rope_type": "linear", "factor": 2.0}, "llama", 1024),
    ({"type": "dynamic", "factor": 3.0}, "llama", 1536),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, "qwen2", 256),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, "llama", 512),
    ({"rope_type": "longrope", "short_factor": [1], "long_factor": [2]}, "phi3", 512),
    ({"rope_type": "linear", "factor": 8.0}, "gemma3_text", 512),
])
def test_context_length_follows_rope_scaling(rope: dict[str, Any] | None, model_type: str, expected: int,
                                             tmp_path: Path) -> None:
    import json

    from noria.protocol.model_identity import model_facts

    cfg = {"vocab_size": 512, "max_position_embeddings": 512, "model_type": model_type, "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert model_facts(tmp_path).max_model_len == expected


def test_runner_serves_the_scaled_length(tmp_path: Path) -> None:
    path = make_checkpoint("llama", tmp_path / "m", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                     "factor": 2.0})
    config = dict(model=str(path), dtype="float32", device="cpu", num_kv_blocks=8, swap_space=0.0, num_threads=1)
    assert ModelRunner(EngineConfig(**config)).max_model_len == 1024  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^max_model_len 1025 exceeds the model's context length 1024 "
                                         r"\(max_position_embeddings 512 scaled by its rope_scaling factor\)$"):
        ModelRunner(EngineConfig(**config, max_model_len=1025))  # type: ignore[arg-type]


def test_phi3_through_the_engine(tmp_path: Path, demo_path: Path) -> None:
    """The whole engine (real processes, the scheduler's chunking under a 64-token budget) on
    Phi-3 with longrope's long factors: prompts past the original 256 tokens, where
    transformers takes the long factors too."""
    import random
    import shutil

    from noria import LLM, SamplingParams

    path = make_checkpoint("phi3", tmp_path / "phi3", seed=9)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_path / name, path / name)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(257, 330))] for _ in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with LLM(str(path), dtype="float32", max_num_seqs=3, max_num_batched_tokens=64, num_kv_blocks=160,
             block_size=16) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    ref = load_reference(path)
    ref.generation_config.eos_token_id = 2  # the engine stops at EOS too
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(ref, p, 8), f"prompt of {len(p)} tokens"
