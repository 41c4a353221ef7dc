"""The decoder stack in one native call (worker/native_stack.py) against the Python path.

Both run the same kernels in the same order, so the hidden states must be equal bit
for bit, not merely close: any slip in the driver (a residual added twice, a buffer
read after it was overwritten, a layer's window or bias dropped) changes bits.
Greedy parity with transformers through the same code is tests/test_worker_parity.py.
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from noria.bench.ceiling import _metadata
from noria.protocol.config import EngineConfig
from noria.protocol.families import FAMILIES
from noria.worker import cpu_kernels, fused_kernels, gemm_bf16_kernels, gemm_kernels, native_stack
from noria.worker.model_runner import ModelRunner
from noria.worker.models.linear import TorchLinear, packed
from tests import tiny_models
from tests.tiny_models import make_checkpoint

pytestmark = pytest.mark.skipif(native_stack.load() is None, reason="no C compiler for the native kernels")

# (query lengths, sequence lengths): decode rows only; short prompts as rows, one after a
# cached prefix; decodes mixed with a prompt; a prompt past ROWS_MAX_LEN (SDPA: Python path).
STEPS = {
    "decode": ([1] * 5, [3, 17, 40, 64, 130]),
    "prompts as rows": ([7, 33, 20], [7, 33, 90]),
    "mixed": ([1, 1, 1, 25], [200, 9, 60, 25]),
    "long prompt": ([1, 1100], [30, 1100]),  # past ROWS_MAX_LEN (1,024)
}


def _runner(path: Path, dtype: str = "float32") -> ModelRunner:
    """`dtype` bfloat16: the CPU's bf16 mode, bf16 weights and KV cache under float32 activations."""
    if dtype == "bfloat16" and gemm_bf16_kernels.load() is None:
        pytest.skip("no native bf16 GEMM: bfloat16 would run on torch's operators, off the driver")
    runner = ModelRunner(EngineConfig(model=str(path), dtype=dtype, device="cpu", num_kv_blocks=128,
                                      swap_space=0.001, num_threads=2))
    assert runner.kv_cache.device_cache.dtype == getattr(torch, dtype)
    torch.manual_seed(0)
    runner.kv_cache.device_cache.uniform_(-1, 1)  # contexts the steps attend to
    return runner


def _forward(runner: ModelRunner, step: tuple[list[int], list[int]], native: bool) -> tuple[torch.Tensor, bool]:
    """Hidden states of one step, and whether the native stack ran it."""
    model = runner.model
    ran: list[bool] = []
    real = native_stack.NativeStack.run

    def spy(self: native_stack.NativeStack, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        ran.append(True)
        return real(self, *args)  # type: ignore[arg-type]

    ids, meta = _metadata(runner, *step)
    before = runner.kv_cache.device_cache.clone()
    try:
        native_stack.NativeStack.run = spy  # type: ignore[method-assign]
        if not native:
            model._native_stack = lambda *a: None  # type: ignore[method-assign]
        with torch.inference_mode():
            hidden = model(ids, meta.positions, meta, runner.attention, runner._kv_layers)
    finally:
        native_stack.NativeStack.run = real  # type: ignore[method-assign]
        model.__dict__.pop("_native_stack", None)
    written = runner.kv_cache.device_cache.clone()
    runner.kv_cache.device_cache.copy_(before)  # the other path starts from the same caches
    return torch.cat([hidden.flatten(), written.flatten()]), bool(ran)


# Checkpoint options per case: plain (tied embeddings); sliding window; q/k/v biases; Qwen3's
# per-head q/k norm with head_dim 32 (not hidden / heads), 64 (GQA groups of 8, tied) and 128
# (no GQA, sliding windows on all layers but the first, as max_window_layers puts them); rotary
# on half of each head, with longrope's scaled cos / sin, and a window on every layer (Phi-3).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"tied": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3, head_dim 64, GQA 8:1, tied": ("qwen3", {"tied": True, "head_dim": 64, "num_attention_heads": 8,
                                                    "num_key_value_heads": 1}),
    "qwen3, head_dim 128, windows": ("qwen3", {"head_dim": 128, "num_key_value_heads": 4, "num_hidden_layers": 3,
                                               "use_sliding_window": True, "sliding_window": 48,
                                               "max_window_layers": 1}),
    "phi3, partial rotary": ("phi3", {"sliding_window": 48}),
    # Gemma 2: four (1 + w) norms per layer, GeGLU (tanh), scores soft-capped at 1.0, sliding and
    # global layers (window 20). Gemma 3: per-head (1 + w) q/k norm, the sliding layers' rope of
    # their own (base 100; the global ones' linear-scaled), also with head_dim 64 and GQA 8:1 over
    # four layers, two sliding ones in a row.
    "gemma2": ("gemma2", {"tied": True}),
    "gemma3": ("gemma3", {"tied": True}),
    "gemma3, head_dim 64, GQA 8:1": ("gemma3", {"head_dim": 64, "num_attention_heads": 8, "num_key_value_heads": 1,
                                                "num_hidden_layers": 4,
                                                "layer_types": ["sliding_attention", "sliding_attention",
                                                                "full_attention", "sliding_attention"]}),
}


@pytest.mark.parametrize("case", CASES)
def test_native_stack_is_bit_identical_to_the_python_path(case: str, tmp_path: Path) -> None:
    arch, options = CASES[case]
    runner = _runner(make_checkpoint(arch, tmp_path / arch, **options))
    assert native_stack.coverage(runner.model, runner._kv_layers) == [None] * len(runner.model.layers)
    for name, step in STEPS.items():
        python, _ = _forward(runner, step, native=False)
        native, ran = _forward(runner, step, native=True)
        assert ran == (name != "long prompt"), name
        assert torch.equal(python, native), f"{case}, {name}: hidden states or written K/V differ"


@pytest.mark.parametrize("case", ["llama", "qwen3, head_dim 128, windows", "phi3, partial rotary", "gemma2",
                                  "gemma3, head_dim 64, GQA 8:1"])
def test_a_bf16_kv_cache_runs_on_the_driver_bit_identically(case: str, tmp_path: Path) -> None:
    """The CPU's bf16 mode (bf16 weights and KV cache): every layer on the driver, whose attention
    reads the bf16 cache and rounds the rows it writes there, bit for bit the Python path's
    (windows, GQA, partial rotary, Gemma's soft-capped scores)."""
    arch, options = CASES[case]
    runner = _runner(make_checkpoint(arch, tmp_path / arch, **options), "bfloat16")
    layers = len(runner.model.layers)
    assert native_stack.describe(_coverage(runner)) == f"native CPU stack: on for all {layers} layers"
    for name, step in STEPS.items():
        python, _ = _forward(runner, step, native=False)
        native, ran = _forward(runner, step, native=True)
        assert ran == (name != "long prompt"), name
        assert torch.equal(python, native), f"{case}, {name}: hidden states or written K/V differ"


def test_qwen3_runs_on_the_driver(tmp_path: Path) -> None:
    """Every layer of a Qwen3 decode step goes through the driver, counted by the stack itself."""
    runner = _runner(make_checkpoint("qwen3", tmp_path / "qwen3", num_hidden_layers=3))
    _forward(runner, STEPS["decode"], native=True)
    _forward(runner, STEPS["long prompt"], native=True)  # SDPA: the Python path, not counted
    stack = runner.model._stack
    assert stack is not None and stack.segments == [(0, 3, True)] and stack.layer_runs == 3


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_runs_on_the_driver(arch: str, tmp_path: Path) -> None:
    """Every layer of a Gemma step whose attention is paged rows goes through the driver, counted
    by the stack itself; a Gemma layer the driver does not know (its MLP's exact gelu) runs in
    Python between the driver's runs, bit for bit the same."""
    runner = _runner(make_checkpoint(arch, tmp_path / arch, tied=True))
    _forward(runner, STEPS["decode"], native=True)
    _forward(runner, STEPS["prompts as rows"], native=True)
    _forward(runner, STEPS["long prompt"], native=True)  # SDPA: the Python path, not counted
    stack = runner.model._stack
    assert stack is not None and stack.segments == [(0, 3, True)] and stack.layer_runs == 2 * 3

    _unpack(runner.model.layers[1].mlp.gate_up_proj)  # F.linear for this one: outside the driver
    runner.model._stack_key = None
    reasons = _coverage(runner)
    assert reasons == [None, "gate_up not packed for the native GEMM", None]
    for name, step in STEPS.items():
        python, _ = _forward(runner, step, native=False)
        native, ran = _forward(runner, step, native=True)
        assert ran == (name != "long prompt"), name
        assert torch.equal(python, native), f"{name}: hidden states or written K/V differ"
    stack = runner.model._stack
    assert stack is not None and stack.segments == [(0, 1, True), (1, 2, False), (2, 3, True)]
    assert stack.layer_runs == 3 * 2


def test_declined_layers_run_in_python_between_the_drivers_runs(tmp_path: Path) -> None:
    runner = _runner(make_checkpoint("qwen3", tmp_path / "qwen3", num_hidden_layers=4))
    _unpack(runner.model.layers[1].mlp.gate_up_proj)  # F.linear for this one: outside the driver
    runner.model._stack_key = None
    reasons = native_stack.coverage(runner.model, runner._kv_layers)
    assert reasons == [None, "gate_up not packed for the native GEMM", None, None]
    assert native_stack.describe(reasons) == ("native CPU stack: on for layers 0, 2-3; "
                                              "off for layer 1 (gate_up not packed for the native GEMM)")
    for name, step in STEPS.items():
        python, _ = _forward(runner, step, native=False)
        native, ran = _forward(runner, step, native=True)
        assert ran == (name != "long prompt"), name
        assert torch.equal(python, native), f"{name}: hidden states or written K/V differ"
    stack = runner.model._stack
    assert stack is not None and stack.segments == [(0, 1, True), (1, 2, False), (2, 4, True)]
    assert stack.layer_runs == 3 * 3  # three steps on the driver, three of the four layers each


@pytest.mark.parametrize("case", ["qwen3, head_dim 128", "gemma2", "gemma3", "gemma2, bf16"])
def test_the_avx2_builds_run_the_stack_bit_identically(case: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel the driver calls built for AVX2 (x86-64-v3: 8-float vectors, where an AVX-512
    host's -march=native build has 16), the driver on them against the Python path on them:
    Qwen3, and Gemma's GeGLU, extra norms, soft-capped attention and local rope; Gemma in the
    bf16 mode too (the bf16 GEMM and the attention over a bf16 cache, both widening in AVX2)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is an x86 instruction set")
    modules = (gemm_kernels, gemm_bf16_kernels, fused_kernels, cpu_kernels)
    for module in modules:
        flags = ["-march=x86-64-v3" if f == "-march=native" else f for f in module._FLAGS]
        monkeypatch.setattr(module, "_FLAGS", flags)
    loads = (*(m.load for m in modules), native_stack.load)
    for load in loads:
        load.cache_clear()
    try:
        if native_stack.load() is None:
            pytest.skip("no compiler for the AVX2 builds")
        arch, options = ("qwen3", {"tied": True, "head_dim": 128}) if case.startswith("qwen3") else \
            (case.split(",")[0], {})
        runner = _runner(make_checkpoint(arch, tmp_path / arch, **options),
                         "bfloat16" if case.endswith("bf16") else "float32")
        for name, step in STEPS.items():
            python, _ = _forward(runner, step, native=False)
            native, ran = _forward(runner, step, native=True)
            assert ran == (name != "long prompt"), name
            assert torch.equal(python, native), f"{name}: hidden states or written K/V differ"
    finally:
        monkeypatch.undo()
        for load in loads:
            load.cache_clear()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixture_of_experts_layers_run_on_the_driver(arch: str, tmp_path: Path) -> None:
    """Mixtral (every layer sparse), Qwen2-MoE (a shared expert and its gate) and Qwen3-MoE (a
    dense first layer, mlp_only_layers): every layer on the driver, a sparse one's MLP its block
    called back on the driver's normed rows; bit for bit the Python path, and each block ran
    once per layer and step."""
    if arch not in getattr(tiny_models, "MOE_ARCHS", ()):
        pytest.skip("no mixture-of-experts tiny checkpoints here")
    runner = _runner(make_checkpoint(arch, tmp_path / arch))
    layers = runner.model.layers
    sparse = [i for i, layer in enumerate(layers) if type(layer.mlp).__name__ == "SparseMoeBlock"]
    assert sparse and (arch != "qwen3_moe" or sparse == list(range(1, len(layers))))
    assert native_stack.coverage(runner.model, runner._kv_layers) == [None] * len(layers)
    calls: list[int] = []
    for i in sparse:
        layers[i].mlp.register_forward_hook(lambda m, args, out, i=i: calls.append(i))
    for name, step in STEPS.items():
        python, _ = _forward(runner, step, native=False)
        calls.clear()
        native, ran = _forward(runner, step, native=True)
        assert ran == (name != "long prompt"), name
        assert calls == sparse, name
        assert torch.equal(python, native), f"{arch}, {name}: hidden states or written K/V differ"
    stack = runner.model._stack
    assert stack is not None and stack.segments == [(0, len(layers), True)]


def test_a_failing_expert_block_raises_from_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in a sparse layer's block, called from inside the C driver, reaches the caller."""
    if "mixtral" not in getattr(tiny_models, "MOE_ARCHS", ()):
        pytest.skip("no mixture-of-experts tiny checkpoints here")
    runner = _runner(make_checkpoint("mixtral", tmp_path / "mixtral"))
    block = runner.model.layers[-1].mlp

    def broken(*args: object) -> None:
        raise RuntimeError("expert block failed")

    monkeypatch.setattr(block, "forward", broken)
    with pytest.raises(RuntimeError, match="expert block failed"):
        _forward(runner, STEPS["decode"], native=True)


def _unpack(linear: torch.nn.Module) -> None:
    """F.linear over the weight the panels hold (the model keeps no other copy)."""
    linear.weight = torch.nn.Parameter(packed(linear.op).unpack(), requires_grad=False)
    linear.op = TorchLinear(linear.weight)


def _coverage(runner: ModelRunner) -> list[str | None]:
    return native_stack.coverage(runner.model, runner._kv_layers)


# tests/tiny_models.py's name of each family's tiny checkpoint, by model_type.
_TINY = {"gemma3_text": "gemma3"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_every_supported_family_runs_on_the_driver(architecture: str, dtype: str, tmp_path: Path) -> None:
    """No family noria implements falls off the native stack, in float32 or in the CPU's bf16 mode
    (bf16 weights and KV cache): every layer of its tiny checkpoint is on the driver, and a decode
    step runs there, bit for bit the Python path."""
    model_type = FAMILIES[architecture].model_type
    arch = _TINY.get(model_type, model_type)
    runner = _runner(make_checkpoint(arch, tmp_path / arch), dtype)
    assert _coverage(runner) == [None] * len(runner.model.layers)
    python, _ = _forward(runner, STEPS["decode"], native=False)
    native, ran = _forward(runner, STEPS["decode"], native=True)
    assert ran and torch.equal(python, native)


def test_recipe_entries_outside_the_drivers_are_declined_with_their_name(tmp_path: Path) -> None:
    """What the driver does not run is named in the reason, from the model's spec, not run wrong:
    an activation, a partial rotary under a q/k norm, a non-positive soft-cap,
    and any spec field the driver has not learnt (fine at its default, declined off it)."""
    runner = _runner(make_checkpoint("qwen3", tmp_path / "qwen3", num_hidden_layers=3))
    model = runner.model
    spec = model.spec
    assert _coverage(runner) == [None, None, None]
    for changes, want in (
        ({"activation": "gelu"}, "activation 'gelu': the driver's gated activations are silu and the tanh GeGLU"),
        ({"rope": dataclasses.replace(spec.rope, partial_rotary_factor=0.5)},
         "per-head q/k norm with partial rotary: its fused kernel rotates whole heads"),
        ({"attn_softcap": -1.0}, "attention soft-cap -1.0: a cap must be positive"),
    ):
        model.spec = dataclasses.replace(spec, **changes)
        assert _coverage(runner) == [want] * 3, changes
    fields = [(f.name, f.type, f) for f in dataclasses.fields(spec)]
    grown = dataclasses.make_dataclass("ModelSpec", [*fields, ("logit_scale", float | None,
                                                               dataclasses.field(default=None, kw_only=True))],
                                       frozen=True)
    copy = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    model.spec = grown(**copy)
    assert _coverage(runner) == [None, None, None]
    model.spec = grown(**copy, logit_scale=0.5)
    assert _coverage(runner) == ["ModelSpec.logit_scale=0.5"] * 3
    model.spec = spec
    assert _coverage(runner) == [None, None, None]


def test_the_start_up_line_says_which_layers_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    path = make_checkpoint("qwen3", tmp_path / "qwen3")

    def lines() -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.getMessage().startswith("native CPU stack: ")]
        caplog.clear()
        return found

    with caplog.at_level("INFO", logger="noria.worker"):
        _runner(path)
        assert lines() == ["native CPU stack: on for all 2 layers"]
        monkeypatch.setenv("NORIA_DISABLE_CPU_STACK", "1")
        native_stack.load.cache_clear()
        try:
            runner = _runner(path)
            assert lines() == ["native CPU stack: off (NORIA_DISABLE_CPU_STACK=1)"]
            _, ran = _forward(runner, STEPS["decode"], native=True)
            assert not ran
        finally:
            monkeypatch.delenv("NORIA_DISABLE_CPU_STACK")
            native_stack.load.cache_clear()


def test_scratch_buffers_grow_and_are_reused(tmp_path: Path) -> None:
    runner = _runner(make_checkpoint("llama", tmp_path / "llama"))
    for step in (STEPS["decode"], STEPS["prompts as rows"], STEPS["decode"]):
        python, _ = _forward(runner, step, native=False)
        native, ran = _forward(runner, step, native=True)
        assert ran and torch.equal(python, native)
    stack = runner.model._stack
    assert stack is not None and stack._capacity >= sum(STEPS["prompts as rows"][0])


def test_qwen3_through_the_engine_is_the_same_with_the_stack_on_and_off(
        tmp_path: Path, demo_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real processes: a Qwen3 checkpoint (head_dim 64, GQA, tied embeddings) gives the same greedy
    tokens and the same logprobs, to float32 rounding, with the native stack on and with
    NORIA_DISABLE_CPU_STACK=1; both are transformers' greedy continuation, logprobs within float32
    rounding of transformers' (teacher-forced). Bit for bit is asserted on fixed steps above: two
    engine runs may cut their steps differently (a request can arrive after the first step is
    planned), and a row's rounding follows the rows beside it in the GEMMs."""
    from transformers import AutoModelForCausalLM

    from noria import LLM, SamplingParams

    path = make_checkpoint("qwen3", tmp_path / "qwen3", tied=True, head_dim=64, num_attention_heads=8,
                           num_key_value_heads=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_path / name).exists():
            shutil.copy(demo_path / name, path / name)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 20, 45, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)

    def generate() -> list[tuple[list[int], object]]:
        with LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
                 block_size=16) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    on = generate()
    monkeypatch.setenv("NORIA_DISABLE_CPU_STACK", "1")
    off = generate()
    assert [tokens for tokens, _ in on] == [tokens for tokens, _ in off]
    for (_, a), (_, b) in zip(on, off, strict=True):
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a]),  # type: ignore[attr-defined]
                                   torch.tensor([lp.logprob for lp in b]), rtol=0, atol=1e-5)  # type: ignore[attr-defined]

    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, (tokens, logprobs) in zip(prompts, on, strict=True):
        with torch.inference_mode():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
            logits = reference(torch.tensor([prompt + tokens])).logits[0]
        assert tokens == want.tolist()
        start = len(prompt) - 1
        ref = torch.log_softmax(logits, -1)[start : start + len(tokens)]
        got = torch.tensor([lp.logprob for lp in logprobs])  # type: ignore[attr-defined]
        torch.testing.assert_close(got, ref[torch.arange(len(tokens)), torch.tensor(tokens)], rtol=0, atol=1e-4)


def test_the_c_structs_match_their_python_mirror(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver reads its structs by offset: the ctypes mirror is checked against the compiled
    C (sizes and offsets) when the library loads, and a field moved or added on one side only
    fails there, named."""
    import ctypes

    from noria.worker import native_layout

    loaded = native_stack.load()
    assert loaded is not None
    dll = loaded[0]
    native_layout.check(dll)
    fields = list(native_layout.Layer._fields_)
    at = [name for name, _ in fields].index("window")
    moved = fields[:at] + [fields[at + 1], fields[at]] + fields[at + 2:]  # window and q_norm swapped
    grown = [*fields, ("lora", ctypes.c_void_p)]
    for layout, want in ((moved, r"differs at Layer\.window: 104 in Python, 96 in C"),
                         (grown, r"differs at sizeof\(Layer\)")):
        layer = type("Layer", (ctypes.Structure,), {"_fields_": layout})
        monkeypatch.setattr(native_layout, "STRUCTS", (native_layout.Kernels, layer, native_layout.Shape,
                                                       native_layout.Step))
        with pytest.raises(RuntimeError, match=want):
            native_layout.check(dll)
