"""The llama.cpp baseline's wrapper: its build and server commands, its client, its skip.

llama.cpp is never built here: the runner and the client are exercised against a stand-in
llama-server (tests/fake_llama_server.py) started as a real process on a real port.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from noria.bench import llama_cpp

FAKE = Path(__file__).with_name("fake_llama_server.py")

# Answers of the real llama-server (llama.cpp 0c1e5709, from llama-cpp-python 0.3.36) to
# completion_body([9, 10, 11, 12], 3, ...) on the small model's F32 GGUF (random weights: one token
# thrice), trimmed of generation_settings, timings and the model's path.
RECORDED = {"index": 0, "content": "", "tokens": [2780, 2780, 2780], "id_slot": 1, "stop": True,
            "model": "small-f32.gguf", "tokens_predicted": 3, "tokens_evaluated": 4, "prompt": "%&'(",
            "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "",
            "tokens_cached": 6}
RECORDED_STREAM = [
    b'data: {"index":0,"content":"","tokens":[2780],"stop":false,"id_slot":-1,"tokens_predicted":1,'
    b'"tokens_evaluated":4}\n',
    b"\n",
    b'data: {"index":0,"content":"","tokens":[2780],"stop":false,"id_slot":-1,"tokens_predicted":2,'
    b'"tokens_evaluated":4}\n',
    b"\n",
    b'data: {"index":0,"content":"","tokens":[2780],"stop":false,"id_slot":-1,"tokens_predicted":3,'
    b'"tokens_evaluated":4}\n',
    b"\n",
    b'data: {"index":0,"content":"","tokens":[],"id_slot":1,"stop":true,"model":"small-f32.gguf",'
    b'"tokens_predicted":3,"tokens_evaluated":4,"prompt":"%&\'(","has_new_line":false,"truncated":false,'
    b'"stop_type":"limit","stopping_word":"","tokens_cached":6}\n',
    b"\n",
]


@pytest.fixture
def fake_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An executable named llama-server that runs the stand-in; its records go to tmp_path."""
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    binary.chmod(0o755)
    monkeypatch.setenv("FAKE_LLAMA_DIR", str(tmp_path))
    return binary


def _requests(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]


def test_build_is_the_server_and_quantizer_alone_release_native_cpu(tmp_path):
    configure, build = llama_cpp.cmake_commands(tmp_path / "src", tmp_path / "build", "0c1e5709", 2)
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_COMMIT=0c1e5709"):
        assert flag in configure
    assert build == ["cmake", "--build", str(tmp_path / "build"), "--target", "llama-server", "llama-quantize",
                     "-j", "2"]


def test_server_command_has_a_slot_per_request_in_flight():
    cmd = llama_cpp.server_command(Path("/b/llama-server"), Path("/m.gguf"), 8123, 16, 768, 2)
    assert cmd[:3] == ["/b/llama-server", "-m", "/m.gguf"]
    arg = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert arg["--port"] == "8123" and arg["--host"] == "127.0.0.1"
    assert arg["-t"] == arg["-tb"] == "2"
    assert arg["-np"] == "16" and arg["-c"] == str(16 * 768)  # the context is split evenly between slots
    assert "--cont-batching" in cmd and arg["--cache-ram"] == "0"


def test_context_per_slot_holds_the_longest_request():
    assert llama_cpp.context_per_request([([1] * 256, 512), ([1] * 40, 32)]) == 768
    assert llama_cpp.context_per_request([([1] * 5, 16, 0.0)]) == 64  # serving's (prompt, max, offset)


def test_request_json_is_greedy_exact_length_token_ids():
    body = llama_cpp.completion_body([9, 10, 11], 40, stream=True)
    assert body == {"prompt": [9, 10, 11], "n_predict": 40, "ignore_eos": True, "temperature": 0.0,
                    "cache_prompt": False, "stream": True, "return_tokens": True, "samplers": ["temperature"]}


def test_recorded_answers_parse_to_token_ids():
    assert llama_cpp.completion_tokens(RECORDED) == [2780, 2780, 2780]
    got = [t for line in RECORDED_STREAM if (ids := llama_cpp.stream_tokens(line)) for t in ids]
    assert got == [2780, 2780, 2780]  # the final event repeats none
    assert llama_cpp.stream_tokens(b"\n") is None
    with pytest.raises(RuntimeError, match="slot"):
        llama_cpp.stream_tokens(b'data: {"error": {"code": 500, "message": "no slot"}}\n')


def test_pre_tokenizer_named_only_for_gpt2_byte_level(tmp_path):
    tok = {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert llama_cpp.pre_tokenizer(tmp_path) == "gpt-2"
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": []}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert llama_cpp.pre_tokenizer(tmp_path) is None
    cmd = llama_cpp.convert_command(tmp_path, "bf16", tmp_path / "o.gguf", base=tmp_path)
    assert "--pre" not in cmd and cmd[cmd.index("--outtype") + 1] == "bf16"
    assert Path(cmd[1]).name == "llama_cpp_convert.py" and Path(cmd[1]).exists()


def test_gguf_files_are_per_checkpoint_and_type(tmp_path):
    ckpt = tmp_path / "bench-small-v1"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    a, b = (llama_cpp.gguf_path(ckpt, t, base=tmp_path) for t in ("f32", "bf16"))
    assert a != b and a.name.startswith("bench-small-v1-") and a.name.endswith("-f32.gguf")
    (ckpt / "config.json").write_text('{"changed": 1}')
    assert llama_cpp.gguf_path(ckpt, "f32", base=tmp_path) != a  # a rebuilt checkpoint is converted again


def test_runner_waits_for_health_then_client_gets_every_token(fake_binary, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what `noria bench` sets for noria's worker
    server = llama_cpp.LlamaServer(tmp_path / "m.gguf", 4, 128, n_threads=2, binary=fake_binary)
    try:
        assert server.wait(timeout=60) is server
        assert server.health() == "ok"
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == "512"
        assert "OMP_WAIT_POLICY" not in json.loads((tmp_path / "env.json").read_text())  # llama.cpp's default
        work = [([5, 6, 7], 5), ([100], 3), ([7, 8], 4), ([1, 2, 3, 4], 6), ([9], 2), ([10], 7)]
        seconds, outs = asyncio.run(llama_cpp.run_batch(server.http, work, in_flight=2))
        assert outs == [[p[-1] + i + 1 for i in range(m)] for p, m in work]
        assert seconds > 0 and int((tmp_path / "most.txt").read_text()) <= 2
        bodies = _requests(tmp_path)
        assert bodies[0]["n_predict"] == 2  # the warm-up
        # Sent two at a time: they arrive in any order.
        assert sorted(map(json.dumps, bodies[1:])) == sorted(json.dumps(llama_cpp.completion_body(p, m, False))
                                                             for p, m in work)
        ms, ids = llama_cpp.ms_per_token(server, tokens=8)
        assert ids == [12 + i + 1 for i in range(9)] and ms >= 0
        assert _requests(tmp_path)[-1] == llama_cpp.completion_body(llama_cpp.LATENCY_PROMPT, 9, True)
    finally:
        assert server.stop() is not None
    assert server.proc.poll() is not None


def test_serving_drive_streams_each_request_at_its_offset(fake_binary, tmp_path):
    reqs = [([3, 4], 4, 0.0), ([50], 2, 0.05)]
    with llama_cpp.LlamaServer(tmp_path / "m.gguf", 2, 64, binary=fake_binary).wait(timeout=60) as server:
        out = asyncio.run(llama_cpp.drive(server.http, reqs))
    assert [len(r["times"]) for r in out] == [4, 2] and [r["prompt_len"] for r in out] == [2, 1]
    assert out[1]["sent"] - out[0]["sent"] >= 0.04
    assert all(r["times"] == sorted(r["times"]) and r["times"][0] >= r["sent"] for r in out)


def test_throughput_row_has_the_bench_fields(fake_binary, tmp_path, monkeypatch):
    from noria.bench import llama_cpp_server

    monkeypatch.setattr(llama_cpp_server, "server_binary", lambda base=None: fake_binary)  # where LlamaServer finds it
    monkeypatch.setattr(llama_cpp, "convert", lambda ckpt, outtype, base=None, log=None: tmp_path / f"{outtype}.gguf")
    work = [([i + 3] * 10, 4) for i in range(20)]
    row = llama_cpp.run_throughput("llama.cpp-bf16", tmp_path, work, in_flight=16)
    assert row["system"] == "llama.cpp-bf16" and row["output_tokens"] == 80 and row["in_flight"] == 16
    assert row["token_ids"][0] == [4, 5, 6, 7] and set(row["rss_bytes"]) == {"idle", "end"}
    assert int((tmp_path / "most.txt").read_text()) <= 16
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("-m") + 1] == str(tmp_path / "bf16.gguf") and argv[argv.index("-np") + 1] == "16"


def test_a_server_that_dies_while_loading_is_an_error(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 7\n")
    binary.chmod(0o755)
    with pytest.raises(RuntimeError, match="code 7"):
        llama_cpp.LlamaServer(tmp_path / "m.gguf", 1, 64, binary=binary).wait(timeout=30)


def test_skipped_with_one_message_where_not_built(tmp_path, capsys):
    systems = ["noria-llm", "llama.cpp-f32", "llama.cpp-bf16"]
    assert llama_cpp.available(systems, tmp_path, install=False, base=tmp_path / "none") == ["noria-llm"]
    out = capsys.readouterr().out
    assert out.count("skipping") == 1
    assert f"skipping llama.cpp-f32, llama.cpp-bf16: no llama.cpp build from llama-cpp-python {llama_cpp.VERSION}" in out
    assert llama_cpp.available(["noria-llm"], tmp_path, install=False, base=tmp_path / "none") == ["noria-llm"]


def test_no_compiler_is_a_reason_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    why = llama_cpp.setup(install=True, base=tmp_path)
    assert why is not None and "cmake" in why and not (tmp_path / llama_cpp.VERSION).exists()


def test_benches_skip_llama_cpp_where_it_is_not_built(tmp_path, monkeypatch, capsys):
    """throughput and serving run their other systems and say why llama.cpp did not run."""
    from noria.bench import llama_cpp_build, serving, throughput

    monkeypatch.setattr(llama_cpp_build, "root", lambda: tmp_path / "no-llama")  # where setup finds it
    monkeypatch.setattr(serving, "serving_checkpoint", lambda: tmp_path)
    assert serving._systems("noria,llama.cpp-bf16", install=False, llama_install=False) == ["noria"]
    assert "skipping llama.cpp-bf16: no llama.cpp build" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="llama.cpp-f32"):
        serving._systems("llama.cpp-f16", install=False, llama_install=False)
    monkeypatch.setitem(throughput.CHECKPOINTS, "serving", lambda: tmp_path)
    args = ["--model", "serving", "--systems", "llama.cpp-f32,llama.cpp-bf16", "--rounds", "1",
            "--no-llama-cpp-install", "--out", str(tmp_path / "out" / "tp")]
    assert throughput.main(args) == 0
    out = capsys.readouterr().out
    assert "skipping llama.cpp-f32, llama.cpp-bf16: no llama.cpp build" in out
    assert json.loads((tmp_path / "out" / "tp.json").read_text())["rows"] == []


def test_converter_gets_transformers_4s_name_for_a_tokenizer_json_class(tmp_path, monkeypatch):
    """The converter pins transformers 4, which calls transformers 5's TokenizersBackend
    PreTrainedTokenizerFast: it reads the checkpoint through a view with that one name changed."""
    import types

    from noria.bench import llama_cpp_convert

    model = tmp_path / "bench-small-v1"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", "x": 1}))
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.57.6"))
    view = llama_cpp_convert._staged(model, staging)
    assert view == staging / "bench-small-v1"  # the same folder name: the GGUF's model name
    assert (view / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    assert json.loads((view / "tokenizer_config.json").read_text()) == {"tokenizer_class": "PreTrainedTokenizerFast",
                                                                         "x": 1}
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5", TokenizersBackend=object))
    assert llama_cpp_convert._staged(model, tmp_path) == model


def test_llama_cpp_waits_as_openmp_does_by_default_unless_asked(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # noria's worker's, which `noria bench` sets
    monkeypatch.setenv("GOMP_SPINCOUNT", "100000")
    assert "OMP_WAIT_POLICY" not in llama_cpp.server_env() and "GOMP_SPINCOUNT" not in llama_cpp.server_env()
    assert llama_cpp.server_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}  # not noria's
    envs = llama_cpp.latency_servers()
    noria = "OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=100000"
    assert list(envs) == ["OpenMP default wait", noria]
    assert "OMP_WAIT_POLICY" not in envs["OpenMP default wait"]
    assert (envs[noria]["OMP_WAIT_POLICY"], envs[noria]["GOMP_SPINCOUNT"]) == ("PASSIVE", "100000")


def test_an_explicit_environment_reaches_the_server(fake_binary, tmp_path):
    env = {**llama_cpp.server_env(), "OMP_WAIT_POLICY": "PASSIVE"}
    with llama_cpp.LlamaServer(tmp_path / "m.gguf", 1, 64, binary=fake_binary, env=env).wait(timeout=60):
        assert json.loads((tmp_path / "env.json").read_text())["OMP_WAIT_POLICY"] == "PASSIVE"

