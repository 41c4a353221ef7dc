"""--kv-cache-dtype fp8 through the engine: logprobs against transformers in float32, the
checkpoint's k/v scales read (vLLM's and compressed-tensors' names) and used, the block count of
--kv-cache-memory, swap preemption, the native decoder stack, compressed-tensors' kv_cache_scheme,
and the attention backend chosen for an fp8 cache (the CUDA kernels read it for 16-bit models;
tests/kernels/test_attention_fp8.py checks the kernels themselves).

The tolerance. An e4m3 value keeps 3 mantissa bits, so every cached K and V value is off by up to
2^-4 of itself (half an ulp); everything else is float32. On these tiny random models (2 layers,
K/V of order 1, near-flat next-token distributions) moves a chosen token's logprob by up to 0.08
(measured on these prompts: 0.073 for the base model, 0.078 for its K/V-scaled twin with scales).
We allow FP8_TOL = 0.2 nats, 2.5x that; a real error moves them by far more: the checkpoint's
scales ignored (values saturated at 448) by 1.9 (over 1 asserted below), a stale or misplaced
block by the difference between contexts. Tokens are
teacher-forced (transformers scores the fp8 engine's own tokens): the logits are too flat here for
greedy tokens to survive 2^-4 perturbations, so tokens alone would not be a fair comparison.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from noria import LLM, SamplingParams
from noria.protocol.config import EngineConfig
from noria.protocol.quant_config import read_quant
from noria.protocol.step import NewRequestData, StepPlan
from noria.worker import native_stack
from noria.worker.attention import LayerAttention, TorchAttentionBackend
from noria.worker.attention_select import select_attention_backend
from noria.worker.errors import WorkerFatal
from noria.worker.kv_cache import GiB
from noria.worker.kv_fp8 import FP8
from noria.worker.model_runner import ModelRunner
from tests.test_worker_swap import GREEDY, _swap_scenario
from tests.tiny_models import make_checkpoint

FP8_TOL = 0.2
SCALE_UP = 1000.0  # K and V of the scaled checkpoint: ~1000x the base model's, far past e4m3's 448
KV_SCALE = 10.0  # its k/v scales: x = k / 10 of order 100, inside e4m3's range
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # CUDA: only named, never used
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, demo_path: Path) -> Path:
    path = make_checkpoint("llama", tmp_path_factory.mktemp("fp8") / "llama", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_path / name, path / name)
    return path


def _variant(base: Path, dest: Path, scales: dict[str, float] | None, quant: dict | None = None) -> Path:
    """`base` with K and V scaled up by SCALE_UP and q / o scaled down by as much (the same function:
    scores and outputs unchanged), plus `scales` (suffix after "model.layers.N.self_attn." -> value)
    for every layer, and `quant` as its quantization_config."""
    shutil.copytree(base, dest)
    file = dest / "model.safetensors"
    tensors = load_file(file)
    for name in list(tensors):
        factor = {"k_proj": SCALE_UP, "v_proj": SCALE_UP, "q_proj": 1 / SCALE_UP, "o_proj": 1 / SCALE_UP}
        for proj, f in factor.items():
            if f".self_attn.{proj}.weight" in name:
                tensors[name] = tensors[name] * f
    config = json.loads((dest / "config.json").read_text())
    for i in range(config["num_hidden_layers"]):
        for suffix, value in (scales or {}).items():
            tensors[f"model.layers.{i}.self_attn.{suffix}"] = torch.tensor(value)
    save_file(tensors, str(file), metadata={"format": "pt"})
    if quant is not None:
        config["quantization_config"] = quant
        (dest / "config.json").write_text(json.dumps(config))
    return dest


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 30, 61)]


def _engine_logprobs(path: Path, kv_cache_dtype: str) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=4, max_num_batched_tokens=48,
             num_kv_blocks=32, block_size=16) as llm:
        outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def _reference_errors(reference: Path, runs: list[tuple[list[int], list[float]]]) -> float:
    """The largest |logprob - transformers' float32 logprob| of the chosen tokens, teacher-forced."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    worst = 0.0
    for prompt, (tokens, logprobs) in zip(_prompts(), runs, strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        chosen = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
        worst = max(worst, (torch.tensor(logprobs) - chosen).abs().max().item())
    return worst


def test_fp8_cache_engine_matches_float32_transformers_logprobs(checkpoint: Path) -> None:
    fp8, exact = _engine_logprobs(checkpoint, "fp8"), _engine_logprobs(checkpoint, "auto")
    assert _reference_errors(checkpoint, fp8) <= FP8_TOL
    assert _reference_errors(checkpoint, exact) <= 1e-4  # the float32 cache: float32 rounding only
    # The cache really is fp8: its rounding shows in the logprobs.
    assert max(abs(a - b) for (_, x), (_, y) in zip(fp8, exact, strict=True) for a, b in zip(x, y, strict=True)) > 1e-3


@pytest.mark.parametrize("names", [("k_scale", "v_scale"), ("k_proj.k_scale", "v_proj.v_scale"),
                                   ("kv_scale",)], ids=["vllm", "modelopt", "kv_scale"])
def test_checkpoint_scales_are_read_and_used(checkpoint: Path, tmp_path: Path, names: tuple[str, ...]) -> None:
    """K/V about 1000x the base model's: without the checkpoint's scales they saturate at 448 and the
    logprobs are more than 1 nat off; with them, as close as the unscaled model's fp8 cache."""
    unscaled = _variant(checkpoint, tmp_path / "none", None)
    scaled = _variant(checkpoint, tmp_path / "scaled", dict.fromkeys(names, KV_SCALE))
    assert _reference_errors(unscaled, _engine_logprobs(scaled, "fp8")) <= FP8_TOL
    if names == ("k_scale", "v_scale"):  # one engine run suffices to show what ignoring them costs
        assert _reference_errors(unscaled, _engine_logprobs(unscaled, "fp8")) > 1.0
        assert _reference_errors(unscaled, _engine_logprobs(scaled, "auto")) <= 1e-3  # a float cache ignores them


def _runner(path: Path, **kw: object) -> ModelRunner:
    flags = {"model": str(path), "num_kv_blocks": 16, "swap_space": 0.001, "num_threads": 2, "dtype": "float32",
             "kv_cache_dtype": "fp8"} | kw
    return ModelRunner(EngineConfig(**flags))  # type: ignore[arg-type]


def test_compressed_tensors_kv_cache_scheme_scales_are_read(checkpoint: Path, tmp_path: Path) -> None:
    """A compressed-tensors checkpoint whose only quantization is its kv_cache_scheme (llm-compressor
    writes k_proj.output_scale / v_proj.output_scale): float weights, each layer's own scales."""
    quant = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
             "kv_cache_scheme": KV_SCHEME}
    path = _variant(checkpoint, tmp_path / "ct", {"k_proj.output_scale": 12.0, "v_proj.output_scale": 9.0}, quant)
    runner = _runner(path)
    assert runner.spec.quantization is None
    assert all((layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) == (12.0, 9.0)
               for layer in runner.model.layers)
    assert runner.kv_cache.device_cache.dtype == FP8
    plain = _runner(checkpoint, kv_cache_dtype="auto")  # scales only on an fp8 cache
    assert {(la.self_attn.attn.k_scale, la.self_attn.attn.v_scale) for la in plain.model.layers} == {(1.0, 1.0)}


def test_kv_cache_scheme_of_another_form_is_refused_in_one_sentence() -> None:
    group = {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel",
                                                      "symmetric": True, "dynamic": False},
                   "input_activations": None}}
    base = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": group}
    assert read_quant({"quantization_config": {**base, "kv_cache_scheme": KV_SCHEME}}) is not None
    for bad in ({**KV_SCHEME, "type": "int"}, {**KV_SCHEME, "num_bits": 4}, {**KV_SCHEME, "strategy": "channel"},
                {**KV_SCHEME, "symmetric": False}):
        with pytest.raises(ValueError, match="kv_cache_scheme") as e:
            read_quant({"quantization_config": {**base, "kv_cache_scheme": bad}})
        assert "\n" not in str(e.value) and str(e.value).count(". ") == 0


def test_kv_cache_memory_holds_four_times_the_float32_blocks(checkpoint: Path) -> None:
    fp8 = _runner(checkpoint, num_kv_blocks=None, kv_cache_memory=0.001, preemption_mode="swap")
    f32 = _runner(checkpoint, num_kv_blocks=None, kv_cache_memory=0.001, preemption_mode="swap",
                  kv_cache_dtype="auto")
    # 2 layers x K, V x 16 tokens x 2 KV heads x head size 16, one byte each.
    assert fp8.kv_cache.layout.bytes_per_block == 2 * 2 * 16 * 2 * 16 == f32.kv_cache.layout.bytes_per_block // 4
    assert fp8.num_kv_blocks == int(0.001 * GiB) // 2048 == 4 * f32.num_kv_blocks
    assert fp8.num_cpu_blocks == int(0.001 * GiB) // 2048 == 4 * f32.num_cpu_blocks  # --swap-space too
    assert fp8.kv_cache.device_cache.nbytes == (fp8.num_kv_blocks + 1) * 2048  # and the null block


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt") / "qwen2", seed=5)


def test_swap_preemption_with_an_fp8_kv_cache(qwen2: Path) -> None:
    """A request swapped out mid-decode (its fp8 blocks to the CPU, the device blocks overwritten)
    and back into other blocks continues as the same engine continues it unpreempted, alone."""
    runner = _runner(qwen2, preemption_mode="swap")
    assert runner.kv_cache.device_cache.dtype == runner.kv_cache.cpu_cache.dtype == FP8
    (pa, out_a), (pb, out_b) = _swap_scenario(runner)
    for prompt, out in ((pa, out_a), (pb, out_b)):
        alone = _runner(qwen2)
        got = alone.execute(StepPlan(step_id=0, params=[GREEDY], scheduled=[(0, len(prompt))], new_requests=[
            NewRequestData(0, prompt, [0, 1, 2, 3], 0, 0, len(prompt))])).token_ids
        for step in range(1, len(out)):
            got += alone.execute(StepPlan(step_id=step, params=[GREEDY], scheduled=[(0, 1)])).token_ids
        assert got == out


@pytest.mark.skipif(native_stack.load() is None, reason="no C compiler for the native kernels")
def test_native_stack_runs_an_fp8_cache_bit_for_bit_as_the_layers(checkpoint: Path, tmp_path: Path) -> None:
    """The decoder stack takes an fp8 cache (each layer's scales through its scaled attention entry):
    hidden states and written bytes equal the per-layer path's, decode rows and prompts as rows."""
    from noria.bench.ceiling import _metadata

    runner = _runner(_variant(checkpoint, tmp_path / "s", {"k_scale": 7.0, "v_scale": 11.0}), num_kv_blocks=64)
    assert native_stack.coverage(runner.model, runner._kv_layers) == [None, None]
    g = torch.Generator().manual_seed(0)
    bits = runner.kv_cache.device_cache.view(torch.uint8)
    bits.copy_(torch.randint(0, 0x60, bits.shape, generator=g, dtype=torch.uint8) | (torch.randint(
        0, 2, bits.shape, generator=g, dtype=torch.uint8) << 7))  # finite values of both signs, no NaN
    model, start = runner.model, bits.clone()
    for step in (([1] * 4, [3, 17, 40, 130]), ([7, 33], [7, 90])):
        results = []
        for native in (True, False):
            ran: list[bool] = []
            real = native_stack.NativeStack.run
            bits.copy_(start)
            ids, meta = _metadata(runner, *step)
            try:
                native_stack.NativeStack.run = lambda self, *a, r=real, ran=ran: ran.append(True) or r(self, *a)
                if not native:
                    model._native_stack = lambda *a: None  # type: ignore[method-assign]
                with torch.inference_mode():
                    hidden = model(ids, meta.positions, meta, runner.attention, runner._kv_layers)
            finally:
                native_stack.NativeStack.run = real  # type: ignore[method-assign]
                model.__dict__.pop("_native_stack", None)
            assert ran == ([True] if native else [])
            results.append((hidden.clone(), bits.clone()))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


LAYER = LayerAttention(4, 2, 32, 0.2)


def test_kernels_backend_with_an_fp8_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model's layers have no fp8 kernels: `--attention-backend kernels` is refused in one
    sentence that says why, auto runs torch; a 16-bit model's layers run on the kernels."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # nothing here may reach for CuPy

    class Compiles:
        """A kernel backend that only records the compiles of the start-up warm-up."""

        def __init__(self) -> None:
            self.names: list[str] = []

        def check(self) -> None:
            pass

        def kernel(self, spec: object, name: str) -> None:
            self.names.append(name)

    with pytest.raises(WorkerFatal) as e:
        select_attention_backend(CUDA, [LAYER], choice="kernels", kernel_backend=Compiles(), kv_dtype=FP8)
    text = str(e.value)
    assert "\n" not in text and "--attention-backend kernels" in text and "fp8 KV cache" in text
    choice = select_attention_backend(CUDA, [LAYER], kernel_backend=Compiles(), kv_dtype=FP8)
    assert isinstance(choice.backend, TorchAttentionBackend) and choice.name == "torch" and "fp8" in choice.reason
    layer = LayerAttention(4, 2, 64, 0.125, k_scale=0.5, v_scale=2.0)
    compiles = Compiles()
    choice = select_attention_backend(CUDA, [layer], torch.float16, 16, choice="kernels", kernel_backend=compiles,
                                      kv_dtype=FP8)
    assert choice.name == "kernels" and choice.reason == ""
    assert any(n.endswith(", unsigned char>") for n in compiles.names)
    assert select_attention_backend(CPU, [LAYER], kv_dtype=FP8).backend.native  # the CPU's native kernel
