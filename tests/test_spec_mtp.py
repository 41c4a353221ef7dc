"""MTP speculation (`{"method": "mtp", "num_speculative_tokens": k}`): a MiMo checkpoint (Qwen2's
decoder, `num_nextn_predict_layers` 1, `model.mtp_layers.0.*` beside it; seeded random weights)
drafts for itself with its MTP layer, read by the real loading code.

The layer's proposals are compared with a float64 reference written here from the published
layout alone: transformers' Qwen2 over the same decoder weights for the target's residual stream
as it enters its final norm (what vLLM's MiMo hands its MTP layer), then
cat[hidden_layernorm(h), token_layernorm(embedding)] (the embedding at position
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
from noria.bench.spec_models import MTP, add_mtp_layer
from noria.worker.step_inputs import RequestState
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
from tests.test_engine_parity import _with_tokenizer
from tests.tiny_models import load_reference, make_checkpoint, reference_greedy


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
    return _final_norm_not_ones(qwen2), make_mimo(qwen2, root / "mimo")


def _final_norm_not_ones(path: Path) -> Path:
    """transformers starts the final norm's weight at ones, which would make the stream entering
    it and its output the same to the MTP layer's own first norm: seeded values instead."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    w = tensors["model.norm.weight"]
    tensors["model.norm.weight"] = 1 + 0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _mtp(k: int = 3) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


# -- the reference ------------------------------------------------------------------------


class _Reference(HeadReference):
    """The MTP layer (tests/spec_heads.py's HeadReference)."""

    def __init__(self, qwen2: Path, mimo: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        cfg = json.loads((mimo / "config.json").read_text())
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 1e4)
        self.t = {k.removeprefix(MTP): v.double() for k, v in load_file(mimo / "model-mtp.safetensors").items()}
        self.target = AutoModelForCausalLM.from_pretrained(str(qwen2), dtype=torch.float64).eval()
        self.embed = self.target.model.embed_tokens.weight.detach()
        self.lm_head = self.target.lm_head.weight.detach()

    def layer(self, tokens: list[int], hidden: torch.Tensor, pos: torch.Tensor,
              keys: list[torch.Tensor]) -> torch.Tensor:
        t, eps = self.t, self.eps
        emb = self.embed[tokens] * (pos != 0)[:, None]
        x = torch.cat([rms(hidden, t["hidden_layernorm.weight"], eps), rms(emb, t["token_layernorm.weight"], eps)], -1)
        x = x @ t["input_proj.weight"].T
        a = rms(x, t["input_layernorm.weight"], eps)

        def proj(name: str, n: int) -> torch.Tensor:
            return (a @ t[f"self_attn.{name}.weight"].T + t[f"self_attn.{name}.bias"]).view(len(tokens), n, self.hd)

        q, k = rope(proj("q_proj", self.heads), pos, self.theta), rope(proj("k_proj", self.kv), pos, self.theta)
        h = self.attend(q, k, proj("v_proj", self.kv), keys) @ t["self_attn.o_proj.weight"].T + x
        m = rms(h, t["post_attention_layernorm.weight"], eps)
        h = (F.silu(m @ t["mlp.gate_proj.weight"].T) * (m @ t["mlp.up_proj.weight"].T)) @ t["mlp.down_proj.weight"].T + h
        return rms(h, t["final_layernorm.weight"], eps)

    def token(self, out: torch.Tensor) -> int:
        return int((out @ self.lm_head.T).argmax())

    def output(self, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        streams: list[torch.Tensor] = []  # the residual stream entering the final norm
        hook = self.target.model.norm.register_forward_hook(lambda _m, args, _out: streams.append(args[0][0]))
        try:
            with torch.no_grad():
                self.target.model(torch.tensor([tokens[:-1]]))
        finally:
            hook.remove()
        hidden = streams[0]
        return self.first_pass(tokens, hidden)


def test_mtp_proposals_equal_a_float64_reference(pair: tuple[Path, Path]) -> None:
    """The layer's proposals are the reference's after every step of tests/spec_heads.py's walk
    (prompt chunks, decodes, a verified draft, the request's worker state rebuilt)."""
    qwen2, mimo = pair
    ref = _Reference(qwen2, mimo)
    runner = head_runner(mimo, _mtp())

    def output_as_the_reference(state: RequestState) -> None:
        # The output itself, not only its argmax (a wrong zero at position 0 moves it a little).
        position, out = runner.drafter.last[0]
        assert position == len(state.token_ids) - 2
        torch.testing.assert_close(out.double(), ref.output(state.token_ids)[0][0], atol=2e-5, rtol=0)

    walk_proposals(runner, ref.drafts, output_as_the_reference)


def test_outputs_equal_speculation_off_and_transformers(pair: tuple[Path, Path]) -> None:
    qwen2, mimo = pair
    outputs_equal_transformers(mimo, _mtp(), qwen2)


# Both preemption modes (the layer's KV recomputed, or swapped with the target's); the other
# engine settings run the same drafter code (worker/head_drafter.py) in tests/test_spec_eagle3.py.
@pytest.mark.parametrize("flags", [{"num_kv_blocks": 20, "preemption_mode": "recompute"},
                                   {"num_kv_blocks": 20, "preemption_mode": "swap", "swap_space": 0.01}],
                         ids=["recompute", "swap"])
def test_sampling_mix_equals_speculation_off(pair: tuple[Path, Path], flags: dict) -> None:
    _, mimo = pair
    mix_equals_speculation_off(mimo, _mtp(2), flags)


def test_what_mtp_cannot_serve_is_refused_in_one_sentence(pair: tuple[Path, Path], tmp_path: Path) -> None:
    qwen2, mimo = pair
    with pytest.raises(ValueError, match="needs MTP layers in the served checkpoint .* Qwen2ForCausalLM has none"):
        LLM(str(qwen2), speculative_config=_mtp())
    with pytest.raises(ValueError, match="drafts with the served model's own MTP layers; drop model"):
        LLM(str(mimo), speculative_config={**_mtp(), "model": str(qwen2)})
    # A checkpoint that promises an MTP layer it lacks, or one of another shape, is refused before
    # anything starts, naming the tensor (served without speculation, it loads: the layer is unused).
    broken = shutil.copytree(qwen2, tmp_path / "broken")
    cfg = json.loads((broken / "config.json").read_text())
    cfg.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks model.mtp_layers.0.self_attn.q_proj.weight, which config.json's "
                                         "num_nextn_predict_layers promises"):
        LLM(str(broken), speculative_config=_mtp())
    from safetensors.torch import load_file, save_file

    wrong = shutil.copytree(mimo, tmp_path / "wrong")
    tensors = load_file(wrong / "model-mtp.safetensors")
    tensors[MTP + "input_proj.weight"] = tensors[MTP + "input_proj.weight"][:, :64].contiguous()
    save_file(tensors, wrong / "model-mtp.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensor model.mtp_layers.0.input_proj.weight has shape \\(64, 64\\) but "
                                         "config.json implies \\(64, 128\\)"):
        LLM(str(wrong), speculative_config=_mtp())
    with LLM(str(broken), dtype="float32") as llm:
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def _tied_pair(tmp_path: Path, demo_path: Path) -> tuple[Path, Path]:
    qwen2 = _with_tokenizer(make_checkpoint("qwen2", tmp_path / "qwen2", tied=True, num_hidden_layers=2,
                                            vocab_size=706), demo_path)
    return _final_norm_not_ones(qwen2), make_mimo(qwen2, tmp_path / "mimo")


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied"])
def test_a_sharded_targets_layer_proposes_with_a_whole_head(pair: tuple[Path, Path], tmp_path: Path,
                                                             demo_path: Path, tied: bool) -> None:
    """Where the target's lm_head is split over ranks, the layer's own whole copy (the
    checkpoint's lm_head, or the tied embedding table) proposes what the target's head does."""
    from types import SimpleNamespace

    from noria.worker.mtp import MtpHead

    _, mimo = _tied_pair(tmp_path, demo_path) if tied else pair
    runner = head_runner(mimo, _mtp(), num_kv_blocks=16)
    target = runner.model

    def split(hidden: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a sharded target's head gathers over every rank: the layer must not call it")

    sharded = SimpleNamespace(spec=target.spec, tp=SimpleNamespace(size=2), embed_tokens=target.embed_tokens,
                              compute_logits=split)
    head = MtpHead(target.spec, sharded)  # type: ignore[arg-type]
    head.load(mimo)
    head.pack(None)
    hidden = torch.randn(7, target.spec.hidden_size, generator=torch.Generator().manual_seed(3)) * 3
    assert head.propose(hidden) == runner.drafter.head.propose(hidden)


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied"])
def test_two_ranks(pair: tuple[Path, Path], tmp_path: Path, demo_path: Path, tied: bool) -> None:
    """The target sharded over two ranks: the first drafts with a whole lm_head of its own (the
    checkpoint's, or the embedding table where they are tied) and broadcasts; greedy outputs are
    transformers'."""
    qwen2, mimo = _tied_pair(tmp_path, demo_path) if tied else pair
    rng = random.Random(8)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True) for _ in prompts]
    with LLM(str(mimo), dtype="float32", tensor_parallel_size=2, max_num_seqs=4, speculative_config=_mtp(2)) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        st = llm.stats()
    hf = load_reference(qwen2)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(hf, p, 20)
    assert st.spec_drafts > 0, st


def test_bfloat16_equals_speculation_off(pair: tuple[Path, Path]) -> None:
    _, mimo = pair
    bfloat16_equals_speculation_off(mimo, _mtp())


def test_the_benchmarks_mimo_copy_of_a_llama_serves_its_outputs(tmp_path: Path, demo_path: Path) -> None:
    """`noria bench spec`'s `mtp-K` rows serve the benchmark's Llama as a MiMo checkpoint (zero
    q/k/v biases and a random MTP layer beside it): its greedy outputs are the Llama's."""
    from noria.bench import spec
    from noria.bench.spec_models import mimo_checkpoint

    llama = _with_tokenizer(make_checkpoint("llama", tmp_path / "llama", num_hidden_layers=3, vocab_size=706),
                            demo_path)
    assert spec._config("mtp-4", (1, 3), llama) == _mtp(4)
    mimo = mimo_checkpoint(llama)
    rng = random.Random(9)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randint(2, 30))] for _ in range(3)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True) for _ in prompts]
    with LLM(str(mimo), dtype="float32", max_num_seqs=4, speculative_config=_mtp()) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats().spec_drafts > 0
    hf = load_reference(llama)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(hf, p, 16)


def test_a_checkpoint_naming_its_own_code_loads_without_asking(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """MiMo's published config.json names its modeling code (`auto_map`, for transformers'
    trust_remote_code): the tokenizer loads without transformers asking whether to run it."""
    import subprocess
    import sys

    _, mimo = pair
    folder = shutil.copytree(mimo, tmp_path / "published")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_mimo.MiMoConfig",
                       "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    code = f"from noria.frontend.processor import load_tokenizer; load_tokenizer({str(folder)!r}); print('loaded')"
    r = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "loaded", r.stderr
    assert "custom code" not in r.stdout + r.stderr
