"""The roofline arithmetic (bench/roofline.py) against hand computations and torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch

from noria.bench.roofline import Shape, analyse, config_spec, step_cost
from noria.bench.roofline_machine import Machine, flops_per_cycle, theoretical_peak

TINY = Shape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10)


def _machine(copy_gbs: float, gemm_gflops: float, read_gbs: float | None = None) -> Machine:
    return Machine(threads=2, copy_gbs=copy_gbs, read_gbs=read_gbs or copy_gbs, gemm_gflops=gemm_gflops,
                   gemm_n=64, stream_mib=1, fma_peak_gflops=None, fma_peak_how="")


def test_a_tiny_step_by_hand():
    # One prefill of 3 tokens (a new sequence) and one decode at position 4, both sampling.
    moved, flops = step_cost(TINY, [3, 1], [3, 5], 2)
    # Per layer: qkv 8 x (8 + 4 + 4) = 128, o 8 x 8 = 64, gate/up/down 3 x 8 x 16 = 384: 576; two layers 1152.
    weights = 1152 * 4 + 5 * 8 * 4 + 10 * 8 * 4  # + 5 norms of 8 + the LM head (rows sample)
    embedding = 4 * 8 * 4  # 4 tokens
    kv = 2 * (2 * 1 * 4 * 4) * (3 + 5 + 4)  # 2 layers x 32 B a row x (8 rows attended + 4 written)
    logits = 2 * 10 * 4
    assert moved == weights + embedding + kv + logits == 6064
    # Keys attended: prefill positions 0, 1, 2 see 1 + 2 + 3; the decode at position 4 sees 5: 11.
    assert flops == 2 * 1152 * 4 + 2 * 80 * 2 + 4 * 2 * 2 * 4 * 11 == 10240


def test_no_sampling_row_reads_no_lm_head():
    moved, flops = step_cost(TINY, [2], [6], 0)  # a prefill chunk that does not reach its end
    assert moved == 1152 * 4 + 5 * 8 * 4 + 2 * 8 * 4 + 2 * 32 * (6 + 2)
    assert flops == 2 * 1152 * 2 + 4 * 2 * 2 * 4 * (5 + 6)


def test_shape_from_a_config_matches_the_model_transformers_builds():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 50, "tie_word_embeddings": False}
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    linear = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and n.endswith("proj.weight"))
    shape = Shape.from_config(cfg)
    assert shape.layer_params == linear
    assert shape.head_params == model.lm_head.weight.numel()
    assert shape.head_dim == 16 and shape.kv_heads == 2 and shape.dtype_bytes == 4


@pytest.mark.parametrize("tokens", [1, 7])
def test_flops_match_torchs_counter_on_a_prefill(tokens):
    """torch's FLOP counter over a transformers forward (eager attention: two matmuls per head over
    the full T x T square, masked afterwards; logits for the last position only) gives, less the
    masked half of the square, the step's FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 50}
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="eager")).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        model(torch.arange(tokens)[None], logits_to_keep=1)
    shape = Shape.from_config(cfg)
    masked = 4 * shape.layers * shape.heads * shape.head_dim * (tokens * tokens - tokens * (tokens + 1) // 2)
    assert step_cost(shape, [tokens], [tokens], 1)[1] == counter.get_total_flops() - masked


def test_analyse_sums_the_larger_bound_and_buckets_by_rows():
    machine = _machine(copy_gbs=1e-6, gemm_gflops=1e-6)  # 1,000 bytes/s, 1,000 FLOP/s
    decode = ([1, 1], [4, 9], 2, 20.0)
    prefill = ([3, 1], [3, 5], 2, 30.0)
    a = analyse(TINY, machine, [decode, prefill, decode], wall_seconds=100.0)
    d_bytes, d_flops = step_cost(TINY, [1, 1], [4, 9], 2)
    assert a["floor_seconds"] == pytest.approx((2 * max(d_bytes, d_flops) + max(6064, 10240)) / 1000)
    assert a["forward_seconds"] == 70.0
    assert a["floor_of_wall"] == pytest.approx(a["floor_seconds"] / 100)
    rows = {(r["kind"], r["rows"]): r for r in a["table"]}
    assert set(rows) == {("decode", "2-3"), ("prefill", "2-3")}
    assert rows[("decode", "2-3")]["steps"] == 2 and rows[("decode", "2-3")]["measured_ms"] == 20000.0
    assert rows[("prefill", "2-3")]["bound"] == "compute"  # 10240 FLOPs > 6064 bytes at equal rates
    assert len(a["per_step"]) == 3


def test_read_bandwidth_only_shortens_the_memory_side():
    steps = [([1], [9], 1, 1.0)]
    slow = analyse(TINY, _machine(1e-6, 1.0, read_gbs=2e-6), steps, 1.0)
    assert slow["floor_seconds_read_bw"] == pytest.approx(slow["floor_seconds"] / 2)


def test_theoretical_peak_from_cpuinfo():
    cpuinfo = "vendor_id\t: AuthenticAMD\ncpu MHz\t\t: 2500.000\nflags\t\t: fpu sse avx avx2 fma\n"
    peak, how = theoretical_peak(cpuinfo, 2)
    assert peak == pytest.approx(2 * 2.5 * 32) and "AVX2" in how
    assert flops_per_cycle({"avx512f", "avx2", "fma"}, "GenuineIntel")[0] == 64
    assert flops_per_cycle({"avx512f", "avx2", "fma"}, "AuthenticAMD")[0] == 32
    assert theoretical_peak("nothing here", 2)[0] is None


def test_best_of_several_measurements():
    a, b = _machine(10.0, 50.0), _machine(12.0, 40.0)
    best = Machine.best([a, b])
    assert (best.copy_gbs, best.gemm_gflops) == (12.0, 50.0)


def test_report_and_plot_of_recorded_runs(tmp_path):
    from noria.bench.roofline import best_per_system, from_runs, plot, report

    steps = [([1, 1], [4, 9], 2, 0.02), ([3, 1], [3, 5], 2, 0.03)]
    runs = {"noria-llm": [{"seconds": 0.2, "_steps": steps}, {"seconds": 0.1, "_steps": steps}],
            "ceiling": [{"seconds": 0.04, "_steps": steps}], "hf-cb": [{"seconds": 1.0}]}
    machine = Machine(threads=2, copy_gbs=1e-6, read_gbs=2e-6, gemm_gflops=1e-5, gemm_n=64, stream_mib=1,
                      fma_peak_gflops=2e-5, fma_peak_how="test")
    analyses = from_runs(TINY, machine, runs)
    assert list(analyses) == ["noria-llm #1", "noria-llm #2", "ceiling #1"]
    assert analyses["ceiling #1"]["forward_seconds"] == 0.0
    assert list(best_per_system(analyses)) == ["noria-llm #2"]
    text = report(machine, analyses)
    floor = analyses["noria-llm #2"]["floor_seconds"]
    assert "noria-llm #2" in text and f"{floor / 0.1:.0%}" in text and "by row count, noria-llm #2" in text
    assert "decode" in text and "prefill" in text
    plot(best_per_system(analyses), tmp_path / "r.png", "test")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_each_run_against_the_probes_that_bracket_it():
    from noria.bench.roofline import bracketed, format_bracketed

    steps = [([1, 1], [4, 9], 2, 0.02), ([3, 1], [3, 5], 2, 0.03)]
    slow, fast = _machine(1e-6, 1e-5), _machine(4e-6, 4e-5)
    runs = {"noria-llm": [{"seconds": 0.2, "_steps": steps, "_probes": [0, 1]},
                          {"seconds": 0.2, "_steps": steps, "_probes": [1, 2]}],
            "hf-cb": [{"seconds": 1.0}]}
    got = bracketed(TINY, [slow, slow, fast], runs)
    assert list(got) == ["noria-llm #1", "noria-llm #2"]
    # The first run saw only slow probes: its floor is the slow machine's, 4x the one after the fast probe.
    assert got["noria-llm #1"]["floor_seconds"] == pytest.approx(analyse(TINY, slow, steps, 0.2)["floor_seconds"])
    assert got["noria-llm #1"]["floor_seconds"] == pytest.approx(4 * got["noria-llm #2"]["floor_seconds"])
    assert got["noria-llm #2"]["gemm_gflops"] == 4e-5
    assert "noria-llm #2" in format_bracketed(got)


def test_throughput_probes_the_machine_after_every_recorded_run(monkeypatch):
    import argparse

    from noria.bench import ceiling, roofline_machine, throughput

    events: list[str] = []

    def probe(threads: int) -> Machine:
        events.append("probe")
        return _machine(1.0, 1.0)

    def run_isolated(name: str, argv: list, record: str, skip: int, args: object) -> dict:
        events.append(name)
        row = {"system": name, "seconds": 1.0, "output_tokens": 4}
        return {**row, "record": record, "record_skip": 0} if name == "noria-llm" else row

    monkeypatch.setattr(roofline_machine, "measure_in_child", probe)
    monkeypatch.setattr(throughput, "run_isolated", run_isolated)
    monkeypatch.setattr(ceiling, "read_steps", lambda path, skip=0: [([1], [2], 1, 0.01)])
    args = argparse.Namespace(num_requests=2, num_kv_blocks=8, model="small", max_tokens=None, rounds=2, dtype="auto",
                              kv_cache_dtype="auto")
    runs, machines = throughput._run_rounds(args, ["noria-llm", "vllm-tuned", "ceiling"])
    assert events == ["probe", "noria-llm", "probe", "vllm-tuned", "ceiling", "probe",
                      "probe", "noria-llm", "probe", "vllm-tuned", "ceiling", "probe"]
    assert len(machines) == 6
    assert [r["_probes"] for r in runs["noria-llm"]] == [[0, 1], [3, 4]]
    assert [r["_probes"] for r in runs["ceiling"]] == [[1, 2], [4, 5]]
    assert "_probes" not in runs["vllm-tuned"][0]
    events.clear()
    runs, machines = throughput._run_rounds(args, ["noria-llm", "vllm-tuned"])
    # The last run (vLLM's) was not followed by a probe: one more closes the job.
    assert events[-2:] == ["vllm-tuned", "probe"]
    assert events.count("probe") == 2 * 2 + 1


def test_sustained_gemm_reports_one_rate_per_window(capsys):
    from noria.bench.roofline_machine import sustained

    rates = sustained(threads=1, seconds=0.6, window=0.2, gemm_n=128)
    assert 2 <= len(rates) <= 3 and all(r > 0 for r in rates)
    assert capsys.readouterr().out.count("GFLOP/s") == len(rates)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_mixture_of_experts_counts_every_expert_and_reads_the_ones_hit(family):
    """layer_params: every linear weight of the decoder layers transformers builds (router, each
    expert, Qwen2-MoE's shared expert and its gate, Qwen3-MoE's dense layer); a step reads the
    experts its tokens are expected to hit, and a token's FLOPs go through its k experts only."""
    import transformers

    cfg = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 50, "num_experts_per_tok": 2}
    if family == "mixtral":
        cfg |= {"num_local_experts": 8}
        config = transformers.MixtralConfig(**cfg)
    else:
        cfg |= {"num_experts": 8, "moe_intermediate_size": 24, "mlp_only_layers": [1]}
        if family == "qwen2_moe":
            cfg |= {"shared_expert_intermediate_size": 40}
            config = transformers.Qwen2MoeConfig(**cfg)
        else:
            config = transformers.Qwen3MoeConfig(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config)
    linear = sum(p.numel() for n, p in model.named_parameters()
                 if ".layers." in n and "norm" not in n and not n.endswith(".bias"))
    shape = Shape.from_config(config.to_dict())
    assert shape.layer_params == linear
    inter = 48 if family == "mixtral" else 24
    expert = 3 * 32 * inter
    assert shape.sparse_layers == (3 if family == "mixtral" else 2) and shape.experts == 8 and shape.top_k == 2
    # One token hits exactly its k = 2 experts; a long prefill all 8 (to within 1e-9).
    assert shape.expected_experts(1) == pytest.approx(2)
    assert shape.expected_experts(1000) == pytest.approx(8)
    assert shape.expected_experts(3) == pytest.approx(8 * (1 - 0.75 ** 3))
    unhit = shape.sparse_layers * (8 - 2) * expert * 4
    assert shape.weight_bytes(1) == shape.layer_params * 4 - unhit
    assert shape.token_params == shape.layer_params - shape.sparse_layers * (8 - 2) * expert
    moved_1, flops_1 = step_cost(shape, [1], [5], 1)
    moved_big, flops_big = step_cost(shape, [1000], [1000], 1)
    assert moved_big - moved_1 == pytest.approx(unhit + 999 * 32 * 4 + 3 * shape.kv_row_bytes * (995 + 999), abs=1)


def test_the_compute_roof_follows_the_weights_dtype() -> None:
    """bf16 weights compute at the bf16 GEMM's measured rate; float16 ones are widened to float32
    FMAs, so half the bytes but float32's rate; without a bf16 GEMM, float32's for all."""
    import dataclasses

    from noria.bench.roofline import step_roofline

    machine = dataclasses.replace(_machine(copy_gbs=1e-6, gemm_gflops=1e-5), bf16_gflops=2e-5)
    assert (machine.gflops("bfloat16"), machine.gflops("float16"), machine.gflops("float32")) == (2e-5, 1e-5, 1e-5)
    assert _machine(1e-6, 1e-5).gflops("bfloat16") == 1e-5
    step = ([1, 1], [4, 9], 2, 0.02)
    bf16, f16 = (dataclasses.replace(TINY, dtype_bytes=2, dtype=d) for d in ("bfloat16", "float16"))
    (mem_b, comp_b, _), (mem_h, comp_h, _) = step_roofline(bf16, machine, step), step_roofline(f16, machine, step)
    assert mem_b == mem_h and comp_h == pytest.approx(2 * comp_b)


def test_quantized_layers_read_their_bytes_and_compute_at_their_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """W4A16 g128 reads half a byte per weight plus a float32 scale per 128 and (with
    $NORIA_CPU_W4A16) widens to float32 FMAs; W8A8 reads a byte plus a scale per row and computes
    at the int8 GEMM's rate; the embedding, the lm_head and the KV cache stay in the checkpoint's
    dtype."""
    import dataclasses

    from noria.protocol import switches

    monkeypatch.setenv(switches.CPU_W4A16, "1")

    from noria.bench.roofline import step_roofline
    from noria.protocol.quant_config import QuantSpec, WeightScheme

    spec = config_spec({"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "vocab_size": 100, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"})
    w4 = QuantSpec("compressed-tensors", ((("Linear",), WeightScheme(4, 128, True, True, False)),), ("lm_head",))
    w8 = QuantSpec("compressed-tensors", ((("Linear",), WeightScheme(8, None, True, False, True)),), ("lm_head",))
    plain = Shape.from_spec(spec)
    s4, s8 = (Shape.from_spec(dataclasses.replace(spec, quantization=q)) for q in (w4, w8))
    assert plain.weight_bytes(1) == 2 * plain.layer_params
    assert s4.weight_bytes(1) == round(plain.layer_params * (0.5 + 4 / 128)) and s4.layer_compute == "float32"
    # One scale per output row: 4 bytes per row of K weights (K = 256, and 512 for down_proj).
    rows_cols = [(256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256), (256, 512)]
    assert s8.weight_bytes(1) == round(2 * sum(r * c + 4 * r for r, c in rows_cols)) and s8.layer_compute == "int8"
    assert s8.kv_row_bytes == plain.kv_row_bytes
    machine = dataclasses.replace(_machine(copy_gbs=1e-6, gemm_gflops=1e-5), bf16_gflops=2e-5, int8_gops=4e-5)
    step = ([64], [64], 1, 0.02)
    _, comp_plain, _ = step_roofline(plain, machine, step)
    _, comp_8, _ = step_roofline(s8, machine, step)
    _, comp_4, _ = step_roofline(s4, machine, step)
    layers = 2 * plain.token_params * 64 / 1e9
    assert comp_8 == pytest.approx(comp_plain - layers / 2e-5 + layers / 4e-5)
    assert comp_4 == pytest.approx(comp_plain - layers / 2e-5 + layers / 1e-5)
    monkeypatch.delenv(switches.CPU_W4A16)  # the CPU's default: 4-bit weights on int8 activations
    assert Shape.from_spec(dataclasses.replace(spec, quantization=w4)).layer_compute == "int8"
