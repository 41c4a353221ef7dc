"""`noria bench gpu`'s harness on the CPU: the roofline arithmetic by hand, the one line on a
host without a GPU, the phase budget (skipped, cut short, failed) with the report on disk after
every figure, and a whole `--tiny` run through the engine and transformers."""

from __future__ import annotations

import json
import threading

import pytest

from noria.bench import gpu, gpu_phases, gpu_quant


def test_llama3_8b_bytes_match_the_published_parameter_count():
    cost = gpu.model_cost(gpu.LLAMA3_8B)
    assert cost.weight_bytes == 2 * 8_030_261_248  # Meta-Llama-3-8B's parameter count, bfloat16
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128
    # Every matmul weight (all but the embedding table and the norms) twice per token.
    assert cost.flops_per_token == 2 * (8_030_261_248 - 128256 * 4096 - 65 * 4096)
    assert cost.attn_flops_per_pair == 4 * 32 * 32 * 128


COST = gpu.ModelCost(weight_bytes=1000, kv_bytes_per_token=10, flops_per_token=100, attn_flops_per_pair=4)


def test_decode_and_prefill_floors_by_hand():
    assert gpu.decode_step_floor(COST, [100, 200], 1e-9) == pytest.approx(1000 + 300 * 10)
    assert gpu.itl_floor(COST, 3, 50, 2e-9) == pytest.approx((1000 + 150 * 10) / 2)
    # 8 tokens: 1080 bytes; 8 x 100 + 4 x 36 = 944 FLOPs.
    assert gpu.prefill_floor(COST, 8, 1e-9, None) == (pytest.approx(1080), "memory")
    assert gpu.prefill_floor(COST, 8, 1e-9, 1e-12) == (pytest.approx(1080), "memory")
    assert gpu.prefill_floor(COST, 8, 1e-9, 0.5e-12) == (pytest.approx(1888), "compute")


def test_throughput_ceiling_by_hand():
    # 3 requests of 2 prompt / 3 output tokens in waves of 2 and 1; bandwidth 1 byte/s.
    wave1 = 2 * 1020 + (1000 + 2 * 3 * 10) + (1000 + 2 * 4 * 10)
    wave2 = 1020 + (1000 + 30) + (1000 + 40)
    assert gpu.throughput_ceiling(COST, 3, 2, 3, 2, 1e-9, None) == pytest.approx(9 / (wave1 + wave2))


def test_quantized_weight_bytes_by_hand():
    # Llama 3 8B: 6,979,321,856 parameters in the decoder layers' linear weights, the rest
    # (embedding, lm_head, norms) 1,050,939,392, kept in bfloat16.
    linear, rest = 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336), 8_030_261_248 - 6_979_321_856
    assert linear == 6_979_321_856
    fp8 = gpu.model_cost(gpu.LLAMA3_8B, 2, linear_bits=8)  # plus a float32 scale per row of 4096
    assert fp8.weight_bytes == 2 * rest + linear + linear * 4 // 4096
    w4 = gpu.model_cost(gpu.LLAMA3_8B, 2, linear_bits=4, scale_group=128)
    assert w4.weight_bytes == 2 * rest + linear // 2 + linear * 4 // 128
    assert fp8.kv_bytes_per_token == w4.kv_bytes_per_token == gpu.model_cost(gpu.LLAMA3_8B).kv_bytes_per_token
    # The ceiling the 1.6x FP8 target sits under at batch 1: bf16 bytes over fp8 bytes.
    assert 1.7 < gpu.model_cost(gpu.LLAMA3_8B).weight_bytes / fp8.weight_bytes < 1.8


def test_closeness_to_the_roofline_reads_the_same_way_for_times_and_rates():
    assert gpu.Row("p", "t", 4.0, "ms", 1.0).of_roofline == pytest.approx(0.25)
    assert gpu.Row("p", "r", 50.0, "tok/s", 200.0).of_roofline == pytest.approx(0.25)
    assert gpu.Row("p", "n", None, "ms", 1.0).of_roofline is None


def test_speedups_pair_batches_both_sides_measured():
    rows = [gpu.Row("itl", "ITL batch 1 (default)", 2.0, "ms"), gpu.Row("itl", "ITL batch 32 (default)", 5.0, "ms"),
            gpu.Row("hf", "ITL batch 1 (transformers, eager)", 8.0, "ms"),
            gpu.Row("hf", "ITL batch 1 (transformers, compiled)", 6.0, "ms"),
            gpu.Row("hf", "ITL batch 16 (transformers, eager)", 9.0, "ms")]
    [r] = gpu.speedups(rows)
    assert r.name.startswith("ITL batch 1:") and r.value == pytest.approx(3.0)


def test_no_gpu_is_one_line_and_exit_zero(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path / "gpu")]) == 0
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and "no GPU" in out.out and not out.err
    assert not list(tmp_path.iterdir())


def _budget(tmp_path, seconds: float, cap: float = 60.0) -> tuple[gpu.Budget, gpu.Report]:
    rep = gpu.Report(tmp_path / "gpu", {"device": "test"})
    sizes = gpu.Sizes(need=dict.fromkeys(gpu.PHASES, 5.0), cap=dict.fromkeys(gpu.PHASES, cap))
    return gpu.Budget(seconds, rep, sizes, set(gpu.PHASES) - {"hf"}), rep


def test_a_phase_over_its_cap_is_cut_and_what_it_measured_is_on_disk(tmp_path):
    budget, rep = _budget(tmp_path, 60.0, cap=1.0)
    with budget.phase("probe") as go:
        assert go
        rep.add(gpu.Row("probe", "first figure", 1.0, "s"))
        assert json.loads((tmp_path / "gpu.json").read_text())["rows"][0]["name"] == "first figure"
        threading.Event().wait()  # never set: only the phase's alarm ends this
    with budget.phase("ttft") as go:
        assert go
        raise RuntimeError("engine died\nsecond line")
    with budget.phase("hf") as go:
        assert not go
    on_disk = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["name"] for r in on_disk["rows"]] == ["first figure"]
    assert on_disk["phases"]["probe"]["status"] == "cut short"
    assert on_disk["phases"]["ttft"] == {"status": "failed", "seconds": on_disk["phases"]["ttft"]["seconds"],
                                         "note": "RuntimeError: engine died"}
    assert on_disk["phases"]["hf"]["status"] == "skipped"
    md = (tmp_path / "gpu.md").read_text()
    assert "| probe | first figure | 1 s |" in md and "| probe | cut short |" in md


def test_phases_that_do_not_fit_are_skipped_for_time(tmp_path):
    budget, rep = _budget(tmp_path, 3.0)  # less than each phase's 5 s need
    with budget.phase("itl") as go:
        assert not go
    assert rep.phases["itl"]["status"] == "skipped" and rep.phases["itl"]["note"].startswith("time:")
    assert "| itl | skipped |" in (tmp_path / "gpu.md").read_text()


def test_a_tiny_run_measures_every_phase(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NORIA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "res" / "gpu"
    assert gpu.main(["--tiny", "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert {k for k, v in data["phases"].items() if v["status"] == "ok"} == set(gpu.PHASES), data["phases"]
    rows = {r["name"]: r for r in data["rows"]}
    s = gpu.TINY_SIZES
    thr = rows[f"offline {s.requests} x {s.prompt}/{s.output}"]
    assert thr["note"].startswith(f"{s.requests * s.output} tokens")  # EOS ignored: every token made
    assert thr["of_roofline"] > 0
    for name in [*(f"TTFT {p}-token prompt" for p in s.ttft_prompts), *(f"ITL batch {b} (default)" for b in s.itl_batches),
                 *(f"ITL batch {b} (transformers, static cache, eager)" for b in s.hf_batches)]:
        assert rows[name]["value"] > 0 and rows[name]["floor"] > 0, name
    assert any(r["phase"] == "vs hf" for r in data["rows"])
    # Speculative decoding beside the itl phase's rows at the same batches.
    for name in gpu_phases.SPEC_CONFIGS:
        for b in s.spec_batches:
            row = rows[f"ITL batch {b} ({name})"]
            assert row["value"] > 0 and "the speed of off" in row["note"], row
    # The quantized kinds beside the model's dtype, each beside its roofline, and their ratios.
    for label in ("float32", gpu_quant.FP8, gpu_quant.W4A16):
        for b in s.quant_batches:
            row = rows[gpu_quant.decode_name(b, label)]
            assert row["value"] > 0 and row["of_roofline"] > 0, row
        assert rows[f"offline {s.quant_requests} x {s.quant_prompt}/{s.quant_output} ({label})"]["value"] > 0
    for label in (gpu_quant.FP8, gpu_quant.W4A16):
        ratio = rows[gpu_quant.ratio_name(1, label, "float32")]
        assert ratio["value"] == pytest.approx(rows[gpu_quant.decode_name(1, label)]["value"]
                                               / rows[gpu_quant.decode_name(1, "float32")]["value"])
    # No weights written: the engine and transformers ran from config.json (--load-format dummy).
    folder = tmp_path / "cache" / f"bench-gpu-tiny-float32-config-v{gpu.CHECKPOINT_VERSION}"
    assert data["meta"]["load_format"] == "dummy" and not list(folder.glob("*.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    assert data["meta"]["weight_gb"] * 1e9 == gpu.model_cost(cfg, 4).weight_bytes
    md = out.with_suffix(".md").read_text()
    assert all(f"| {name} |" in md for name in rows)
