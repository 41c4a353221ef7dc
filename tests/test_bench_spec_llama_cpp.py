"""llama.cpp's speculation as rows of `noria bench spec` (bench/spec_llama_cpp.py): its names and
flags, and a row measured against the stand-in llama-server (tests/fake_llama_server.py), a real
process on a real port; llama.cpp itself is never built here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from noria.bench import spec, spec_llama_cpp
from tests.test_bench_llama_cpp import _requests, fake_binary  # noqa: F401 (a fixture)


def test_names_parse_and_bad_ones_say_what_exists():
    assert spec_llama_cpp.method_of("llama.cpp-off") == ("off", 0)
    assert spec_llama_cpp.method_of("llama.cpp") == ("off", 0)
    assert spec_llama_cpp.method_of("llama.cpp-ngram-4") == ("ngram", 4)
    assert spec_llama_cpp.method_of("llama.cpp-head2-3") == ("head2", 3)
    assert spec_llama_cpp.method_of("llama.cpp-self-4") == ("self", 4)
    for bad in ("llama.cpp-suffix-4", "llama.cpp-ngram-0", "llama.cpp-headx-2", "llama.cpp-eagle3-4"):
        with pytest.raises(SystemExit, match="llama.cpp-ngram-K"):
            spec_llama_cpp.method_of(bad)
    assert spec._config("llama.cpp-ngram-4", (1, 3)) is None  # a noria config is not made for it
    with pytest.raises(SystemExit, match="llama.cpp-"):
        spec._config("llama.cpp-bogus-1", (1, 3))


def test_flags_are_llama_servers_own():
    assert spec_llama_cpp.spec_args("llama.cpp-off", 3) == []
    assert spec_llama_cpp.spec_args("llama.cpp-ngram-4", 3) == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4"]
    assert spec_llama_cpp.spec_args("llama.cpp-head2-4", 3, Path("/d.gguf")) == [
        "--spec-type", "draft-simple", "-md", "/d.gguf", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0"]
    with pytest.raises(ValueError, match="draft"):
        spec_llama_cpp.spec_args("llama.cpp-self-4", 3)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"tokens": 6, "b1_prompts": 2, "lookup": (1, 3), **kw})


def _argvs(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "argvs.jsonl").read_text().splitlines()]


def _row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Path, name: str,
         work: list[tuple[list[int], int]]) -> dict:
    from noria.bench import llama_cpp, llama_cpp_server, spec_models

    monkeypatch.setattr(llama_cpp_server, "server_binary", lambda base=None: fake)
    monkeypatch.setattr(llama_cpp, "convert", lambda ckpt, outtype, base=None, log=None:
                        tmp_path / f"{Path(ckpt).name}-{outtype}.gguf")
    monkeypatch.setattr(spec_models, "head_checkpoint", lambda model, layers: tmp_path / f"head{layers}")
    return spec_llama_cpp.run_config(name, tmp_path / "target", _args(), work)


def test_a_draft_model_row_measures_every_part_and_counts_llama_cpps_acceptance(fake_binary, tmp_path,  # noqa: F811
                                                                                    monkeypatch):
    work = [([i + 3] * 5, 4 + i % 3) for i in range(40)]
    row = _row(tmp_path, monkeypatch, fake_binary, "llama.cpp-head2-4", work)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("-m") + 1] == str(tmp_path / "target-bf16.gguf")
    assert argv[argv.index("-md") + 1] == str(tmp_path / "head2-bf16.gguf")
    assert argv[argv.index("--spec-draft-n-max") + 1] == "4"
    # A server per part, a slot per request in flight: b1, b8, b32, then W1 at llama.cpp's 16.
    assert [a[a.index("-np") + 1] for a in _argvs(tmp_path)] == ["1", "8", "32", "16"]
    assert row["config"] == "llama.cpp-head2-4" and row["w1_sampled"] is None
    for part in ("itl_b1", "itl_b8"):
        assert row[part] >= 0
    assert row["b32"] > 0 and row["w1"] > 0
    # The stand-in drafts every generated token and accepts half of them (rounded down), per answer.
    assert row["itl_b1_acceptance"] == {"draft_tokens": 2 * 7, "accepted": 2 * 3, "accepted_rate": 0.429}
    assert row["itl_b8_acceptance"]["draft_tokens"] == 8 * 7
    assert row["b32_acceptance"]["draft_tokens"] == 32 * 6
    assert row["w1_acceptance"] == {"draft_tokens": sum(m for _, m in work),
                                    "accepted": sum(m // 2 for _, m in work),
                                    "accepted_rate": round(sum(m // 2 for _, m in work) / sum(m for _, m in work), 3)}
    bodies = _requests(tmp_path)
    streamed = [b for b in bodies if b["stream"]]
    assert [b["n_predict"] for b in streamed] == [7] * (2 + 8)  # b1's prompts one by one, then eight at once
    assert [b["prompt"] for b in streamed[:2]] == [work[0][0], work[1][0]]
    # Non-streamed: a warm-up request per slot of each server, b32's 32 of `tokens`, then W1 as given.
    warm = [8] * (1 + 8 + 32 + 16)
    assert sorted(b["n_predict"] for b in bodies if not b["stream"]) == sorted(warm + [6] * 32 + [m for _, m in work])


def test_off_runs_llama_cpp_without_speculation(fake_binary, tmp_path, monkeypatch):  # noqa: F811
    row = _row(tmp_path, monkeypatch, fake_binary, "llama.cpp-off", [([7] * 4, 3)] * 34)
    assert "--spec-type" not in json.loads((tmp_path / "argv.json").read_text())
    assert row["w1_acceptance"] == {"draft_tokens": 0, "accepted": 0, "accepted_rate": 0.0}


def test_the_table_compares_each_system_with_its_own_off(capsys):
    def row(name, b1, w1, sampled):
        acc = {"accepted_rate": 0.5}
        return {"config": name, "itl_b1": b1, "itl_b8": 8.0, "b32": 100.0, "w1": w1, "w1_sampled": sampled,
                "itl_b1_acceptance": acc, "w1_acceptance": acc}

    spec._print([row("off", 8.0, 100.0, 90.0), row("ngram-4", 2.0, 150.0, 90.0),
                 row("llama.cpp-off", 6.0, 80.0, None), row("llama.cpp-ngram-4", 3.0, 40.0, None)])
    lines = capsys.readouterr().out.splitlines()
    ratios = [line.split() for line in lines if line.strip().startswith("vs its off")]
    assert ratios[0][3:6] == ["4.00x", "1.00x", "1.00x"]  # noria's ngram against noria's off
    assert ratios[1][3] == "2.00x" and ratios[1][6] == "0.50x" and ratios[1][7] == "-"  # llama.cpp's against its own


def test_best_of_rounds_keeps_a_missing_part_missing():
    a = {"itl_b1": 3.0, "itl_b8": 5.0, "b32": 10.0, "w1": 20.0, "w1_sampled": None}
    b = {"itl_b1": 2.0, "itl_b8": 6.0, "b32": 12.0, "w1": 19.0, "w1_sampled": None}
    assert spec._best([a, b]) == {"itl_b1": 2.0, "itl_b8": 5.0, "b32": 12.0, "w1": 20.0, "w1_sampled": None}
