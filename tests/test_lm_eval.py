"""lm-evaluation-harness, unmodified, against a live `noria serve`: `local-completions` with its
defaults (token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`) runs a multiple-choice, a
rolling-loglikelihood and a generate_until task made here from local JSONL files, and its
per-sample loglikelihoods equal those of lm-eval's own `hf` model on the same float32
checkpoint. No network: the tasks read local files and the checkpoint is built here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.procs import serve_http
from tests.test_embeddings import with_tokenizer
from tests.tiny_models import make_checkpoint

# float32 on both sides, summed in another order: per-token differences are ~1e-5 of values
# up to ~20, and a sample sums a few tokens (tests/test_prompt_logprobs.py has the bound).
ATOL = 1e-3

MC_DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "a fish", "seven hundred"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "north", "of the moon"], "answer": 0},
]
PPL_DOCS = [
    {"text": "Once upon a time there was a little girl who lived in a village near the forest."},
    {"text": "The quick brown fox jumps over the lazy dog, and the dog does not mind at all."},
]
GEN_DOCS = [
    {"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
    {"question": "Q: Name a colour.\nA:", "answer": " red"},
]

TASKS = {
    "noria_mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                 "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]},
    "noria_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                  "metric_list": [{"metric": "word_perplexity"}]},
    "noria_gen": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                  "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
                  "metric_list": [{"metric": "exact_match"}]},
}
DOCS = {"noria_mc": MC_DOCS, "noria_ppl": PPL_DOCS, "noria_gen": GEN_DOCS}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, demo_path) -> Path:
    # The demo tokenizer's vocabulary and special ids, so any text's ids fit the model.
    demo = json.loads((demo_path / "config.json").read_text())
    path = tmp_path_factory.mktemp("lm-eval") / "llama"
    make_checkpoint("llama", path, vocab_size=demo["vocab_size"], bos_token_id=demo["bos_token_id"],
                    eos_token_id=demo["eos_token_id"])
    return with_tokenizer(path, demo_path)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """One YAML task per output type, each reading its own local JSONL file (`dataset_path: json`)."""
    import yaml

    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, spec in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in DOCS[name]))
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **spec}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return folder


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """The harness and `datasets` must not look for anything on a hub."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    yield
    mp.undo()


def _evaluate(model: str, model_args: dict[str, Any], task_dir: Path) -> dict[str, list[dict]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), task_manager=manager,
                                  log_samples=True, bootstrap_iters=0)
    assert out is not None
    return {name: sorted(samples, key=lambda s: s["doc_id"]) for name, samples in out["samples"].items()}


@pytest.fixture(scope="module")
def both(ckpt, task_dir, offline) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(local-completions against noria, hf) samples per task."""
    with serve_http("--model", str(ckpt), "--dtype", "float32", "--num-kv-blocks", "128",
                    "--max-model-len", "512") as s:
        served = _evaluate("local-completions", {"model": str(ckpt), "base_url": f"{s.http}/v1/completions",
                                                 "tokenizer": str(ckpt), "tokenizer_backend": "huggingface"},
                           task_dir)
    # The harness's API models never add BOS, while `hf` lets the tokenizer add it (the demo's
    # does): told not to, hf scores the same token ids that local-completions sends.
    hf = _evaluate("hf", {"pretrained": str(ckpt), "dtype": "float32", "device": "cpu", "add_bos_token": False},
                   task_dir)
    return served, hf


def _loglikelihoods(samples: list[dict]) -> list[list[float]]:
    """Per doc, per request: the loglikelihood (responses are (ll, is_greedy) pairs, or a bare ll
    for a rolling one)."""
    out = []
    for s in samples:
        row = []
        for resp in s["resps"]:
            value = resp[0]
            row.append(float(value[0]) if isinstance(value, list | tuple) else float(value))
        out.append(row)
    return out


def test_multiple_choice_loglikelihoods_equal_hf(both):
    served, hf = both
    got, want = _loglikelihoods(served["noria_mc"]), _loglikelihoods(hf["noria_mc"])
    assert len(got) == len(MC_DOCS) and [len(r) for r in got] == [len(d["choices"]) for d in MC_DOCS]
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=ATOL)
    # is_greedy comes from the echoed top_logprobs: the same verdict as hf's argmax.
    flags = [[bool(r[0][1]) for r in s["resps"]] for s in served["noria_mc"]]
    assert flags == [[bool(r[0][1]) for r in s["resps"]] for s in hf["noria_mc"]]


def test_rolling_loglikelihoods_equal_hf(both):
    served, hf = both
    got, want = _loglikelihoods(served["noria_ppl"]), _loglikelihoods(hf["noria_ppl"])
    assert len(got) == len(PPL_DOCS)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=ATOL)
        assert g[0] < 0


def test_generate_until_runs_and_matches_hf_greedy(both):
    served, hf = both
    got = [s["resps"][0][0] for s in served["noria_gen"]]
    assert len(got) == len(GEN_DOCS) and all(isinstance(t, str) for t in got)
    assert got == [s["resps"][0][0] for s in hf["noria_gen"]]
