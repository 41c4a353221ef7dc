"""The llama.cpp baseline on GGUF models: llama.cpp's own Q8_0 and Q4_K_M files made by name
(its converter, then llama-quantize), the "llama.cpp" system serving a GGUF model's own file, the
refusals, and batch-1 latency on the same file as noria (tests/test_bench_llama_cpp.py's split).

llama.cpp is never built here: its commands are recorded, its server is the stand-in.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from noria.bench import llama_cpp
from tests import test_bench_llama_cpp

fake_binary = test_bench_llama_cpp.fake_binary  # the stand-in llama-server, as a fixture here too


def _built(base: Path, quantizer: bool = True) -> None:
    """A stand-in for a finished build under `base`: build.json, the binaries, the converter's venv."""
    (base / llama_cpp.VERSION).mkdir(parents=True)
    (base / llama_cpp.VERSION / "build.json").write_text('{"llama_cpp_commit": "0c1e5709"}')
    for binary in (llama_cpp.server_binary(base), *([llama_cpp.quantize_binary(base)] if quantizer else [])):
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text("")
    (base / "convert-venv").mkdir()
    (base / "convert-venv" / "ready").write_text("[]")


class _Runs:
    """subprocess.run in llama_cpp_build, recorded; the output file a command names is written."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, cmd, **kw):
        self.commands.append(list(cmd))
        out = cmd[cmd.index("--outfile") + 1] if "--outfile" in cmd else cmd[2] if "llama-quantize" in cmd[0] else None
        if out:
            Path(out).write_bytes(b"GGUF")
        return None


def test_q4_k_m_is_quantized_by_llama_quantize_from_the_checkpoints_float_type(tmp_path, monkeypatch):
    from noria.bench import llama_cpp_build

    runs = _Runs()
    monkeypatch.setattr(llama_cpp_build.subprocess, "run", runs)
    monkeypatch.setattr(llama_cpp_build.os, "cpu_count", lambda: 2)
    ckpt = tmp_path / "bench-small-v1"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    out = llama_cpp.convert(ckpt, "q4_k_m", base=tmp_path, log=sys.stderr)
    assert out == llama_cpp.gguf_path(ckpt, "q4_k_m", base=tmp_path) and out.exists()
    convert, quantize = runs.commands
    f32 = llama_cpp.gguf_path(ckpt, "f32", base=tmp_path)
    assert convert[convert.index("--outtype") + 1] == "f32" and f32.exists()  # the float file, cached too
    assert quantize == [str(llama_cpp.quantize_binary(tmp_path)), str(f32), str(out) + ".part", "Q4_K_M", "2"]
    assert llama_cpp.convert(ckpt, "q4_k_m", base=tmp_path) == out and len(runs.commands) == 2  # made once
    # Q8_0 is the converter's own outtype.
    q8 = llama_cpp.convert(ckpt, "q8_0", base=tmp_path)
    assert runs.commands[-1][runs.commands[-1].index("--outtype") + 1] == "q8_0" and q8.name.endswith("-q8_0.gguf")
    # A bfloat16 checkpoint (llama-1b) is quantized from its exact bf16 GGUF.
    (ckpt / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert llama_cpp.quantize_from(ckpt) == "bf16"
    with pytest.raises(ValueError, match="q5_k_s"):
        llama_cpp.convert(ckpt, "q5_k_s", base=tmp_path)


def test_an_older_build_gets_the_quantizer_alone(tmp_path, monkeypatch):
    from noria.bench import llama_cpp_build

    _built(tmp_path, quantizer=False)
    why = llama_cpp.setup(install=False, base=tmp_path)
    assert why is not None and "llama-quantize" in why
    runs = _Runs()
    monkeypatch.setattr(llama_cpp_build.subprocess, "run", runs)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert llama_cpp.setup(install=True, base=tmp_path, jobs=2) is None
    assert runs.commands == [["cmake", "--build", str(tmp_path / llama_cpp.VERSION / "build"), "--target",
                              "llama-quantize", "-j", "2"]]  # no download, no re-extraction, no reconfigure


def test_gguf_models_by_name(tmp_path, monkeypatch):
    """small-q8_0 / small-q4_k_m (and serving's, llama-1b's): the base checkpoint as llama.cpp's
    file, made once: a cached file needs no build at all."""
    from noria.bench import llama_cpp_build, workloads

    for base in ("small", "serving", "llama-1b"):
        for t in ("q8_0", "q4_k_m"):
            assert f"{base}-{t}" in workloads.CHECKPOINTS
    ckpt = tmp_path / "bench-small-v1"
    ckpt.mkdir()
    monkeypatch.setitem(workloads.CHECKPOINTS, "small", lambda: ckpt)
    monkeypatch.setattr(llama_cpp_build, "root", lambda: tmp_path / "llama")
    made: list[str] = []

    def convert(checkpoint, outtype, base=None, log=None):
        made.append(outtype)
        path = llama_cpp_build.gguf_path(checkpoint, outtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF")
        return path

    monkeypatch.setattr(llama_cpp_build, "convert", convert)
    monkeypatch.setattr(llama_cpp_build, "setup", lambda: "no cmake on PATH to build llama.cpp")
    with pytest.raises(SystemExit, match="small-q4_k_m is made by llama.cpp's own tools: no cmake"):
        workloads.CHECKPOINTS["small-q4_k_m"]()
    monkeypatch.setattr(llama_cpp_build, "setup", lambda: None)
    path = workloads.CHECKPOINTS["small-q4_k_m"]()
    assert path.name.endswith("-q4_k_m.gguf") and llama_cpp.is_gguf(path) and made == ["q4_k_m"]
    monkeypatch.setattr(llama_cpp_build, "setup", lambda: pytest.fail("a cached file needs no build"))
    assert workloads.CHECKPOINTS["small-q4_k_m"]() == path and made == ["q4_k_m"]


def test_llama_cpp_serves_a_gguf_model_as_it_is(fake_binary, tmp_path, monkeypatch):
    from noria.bench import llama_cpp_server

    monkeypatch.setattr(llama_cpp_server, "server_binary", lambda base=None: fake_binary)
    monkeypatch.setattr(llama_cpp, "convert", lambda *a, **k: pytest.fail("the model's own file is not converted"))
    model = tmp_path / "bench-small-v1-abc-q4_k_m.gguf"
    model.write_bytes(b"GGUF")
    assert llama_cpp.gguf_for("llama.cpp", model) == model
    row = llama_cpp.run_throughput("llama.cpp", model, [([5] * 4, 3)] * 4, in_flight=2)
    assert row["system"] == "llama.cpp" and row["output_tokens"] == 12 and row["settings"]["gguf"] == str(model)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("-m") + 1] == str(model)


def test_each_llama_cpp_system_refuses_the_other_kind_of_model(tmp_path):
    folder, gguf = tmp_path / "bench-small-v1", tmp_path / "small-q4_k_m.gguf"
    folder.mkdir()
    with pytest.raises(SystemExit, match="llama.cpp serves the model's own GGUF file, and .* is a checkpoint folder"):
        llama_cpp.available(["noria-llm", "llama.cpp"], folder, install=False, base=tmp_path / "none")
    with pytest.raises(SystemExit, match="llama.cpp-f32 converts a checkpoint folder .* run llama.cpp"):
        llama_cpp.available(["llama.cpp-f32", "llama.cpp"], gguf, install=False, base=tmp_path / "none")
    with pytest.raises(ValueError, match="checkpoint folder"):
        llama_cpp.gguf_for("llama.cpp", folder)
    # The right kind, unbuilt: a skip, as before.
    assert llama_cpp.available(["noria-llm", "llama.cpp"], gguf, install=False, base=tmp_path / "none") == ["noria-llm"]


def test_benches_refuse_folder_only_systems_on_a_gguf_model(tmp_path, monkeypatch, capsys):
    from noria.bench import llama_cpp_build, serving, throughput

    gguf = tmp_path / "small-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(throughput.CHECKPOINTS, "small-q4_k_m", lambda: gguf)
    monkeypatch.setattr(llama_cpp_build, "root", lambda: tmp_path / "no-llama")
    out = ["--out", str(tmp_path / "out" / "tp"), "--rounds", "1", "--no-llama-cpp-install", "--no-vllm-install"]
    with pytest.raises(SystemExit, match="small-q4_k_m is a GGUF file .*which hf-cb, vllm cannot load"):
        throughput.main(["--model", "small-q4_k_m", "--systems", "hf-cb,vllm,llama.cpp", *out])
    with pytest.raises(SystemExit, match="llama.cpp-bf16 converts a checkpoint folder"):
        throughput.main(["--model", "small-q4_k_m", "--systems", "llama.cpp-bf16", *out])
    assert throughput.main(["--model", "small-q4_k_m", "--systems", "llama.cpp", *out]) == 0
    assert "skipping llama.cpp: no llama.cpp build" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="vllm-tuned cannot load"):
        serving._systems("noria,vllm-tuned", install=False, llama_install=False, model=gguf)
    assert serving._systems("noria,llama.cpp", install=False, llama_install=False, model=gguf) == ["noria"]
    with pytest.raises(SystemExit, match="checkpoint folder"):
        serving._systems("noria,llama.cpp", install=False, llama_install=False, model=tmp_path)


def test_latency_pairs_a_quantized_type_with_the_same_file(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "convert", lambda ckpt, outtype, base=None, log=None: tmp_path / f"{outtype}.gguf")
    assert llama_cpp.latency_models(tmp_path, "q4_k_m") == (tmp_path / "q4_k_m.gguf", tmp_path / "q4_k_m.gguf", "auto")
    assert llama_cpp.latency_models(tmp_path, "q8_0")[1] == tmp_path / "q8_0.gguf"
    assert llama_cpp.latency_models(tmp_path, "bf16") == (tmp_path / "bf16.gguf", tmp_path, "bfloat16")
    assert llama_cpp.LATENCY_CHOICES["both"] == ("f32", "bf16") and llama_cpp.LATENCY_CHOICES["q4_k_m"] == ("q4_k_m",)
    from noria.bench import workloads

    monkeypatch.setitem(workloads.CHECKPOINTS, "small-q8_0", lambda: tmp_path / "small-q8_0.gguf")
    with pytest.raises(SystemExit, match="--model small --dtype q4_k_m"):
        llama_cpp.latency(["q8_0"], 1, model="small-q8_0")
    monkeypatch.setattr(llama_cpp, "setup", lambda **kw: None)
    monkeypatch.setattr(llama_cpp, "build_info", lambda: {})
    seen = []
    monkeypatch.setattr(llama_cpp, "latency", lambda types, rounds, tokens, model: seen.append((types, model)))
    assert llama_cpp.main(["latency", "--dtype", "q4_k_m", "--rounds", "1"]) == 0
    assert seen == [(["q4_k_m"], "small")]
    with pytest.raises(SystemExit):
        llama_cpp.main(["latency", "--dtype", "q5_k_s"])


def test_roofline_and_dtype_read_a_gguf_file_through_its_view(tmp_path, demo_path):
    """A Q4_K_M file (Q4_K beside Q6_K) as the benchmarks pass it: its shape and quantized bytes per
    weight from the view's QuantSpec, noria's dtype for it."""
    from noria.bench import roofline, throughput
    from tests import gguf_files as gf

    vocab = len(json.loads((demo_path / "tokenizer.json").read_text())["model"]["vocab"])
    path = gf.write_gguf(gf.tiny_model("llama", vocab), tmp_path / "tiny-q4_k_m.gguf", "llama", gf.q4_k_m, demo_path)
    shape = roofline.Shape.from_checkpoint(path)
    assert (shape.hidden, shape.intermediate, shape.vocab) == (256, 512, vocab)
    # Q4_K (4-bit values, a scale and a minimum per 32: 0.75 bytes per weight as held) beside
    # Q6_K layers (8-bit values, a scale per 16: 1.25), averaged by size; 4-bit weights run on
    # int8 activations on a CPU by default.
    assert 0.75 < shape.layer_weight_bytes < 1.25 and shape.layer_compute == "int8"
    assert throughput._noria_dtype("auto", path) == "float32"
